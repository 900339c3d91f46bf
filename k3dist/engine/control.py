"""The control plane: rank 0 decides, every rank follows.

Each window rank 0 sends every other rank one small record over the gloo control group: the requests admitted into
slots (prompt ids and SamplingParams: sampling and logit processors), the pieces of prompts to prefill, the slots whose
requests ended, how many decode steps to run, and at the end a shutdown; now and then a record asks every rank for
the memory it holds (watch.py). A window with grammar-constrained slots sends their token bitmasks right after it,
as one int32 tensor (a broadcast on the same group), never inside the record. Every rank applies the same records
in the same order, so all keep the same slot table and run the same steps; generated ids never travel (sampling is
identical on every rank). An idle rank 0 sends an empty record every `heartbeat_s`, so a follower waiting for the
next one is never left in a collective that times out, however long the server idles.
"""

import json
import logging
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

from ..base import allocator
from ..base.dist import Runtime
from ..base.errors import K3Error
from ..weights.memory import resident_bytes
from .sampling import GREEDY, SamplingMode, SamplingParams

log = logging.getLogger("k3dist")


@dataclass(frozen=True)
class Admit:
    """A request taking a slot: its prompt and sampling (all a rank needs to prefill it and choose its tokens). Its
    prefill runs in pieces, in this window and maybe later ones (Window.prefill)."""

    slot: int
    ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()  # how its tokens are chosen (DecodeStep.load writes its slot)
    restore: int | None = None  # a prefix snapshot to start from: the prefill starts at its length
    saves: tuple[tuple[int, int], ...] = ()  # (position, snapshot id): prefix snapshots to take on the way
    emit: bool = True  # False: choose no token (snapshots of a finished request's prompt + completion, or a score)
    score: int | None = None  # prompt log-probabilities: the k best of every position gathered too (prompt_logprobs.py)


@dataclass(frozen=True)
class Window:
    """One window of work, the same on every rank."""

    admit: tuple[Admit, ...] = ()
    # (slot, start, end, new): prompt tokens [start, end) of a slot's prompt to prefill, in this order; `new` takes
    # the next Admit (its slot is reset and its snapshot restored first); the piece that reaches the prompt's end
    # emits its first token
    prefill: tuple[tuple[int, int, int, bool], ...] = ()
    ended: tuple[int, ...] = ()  # slots whose requests finished or were aborted since the last window
    drop: tuple[int, ...] = ()  # prefix snapshots evicted for good ...
    demote: tuple[int, ...] = ()  # ... and moved to host memory, before anything else in the window
    steps: int = 0  # decode steps over every slot
    rows: int | None = None  # eager steps: the MLA cache rows no live slot gets past in this window
    active: int | None = None  # eager steps: the slots stepped (every live one is below it)
    mode: SamplingMode = GREEDY  # the least sampling mode covering the live slots
    top: int = 5  # top logits the window's emits gather (decode_step.py's TOP, or more when a live slot asks for more)
    report: bool = False  # after the window every rank reports the memory it holds (watch.py)
    stop: int | None = None  # shutdown: every rank leaves its loop (the exit code, 0 for a normal end)
    masks: tuple[int, ...] = ()  # slots whose grammar masks come with this window ...
    mask_words: int = 0  # ... as `bitmask` [len(masks), mask_words] int32, sent beside the record
    bitmask: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> bytes:
        raw = asdict(replace(self, bitmask=None))
        del raw["bitmask"]
        return json.dumps(raw, separators=(",", ":")).encode()

    @staticmethod
    def from_json(data: bytes) -> "Window":
        raw = json.loads(data)
        raw["admit"] = tuple(_admit(a) for a in raw["admit"])
        raw["mode"] = SamplingMode(**raw["mode"])
        for key in ("ended", "drop", "demote", "masks"):
            raw[key] = tuple(raw[key])
        raw["prefill"] = tuple(tuple(p) for p in raw["prefill"])
        return Window(**raw)


def _admit(raw: dict) -> Admit:
    saves, sampling = tuple(map(tuple, raw["saves"])), SamplingParams.from_json(raw["sampling"])
    return Admit(**(raw | {"ids": tuple(raw["ids"]), "saves": saves, "sampling": sampling}))


class Channel:
    """Window records from rank 0 to every rank (a world of one sends nothing)."""

    def __init__(self, rt: Runtime | None, check_tokens: bool = False):
        """`rt` None: a world of one (tests and tools that build an engine without a process group)."""
        self.rt, self.check_tokens = rt, check_tokens
        self.world = rt.world if rt is not None else 1
        self.heartbeat_s = min(1.0, rt.timeout_s / 4) if rt is not None else 1.0
        self.windows = 0

    def send(self, window: Window) -> None:
        if self.world > 1:
            data = window.to_json()
            dist.broadcast(torch.tensor([len(data)]), 0, group=self.rt.ctrl)
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.rt.ctrl)
            if window.masks:
                dist.broadcast(window.bitmask.contiguous(), 0, group=self.rt.ctrl)

    def receive(self) -> Window:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.rt.ctrl)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.rt.ctrl)
        window = Window.from_json(data.numpy().tobytes())
        if window.masks:
            bitmask = torch.empty(len(window.masks), window.mask_words, dtype=torch.int32)
            dist.broadcast(bitmask, 0, group=self.rt.ctrl)
            window = replace(window, bitmask=bitmask)
        return window

    def gather_memory(self, device: torch.device) -> list[list[int]]:
        """After a report window, on every rank: give back free heap pages, then every rank's (resident, base) to
        all (rank 0 keeps them; the others' copy is 16 bytes a rank)."""
        if device.type == "cpu":
            allocator.trim()
        mine = torch.tensor(resident_bytes(device), dtype=torch.int64)
        if self.world == 1:
            return [mine.tolist()]
        figures = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(figures, mine, group=self.rt.ctrl)
        return [f.tolist() for f in figures]

    def compare(self, window: Window, out_tokens: torch.Tensor) -> None:
        """With dist.check_tokens, after every window that ran anything: every rank's generated ids must equal rank
        0's (a checksum of the output buffers, exchanged over the control group); a mismatch ends the run with one
        line."""
        if not (window.prefill or window.steps):
            return
        self.windows += 1
        if not self.check_tokens or self.world == 1:
            return
        weights = torch.arange(1, out_tokens.numel() + 1, device=out_tokens.device).view_as(out_tokens)
        mine = torch.tensor([int((out_tokens * weights).sum()) % (2**61 - 1)], dtype=torch.int64)
        sums = [torch.zeros(1, dtype=torch.int64) for _ in range(self.rt.world)]
        dist.all_gather(sums, mine, group=self.rt.ctrl)
        odd = [r for r, s in enumerate(sums) if int(s) != int(sums[0])]
        if odd:
            raise K3Error(
                f"rank {self.rt.rank}: dist.check_tokens: ranks {odd} generated other token ids than rank 0 in window "
                f"{self.windows} (checksums {[int(s) for s in sums]}): the ranks' sampling or state diverged"
            )
