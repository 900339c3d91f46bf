"""Rank 0's prefix index: the longest snapshot whose ids are a prefix of the prompt, verified id by id (never by a
hash alone), least-recently-used eviction by bytes with a host tier, and nothing pinned in a window evicted."""

import pytest

from k3dist.engine import prefix as prefix_module
from k3dist.engine.prefix import Moves, PrefixIndex

DOC = tuple(range(100, 140))  # 40 tokens


def index(device=10_000, host=0, every=16) -> PrefixIndex:
    return PrefixIndex(device, host, every, lambda n: 100 + n)  # a snapshot of n tokens: 100 + n bytes


def saved(idx: PrefixIndex, ids) -> int:
    snap = idx.plan(tuple(ids), Moves(), set())
    if snap is not None:
        idx.made(snap)
    return snap


def test_the_longest_verified_prefix_is_the_hit():
    idx = index()
    for at in idx.boundaries(len(DOC), 0):
        saved(idx, DOC[:at])
    assert idx.boundaries(len(DOC), 0) == [16, 32, 40]
    assert len(idx.lookup(DOC).ids) == 40  # equal to a snapshot: served whole
    assert len(idx.lookup(DOC + (7, 8)).ids) == 40
    assert len(idx.lookup(DOC[:37]).ids) == 32  # a strict prefix of the 40-token snapshot never gets it
    changed = DOC[:20] + (999,) + DOC[21:]
    assert len(idx.lookup(changed).ids) == 16  # one middle token changed: only what precedes it is reused
    assert idx.lookup((1, 2, 3)) is None and idx.lookup(DOC[:15]) is None
    s = idx.stats
    assert (s.hits, s.misses, s.tokens_reused) == (4, 2, 40 + 40 + 32 + 16)
    assert idx.report()["hit_rate"] == pytest.approx(4 / 6)


def test_a_hash_collision_is_no_hit(monkeypatch):
    collide = lambda ids, lengths: dict.fromkeys(lengths, 0)  # noqa: E731
    monkeypatch.setattr(prefix_module, "_hashes", collide)  # every prefix of every length has the same digest
    idx = index()
    saved(idx, DOC[:16])
    assert idx.lookup(tuple(range(500, 540))) is None  # same length, same hash, other ids
    assert len(idx.lookup(DOC).ids) == 16
    assert saved(idx, (7,) * 16) is not None and not idx.has((8,) * 16) and idx.has((7,) * 16)


def test_an_existing_or_oversized_snapshot_is_not_planned():
    idx = index(device=150)
    assert saved(idx, DOC[:16]) is not None
    assert saved(idx, DOC[:16]) is None  # already there
    assert saved(idx, DOC[:40] * 2) is None  # 180 bytes > the 150-byte pool


def test_eviction_is_lru_by_bytes_to_the_host_tier_then_dropped():
    idx = index(device=3 * 116, host=116)  # three 16-token snapshots on the device, one on the host
    a, b, c = (saved(idx, (n,) * 16) for n in (1, 2, 3))
    idx.lookup((1,) * 16)  # a is now the most recently used
    moves = Moves()
    d = idx.plan((4,) * 16, moves, set())
    assert moves.demote == [b] and moves.drop == [] and idx.held == {"device": 348, "host": 116}
    moves = Moves()
    e = idx.plan((5,) * 16, moves, set())
    assert moves.demote == [c] and moves.drop == [b]  # the host tier's oldest goes for good
    assert idx.stats.evictions == 1 and idx.stats.demotions == 2
    assert len(idx.lookup((3,) * 16 + (0,)).ids) == 16  # a demoted snapshot still hits (restored from the host)
    assert idx.lookup((2,) * 16) is None
    assert {e.id for e in idx.tiers["device"].values()} == {a, d, e}


def test_pinned_snapshots_are_never_evicted():
    idx = index(device=2 * 116)
    a, b = saved(idx, (1,) * 16), saved(idx, (2,) * 16)
    moves = Moves()
    assert idx.plan((3,) * 16, moves, {a, b}) is None and moves.drop == []  # no room without evicting a pinned one
    c = idx.plan((3,) * 16, moves, {b})
    assert c is not None and moves.drop == [a]
