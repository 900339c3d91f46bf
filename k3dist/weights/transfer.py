"""Reading runs ahead of copying: reader threads fill chunks while the calling thread puts finished ones in place.

Readers use `os.preadv` for contiguous ranges: one call per range (the GIL released meanwhile) into any list of
buffers, so a range spanning several tensors lands in all of them at once. On CPU the buffers are the weights
themselves wherever the bytes need no change; casts and the holes between merged reads go through a staging slot
and are then copied into the weights by this thread. A span (a row-split tensor read whole) is read through the
file's mapping: its pages are asked for at once (MADV_WILLNEED) and its local columns copied out, on CPU straight
into the weights. On CUDA every chunk goes through a pinned slot and on to the device with non-blocking copies on a
side stream; a slot is refilled only after its copies finished.

Readahead is off on the descriptor and the mapping, so the pages read are exactly the ones reads.py counts.
"""

import mmap
import os
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

import torch

from ..base.dtypes import BY_CODE
from .reads import PAGE, Chunk, run_of
from .staging import Ring, Slot
from .tp_plan import ShardPlan

IOV_MAX = os.sysconf("SC_IOV_MAX")


def _buffer(t: torch.Tensor):
    """The writable memory of a contiguous CPU tensor, for preadv."""
    return memoryview(t.view(torch.uint8).numpy())


def preadv_all(fd: int, buffers: list, offset: int) -> None:
    """Fill `buffers` from file offset `offset` on, in as many calls as the kernel needs."""
    views = [b for b in buffers if len(b)]
    first = 0
    while first < len(views):
        n = os.preadv(fd, views[first : first + IOV_MAX], offset)
        if n == 0:
            missing = sum(len(v) for v in views[first:])
            raise EOFError(f"the file ends at byte {offset}, {missing} bytes before the planned data does")
        offset += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:
            views[first] = views[first][n:]


class _Mapping:
    """One file mapped read-only for its spans, readahead off."""

    def __init__(self, fd: int):
        self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        self.map.madvise(mmap.MADV_RANDOM)
        with warnings.catch_warnings():  # torch has no read-only tensors; these views are only ever read
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def columns(self, offset: int, rows: int, length: int, stride: int, dtype: torch.dtype) -> torch.Tensor:
        """`rows` rows of `length` bytes, `stride` apart from `offset`, as a strided view of elements (not read)."""
        raw = self.bytes[offset : offset + (rows - 1) * stride + length]
        if offset % dtype.itemsize:  # a file that does not align its tensors: read them out here
            raw = raw.clone()
        return raw.view(dtype).as_strided((rows, length // dtype.itemsize), (stride // dtype.itemsize, 1))

    def willneed(self, offset: int, size: int) -> None:
        """Ask for the pages of [offset, offset + size) at once: one large read, not a fault per page."""
        start = offset // PAGE * PAGE
        self.map.madvise(mmap.MADV_WILLNEED, start, offset + size - start)

    def close(self) -> None:
        self.bytes = None
        try:
            self.map.close()
        except BufferError:  # a view survived a failure (its traceback): the mapping goes when it does
            pass


class _Job:
    """A chunk in flight: its reader's future, its slot, the copies that finish it (target, source, the source's
    element type when it is slot bytes), its local bytes."""

    def __init__(self, chunk: Chunk, slot: Slot | None, copies: list, nbytes: int):
        self.chunk, self.slot, self.copies, self.nbytes = chunk, slot, copies, nbytes
        self.future: Future | None = None


class Transfer:
    """One upload's reader threads, staging ring and (CUDA) copy stream."""

    def __init__(self, device: torch.device, slots: int, slot_bytes: int, readers: int, cuda: bool | None = None):
        self.device = device
        self.cuda = device.type == "cuda" if cuda is None else cuda  # tests force the CUDA path on CPU tensors
        self.ring = Ring(slots, slot_bytes, self.cuda)
        self.depth = max(slots, 1)
        self.pool = ThreadPoolExecutor(max(readers, 1), thread_name_prefix="k3dist-read")
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.chunk: Chunk | None = None  # the chunk last started or finished: names the tensor when one fails

    def run(
        self,
        fd: int,
        chunks: list[Chunk],
        targets: dict[int, torch.Tensor],
        plans: list[ShardPlan],
        at_read: Callable[[int], None],
        done: Callable[[int], None],
    ) -> None:
        """Read and place one file's chunks (`targets`: plan index -> its local tensor on the device). Returns, or
        raises, only once no reader touches memory anymore; on CUDA the copies may still be queued."""
        if self.stream is not None:  # the weights were just allocated on the current stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        mapping = _Mapping(fd) if any(c.spans for c in chunks) else None
        pending: deque[_Job] = deque()
        try:
            for chunk in chunks:
                if len(pending) >= self.depth:
                    self._finish(pending.popleft(), done)
                self.chunk = chunk
                job, reads, spans, packs = self._prepare(chunk, targets, plans, mapping)
                steps = [(partial(at_read, i), i) for i in _indices(chunk)]
                steps += [(partial(m.willneed, offset, size), i) for m, offset, size, i in spans]  # I/O starts now
                steps += [(partial(preadv_all, fd, buffers, offset), i) for offset, buffers, i in reads]
                steps += [(partial(target.copy_, source), i) for target, source, i in packs]
                job.future = self.pool.submit(self._read, steps)
                pending.append(job)
            while pending:
                self._finish(pending.popleft(), done)
        except BaseException:
            for job in pending:
                if job.future is not None:
                    job.future.cancel()
            wait([job.future for job in pending if job.future is not None])
            raise
        finally:
            if mapping is not None:
                mapping.close()

    def _prepare(self, chunk: Chunk, targets: dict[int, torch.Tensor], plans: list[ShardPlan], mapping):
        """The chunk's job and its reader's work: preads (file offset, buffers), span ranges to ask for, and the
        copies of the spans' local columns (on CPU straight into the weights; on CUDA packed into the slot, so that
        each device copy is one contiguous transfer)."""
        direct = not self.cuda
        sources = {i: BY_CODE[plans[i].src_dtype].torch for i in _indices(chunk)}
        staged = {p.index for p in chunk.parts if not (direct and targets[p.index].dtype == sources[p.index])}
        holes = sum(p.end - p.begin for p in chunk.parts) < sum(size for _, size, _ in chunk.reads)
        slot = self.ring.take() if staged or holes or (chunk.spans and not direct) else None
        reads, copies, nbytes = [], [], 0
        parts = iter(chunk.parts)
        part = next(parts, None)
        for offset, size, at in chunk.reads:
            buffers, cursor, first_index = [], offset, part.index if part is not None else -1
            while part is not None and part.offset < offset + size:
                if part.offset > cursor:
                    buffers.append(_buffer(slot.buffer[at + cursor - offset : at + part.offset - offset]))
                target = targets[part.index].view(-1)
                src = sources[part.index]
                first, last = part.begin // src.itemsize, part.end // src.itemsize
                if part.index in staged:
                    lo = at + part.offset - offset
                    raw = slot.buffer[lo : lo + part.end - part.begin]
                    buffers.append(_buffer(raw))
                    copies.append((target[first:last], raw, src))
                else:
                    buffers.append(_buffer(target[first:last]))
                nbytes += (last - first) * target.dtype.itemsize
                cursor = part.offset + part.end - part.begin
                part = next(parts, None)
            reads.append((offset, buffers, first_index))
        spans, packs = [], []
        for span in chunk.spans:
            run, src = run_of(plans[span.index]), sources[span.index]
            columns = mapping.columns(span.offset, span.rows, run.length, run.stride, src)
            target = targets[span.index].view(run.count, -1)[span.row : span.row + span.rows]
            spans.append((mapping, span.offset, span.size, span.index))
            if direct:
                packs.append((target, columns, span.index))
            else:
                packed = slot.buffer[span.at : span.at + span.rows * run.length].view(src).view(span.rows, -1)
                packs.append((packed, columns, span.index))
                copies.append((target, packed, None))
            nbytes += target.numel() * target.dtype.itemsize
        return _Job(chunk, slot, copies, nbytes), reads, spans, packs

    @staticmethod
    def _read(steps: list) -> None:
        """A reader's work, step by step; an error carries the plan index of the tensor it hit (`k3_index`)."""
        for step, index in steps:
            try:
                step()
            except Exception as exc:
                exc.k3_index = index
                raise

    def _finish(self, job: _Job, done: Callable[[int], None]) -> None:
        self.chunk = job.chunk
        job.future.result()
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                for target, source, dtype in job.copies:
                    target.copy_(_typed(source, dtype), non_blocking=True)
        else:
            for target, source, dtype in job.copies:
                target.copy_(_typed(source, dtype))
        if job.slot is not None:
            self.ring.release(job.slot, self.stream)
        done(job.nbytes)

    def end(self) -> None:
        """After the last file: later work on the current stream sees every copy."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        """Stop the readers (waiting for any running read), wait for queued copies, free the ring."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.stream is not None:
            self.stream.synchronize()
        self.ring.close()


def _typed(raw: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Slot bytes as elements; bytes off their element alignment (a file that does not align tensors, reads._pad)
    are copied out first."""
    if dtype is None:
        return raw
    return raw.view(dtype) if raw.storage_offset() % dtype.itemsize == 0 else raw.clone().view(dtype)


def _indices(chunk: Chunk) -> list[int]:
    """The chunk's tensors, in file order."""
    items = sorted([(p.offset, p.index) for p in chunk.parts] + [(s.offset, s.index) for s in chunk.spans])
    return list(dict.fromkeys(index for _, index in items))
