"""The server's life: it idles past every timeout and still answers, a dropped stream frees its slot, SIGTERM drains
in-flight requests (new ones get 503) and exits 143, and a killed rank fails every request and ends every process."""

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.serve.conftest import _server
from tests.support.tiers import slow_but


def _wait(predicate, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_dropped_stream_frees_its_slot(server1):
    c = server1.client()
    stream = c.completions.create(model=server1.model, prompt=[5, 6, 7], max_tokens=200, temperature=0, stream=True)
    next(stream)
    next(stream)
    stream.close()  # the client goes away mid-way
    idle = lambda: (m := server1.metrics())["k3dist_requests_running"] == 0 and m["k3dist_slots_used"] == 0  # noqa: E731
    _wait(idle, what="the slot to be freed")
    assert server1.metrics()["k3dist_requests_waiting"] == 0
    after = c.completions.create(model=server1.model, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert after.usage.completion_tokens == 3 and after.choices[0].finish_reason == "length"


def _stream_all(server, results: list, index: int, max_tokens: int) -> None:
    """One streamed request to the end; records (token count, finish reason) or the exception."""
    try:
        chunks = list(
            server.client().completions.create(
                model=server.model,
                prompt=[9, 8, 7 + index],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},  # a greedy eos would end a stream before the test's signal
            )
        )
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        results[index] = ("done", finish)
    except Exception as exc:  # noqa: BLE001 - what the client saw is the result
        results[index] = ("error", exc)


def _streaming(server, count: int, max_tokens: int) -> tuple[list, list[threading.Thread]]:
    """`count` streams, returned once the engine holds every one of them and has generated: a request still on its
    way when the test signals would be refused (503), not in flight."""
    before = server.metrics()
    results = [None] * count
    threads = [threading.Thread(target=_stream_all, args=(server, results, i, max_tokens)) for i in range(count)]
    for t in threads:
        t.start()

    def started() -> bool:
        grown = {k: v - before[k] for k, v in server.metrics().items() if k in before}
        # a 3-token prompt each: the prompt tokens count every request the engine took
        return grown["k3dist_prompt_tokens_total"] >= 3 * count and grown["k3dist_generation_tokens_total"] > 0

    _wait(started, what="the streams to start")
    return results, threads


@pytest.mark.parametrize(
    "world, who",
    slow_but([(1, "launcher"), (2, "launcher"), (2, "follower")], keep=[(2, "launcher")]),
)
def test_sigterm_drains_in_flight_requests_then_exits_143(serve_dir, tmp_path, world, who):
    """SIGTERM to the launcher, or to one follower alone (rank 0 then drains as if it had the signal too)."""
    server = _server(tmp_path, serve_dir, "serve.drain_s=60", f"dist.nproc={world}")
    results, threads = _streaming(server, 3, 150)
    if who == "follower":
        server.signalled_at = time.monotonic()
        os.kill(server.pids[1], signal.SIGTERM)
    else:
        server.signal(signal.SIGTERM, group=False)
    _wait(lambda: httpx.get(f"{server.base}/health").status_code == 503, what="/health to turn 503")
    late = httpx.post(f"{server.url}/completions", json={"prompt": "late", "max_tokens": 2}, timeout=30)
    assert late.status_code == 503 and late.json()["error"]["code"] == "unavailable"
    for t in threads:
        t.join(timeout=60)
    assert [(kind, len(finish)) for kind, finish in results] == [("done", 1)] * 3  # every in-flight request ended
    rc, took, left = server.finish(timeout=60)
    assert rc == 143 and not left, (rc, left, server.text)
    assert [line for line in server.lines if line.startswith("error:")] == ["error: interrupted"]


@pytest.mark.timing  # three-second timeouts must hold through idling
def test_world2_idles_past_its_timeouts_then_a_killed_rank_ends_everything(serve_dir, tmp_path):
    """dist.collective_timeout_s=3 and dist.timeout_s=3: 8 s of idling (ten heartbeats) trips neither. Then rank 1
    is killed while requests stream: every client gets an error, and every process ends, non-zero, within 10 s."""
    server = _server(tmp_path, serve_dir, "dist.nproc=2", "dist.collective_timeout_s=3", "dist.timeout_s=3")
    time.sleep(8)
    c = server.client()
    still = c.completions.create(model=server.model, prompt="still here", max_tokens=3, extra_body={"ignore_eos": True})
    assert still.usage.completion_tokens == 3  # sampled: without ignore_eos an eos may end it sooner
    results, threads = _streaming(server, 3, 250)
    os.kill(server.pids[1], signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=30)
    assert all(kind == "error" for kind, _ in results), [
        r if r is None else (r[0], type(r[1]).__name__, str(r[1])[:80]) for r in results
    ]
    assert all(isinstance(exc, openai.APIError | openai.APIConnectionError) for _, exc in results)
    rc, _, left = server.finish(timeout=30)
    assert rc != 0 and time.monotonic() - killed < 10 and not left, (rc, left, server.text)
    errors = [line for line in server.lines if line.startswith("error:")]
    assert errors and "rank" in errors[0], server.text
