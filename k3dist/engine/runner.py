"""What every rank does with a window record: apply prefix-snapshot evictions, reset and prefill the admitted
requests' slots (from a prefix snapshot where rank 0 found one, taking the snapshots it asked for), then decode.

The same records reach every rank in the same order (control.py), so every rank runs the same prefills and the same
steps on its own shard and the collectives inside them pair up. Nothing here reads generated tokens: that is rank
0's business (engine.py). Nothing is ever padded: a prompt only ever touches its own slot's state.
"""

import time
from dataclasses import dataclass, field

import torch

from ..base.faults import Faults
from .control import Admit, Window
from .sampling import slot_seed
from .snapshots import SnapshotStore
from .step import DecodeStep


def prefills_together(device_type: str) -> bool:
    """Whether same-length prompts are prefilled as one batch (CUDA: bigger GEMMs) or one sequence at a time (CPU:
    a batch gains no arithmetic efficiency there and its chunk activations fall out of cache; benchmarks/prefill.py
    measured four 2048-token prompts at 4.2-9x one when prefilled together). runtime.py sizes prefill by it."""
    return device_type == "cuda"


@dataclass
class Timings:
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens live slots produced in decode steps (counted by rank 0's engine)
    window_step_seconds: list[float] = field(default_factory=list)  # per window: its time / its steps

    def step_ms(self) -> dict:
        ms = sorted(s * 1e3 for s in self.window_step_seconds)
        pick = lambda q: ms[min(int(q * len(ms)), len(ms) - 1)] if ms else 0.0  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9)}

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


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
        self.step, self.model, self.cache = step, step.model, step.cache
        self.prefill_chunk, self.faults, self.rank = prefill_chunk, faults or Faults(), rank
        self.snapshots = snapshots  # None: prefix reuse is off
        self.device = self.cache.positions.device
        self.timings = Timings()
        self.stage = "prefill"  # what the rank is doing: prefill or decode (named in a failure)

    def run(self, window: Window) -> None:
        if self.snapshots is not None:  # evictions first: the pool never holds more than its bytes
            for snap in sorted(set(window.demote) - set(window.drop)):  # demoted, then pushed out of the host tier too
                self.snapshots.demote(snap)
            for snap in window.drop:
                self.snapshots.drop(snap)
        if window.admit:
            self.admit(window.admit, window)
        if window.steps:
            self.decode(window)

    def admit(self, admitted: tuple[Admit, ...], window: Window) -> None:
        """Reset the slots, restore their prefix snapshots, prefill the rest (same-length fresh prompts together
        where `prefills_together`), take the snapshots asked for, emit each first token.

        Order matters, and is the same on every rank: snapshot-only work (a finished request's) first, then fresh
        prompts, then those starting from a snapshot, one by one in record order, so a snapshot an earlier admission
        of this window takes is there for a later one to restore."""
        self.stage = "prefill"
        self.faults.after_load(self.rank, "prefill")
        _sync(self.device)
        start = time.perf_counter()
        together = prefills_together(self.device.type)
        extend = [a for a in admitted if not a.emit]
        fresh = [a for a in admitted if a.emit and a.restore is None]
        restored = [a for a in admitted if a.emit and a.restore is not None]
        groups: dict[tuple[int, int | None], list[Admit]] = {}
        for a in fresh:  # keyed by (length, slot), the slot left out where prompts go together
            groups.setdefault((len(a.ids), None if together else a.slot), []).append(a)
        with torch.inference_mode():
            for items in [[a] for a in extend] + list(groups.values()) + [[a] for a in restored]:
                self._prefill(items, window)
        _sync(self.device)
        self.timings.prefill_seconds += time.perf_counter() - start

    def _prefill(self, items: list[Admit], window: Window) -> None:
        """Prefill same-length prompts (one, if it starts from a snapshot) in chunks that end on multiples of
        `prefill_chunk`, so a prompt restored at a chunk boundary runs exactly the chunks it would have from 0, and
        at every position a snapshot is taken (a branch point inside a chunk splits that chunk in two)."""
        self._reset(items)
        rows = torch.tensor([a.slot for a in items], device=self.device)
        ids = torch.tensor([list(a.ids) for a in items], device=self.device)
        at, logits, length, c = 0, None, len(items[0].ids), self.prefill_chunk
        if items[0].restore is not None:
            at, saved = self.snapshots.restore(items[0].restore, items[0].slot)
            logits = saved.unsqueeze(0)
        saves = [dict(a.saves) for a in items]
        stops = sorted({p for wanted in saves for p in wanted})
        while at < length:
            end = min(length, (at // c + 1) * c, *(p for p in stops if p > at))
            logits = self.model.prefill(ids[:, at:end], rows, at)
            for row, (a, wanted) in enumerate(zip(items, saves, strict=True)):
                if end in wanted:
                    self.snapshots.save(wanted[end], a.slot, end, logits[row])
            at = end
        self.cache.positions.index_fill_(0, rows, length)
        if items[0].emit:
            self.step.emit(logits, rows, window.mode)

    def _reset(self, items: list[Admit]) -> None:
        """Empty the slots and load their requests' sampling settings (host-to-device writes, outside any step).

        Any integer fits: a top_k past the vocabulary cuts nothing and is the vocabulary, a seed is its low 64 bits."""
        s, vocab = self.step, self.model.cfg.vocab_size
        for a in items:
            self.cache.reset_slot(a.slot)
            s.gen[a.slot] = 0
            s.temperature[a.slot], s.top_p[a.slot], s.top_k[a.slot], s.seed[a.slot] = (
                a.temperature,
                a.top_p,
                min(a.top_k, vocab),
                slot_seed(a.seed),
            )

    def decode(self, window: Window) -> None:
        self.stage = "decode"
        self.step.rows, self.step.active = window.rows, window.active
        self.faults.after_load(self.rank, "decode")
        if self.model.threads is not None:  # the CPU's thread governor times steps, not the gaps between windows
            self.model.threads.pause()
        start = time.perf_counter()
        for _ in range(window.steps):
            self.step(window.mode)
        _sync(self.device)
        elapsed = time.perf_counter() - start
        self.timings.decode_seconds += elapsed
        self.timings.window_step_seconds.append(elapsed / window.steps)
