"""Which checkpoint bytes one rank reads, in which reads, and what that costs in pages.

A tensor's rank-local bytes lie in its file as `count` rows of `length` bytes, `stride` apart: one row when they are
contiguous (replicated tensors, splits of the leading dim), one row per leading index for a split of a later dim.
Reads are scheduled as chunks that each fit one staging slot. Byte ranges closer than `MERGE` join into one read
(the bytes between are read and dropped: reading through a small hole is cheaper than a second request), so
consecutive tensors of a file read as one range, and a row-split tensor whose local parts of its rows lie closer
than that is read whole: a span, whose pages are brought in at once and whose local columns are then picked out of
the file's mapping. Large ranges are cut at row boundaries.

The kernel reads whole pages, so `read_bytes` counts the pages these reads touch: the honest reading figure, which
for row splits at high TP is many times the rank's share of the checkpoint. Plans from the config alone know no
offsets: each tensor is taken to start on a page of its own.
"""

import gc
import math
import mmap
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from ..base.dtypes import BY_CODE
from .tp_plan import ShardPlan

PAGE = mmap.PAGESIZE
CHUNK = 64 * 2**20  # the most one staging slot holds (a row larger than that gets a chunk of its own)
SLOTS = 4  # staging slots: chunks read ahead of the copies
MERGE = 128 * 2**10  # holes smaller than this are read through (the kernel's default readahead window)
ALIGN = 8  # the largest element size


class Run(NamedTuple):
    """A tensor's rank-local bytes in its file: `count` rows of `length` bytes, `stride` apart, from `start`."""

    start: int
    length: int
    stride: int
    count: int
    unit: int  # bytes of one row of the local tensor: where a contiguous range may be cut between chunks

    @property
    def end(self) -> int:
        return self.start + (self.count - 1) * self.stride + self.length


def run_of(plan: ShardPlan) -> Run:
    item = BY_CODE[plan.src_dtype].itemsize
    base = plan.offset or 0
    local = math.prod(plan.local_shape) * item
    rows = plan.local_shape[0] if plan.local_shape else 1
    unit = local // rows if rows else item
    if plan.axis.dim is None:
        return Run(base, local, local, 1, unit)
    dim, shape = plan.axis.dim, plan.full_shape
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1 :]) * item
    length, stride = (plan.stop - plan.start) * inner, shape[dim] * inner
    start = base + plan.start * inner
    if outer == 1 or length == stride:
        return Run(start, local, local, 1, unit)
    return Run(start, length, stride, outer, length)


class Part(NamedTuple):
    """Bytes [begin, end) of a tensor's local data (source dtype, row-major), found at file offset `offset`."""

    index: int  # the tensor's position in the rank's plan
    begin: int
    end: int
    offset: int


class Span(NamedTuple):
    """Rows [row, row + rows) of a row-split tensor whose local parts lie close: the file range [offset, offset +
    size) is read whole through the file's mapping, and the rows' local columns are staged, packed, at slot position
    `at` (on CPU they go straight into the weights)."""

    index: int
    row: int
    rows: int
    offset: int
    size: int
    at: int


class Chunk(NamedTuple):
    """One reader task: preads (file offset, bytes, slot position) and the contiguous parts they hold, and spans.

    A part lands at its read's slot position plus its distance from the read's start.
    """

    reads: tuple[tuple[int, int, int], ...]
    parts: tuple[Part, ...] = ()
    spans: tuple[Span, ...] = ()
    size: int = 0  # slot bytes it needs when everything is staged


class _Builder:
    """Packs one file's parts and spans into chunks, in file order."""

    def __init__(self, cap: int, merge: int):
        self.cap, self.merge, self.chunks = cap, merge, []
        self._reset()

    def _reset(self) -> None:
        self.reads: list[list[int]] = []
        self.parts: list[Part] = []
        self.spans: list[Span] = []
        self.size, self.joinable = 0, False

    def flush(self) -> None:
        if self.parts or self.spans:
            reads = tuple(map(tuple, self.reads))
            self.chunks.append(Chunk(reads, tuple(self.parts), tuple(self.spans), self.size))
        self._reset()

    def add(self, index: int, begin: int, end: int, offset: int, unit: int) -> None:
        while begin < end:
            gap = offset - self.reads[-1][0] - self.reads[-1][1] if self.reads and self.joinable else -1
            joined = 0 <= gap < self.merge
            extra = gap if joined else _pad(offset - self.size)
            take = min(end - begin, (self.cap - self.size - extra) // unit * unit)
            if take <= 0:
                if self.parts or self.spans:
                    self.flush()
                    continue
                take = min(unit, end - begin)
            if joined:
                self.reads[-1][1] += gap + take
            else:
                self.reads.append([offset, take, self.size + extra])
            self.size += extra + take
            self.parts.append(Part(index, begin, begin + take, offset))
            begin, offset, self.joinable = begin + take, offset + take, True

    def span(self, index: int, run: Run) -> None:
        row = 0
        while row < run.count:
            at = -(-self.size // ALIGN) * ALIGN
            rows = min(run.count - row, (self.cap - at) // run.length)
            if rows <= 0:
                if self.parts or self.spans:
                    self.flush()
                    continue
                at, rows = 0, 1
            offset = run.start + row * run.stride
            self.spans.append(Span(index, row, rows, offset, (rows - 1) * run.stride + run.length, at))
            self.size, row, self.joinable = at + rows * run.length, row + rows, False


def _pad(distance: int) -> int:
    """Bytes that put the next read at a slot position congruent to its file offset, so every tensor keeps the
    alignment it has in the file (safetensors aligns each tensor to its element size)."""
    return distance % ALIGN


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: scheduling and uploading make many short-lived objects, which would set
    off full collections over the whole process (tens of milliseconds each, nothing to free); explicit
    `gc.collect()` still works."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def schedule(plans: list[ShardPlan], cap: int = CHUNK, merge: int = MERGE) -> dict[object, list[Chunk]]:
    """Chunks per file, in file order (per tensor, in plan order, for tensors of no known offset)."""
    with collector_paused():
        return _schedule(plans, cap, merge)


def _schedule(plans: list[ShardPlan], cap: int, merge: int) -> dict[object, list[Chunk]]:
    groups: dict[object, list[int]] = {}
    for i, p in enumerate(plans):
        groups.setdefault(p.file if p.offset is not None else ("tensor", i), []).append(i)
    out = {}
    for key, members in groups.items():
        runs = {i: run_of(plans[i]) for i in members}
        build = _Builder(cap, merge)
        for i in sorted(members, key=lambda i: runs[i].start):
            run = runs[i]
            if run.length == 0:
                continue
            if run.count == 1:
                build.add(i, 0, run.length, run.start, run.unit)
            elif run.stride - run.length < merge:
                build.span(i, run)
            else:
                for r in range(run.count):
                    build.add(i, r * run.length, (r + 1) * run.length, run.start + r * run.stride, run.length)
        build.flush()
        out[key] = build.chunks
    return out


def pages(chunks: Iterable[Chunk], page: int = PAGE) -> int:
    """Pages the reads of one file's chunks touch, each page counted once."""
    total, last = 0, -1
    ranges = [(start, size) for c in chunks for start, size, _ in c.reads]
    ranges += [(span.offset, span.size) for c in chunks for span in c.spans]
    for start, size in sorted(ranges):
        first, final = start // page, (start + size - 1) // page
        total += max(0, final - max(first, last + 1) + 1)
        last = max(last, final)
    return total


def read_bytes(plans: list[ShardPlan], chunks: dict[object, list[Chunk]] | None = None, page: int = PAGE) -> int:
    """Page-granular bytes a rank reads from the checkpoint, given its whole plan: each file's header (read again at
    load to check it: everything before the file's first tensor), then the reads of its schedule."""
    chunks = schedule(plans) if chunks is None else chunks
    data: dict[object, int] = {}  # where each file's data starts: its first tensor's offset
    for p in plans:
        if p.offset is not None:
            data[p.file] = min(data.get(p.file, p.offset), p.offset)
    total = 0
    for key, file_chunks in chunks.items():
        header = [Chunk(((0, data[key], 0),))] if key in data else []
        total += pages(header + file_chunks, page)
    return total * page


def staging(chunks: dict[object, list[Chunk]]) -> tuple[int, int]:
    """(slots, bytes per slot) of the staging ring that holds a schedule's chunks."""
    every = [c for file_chunks in chunks.values() for c in file_chunks]
    return min(SLOTS, len(every)), max((c.size for c in every), default=0)
