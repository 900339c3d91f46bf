"""Logit processors through the real server at world 1 and 2: greedy tokens under logit_bias, the presence, frequency
and repetition penalties and min_tokens equal a reference built from transformers' logits with vLLM's definitions
(teacher-forced along the server's own tokens: at each position the processed argmax is the token it chose), and
stop_token_ids and ignore_eos end (or do not end) a sequence where they should."""

import pytest
import torch

from k3dist.text.tokenizer import load_tokenizer

PROMPT = [5, 9, 2, 7, 3, 11, 4, 30, 200, 17]
IDS = {"return_token_ids": True}
LOGITS: dict[tuple[int, ...], torch.Tensor] = {}  # transformers' logits along PROMPT + these tokens


@pytest.fixture(scope="module")
def model(serve_dir):
    from transformers import KimiLinearForCausalLM

    return KimiLinearForCausalLM.from_pretrained(serve_dir, dtype=torch.float32).eval()


def _processed(logits: torch.Tensor, prompt: list[int], out: list[int], case: dict, held: tuple[int, ...]):
    """vLLM's order: min_tokens, logit_bias, repetition (prompt and output), frequency and presence (output)."""
    x = logits.clone()
    if len(out) < case.get("min_tokens", 0):
        x[list(held)] = float("-inf")
    for token, bias in case.get("logit_bias", {}).items():
        x[int(token)] += bias
    rep = case.get("repetition_penalty", 1.0)
    for token in set(prompt) | set(out):
        x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    for token in set(out):
        x[token] -= case.get("frequency_penalty", 0.0) * out.count(token) + case.get("presence_penalty", 0.0)
    return x


def test_greedy_tokens_with_processors_equal_transformers_with_the_same_definitions(server, model, serve_dir):
    eos = load_tokenizer(serve_dir).eos_ids
    c = server.client()
    plain = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=1, temperature=0, extra_body=IDS)
    first = plain.choices[0].token_ids[0]
    cases = [  # each changes some greedy choice (checked below); a bias makes a token repeat for the penalties
        {"logit_bias": {str(first): -100, "7": 4, "300": 1.5}, "presence_penalty": 1.5, "frequency_penalty": 0.7},
        {"logit_bias": {"9": 3}, "repetition_penalty": 1.6},
        {"repetition_penalty": 0.7, "presence_penalty": -0.5},
        {"min_tokens": 3, "logit_bias": {str(eos[1]): 100}},  # eos would win at once; held back for 3 tokens
    ]
    for case in cases:
        body = {k: v for k, v in case.items() if k not in ("presence_penalty", "frequency_penalty", "logit_bias")}
        r = c.completions.create(
            model=server.model, prompt=PROMPT, max_tokens=10, temperature=0, extra_body=IDS | body,
            **{k: v for k, v in case.items() if k in ("presence_penalty", "frequency_penalty", "logit_bias")},
        )  # fmt: skip
        out = r.choices[0].token_ids
        if tuple(out) not in LOGITS:  # world 2 draws what world 1 drew: one forward each
            with torch.no_grad():
                LOGITS[tuple(out)] = model(torch.tensor([PROMPT + out]), use_cache=False).logits[0, len(PROMPT) - 1 :]
        logits = LOGITS[tuple(out)]
        changed = False
        for i, token in enumerate(out):
            x = _processed(logits[i], PROMPT, out[:i], case, eos)
            assert int(x.argmax()) == token, (case, i, out)
            changed |= int(logits[i].argmax()) != token
        assert changed, case  # the processors decided something
        if "min_tokens" in case:
            assert len(out) == 4 and out[-1] == eos[1] and r.choices[0].finish_reason == "stop"


def test_stop_token_ids_and_ignore_eos(server, serve_dir):
    eos = load_tokenizer(serve_dir).eos_ids
    c = server.client()
    stop = c.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={"100": 100},
        extra_body=IDS | {"stop_token_ids": [100]},
    )  # fmt: skip
    assert stop.choices[0].token_ids == [100] and stop.choices[0].text == "" and stop.choices[0].finish_reason == "stop"
    endless = c.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(eos[1]): 100},
        extra_body=IDS | {"ignore_eos": True},
    )  # fmt: skip
    choice = endless.choices[0]
    assert choice.token_ids == [eos[1]] * 5 and choice.text == "" and choice.finish_reason == "length"
