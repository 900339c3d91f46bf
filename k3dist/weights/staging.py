"""The staging ring: a few host buffers that reader threads fill while earlier ones are copied into place.

On CUDA the slots are pinned, so host-to-device copies run asynchronously on a side stream; each slot carries an
event recorded after its copies, and a slot is handed out again only once that event has passed. On CPU a slot is
plain memory, allocated on first use: only casts and the holes between merged reads pass through it, everything
else is read straight into the weights.
"""

import torch

from ..base import compat


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def release_pinned() -> None:
    """Give cached pinned memory back to the system: torch keeps freed pinned blocks for reuse, which would hold the
    ring's host memory for the whole job."""
    compat.empty_host_cache()


class Slot:
    def __init__(self, buffer: torch.Tensor, event):
        self.buffer = buffer  # uint8, `Ring.nbytes` long
        self.event = event  # CUDA: recorded on the copy stream after the slot's copies; None on CPU


class Ring:
    def __init__(self, slots: int, nbytes: int, cuda: bool):
        self.nbytes, self.cuda = nbytes, cuda
        self.slots: list[Slot | None] = [None] * max(slots, 1)
        self.next = 0

    def take(self) -> Slot:
        """The next slot in turn, once the copies out of its last chunk have finished."""
        i, self.next = self.next, (self.next + 1) % len(self.slots)
        slot = self.slots[i]
        if slot is None:
            slot = self.slots[i] = Slot(host_buffer(self.nbytes, self.cuda), torch.cuda.Event() if self.cuda else None)
        elif slot.event is not None:
            slot.event.synchronize()
        return slot

    def release(self, slot: Slot, stream) -> None:
        """The slot's copies are queued on `stream` (CUDA) or done (CPU)."""
        if slot.event is not None:
            slot.event.record(stream)

    def close(self) -> None:
        for slot in self.slots:
            if slot is not None and slot.event is not None:
                slot.event.synchronize()
        used = any(slot is not None for slot in self.slots)
        self.slots = [None] * len(self.slots)
        if self.cuda and used:
            release_pinned()
