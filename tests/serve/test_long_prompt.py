"""A long prompt is an ordinary request: with three streams running, a prompt of 16 prefill chunks is admitted and
prefilled one chunk per window between their decode steps. No stream waits longer than two chunks and two steps for
its next token, every stream's greedy tokens are what it gets alone, and the newcomer's time to first token stays
within 1.5x of what it is on an idle server. A client that leaves in the middle of a long prefill frees its slot and
the prefill it had left at the next window. At world 1 and 2, on a server of its own whose chunk costs well more
than a decode step (as with real models), with prefix reuse off so that every run prefills the whole prompt."""

import statistics
import threading
import time

import httpx
import pytest

from tests.support.server import Server

CHUNK = 512
LONG = [(13 * i) % 480 + 7 for i in range(16 * CHUNK)]
SHORT = [[5 + k, 9, 2 + k, 7, 3] for k in range(3)]
STEPS = 300


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def server(request, serve_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"long{request.param}")
    args = (f"model.path={serve_dir}", "generate.batch=4", "cache.cap=9216", f"generate.prefill_chunk={CHUNK}")
    chunked = Server(tmp, *args, "prefix.enabled=off", f"dist.nproc={request.param}")
    yield chunked
    chunked.stop()


def _stream(server, ids, max_tokens, out: list, started: threading.Event | None = None) -> None:
    """Greedy tokens of a streamed completion into `out`, as (arrival time, token ids) per chunk."""
    extra = {"return_token_ids": True}
    stream = server.client().completions.create(
        model=server.model, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].token_ids:
            out.append((time.monotonic(), list(chunk.choices[0].token_ids)))
            if started is not None and len(out) >= 4:
                started.set()


def _alone(server, ids, max_tokens) -> tuple[list[int], float]:
    out, start = [], time.monotonic()
    _stream(server, ids, max_tokens, out)
    return [t for _, ts in out for t in ts], out[0][0] - start


def test_a_long_prompt_never_freezes_the_running_streams(server):
    alone = [_alone(server, ids, STEPS)[0] for ids in SHORT]
    idle_ttft = min(_alone(server, LONG, 2)[1] for _ in range(2))
    runs, threads, ready = [[] for _ in SHORT], [], []
    for ids, out in zip(SHORT, runs, strict=True):
        ready.append(threading.Event())
        threads.append(threading.Thread(target=_stream, args=(server, ids, STEPS, out, ready[-1])))
        threads[-1].start()
    for event in ready:
        assert event.wait(60)
    sent = time.monotonic()
    _, ttft = _alone(server, LONG, 2)
    for t in threads:
        t.join(60)
    gaps = [(b[0], b[0] - a[0]) for out in runs for a, b in zip(out, out[1:], strict=False)]
    step = statistics.median(gap for at, gap in gaps if at < sent)
    worst = max(gap for at, gap in gaps if at > sent)
    chunk = idle_ttft / 16
    assert [[t for _, ts in out for t in ts] for out in runs] == alone
    assert worst < 2 * chunk + 2 * step, f"worst gap {worst:.4f} s; chunk {chunk:.4f} s, step {step:.4f} s"
    assert ttft < 1.5 * idle_ttft, f"TTFT {ttft:.3f} s beside three streams; {idle_ttft:.3f} s idle"


def test_a_client_leaving_in_the_middle_of_a_long_prefill_frees_its_slot(server):
    body = {"model": server.model, "prompt": LONG[::-1], "max_tokens": 2, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=httpx.Timeout(30, read=0.05)) as r:
            r.read()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["k3dist_prefill_tokens_pending"] == 0 and m["k3dist_slots_used"] == 0:
            break
        time.sleep(0.02)
    assert m["k3dist_prefill_tokens_pending"] == 0 and m["k3dist_slots_used"] == 0, m
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    assert 'k3dist_requests_total{finish_reason="abort"} 1.0' in text  # aborted, not run to its end
    assert _alone(server, SHORT[0], 3)[0]  # and it serves on
