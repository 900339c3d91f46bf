"""The real `openai` client against the real server, at world 1 and world 2 (gloo): completions and chat, streamed
and whole; exact usage; greedy fp32 tokens equal to the offline run's and to transformers'; log-probabilities equal
to a log-softmax of transformers' logits; n, seeds and stops; and 12 concurrent requests over 4 slots, mixing lengths,
greedy and sampling, each answered exactly as when sent alone."""

import asyncio

import pytest
import torch

from k3dist.text.tokenizer import load_tokenizer
from tests.support.cli_run import run_cli

PROMPT_IDS = [5, 9, 2, 7, 3, 11, 4, 30, 200, 17]
IDS = {"return_token_ids": True}  # the vLLM extension: token ids back in each choice


@pytest.fixture(scope="module")
def reference(serve_dir, tmp_path_factory):
    """The offline run's greedy tokens for PROMPT_IDS, and transformers' fp32 logits along them."""
    from transformers import KimiLinearForCausalLM

    tmp = tmp_path_factory.mktemp("offline")
    prompt = "[" + ",".join(map(str, PROMPT_IDS)) + "]"
    args = (f"model.path={serve_dir}", f"generate.prompt={prompt}", "generate.max_new_tokens=12")
    rc, text, result = run_cli(tmp, *args)
    assert rc == 0, text
    tokens = result["tokens"][0]
    model = KimiLinearForCausalLM.from_pretrained(serve_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS + tokens]), use_cache=False).logits[0, len(PROMPT_IDS) - 1 : -1]
    return tokens, logits.double()


def test_greedy_tokens_and_logprobs_equal_the_offline_run_and_transformers(server, reference):
    tokens, logits = reference
    r = server.client().completions.create(
        model=server.model, prompt=PROMPT_IDS, max_tokens=len(tokens), temperature=0, logprobs=5, extra_body=IDS
    )
    choice = r.choices[0]
    assert choice.token_ids == tokens and r.prompt_token_ids == PROMPT_IDS
    assert logits.argmax(-1).tolist() == tokens  # and so transformers' greedy tokens
    assert r.usage.prompt_tokens == len(PROMPT_IDS) and r.usage.completion_tokens == len(tokens)
    assert r.usage.total_tokens == len(PROMPT_IDS) + len(tokens)
    ref = torch.log_softmax(logits, dim=-1)
    got = torch.tensor(choice.logprobs.token_logprobs, dtype=torch.float64)
    torch.testing.assert_close(got, ref[torch.arange(len(tokens)), torch.tensor(tokens)], rtol=0, atol=1e-4)
    for i, top in enumerate(choice.logprobs.top_logprobs):  # keyed by token text: tokens sharing one may collapse
        best = ref[i].topk(5).values
        assert 0 < len(top) <= 5 and all(any(abs(v - float(b)) < 1e-4 for b in best) for v in top.values())


def test_chat_logprobs_are_a_log_softmax_of_transformers_logits(server):
    """Chat's top_logprobs are a list per token: all five, best first, against transformers over the same ids."""
    from transformers import KimiLinearForCausalLM

    r = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Name a colour"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body=IDS,
    )
    prompt, tokens = r.prompt_token_ids, r.choices[0].token_ids
    model = KimiLinearForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]), use_cache=False).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, entry in enumerate(r.choices[0].logprobs.content):
        best = ref[i].topk(5)
        assert entry.logprob == pytest.approx(float(ref[i, tokens[i]]), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token


def test_completions_whole_and_streamed_agree_with_exact_usage(server, serve_dir):
    c, prompt = server.client(), "The lighthouse keeper"
    n_prompt = len(load_tokenizer(serve_dir).encode(prompt))
    whole = c.completions.create(model=server.model, prompt=prompt, max_tokens=9, temperature=0, extra_body=IDS)
    assert whole.usage.prompt_tokens == n_prompt and whole.usage.completion_tokens == len(whole.choices[0].token_ids)
    chunks = list(
        c.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_whole_and_streamed_agree(server, serve_dir):
    c = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    whole = c.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=10, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    rendered = load_tokenizer(serve_dir).encode(
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Tell me a story<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    assert whole.usage.prompt_tokens == len(rendered)


def test_n_seeds_and_stops(server):
    c = server.client()
    sampled = dict(model=server.model, prompt=PROMPT_IDS, max_tokens=10, temperature=1.0, top_p=0.9, seed=5, n=2)
    a = c.completions.create(**sampled, extra_body=IDS)
    b = c.completions.create(**sampled, extra_body=IDS)
    assert [ch.index for ch in a.choices] == [0, 1] and a.usage.completion_tokens == 20
    assert a.choices[0].token_ids != a.choices[1].token_ids  # each choice its own derived seed
    assert [ch.token_ids for ch in a.choices] == [ch.token_ids for ch in b.choices]  # the same seed draws the same
    greedy = c.completions.create(model=server.model, prompt="Where does the river go", max_tokens=16, temperature=0)
    text = greedy.choices[0].text
    stop = text[4:6]
    cut = c.completions.create(
        model=server.model, prompt="Where does the river go", max_tokens=16, temperature=0, stop=[stop, "\u2603never"]
    )
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]


async def _concurrently(server, requests: list[dict]) -> list:
    async with server.async_client() as c:
        return await asyncio.gather(*(c.completions.create(model=server.model, **_split(r)) for r in requests))


def _split(request: dict) -> dict:
    """top_k is an extension: the client sends it in the body's extras."""
    extra = IDS | ({"top_k": request["top_k"]} if "top_k" in request else {})
    return {k: v for k, v in request.items() if k != "top_k"} | {"extra_body": extra}


def test_twelve_concurrent_requests_over_four_slots_each_as_alone(server):
    requests = []
    for i in range(12):
        prompt = [(7 * i + 3 * j) % 500 + 3 for j in range(3 + 5 * (i % 4))]  # lengths 3 to 18
        sampling = {"temperature": 0.0} if i % 3 == 0 else {"temperature": 0.9, "seed": 40 + i}
        if i % 3 == 2:
            sampling |= {"top_k": 20, "top_p": 0.8} if i % 2 else {"top_p": 0.7}
        requests.append({"prompt": prompt, "max_tokens": 4 + 3 * (i % 5), **sampling})
    together = asyncio.run(_concurrently(server, requests))
    c = server.client()
    for r, got in zip(requests, together, strict=True):
        alone = c.completions.create(model=server.model, **_split(r))
        assert got.choices[0].token_ids == alone.choices[0].token_ids, r
        assert got.choices[0].text == alone.choices[0].text
        assert len(got.choices[0].token_ids) == r["max_tokens"] or got.choices[0].finish_reason == "stop"
    assert len({tuple(g.choices[0].token_ids) for g in together}) == 12


def test_a_chat_turn_reuses_the_previous_turns_state(server):
    """The second turn's prompt starts with the first turn's: its snapshot is restored, counted in /metrics."""
    c, before = server.client(), server.metrics()
    doc = "The keeper wound the clock at seven and watched the boats come in. " * 2
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": "What did the keeper do?"}]
    first = c.chat.completions.create(model=server.model, messages=messages, max_tokens=6, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Why?"},
    ]
    second = c.chat.completions.create(model=server.model, messages=messages, max_tokens=6, temperature=0)
    after = server.metrics()
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert after["k3dist_prefix_hits"] - before["k3dist_prefix_hits"] >= 1
    assert after["k3dist_prefix_tokens_reused"] - before["k3dist_prefix_tokens_reused"] >= first.usage.prompt_tokens
    assert after["k3dist_prefix_bytes_held"] > 0 and 0 < after["k3dist_prefix_hit_rate"] <= 1
