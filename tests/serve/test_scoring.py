"""What evaluators send, against the real server at world 1 and 2 (gloo, fp32): echo with logprobs scores every
prompt token as transformers' log-softmax does (1e-4), with its top-k and exactly greedy-consistent floats; 20
log-probabilities equal transformers' 20 best; a batch of prompts with n choices each equals each prompt sent alone;
a prompt that has a prefix snapshot is still scored at every position; the tokenizer routes round-trip."""

import json

import httpx
import pytest
import torch

from tests.serve.conftest import CAP

LONG = [(37 * i + 11) % 500 + 3 for i in range(40)]  # crosses the prefill chunks of 16
BATCH = [[5, 9, 2, 7, 3, 11, 4, 30, 200, 17], [3, 1, 4, 1, 5, 9, 2, 6], LONG[:21]]


@pytest.fixture(scope="module")
def hf(serve_dir):
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(serve_dir, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0].double(), dim=-1)

    return log_softmax


def _complete(server, **body) -> dict:
    reply = httpx.post(f"{server.url}/completions", json={"model": server.model, "temperature": 0} | body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _check_prompt_scores(logprobs: dict, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """Every prompt token's log-probability within 1e-4 of transformers', its top-k values the k best."""
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    got = torch.tensor(logprobs["token_logprobs"][1 : len(ids)], dtype=torch.float64)
    torch.testing.assert_close(got, ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], rtol=0, atol=1e-4)
    for i, top in enumerate(logprobs["top_logprobs"][1 : len(ids)]):  # keyed by text: tokens sharing one collapse
        best = ref[i].topk(k).values
        assert 0 < len(top) <= k and all(any(abs(v - float(b)) < 1e-4 for b in best) for v in top.values())
        assert max(top.values()) == pytest.approx(float(best[0]), abs=1e-4)


def test_echo_scores_every_prompt_token_as_transformers_and_greedily_consistent(server, hf):
    greedy = _complete(server, prompt=LONG, max_tokens=6, return_token_ids=True)["choices"][0]["token_ids"]
    ids = LONG + greedy  # its last 6 tokens are each the argmax after the ones before
    r = _complete(server, prompt=[ids], max_tokens=1, logprobs=5, echo=True)  # lm-eval's loglikelihood request
    choice, ref = r["choices"][0], hf(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids) + 1
    _check_prompt_scores(lp, ids, ref, 5)
    for tok, top in zip(lp["token_logprobs"][len(LONG) : -1], lp["top_logprobs"][len(LONG) : -1], strict=True):
        assert tok == max(top.values())  # lm-eval's is_greedy: the same float, not a near one
    assert choice["text"].startswith(choice["text"][: lp["text_offset"][-1]]) and r["usage"]["completion_tokens"] == 1
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0

    # scoring only (max_tokens 0), after the prompt left prefix snapshots behind: still every position, no token
    _complete(server, prompt=LONG, max_tokens=2)
    scored = _complete(server, prompt=LONG, max_tokens=0, logprobs=2, echo=True)
    assert scored["usage"] == {"prompt_tokens": len(LONG), "completion_tokens": 0, "total_tokens": len(LONG)}
    assert scored["choices"][0]["finish_reason"] == "length"
    assert len(scored["choices"][0]["logprobs"]["token_logprobs"]) == len(LONG)
    _check_prompt_scores(scored["choices"][0]["logprobs"], LONG, hf(LONG), 2)


def test_twenty_logprobs_equal_transformers_twenty_best(server, hf):
    c = server.client()
    r = c.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Count to three"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
        extra_body={"return_token_ids": True},
    )
    prompt, tokens = r.prompt_token_ids, r.choices[0].token_ids
    ref = hf(prompt + tokens)[len(prompt) - 1 : -1]
    for i, entry in enumerate(r.choices[0].logprobs.content):
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(ref[i].topk(20).values.tolist(), abs=1e-4)
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: the same float
        assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token
    echoed = _complete(server, prompt=BATCH[0], max_tokens=2, logprobs=20, echo=True)["choices"][0]["logprobs"]
    _check_prompt_scores(echoed, BATCH[0], hf(BATCH[0]), 20)
    assert all(len(top) > 5 for top in echoed["top_logprobs"][1:])


def test_a_batch_of_prompts_with_n_choices_each_equals_the_prompt_alone(server):
    sampled = dict(max_tokens=5, temperature=0.8, seed=7, n=2, logprobs=3, echo=True, return_token_ids=True)
    batch = _complete(server, prompt=BATCH, **sampled)
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    assert batch["usage"]["prompt_tokens"] == sum(map(len, BATCH))
    assert batch["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in batch["choices"])
    for i, prompt in enumerate(BATCH):
        alone = _complete(server, prompt=prompt, **sampled)
        for j in range(2):
            got, want = batch["choices"][i * 2 + j], alone["choices"][j]
            assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"], (i, j)
            got, want, n = got["logprobs"], want["logprobs"], len(prompt)  # the prompt's: scored alike, exactly
            assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
            assert got["token_logprobs"][:n] == want["token_logprobs"][:n], (i, j)
            assert got["top_logprobs"][:n] == want["top_logprobs"][:n], (i, j)
            # the generated ones: a decode step over more slots rounds its GEMMs differently
            assert got["token_logprobs"][n:] == pytest.approx(want["token_logprobs"][n:], abs=1e-5)
    texts = _complete(server, prompt=["The keeper", "A lighthouse 灯塔"], max_tokens=3, echo=True)["choices"]
    assert [c["text"][: len("The keeper")] for c in texts][0] == "The keeper" and texts[1]["text"].startswith("A light")
    streamed = httpx.post(
        f"{server.url}/completions",
        json={"model": server.model, "prompt": "The keeper", "max_tokens": 3, "temperature": 0, "echo": True},
        timeout=60,
    )
    assert streamed.status_code == 200
    with httpx.stream(
        "POST",
        f"{server.url}/completions",
        json={"prompt": "The keeper", "max_tokens": 3, "temperature": 0, "echo": True, "stream": True},
        timeout=60,
    ) as events:
        chunks = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"] == "The keeper"
    assert "".join(c["choices"][0]["text"] for c in chunks) == streamed.json()["choices"][0]["text"]
    refused = httpx.post(f"{server.url}/completions", json={"prompt": [[5, 6], [7] * CAP], "max_tokens": 1}, timeout=60)
    assert refused.status_code == 400 and "prompt[1]" in refused.json()["error"]["message"]


def test_the_tokenizer_routes_round_trip(server):
    text = "价格是 12345 元, 東京<|im_end|>ok\n<|im_user|>"
    base = server.base
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == CAP
    back = httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()
    assert back["prompt"] == text
    info = httpx.get(f"{base}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == CAP
    eos = httpx.post(f"{base}/tokenize", json={"prompt": info["eos_token"]}, timeout=30).json()["tokens"]
    assert len(eos) == 1  # a special token's text is its one id
    messages = [{"role": "user", "content": "Hi 你好"}]
    chat = server.client().chat.completions.create(
        model=server.model, messages=messages, max_tokens=1, extra_body={"return_token_ids": True}
    )
    rendered = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=30).json()
    assert rendered["tokens"] == chat.prompt_token_ids
    bad = [
        ("/detokenize", {"tokens": [3, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": messages}, "messages"),
    ]
    for path, body, param in bad:
        r = httpx.post(f"{base}{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
