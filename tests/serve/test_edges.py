"""Requests at the server's edges: a whole (not streamed) response whose client left while its tokens still flow,
more choices than the slots and the queue hold, sampling settings past what a slot's int64 holds, an IPv6 address.

The server here runs a checkpoint whose end-of-sequence tokens never win the argmax (their lm_head rows are zero:
logit 0 among random ones), so a greedy request runs to its budget of thousands of tokens."""

import re
import socket
import time

import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file

from k3dist.text.tokenizer import load_tokenizer
from k3dist.twin.checkpoint import write_checkpoint
from tests.support.configs import small_config
from tests.support.server import Server

CAP = 4096


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    model_dir = write_checkpoint(small_config(), tmp_path_factory.mktemp("endless") / "m", seed=9, dtype="float32")
    shard = next(model_dir.glob("*.safetensors"))
    weights = load_file(shard)
    weights["lm_head.weight"][list(load_tokenizer(model_dir).eos_ids)] = 0
    save_file(weights, shard, metadata={"format": "pt"})
    overrides = ("generate.batch=2", f"cache.cap={CAP}", "serve.max_waiting=0", "generate.prefill_chunk=16")
    server = Server(tmp_path_factory.mktemp("endless-run"), f"model.path={model_dir}", *overrides)
    yield server
    server.stop()


def _ended(server, reason: str) -> float:
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    found = re.search(rf'^k3dist_requests_total{{finish_reason="{reason}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_whole_response_whose_client_left_frees_its_slot_while_its_tokens_still_flow(endless):
    aborted = _ended(endless, "abort")
    body = {"prompt": [5, 6, 7], "max_tokens": CAP - 3, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up on a response that would take many seconds
        httpx.post(f"{endless.url}/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 60
    while endless.metrics()["k3dist_requests_running"] > 0:
        assert time.monotonic() < deadline, "the slot was never freed"
        time.sleep(0.1)
    assert _ended(endless, "abort") == aborted + 1  # ended for its client, not run to its budget
    assert endless.metrics()["k3dist_generation_tokens_total"] < CAP - 3


def test_more_choices_than_the_slots_and_the_queue_hold_is_a_400_not_a_retry(endless):
    c = endless.client()
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model=endless.model, prompt="hi", max_tokens=2, n=3)
    assert refused.value.body["param"] == "n" and "generate.batch=2 + serve.max_waiting=0" in str(refused.value)
    assert len(c.completions.create(model=endless.model, prompt="hi", max_tokens=2, n=2).choices) == 2


def test_a_top_k_past_int64_cuts_nothing_and_the_server_keeps_serving(endless):
    def tokens(**extra) -> list[int]:
        body = {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 1.0, "seed": 3, "return_token_ids": True}
        reply = httpx.post(f"{endless.url}/completions", json=body | extra, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    assert tokens(top_k=2**64) == tokens(top_k=10**6) == tokens()
    assert httpx.get(f"{endless.base}/health", timeout=10).status_code == 200


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_address_is_bracketed_in_the_ready_line(serve_dir, tmp_path):
    server = Server(tmp_path, f"model.path={serve_dir}", "serve.host=::1", "cache.cap=64", "prefix.enabled=off")
    try:
        assert server.url.startswith("http://[::1]:"), server.url
        reply = server.client().completions.create(
            model=server.model, prompt=[5, 6], max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 2
    finally:
        server.stop()
