"""A world-1 server's KV-cache events (serve.kv_events, vLLM's schema over ZMQ), read by a subscriber: a block is
published exactly where a later request with that prefix is served from a snapshot (/metrics counts the tokens it
restored), none names a position a request cannot resume from, and a block is removed when its snapshot is evicted
(the same prefix then restores nothing)."""

import importlib.util
import os
import random
import re
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import zmq

from tests.support.gateway import ANSI, free_port
from tests.support.server import Server

BLOCK = 32  # prefix.every: two prefill chunks of 16
ARGS = ("generate.batch=4", "cache.cap=256", "generate.prefill_chunk=16", f"prefix.every={BLOCK}")
POOL = "prefix.bytes=300KiB"  # about nine snapshots of the small checkpoint (some 33 KiB each at 100 tokens)


class Subscriber:
    """A ZMQ SUB socket on the server's endpoint, decoding vLLM's multipart batches."""

    def __init__(self, endpoint: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.connect(endpoint)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.seqs: list[int] = []
        self.first: str | None = None  # the type of the first event received
        time.sleep(0.5)  # the subscription reaches the publisher before anything we wait for is published

    def events(self, settle_s: float = 1.0) -> list[dict]:
        """Every event published until none has come for `settle_s`."""
        out = []
        while self.socket.poll(int(settle_s * 1000)):
            topic, seq, payload = self.socket.recv_multipart()
            ts, events, dp_rank = msgspec.msgpack.decode(payload)  # EventBatch: a positional 3-array
            assert topic == b"" and dp_rank == 0 and ts > 0
            self.seqs.append(int.from_bytes(seq, "big"))
            out += events
            self.first = self.first or (events[0]["type"] if events else None)
        return out

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def published(serve_dir, tmp_path_factory):
    server = Server(
        tmp_path_factory.mktemp("kv"), f"model.path={serve_dir}", *ARGS, POOL, "serve.kv_events=tcp://127.0.0.1:*"
    )
    line = next(line for line in server.lines if "KV events at" in line)
    assert f"blocks of {BLOCK} tokens" in line, line
    sub = Subscriber(re.search(r"KV events at (\S+)", line).group(1))
    yield server, sub
    sub.close()
    server.stop()


def _reused(server: Server, prompt: list[int]) -> float:
    """Prompt tokens this request restored from a snapshot (by /metrics)."""
    before = server.metrics()["k3dist_prefix_tokens_reused"]
    server.client().completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0)
    return server.metrics()["k3dist_prefix_tokens_reused"] - before


def _other(n: int, length: int = 100) -> list[int]:
    """A prompt of its own: its first id differs from every other prompt's here (ids below the vocabulary, 512)."""
    rng = random.Random(n)
    return [300 + n] + [rng.randrange(3, 512) for _ in range(length - 1)]


def _stored(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "BlockStored"]


def test_blocks_are_published_where_a_request_resumes_and_removed_with_their_snapshot(published):
    server, sub = published
    first = list(range(10, 110))  # 100 tokens: snapshots at 32, 64, 96 (the grid) and 100 (its end)
    assert _reused(server, first) == 0
    stored = _stored(sub.events())
    assert sub.seqs[0] == 0 and sub.first == "AllBlocksCleared"  # the sequence began with this subscriber
    assert [e["block_size"] for e in stored] == [BLOCK] * 3, stored  # 100, off the grid, is never published
    assert [e["token_ids"] for e in stored] == [first[i : i + BLOCK] for i in (0, 32, 64)]
    hashes = [e["block_hashes"][0] for e in stored]
    assert [e["parent_block_hash"] for e in stored] == [None, *hashes[:2]]  # one chain from position 0
    assert all(set(e) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                          "medium", "lora_name"} for e in stored), stored  # fmt: skip

    for end in (32, 64, 96):  # each published boundary: a request sharing exactly that prefix restores it
        assert _reused(server, first[:end] + [400 + end] * 10) == end, end
    assert _stored(sub.events()) == []  # those requests took snapshots off the grid only: nothing published
    assert _reused(server, first) == 100  # its end is a snapshot too, one no event names (a lower bound)

    # other prompts fill the pool: the least recently used snapshot goes first, the first prompt's at 32 (its
    # later ones and the requests' ends were used since), and with it every block published after it
    evicted = server.metrics()["k3dist_prefix_evictions"]
    removed = []
    for n in range(12):
        _reused(server, _other(n))
        removed += [e for e in sub.events(0.3) if e["type"] == "BlockRemoved"]
        if removed:
            break
    assert server.metrics()["k3dist_prefix_evictions"] > evicted, server.metrics()
    assert removed and removed[0]["block_hashes"] == hashes, (removed, hashes)
    assert _reused(server, first[:32] + [500] * 10) == 0  # the dropped snapshot restores nothing any more
    assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))  # one sequence, no batch lost


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("dynamo") is None, reason="ai-dynamo-runtime is not installed")
def test_dynamos_kv_indexer_credits_what_the_server_restores(serve_dir, tmp_path):
    """Dynamo's standalone KV indexer (ai-dynamo-runtime 1.6.1, in no extra: it pins pydantic <= 2.13.5), started
    first and subscribed to a fresh server as its worker, with block size prefix.every: the tokens it credits a
    prompt with are what the server then restores for it, on a published boundary, never more; it reads every
    batch (no gap, no unknown block) and drops the blocks of an evicted snapshot."""
    endpoint, port, log = f"ipc://{tmp_path}/kv", free_port(), tmp_path / "indexer.log"
    cmd = [sys.executable, "-m", "dynamo.indexer", "--workers", f"1={endpoint}", "--block-size", str(BLOCK)]
    cmd += ["--model-name", "m", "--port", str(port), "--threads", "1"]
    with open(log, "w") as out:
        indexer = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = None
    try:
        server = Server(
            tmp_path, f"model.path={serve_dir}", *ARGS, POOL, "serve.model_name=m", f"serve.kv_events={endpoint}"
        )
        url = f"http://127.0.0.1:{port}"

        def credited(prompt: list[int]) -> int:
            time.sleep(0.5)  # the events of the last request reach it
            reply = httpx.post(f"{url}/query", json={"token_ids": prompt, "model_name": "m"}, timeout=10)
            return reply.json()["instances"].get("1", {}).get("longest_matched", 0)

        doc = _other(50, 150)  # snapshots at 32, 64, 96, 128 (the grid) and 150 (its end)
        _reused(server, doc)
        assert credited(doc) == 128, log.read_text()  # whole blocks, on snapshots only
        for end in (32, 64, 96, 128):
            probe = doc[:end] + [7] * 9
            assert credited(probe) == end
            assert _reused(server, probe) == end  # what it credits is what the server restores
        assert credited(doc[:20] + [7] * 40) == 0  # no boundary below 32
        for n in range(12):  # other prompts fill the pool until the document's snapshot at 32 is dropped
            _reused(server, _other(n))
            if credited(doc) == 0:
                break
        assert credited(doc) == 0 and _reused(server, doc[:32] + [7] * 9) == 0, log.read_text()
        assert " WARN " not in ANSI.sub("", log.read_text()), log.read_text()
    finally:
        if server is not None:
            server.stop()
        os.killpg(indexer.pid, signal.SIGKILL)
        indexer.wait()
