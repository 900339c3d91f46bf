"""Reading runs ahead of copying: reader threads fill chunks while the calling thread puts finished ones in place.

Readers use `os.preadv`: one call per contiguous file range (the GIL released meanwhile) into any list of buffers,
so a range spanning several tensors lands in all of them at once. On CPU the buffers are the weights themselves
wherever the bytes need no change; casts, row-split tensors and the holes between merged reads go through a staging
slot and are then copied into the weights by this thread. On CUDA every chunk goes through a pinned slot and on to
the device with non-blocking copies on a side stream; a slot is refilled only after its copies finished.

The file descriptor is opened with readahead off, so the pages read are exactly the ones reads.py counts.
"""

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from ..dtypes import BY_CODE
from .reads import Chunk, packed_at, run_of
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
        pending: deque[_Job] = deque()
        try:
            for chunk in chunks:
                if len(pending) >= self.depth:
                    self._finish(pending.popleft(), done)
                self.chunk = chunk
                job, reads, pack = self._prepare(chunk, targets, plans)
                job.future = self.pool.submit(self._read, fd, reads, pack, _indices(chunk), at_read)
                pending.append(job)
            while pending:
                self._finish(pending.popleft(), done)
        except BaseException:
            for job in pending:
                if job.future is not None:
                    job.future.cancel()
            wait([job.future for job in pending if job.future is not None])
            raise

    def _prepare(self, chunk: Chunk, targets: dict[int, torch.Tensor], plans: list[ShardPlan]):
        """The chunk's job, its reads (file offset, buffers) and the packing its reader does (CUDA spans)."""
        if chunk.span is not None:
            return self._prepare_span(chunk, targets, plans)
        direct = not self.cuda
        sources = {p.index: BY_CODE[plans[p.index].src_dtype].torch for p in chunk.parts}
        staged = {i for i, src in sources.items() if not (direct and targets[i].dtype == src)}
        holes = sum(p.end - p.begin for p in chunk.parts) < sum(size for _, size, _ in chunk.reads)
        slot = self.ring.take() if staged or holes else None
        reads, copies, nbytes = [], [], 0
        parts = iter(chunk.parts)
        part = next(parts, None)
        for offset, size, at in chunk.reads:
            buffers, cursor = [], offset
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
            reads.append((offset, buffers))
        return _Job(chunk, slot, copies, nbytes), reads, None

    def _prepare_span(self, chunk: Chunk, targets: dict[int, torch.Tensor], plans: list[ShardPlan]):
        """Whole rows into the slot; their local columns go to the weights (CUDA: packed in the slot first, by the
        reader, so the device copy is one contiguous transfer)."""
        span = chunk.span
        run, src = run_of(plans[span.index]), BY_CODE[plans[span.index].src_dtype].torch
        ((offset, raw, _),) = chunk.reads
        slot = self.ring.take()
        columns = (
            slot.buffer[:raw]
            .view(src)
            .as_strided((span.rows, run.length // src.itemsize), (run.stride // src.itemsize, 1))
        )
        target = targets[span.index].view(run.count, -1)[span.row : span.row + span.rows]
        pack = None
        if self.cuda:
            at = packed_at(raw)
            packed = slot.buffer[at : at + span.rows * run.length].view(src).view(span.rows, -1)
            pack, columns = (packed, columns), packed
        job = _Job(chunk, slot, [(target, columns, None)], target.numel() * target.dtype.itemsize)
        return job, [(offset, [_buffer(slot.buffer[:raw])])], pack

    @staticmethod
    def _read(fd: int, reads: list, pack, indices: list[int], at_read: Callable[[int], None]) -> None:
        for index in indices:
            at_read(index)
        for offset, buffers in reads:
            preadv_all(fd, buffers, offset)
        if pack is not None:
            pack[0].copy_(pack[1])

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
    if chunk.span is not None:
        return [chunk.span.index]
    return list(dict.fromkeys(p.index for p in chunk.parts))
