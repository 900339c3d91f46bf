"""The control plane: rank 0 decides, every rank follows.

Each window rank 0 sends every other rank one small record over the gloo control group: the requests admitted into
slots (prompt ids and sampling settings), the pieces of prompts to prefill, the slots whose requests ended, how many
decode steps to run, and at the end a shutdown. Every rank applies the same records in the same order, so all keep
the same slot table and run the same steps; generated ids never travel (sampling is identical on every rank). An idle
rank 0 sends an empty record every `heartbeat_s`, so a follower waiting for the next one is never left in a
collective that times out, however long the server idles.
"""

import json
import logging
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..base.dist import Runtime
from ..base.errors import K3Error
from .sampling import GREEDY, SamplingMode

log = logging.getLogger("k3dist")


@dataclass(frozen=True)
class Admit:
    """A request taking a slot: its prompt and sampling settings (all a rank needs to prefill and sample it). Its
    prefill runs in pieces, in this window and maybe later ones (Window.prefill)."""

    slot: int
    ids: tuple[int, ...]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    restore: int | None = None  # a prefix snapshot to start from: the prefill starts at its length
    saves: tuple[tuple[int, int], ...] = ()  # (position, snapshot id): prefix snapshots to take on the way
    emit: bool = True  # False: only make snapshots (a finished request's prompt + completion), choose no token


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
    stop: int | None = None  # shutdown: every rank leaves its loop (the exit code, 0 for a normal end)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @staticmethod
    def from_json(data: bytes) -> "Window":
        raw = json.loads(data)
        saves = lambda a: tuple(map(tuple, a["saves"]))  # noqa: E731
        raw["admit"] = tuple(Admit(**(a | {"ids": tuple(a["ids"]), "saves": saves(a)})) for a in raw["admit"])
        raw["mode"] = SamplingMode(**raw["mode"])
        for key in ("ended", "drop", "demote"):
            raw[key] = tuple(raw[key])
        raw["prefill"] = tuple(tuple(p) for p in raw["prefill"])
        return Window(**raw)


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

    def receive(self) -> Window:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.rt.ctrl)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.rt.ctrl)
        return Window.from_json(data.numpy().tobytes())

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
