"""Which checkpoint bytes one rank reads, in which reads, and what that costs in pages.

A tensor's rank-local bytes lie in its file as `count` rows of `length` bytes, `stride` apart: one row when they are
contiguous (replicated tensors, splits of the leading dim), one row per leading index for a split of a later dim.
Reads are scheduled as chunks that each fit one staging slot. Byte ranges closer than `MERGE` join into one read
(the bytes between are read and dropped: reading through a small hole is cheaper than a second request), so a
row-split tensor whose local part of a row is small is read whole, and consecutive tensors of a file read as one
range. Large ranges are cut at row boundaries.

The kernel reads whole pages, so `read_bytes` counts the pages these reads touch: the honest reading figure, which
for row splits at high TP is many times the rank's share of the checkpoint. Plans from the config alone know no
offsets: each tensor is taken to start on a page of its own.
"""

import math
import mmap
from collections.abc import Iterable
from typing import NamedTuple

from ..dtypes import BY_CODE
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
    """Rows [row, row + rows) of a row-split tensor read as one range; the local columns are picked out after."""

    index: int
    row: int
    rows: int


class Chunk(NamedTuple):
    """One reader task: preads (file offset, bytes, slot position) and the tensor parts they hold.

    A contiguous part lands at its read's slot position plus its distance from the read's start. A span chunk holds
    one read of whole rows, then (at `packed_at`) room for the rows' local columns packed.
    """

    reads: tuple[tuple[int, int, int], ...]
    parts: tuple[Part, ...] = ()
    span: Span | None = None
    size: int = 0  # slot bytes it needs when everything is staged


class _Builder:
    """Packs one file's parts into chunks, in file order."""

    def __init__(self, cap: int, merge: int):
        self.cap, self.merge, self.chunks = cap, merge, []
        self.reads: list[list[int]] = []
        self.parts: list[Part] = []
        self.size = 0

    def flush(self) -> None:
        if self.reads:
            self.chunks.append(Chunk(tuple(map(tuple, self.reads)), tuple(self.parts), None, self.size))
        self.reads, self.parts, self.size = [], [], 0

    def add(self, index: int, begin: int, end: int, offset: int, unit: int) -> None:
        while begin < end:
            gap = offset - self.reads[-1][0] - self.reads[-1][1] if self.reads else -1
            joined = 0 <= gap < self.merge
            extra = gap if joined else _pad(offset - self.size)
            take = min(end - begin, (self.cap - self.size - extra) // unit * unit)
            if take <= 0:
                if self.reads:
                    self.flush()
                    continue
                take = min(unit, end - begin)
            if joined:
                self.reads[-1][1] += gap + take
            else:
                self.reads.append([offset, take, self.size + extra])
            self.size += extra + take
            self.parts.append(Part(index, begin, begin + take, offset))
            begin, offset = begin + take, offset + take

    def span(self, index: int, run: Run) -> None:
        self.flush()
        per = max(1, (self.cap - ALIGN) // (run.stride + run.length))
        for row in range(0, run.count, per):
            rows = min(per, run.count - row)
            raw = (rows - 1) * run.stride + run.length
            read = ((run.start + row * run.stride, raw, 0),)
            self.chunks.append(Chunk(read, (), Span(index, row, rows), packed_at(raw) + rows * run.length))


def _pad(distance: int) -> int:
    """Bytes that put the next read at a slot position congruent to its file offset, so every tensor keeps the
    alignment it has in the file (safetensors aligns each tensor to its element size)."""
    return distance % ALIGN


def packed_at(raw: int) -> int:
    """Slot position of a span chunk's packed columns, after its `raw` bytes of whole rows."""
    return -(-raw // ALIGN) * ALIGN


def schedule(plans: list[ShardPlan], cap: int = CHUNK, merge: int = MERGE) -> dict[object, list[Chunk]]:
    """Chunks per file, in file order (per tensor, in plan order, for tensors of no known offset)."""
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
    for start, size, _ in sorted(r for c in chunks for r in c.reads):
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
