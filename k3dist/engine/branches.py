"""Rank 0's memory of recent prompts and completions (token ids only, no state), to find where prompts branch.

A prompt's branch point is the longest prefix it shares with any remembered sequence. Kept in lexicographic order,
that is the longer of its common prefixes with its two neighbours in the order (any sequence sharing more with it
would sort between them), so one binary search answers it: the equivalent of a radix tree's walk, at 4 bytes a
token. Each sequence is stored as big-endian 4-byte ids, whose byte order is the ids' lexicographic order, so
comparisons and prefix tests are plain byte comparisons. The memory is bounded by bytes; the least recently
remembered sequences are forgotten first.
"""

import bisect
import struct
from collections import OrderedDict

ENTRY_OVERHEAD = 256  # bytes a remembered sequence costs beyond its ids: its bytes object, list and dict slots


def _key(ids) -> bytes:
    return struct.pack(f">{len(ids)}I", *ids)


def _common(a: bytes, b: bytes) -> int:
    """Length of the common prefix of two keys, in ids (a binary search of prefix comparisons)."""
    lo, hi = 0, min(len(a), len(b)) // 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: 4 * mid] == b[: 4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_prefix(a, b) -> int:
    """Length of the common prefix of two id sequences."""
    return _common(_key(a), _key(b))


class BranchMemory:
    def __init__(self, budget: int):
        """`budget`: bytes the remembered ids and their bookkeeping may take."""
        self.budget, self.held = budget, 0
        self.order: list[bytes] = []  # every remembered key, sorted
        self.recent: OrderedDict[bytes, None] = OrderedDict()  # the same keys, least recently remembered first

    def __len__(self) -> int:
        return len(self.order)

    def shared(self, ids) -> int:
        """The longest prefix of `ids` that some remembered sequence also starts with (in tokens)."""
        key = _key(ids)
        at = bisect.bisect_left(self.order, key)
        near = self.order[max(at - 1, 0) : at + 1]
        return max((_common(key, other) for other in near), default=0)

    def remember(self, ids) -> None:
        """Keep `ids` (a prompt, or a prompt and its completion); forget the oldest sequences past the budget. A
        sequence that is a prefix of a remembered one adds nothing: every query it could answer, that one does."""
        key = _key(ids)
        cost = len(key) + ENTRY_OVERHEAD
        if not key or cost > self.budget:
            return
        if key in self.recent:
            self.recent.move_to_end(key)
            return
        at = bisect.bisect_left(self.order, key)
        if at < len(self.order) and self.order[at].startswith(key):
            self.recent.move_to_end(self.order[at])
            return
        if at and key.startswith(self.order[at - 1]):  # it extends a remembered sequence, which it now answers for
            self._forget(self.order[at - 1])
            at -= 1
        while self.held + cost > self.budget:
            self._forget(next(iter(self.recent)))
            at = bisect.bisect_left(self.order, key)
        self.order.insert(at, key)
        self.recent[key] = None
        self.held += cost

    def _forget(self, key: bytes) -> None:
        del self.recent[key]
        del self.order[bisect.bisect_left(self.order, key)]
        self.held -= len(key) + ENTRY_OVERHEAD
