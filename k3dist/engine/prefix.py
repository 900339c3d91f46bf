"""Rank 0's index of prefix snapshots: which token prefixes have a snapshot, where it lives, what to evict.

A snapshot is keyed by its exact token ids. Lookup finds the longest snapshot whose ids are a prefix of a prompt
(the whole prompt included: then its stored logits give the first token with no prefill): a digest of each of the
prompt's prefixes narrows the candidates to the lengths snapshots have, and a candidate is a hit only when every id
matches. Snapshots are planned here and made by every rank on its own shard (snapshots.py), in the order the window
record lists them; eviction is least-recently-used by bytes, to the host tier when it has room, else dropped.

Where a prompt is snapshotted: at its end, on the `prefix.every` grid, and at its branch point, the longest prefix it
shares with a recent prompt or completion (branches.py) that has no snapshot yet, so the next prompt that branches
there finds one. A branch point closer than MIN_BRANCH_GAP tokens to the snapshot or grid point below it is not
worth a snapshot (docs/prefix.md says why).
"""

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from .branches import BranchMemory, common_prefix

MIN_BRANCH_GAP = 32  # tokens a branch point must lie past the snapshot or grid point below it
BRANCH_MEMORY = 8 * 2**20  # bytes of recent prompts' and completions' ids remembered to find branch points


def _hashes(ids, lengths: set[int]) -> dict[int, int]:
    """A digest of ids[:L] for each L in `lengths`, in one incremental pass of hashlib over the ids' bytes: a request
    is hashed on the engine's thread before it is admitted, where a Python loop over a long prompt's ids cost
    milliseconds of every request's time to first token."""
    data = memoryview(array("q", ids[: max(lengths, default=0)])).cast("B")
    out, h, done = {}, hashlib.blake2b(digest_size=8), 0
    for length in sorted(lengths):
        h.update(data[done * 8 : length * 8])
        out[length], done = int.from_bytes(h.digest(), "little"), length
    return out


@dataclass
class Entry:
    id: int
    ids: tuple[int, ...]
    nbytes: int
    digest: int = 0  # the digest of its ids (_hashes)
    tier: str = "device"  # device, or host (pinned memory; restored host-to-device)
    ready: bool = True  # False from its planning until the window whose prefill reaches it (never evicted then)


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    evictions: int = 0  # dropped for good (a move to the host tier is not one)
    demotions: int = 0
    saved: int = 0
    branches: int = 0  # of the snapshots taken, those at a branch point

    def as_dict(self, held: dict) -> dict:
        asked = self.hits + self.misses
        return {**self.__dict__, "hit_rate": self.hits / asked if asked else 0.0, **held}


@dataclass
class Moves:
    """What a window's planning decided about old snapshots, applied by every rank before anything else."""

    drop: list[int] = field(default_factory=list)
    demote: list[int] = field(default_factory=list)


class PrefixIndex:
    def __init__(self, device_bytes: int, host_bytes: int, every: int, nbytes, memory_bytes: int = BRANCH_MEMORY):
        """`nbytes(length)`: the bytes of one snapshot of `length` tokens on one rank; `memory_bytes`: what the ids
        remembered to find branch points may take."""
        self.budget = {"device": device_bytes, "host": host_bytes}
        self.memory = BranchMemory(memory_bytes)
        self.every, self.nbytes = every, nbytes
        self.tiers: dict[str, OrderedDict[int, Entry]] = {"device": OrderedDict(), "host": OrderedDict()}
        self.by_key: dict[tuple[int, int], list[Entry]] = {}
        self.lengths: dict[int, int] = {}  # length -> how many snapshots have it
        self.held = {"device": 0, "host": 0}
        self.stats = Stats()
        self._next = 0
        # for a KV-event publisher (serve/kv_events.py): ("stored", entry) once a snapshot can be restored,
        # ("dropped", entry) when it leaves for good; None: nothing is journaled
        self.journal: list[tuple[str, Entry]] | None = None

    # ------------------------------------------------------------------ lookup

    def lookup(self, ids: tuple[int, ...], count: bool = True) -> Entry | None:
        """The longest snapshot whose ids are ids[:L] for some L <= len(ids), verified id by id."""
        hashes = _hashes(ids, {n for n in self.lengths if n <= len(ids)})
        for length in sorted(hashes, reverse=True):
            for entry in self.by_key.get((length, hashes[length]), ()):
                if entry.ids == ids[:length]:
                    self._touch(entry)
                    if count:
                        self.stats.hits += 1
                        self.stats.tokens_reused += length
                    return entry
        if count:
            self.stats.misses += 1
        return None

    def has(self, ids: tuple[int, ...], digest: int | None = None) -> bool:
        key = (len(ids), _hashes(ids, {len(ids)}).get(len(ids)) if digest is None else digest)
        return any(e.ids == ids for e in self.by_key.get(key, ()))

    @staticmethod
    def digests(ids: tuple[int, ...], lengths) -> dict[int, int]:
        """The digests of several prefixes of `ids` in one pass (for `plan`)."""
        return _hashes(ids, set(lengths))

    def _touch(self, entry: Entry) -> None:
        self.tiers[entry.tier].move_to_end(entry.id)

    # ------------------------------------------------------------------ planning

    def boundaries(self, length: int, start: int, branch: int = 0) -> list[int]:
        """Where a prompt of `length` tokens prefilled from `start` is snapshotted: every `every` tokens past
        `start`, at its branch point `branch` when that is worth a snapshot, and at its end."""
        first = (start // self.every + 1) * self.every
        points = [*range(first, length, self.every), length]
        below = max(start, branch // self.every * self.every)  # the snapshot or grid point it would save beyond
        if below + MIN_BRANCH_GAP <= branch < length and branch % self.every:
            points.insert(sum(p < branch for p in points), branch)
        return points

    def branch_point(self, ids: tuple[int, ...], others=()) -> int:
        """The longest prefix `ids` shares with a remembered prompt or completion, or with one of `others` (prompts
        admitted beside it)."""
        return max(self.memory.shared(ids), *(common_prefix(ids, o) for o in others), 0)

    def remember(self, ids: tuple[int, ...]) -> None:
        self.memory.remember(ids)

    def plan(
        self, ids: tuple[int, ...], moves: Moves, pinned: set[int], branch: bool = False, digest: int | None = None
    ) -> int | None:
        """A new snapshot of `ids`: its id, with room made in the device pool (evictions into `moves`, never of a
        snapshot in `pinned`), or None when it cannot fit or already exists."""
        nbytes = self.nbytes(len(ids))
        digest = _hashes(ids, {len(ids)})[len(ids)] if digest is None else digest
        if nbytes > self.budget["device"] or self.has(ids, digest):
            return None
        if not self._make_room("device", nbytes, moves, pinned):
            return None
        self._next += 1
        entry = Entry(self._next, ids, nbytes, digest, ready=False)
        self._add(entry)
        self.stats.saved += 1
        self.stats.branches += branch
        return entry.id

    def made(self, snap_id: int) -> None:
        """A planned snapshot is scheduled to be taken: from this point of the record on it can be restored."""
        entry = self._entry(snap_id)
        entry.ready = True
        if self.journal is not None:
            self.journal.append(("stored", entry))

    def unplan(self, snap_id: int) -> None:
        """A planned snapshot that will never be taken (its prompt was aborted first): no rank holds it."""
        self._remove(self._entry(snap_id))
        self.stats.saved -= 1

    def _entry(self, snap_id: int) -> Entry:
        return self.tiers["device"].get(snap_id) or self.tiers["host"][snap_id]

    def _make_room(self, tier: str, nbytes: int, moves: Moves, pinned: set[int]) -> bool:
        queue = self.tiers[tier]
        while self.held[tier] + nbytes > self.budget[tier]:
            victim = next((e for e in queue.values() if e.id not in pinned and e.ready), None)
            if victim is None:
                return False
            self._remove(victim)
            if tier == "device" and self._make_room("host", victim.nbytes, moves, pinned | {victim.id}):
                victim.tier = "host"
                self._add(victim)
                moves.demote.append(victim.id)
                self.stats.demotions += 1
            else:
                moves.drop.append(victim.id)
                self.stats.evictions += 1
                if self.journal is not None:
                    self.journal.append(("dropped", victim))
        return True

    def _add(self, entry: Entry) -> None:
        self.tiers[entry.tier][entry.id] = entry
        self.held[entry.tier] += entry.nbytes
        key = (len(entry.ids), entry.digest)
        self.by_key.setdefault(key, []).append(entry)
        self.lengths[len(entry.ids)] = self.lengths.get(len(entry.ids), 0) + 1

    def _remove(self, entry: Entry) -> None:
        del self.tiers[entry.tier][entry.id]
        self.held[entry.tier] -= entry.nbytes
        key = (len(entry.ids), entry.digest)
        self.by_key[key].remove(entry)
        if not self.by_key[key]:
            del self.by_key[key]
        self.lengths[len(entry.ids)] -= 1
        if not self.lengths[len(entry.ids)]:
            del self.lengths[len(entry.ids)]

    def report(self) -> dict:
        held = {"bytes_held": self.held["device"] + self.held["host"], "snapshots": sum(map(len, self.tiers.values()))}
        held |= {"remembered": len(self.memory), "remembered_bytes": self.memory.held}
        return self.stats.as_dict(held | {"device_bytes": self.held["device"], "host_bytes": self.held["host"]})
