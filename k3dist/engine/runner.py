"""What every rank does with a window record: apply prefix-snapshot evictions, prefill the pieces of prompts it lists
(a new request's slot reset and its prefix snapshot restored first, the snapshots rank 0 asked for taken on the way,
each prompt's first token emitted after its last piece; a prompt that asks for its log-probabilities scored piece by
piece, prompt_logprobs.py), then decode.

The logits a window's prefill needs (each finished prompt's last position, each snapshot's) come from one pass of the
LM head over all their rows, as a decode step's do, not one pass a prompt: at few rows the head is read at the
memory's rate whatever the rows, and it is most of a small model's bytes. A snapshot taken in the window holds its
logits once that pass ran; a prompt restoring it in the same window runs the pass first.

The same records reach every rank in the same order (control.py), so every rank runs the same prefills and the same
steps on its own shard and the collectives inside them pair up. Nothing here reads generated tokens: that is rank
0's business (engine.py). Nothing is ever padded: a prompt only ever touches its own slot's state. A prompt whose
prefill spans windows sits in its slot while the others decode: every decode step runs over it too, so its KDA
state is set aside and put back around the steps, and its position is where its next piece starts (the rows a step
writes there are written again by that piece).
"""

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..base.errors import K3Error
from ..base.fault_injection import Faults
from ..kinds.registry import cache_entry
from .control import Admit, Window
from .decode_step import DecodeStep
from .prompt_logprobs import PromptScores, score
from .sampling import GREEDY, SamplingMode
from .snapshots import SnapshotStore


def prefills_together(device_type: str) -> bool:
    """Whether same-length prompts are prefilled as one batch (CUDA: bigger GEMMs) or one sequence at a time (CPU:
    a batch gains no arithmetic efficiency there and its chunk activations fall out of cache: benchmarks/prefill.py,
    BENCHMARKS.md "Measurements behind the code"). memory/runtime.py sizes prefill by it."""
    return device_type == "cuda"


WINDOWS_TIMED = 100_000  # step_ms's percentiles cover the latest this many windows (a server's run has no end)


@dataclass
class Timings:
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens live slots produced in decode steps (counted by rank 0's engine)
    window_step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOWS_TIMED))  # time / steps

    def step_ms(self) -> dict:
        ms = sorted(s * 1e3 for s in self.window_step_seconds)
        pick = lambda q: ms[min(int(q * len(ms)), len(ms) - 1)] if ms else 0.0  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9)}

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def _save_at(admit: Admit, end: int) -> int | None:
    """The snapshot id `admit` asks for at position `end`, if any (its saves are few: a tuple scanned)."""
    return next((snap for at, snap in admit.saves if at == end), None)


def _emits(admit: Admit, end: int) -> bool:
    """Whether a piece ending at `end` finishes `admit`'s prompt and its first token comes from its logits."""
    return end == len(admit.ids) and admit.emit


@dataclass
class Prefilling:
    """A prompt partly prefilled in its slot on this rank (admission.py's `Filling` is rank 0's view of it)."""

    admit: Admit
    at: int  # prompt tokens in the slot so far (a restored snapshot's included)


@dataclass
class _Logits:
    """One row of logits a window's prefill needs: from a restored snapshot (`value` at once), or the final hidden
    state [D] of a piece's last position (`value` once the window's LM head pass ran: Runner._heads)."""

    hidden: torch.Tensor | None = None
    value: torch.Tensor | None = None
    snap: int | None = None  # the snapshot taken with these logits


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    def __init__(
        self,
        step: DecodeStep,
        prefill_chunk: int,
        faults: Faults | None = None,
        rank: int = 0,
        snapshots: SnapshotStore | None = None,
    ):
        self.decode_step, self.model, self.cache = step, step.model, step.cache
        self.prefill_chunk, self.faults, self.rank = prefill_chunk, faults or Faults(), rank
        self.snapshots = snapshots  # None: prefix reuse is off
        self.device = self.cache.positions.device
        self.timings = Timings()
        self.stage = "prefill"  # what the rank is doing: prefill or decode (named in a failure)
        self.filling: dict[int, Prefilling] = {}  # slot -> its prefill not yet done
        self.restored: dict[int, torch.Tensor] = {}  # slot -> logits of the snapshot it was restored from
        self.heads: list[_Logits] = []  # rows waiting for the window's LM head pass
        self.scoring: dict[int, PromptScores] = {}  # slot -> its prompt's positions scored so far
        self.scores: dict[int, PromptScores] = {}  # rank 0: the prompts scored whole in the last window, by slot
        states = {n: t for n, t in self.cache.tensors.items() if (e := cache_entry(n)) is not None and not e.grows}
        self.guard = {n: torch.empty_like(t[0]) for n, t in states.items()}  # one slot's states (KDA's), set aside

    def run(self, window: Window) -> None:
        self.scores = {}
        self.decode_step.use_top(window.top)
        if self.snapshots is not None:  # evictions first: the pool never holds more than its bytes
            for snap in sorted(set(window.demote) - set(window.drop)):  # demoted, then pushed out of the host tier too
                self.snapshots.demote(snap)
            for snap in window.drop:
                self.snapshots.drop(snap)
        for slot in window.ended:  # aborted in the middle of its prefill
            self.filling.pop(slot, None)
            self.scoring.pop(slot, None)
        if window.prefill:
            self.prefill(window)
        if window.masks:  # after the prefills' resets (a finished request's snapshot may share a slot)
            self.decode_step.processors.load_masks(window.masks, window.bitmask)
        if window.steps:
            self.decode(window)

    def admit(self, admitted: tuple[Admit, ...], mode: SamplingMode = GREEDY, **window) -> None:
        """Prefill `admitted` whole in their chunks, outside any engine (tools and tests that drive a runner);
        `window`: more Window fields (grammar masks)."""
        c, pieces = self.prefill_chunk, []
        for a in admitted:
            at, new = 0, True
            while at < len(a.ids):
                end = min(len(a.ids), (at // c + 1) * c)
                pieces.append((a.slot, at, end, new))
                at, new = end, False
        self.run(Window(admitted, prefill=tuple(pieces), mode=mode, **window))

    def prefill(self, window: Window) -> None:
        """Run the window's pieces in record order (same-range pieces of several slots as one batch where
        `prefills_together`), then emit the first token of every prompt whose last piece ran."""
        self.stage = "prefill"
        self.faults.after_load(self.rank, "prefill")
        _sync(self.device)
        start = time.perf_counter()
        admits, done = iter(window.admit), []
        with torch.inference_mode():
            for group in self._groups(window.prefill):
                for *_, new in group:
                    if new:
                        self._start(next(admits))
                done += self._piece(group)
            self._heads()
            if done:
                self._emit([(admit, logits.value) for admit, logits in done], window)
        _sync(self.device)
        self.timings.prefill_seconds += time.perf_counter() - start

    def _emit(self, done: list[tuple[Admit, torch.Tensor]], window: Window) -> None:
        """The first tokens of the prompts whose prefill this window finished: their processors as at admission
        (decode steps ran over the slots while they filled), their grammar masks, one emit."""
        slots = [admit.slot for admit, _ in done]
        for admit, _ in done:
            self.decode_step.load(admit.slot, admit.sampling, admit.ids)
        if masked := [i for i, slot in enumerate(window.masks) if slot in slots]:
            self.decode_step.processors.load_masks(tuple(window.masks[i] for i in masked), window.bitmask[masked])
        rows = torch.tensor(slots, device=self.device)
        self.decode_step.gen.index_fill_(0, rows, 0)
        self.decode_step.emit(torch.stack([logits for _, logits in done]), rows, window.mode)

    def _heads(self) -> None:
        """The LM head over every row waiting for it, in one pass; the snapshots taken with them get their logits."""
        if not self.heads:
            return
        logits = self.model.logits(torch.stack([row.hidden for row in self.heads]))
        for row, value in zip(self.heads, logits, strict=True):
            row.hidden, row.value = None, value
            if row.snap is not None:
                self.snapshots.set_logits(row.snap, value)
        self.heads = []

    def _groups(self, pieces):
        """Consecutive pieces of the same token range, prefilled as one batch where that pays (CUDA)."""
        out = []
        for piece in pieces:
            together = out and prefills_together(self.device.type) and piece[1:3] == out[-1][-1][1:3]
            if together and piece[1] < piece[2]:
                out[-1].append(piece)
            else:
                out.append([piece])
        return out

    def _piece(self, group) -> list[tuple[Admit, _Logits]]:
        """Prefill tokens [start, end) of each slot's prompt; take the snapshots asked for at `end`. Returns (Admit,
        last logits) of the prompts it finished that emit a token (logits from the window's LM head pass)."""
        _, start, end, _ = group[0]
        slots = [slot for slot, *_ in group]
        snaps = [_save_at(self.filling[slot].admit, end) for slot in slots]  # the snapshot each takes at `end`, if any
        if start == end:  # restored whole from a snapshot: its stored logits give the first token
            rows = [_Logits(value=self.restored.pop(slot).clone()) for slot in slots]  # the step may change them
        else:
            slot_ids = torch.tensor(slots, device=self.device)
            ids = torch.tensor([self.filling[slot].admit.ids[start:end] for slot in slots], device=self.device)
            h = self.model.prefill_hidden(ids, slot_ids, start)
            for row, slot in enumerate(slots):  # positions up to a prompt's last but one score its next token
                prompt, wanted = self.filling[slot].admit.ids, self.scoring.get(slot)
                if wanted is not None and (n := min(end, len(prompt) - 1) - start) > 0:
                    following = torch.tensor(prompt[start + 1 : start + 1 + n], device=self.device)
                    wanted.parts.append(score(self.model, h[row, :n], following, wanted.k))
            # logits only where a token is emitted or a snapshot taken: a piece in the middle of a prompt would
            # read the whole head for logits nobody uses
            admits = [self.filling[slot].admit for slot in slots]
            rows = [
                _Logits(hidden=h[row, -1].clone()) if snap is not None or _emits(admit, end) else None
                for row, (admit, snap) in enumerate(zip(admits, snaps, strict=True))
            ]
            del h
        done = []
        for slot, snap, logits in zip(slots, snaps, rows, strict=True):
            self.restored.pop(slot, None)
            admit = self.filling[slot].admit
            self.filling[slot].at = end
            if logits is not None and logits.value is None:
                logits.snap = snap
                self.heads.append(logits)
            if snap is not None:
                self.snapshots.save(snap, slot, end, logits.value)
            if end == len(admit.ids):
                del self.filling[slot]
                self.cache.positions[slot] = end
                if (scored := self.scoring.pop(slot, None)) is not None and self.rank == 0:
                    self.scores[slot] = scored  # the other ranks took part in the gathers; only rank 0 answers
                if admit.emit:
                    done.append((admit, logits))
        return done

    def _start(self, a: Admit) -> None:
        """Empty the slot, restore the request's snapshot, load its sampling (host-to-device writes, outside any
        step)."""
        self.cache.reset_slot(a.slot)
        self.decode_step.gen[a.slot] = 0
        self.decode_step.load(a.slot, a.sampling, a.ids)
        at = 0
        if a.restore is not None:
            if any(row.snap == a.restore for row in self.heads):  # taken in this window: its logits first
                self._heads()
            at, self.restored[a.slot] = self.snapshots.restore(a.restore, a.slot)
        self.filling[a.slot] = Prefilling(a, at)
        if a.score is not None:
            self.scoring[a.slot] = PromptScores(a.score)

    def decode(self, window: Window) -> None:
        self.stage = "decode"
        self.decode_step.rows, self.decode_step.active = window.rows, window.active
        self.faults.after_load(self.rank, "decode")
        if self.model.threads is not None:  # the CPU's thread governor times steps, not the gaps between windows
            self.model.threads.pause()
        start = time.perf_counter()
        with self._guarded():
            for _ in range(window.steps):
                self.decode_step(window.mode)
        _sync(self.device)
        elapsed = time.perf_counter() - start
        self.timings.decode_seconds += elapsed
        self.timings.window_step_seconds.append(elapsed / window.steps)

    @contextmanager
    def _guarded(self):
        """A prompt in the middle of its prefill keeps its KDA state across the window's decode steps, and the steps
        write MLA rows only from where its next piece starts."""
        filling = list(self.filling.items())
        if len(filling) > 1:
            raise K3Error(f"{len(filling)} prompts are partly prefilled at once; the engine keeps it to one")
        tensors = self.cache.tensors
        with torch.inference_mode():
            for slot, f in filling:
                for name, kept in self.guard.items():
                    kept.copy_(tensors[name][slot])
                self.cache.positions[slot] = f.at
        yield
        with torch.inference_mode():
            for slot, _ in filling:
                for name, kept in self.guard.items():
                    tensors[name][slot].copy_(kept)
