"""The Responses API's store (serve/response_store.py): bounded in entries and in bytes, the oldest evicted first, a
response larger than the store not kept, what it counts at least what it holds (measured by tracemalloc), and its
byte bound in rank 0's memory plan of a server (runtime `stored`), on no other rank and in no other run."""

import tracemalloc
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from k3dist.config import load_config
from k3dist.run.plan import plan_run
from k3dist.serve.response_store import ENTRY_BYTES, ResponseStore, Stored
from k3dist.settings import GROUPS, parse

ROOT = Path(__file__).resolve().parents[2]


def _stored(i: int, text: str = "") -> Stored:
    response = {"id": f"resp_{i}", "object": "response", "output": [{"type": "message", "content": text}]}
    return Stored(response, [{"role": "user", "content": f"turn {i} {text}"}])


def test_the_oldest_go_first_past_the_entries_or_the_bytes():
    store = ResponseStore(entries=3, max_bytes=10**6)
    for i in range(5):
        assert store.put(f"resp_{i}", _stored(i))
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.get("resp_4") == _stored(4) and store.evicted == 2
    one = len(store) and store.held // len(store)  # each entry the same size here
    by_bytes = ResponseStore(entries=100, max_bytes=3 * one + ENTRY_BYTES)
    for i in range(5):
        by_bytes.put(f"resp_{i}", _stored(i))
    assert len(by_bytes) == 3 and by_bytes.get("resp_1") is None and by_bytes.get("resp_2") is not None
    assert by_bytes.held <= by_bytes.max_bytes
    by_bytes.put("resp_2", _stored(2, "again"))  # the same id: replaced, now the newest
    by_bytes.put("resp_5", _stored(5))
    assert by_bytes.get("resp_2").response["output"][0]["content"] == "again" and by_bytes.get("resp_3") is None
    assert not by_bytes.put("resp_big", _stored(9, "x" * by_bytes.max_bytes)) and by_bytes.get("resp_big") is None
    assert by_bytes.delete("resp_5") and not by_bytes.delete("resp_5") and by_bytes.get("resp_5") is None
    assert by_bytes.held == sum(len(b) + ENTRY_BYTES for b in by_bytes._kept.values())
    assert not ResponseStore(0, 10**6).on and not ResponseStore(0, 10**6).put("resp_0", _stored(0))


def test_what_it_counts_covers_what_it_holds():
    store = ResponseStore(entries=10**6, max_bytes=2**30)
    made = [_stored(i, "word " * (i % 50)) for i in range(2000)]  # made first: what a request holds anyway
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, stored in enumerate(made):
            store.put(f"resp_{i:032x}", stored)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(store) == 2000 and held <= store.held, (held, store.held)


def _settings(*overrides: str):
    job = {g: OmegaConf.load(ROOT / "conf" / g / "default.yaml") for g in GROUPS if g != "model"}
    job["model"] = OmegaConf.load(ROOT / "conf" / "model" / "twin_0_40b.yaml")
    job = OmegaConf.to_container(OmegaConf.merge(job, OmegaConf.from_dotlist(list(overrides))))
    return parse(job | {"fault": OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "fault" / "none.yaml"))})


@pytest.mark.parametrize("plan_for", ["serve", "generate"])
def test_the_store_is_in_rank_0s_plan_of_a_server(plan_for):
    cfg = load_config(ROOT / "k3dist" / "configs" / "Kimi-K3-0.40B-config.json")
    plans, cpu = {}, torch.device("cpu")
    for size in ("64MiB", "1GiB"):
        s = _settings("run.mode=plan", f"run.plan_for={plan_for}", f"serve.store_bytes={size}", "memory.free=64GiB")
        plans[size] = plan_run(s, cfg, 2, cpu)
    off = plan_run(_settings("run.mode=plan", f"run.plan_for={plan_for}", "serve.store_responses=0"), cfg, 2, cpu)
    if plan_for == "serve":
        assert plans["64MiB"].runtimes[0].stored == 64 * 2**20 and plans["1GiB"].runtimes[0].stored == 2**30
        grew = plans["1GiB"].terms[0].runtime - plans["64MiB"].terms[0].runtime
        assert grew == 2**30 - 64 * 2**20
        assert off.runtimes[0].stored == 0
    assert all(p.runtimes[r].stored == 0 for p in plans.values() for r in p.runtimes if plan_for != "serve" or r)
