"""Requests through a fixed batch of slots: prefill into free slots, decode windows, stops, refills.

Every rank runs this same host logic on the same tokens (sampling is identical everywhere), so all ranks prefill and
step together without any extra collective. The host looks at the device only every `decode.sync_every` steps (or
when a slot reaches its token budget): it reads the new tokens, ends sequences at an eos id, a stop string or the
budget, and gives each freed slot the next request at once (reset, prefilled alone or with others of the same
length, while the other slots wait). Nothing is ever padded: a prompt only ever touches its own slot's state.
"""

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..base.errors import K3Error
from ..base.faults import Faults
from .step import DecodeStep

ROW_BUCKET = 256  # eager decode attends to MLA cache rows in multiples of this (few distinct shapes)


def prefills_together(device_type: str) -> bool:
    """Whether same-length prompts are prefilled as one batch (CUDA: bigger GEMMs) or one sequence at a time (CPU:
    a batch gains no arithmetic efficiency there and its chunk activations fall out of cache; benchmarks/prefill.py
    measured four 2048-token prompts at 4.2-9x one when prefilled together). runtime.py sizes prefill by it."""
    return device_type == "cuda"


@dataclass(frozen=True)
class Prompt:
    """A request made ready for the engine: token ids and its own budget, sampling and stops."""

    id: str
    ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()


@dataclass
class Completion:
    id: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str = "length"
    top_logits: list = field(default_factory=list)  # per token: [[token_id, logit] x 5]


@dataclass
class Timings:
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens live slots produced in decode steps
    window_step_seconds: list[float] = field(default_factory=list)  # per window: its time / its steps

    def step_ms(self) -> dict:
        ms = sorted(s * 1e3 for s in self.window_step_seconds)
        pick = lambda q: ms[min(int(q * len(ms)), len(ms) - 1)] if ms else 0.0  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9)}

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


@dataclass
class _Live:
    index: int  # position of the request in the input
    prompt: Prompt
    out: Completion
    assembler: object | None  # text/stream.py's TextAssembler when there is a tokenizer
    produced: int = 1  # tokens produced on the device (the first comes from the prefill)
    read: int = 0  # tokens the host has looked at


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    def __init__(
        self,
        step: DecodeStep,
        prefill_chunk: int,
        sync_every: int,
        eos_ids: tuple[int, ...] = (),
        make_assembler: Callable | None = None,
        faults: Faults | None = None,
        rank: int = 0,
    ):
        self.step, self.model, self.cache = step, step.model, step.cache
        self.prefill_chunk, self.sync_every, self.eos = prefill_chunk, sync_every, set(eos_ids)
        self.make_assembler, self.faults, self.rank = make_assembler, faults or Faults(), rank
        self.device = self.cache.positions.device
        self.timings = Timings()
        self.stage = "prefill"  # what the engine is doing: prefill or decode (named in a failure)
        self.on_text: Callable[[int, str], None] | None = None  # (request index, new text)
        self.on_done: Callable[[int, Completion], None] | None = None

    def run(self, prompts: list[Prompt]) -> list[Completion]:
        """Generate for every prompt; returns completions in input order."""
        done: dict[int, Completion] = {}
        pending = deque(enumerate(prompts))
        live: dict[int, _Live] = {}
        free = list(range(self.cache.batch))
        while pending or live:
            admitted = []
            while free and pending:
                index, prompt = pending.popleft()
                if prompt.max_new_tokens == 0:
                    self._finish(done, index, Completion(prompt.id, list(prompt.ids)))
                    continue
                admitted.append((free.pop(0), index, prompt))
            if admitted:
                live |= self._admit(admitted)
            if not live:
                continue
            steps = min(self.sync_every, *(s.prompt.max_new_tokens - s.produced for s in live.values()))
            if steps:
                self._decode(steps, live)
                for s in live.values():
                    s.produced += steps
            for slot in self._read(live):
                state = live.pop(slot)
                self._finish(done, state.index, self._complete(slot, state))
                free.append(slot)
            free.sort()
        return [done[i] for i in range(len(prompts))]

    # ------------------------------------------------------------------ prefill

    def _admit(self, admitted: list[tuple[int, int, Prompt]]) -> dict[int, "_Live"]:
        """Reset the slots, prefill their prompts (same-length ones together where `prefills_together`), emit each
        first token."""
        self.stage = "prefill"
        self.faults.after_load(self.rank, "prefill")
        _sync(self.device)
        start = time.perf_counter()
        together = prefills_together(self.device.type)
        groups: dict[tuple[int, int | None], list[tuple[int, int, Prompt]]] = {}
        for item in admitted:  # keyed by (length, slot), the slot left out where prompts go together
            groups.setdefault((len(item[2].ids), None if together else item[0]), []).append(item)
        with torch.inference_mode():
            for (length, _), items in groups.items():
                slots = [slot for slot, _, _ in items]
                self._reset(items)
                rows = torch.tensor(slots, device=self.device)
                ids = torch.tensor([list(p.ids) for _, _, p in items], device=self.device)
                for at in range(0, length, self.prefill_chunk):
                    logits = self.model.prefill(ids[:, at : at + self.prefill_chunk], rows, at)
                self.cache.positions.index_fill_(0, rows, length)
                self.step.emit(logits, rows)
        _sync(self.device)
        self.timings.prefill_seconds += time.perf_counter() - start
        return {
            slot: _Live(
                index, p, Completion(p.id, list(p.ids)), self.make_assembler(p) if self.make_assembler else None
            )
            for slot, index, p in admitted
        }

    def _reset(self, items: list[tuple[int, int, Prompt]]) -> None:
        """Empty the slots and load their requests' sampling settings (host-to-device writes, outside any step)."""
        s = self.step
        for slot, _, p in items:
            self.cache.reset_slot(slot)
            s.gen[slot] = 0
            s.temperature[slot], s.top_p[slot], s.top_k[slot], s.seed[slot] = p.temperature, p.top_p, p.top_k, p.seed

    # ------------------------------------------------------------------ decode

    def _decode(self, steps: int, live: dict[int, "_Live"]) -> None:
        self.stage = "decode"
        if self.step.kind == "eager":  # no slot of interest gets past this row in the window: attend to no more
            last = max(len(s.prompt.ids) + s.produced for s in live.values()) + steps
            self.step.rows = min(self.cache.cap, -(-last // ROW_BUCKET) * ROW_BUCKET)
        self.faults.after_load(self.rank, "decode")
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        _sync(self.device)
        elapsed = time.perf_counter() - start
        self.timings.decode_seconds += elapsed
        self.timings.decode_tokens += steps * len(live)
        self.timings.window_step_seconds.append(elapsed / steps)

    def _read(self, live: dict[int, "_Live"]) -> list[int]:
        """Look at the new tokens of every live slot (one device-to-host copy); returns the slots that finished."""
        lo = min(s.read for s in live.values())
        hi = max(s.produced for s in live.values())
        window = self.step.out_tokens[:, lo:hi].tolist()
        finished = []
        for slot, s in live.items():
            new = window[slot][s.read - lo : s.produced - lo]
            s.read = s.produced
            if self._take(s, new):
                finished.append(slot)
        return finished

    def _take(self, s: "_Live", new: list[int]) -> bool:
        """Append tokens up to the first stop; True when the sequence is over."""
        for token in new:
            s.out.tokens.append(token)
            if token in self.eos:
                s.out.finish_reason = "stop"
                return True
            if s.assembler is not None:
                text, stopped = s.assembler.feed([token])
                if text and self.on_text:
                    self.on_text(s.index, text)
                if stopped is not None:
                    s.out.finish_reason = "stop"
                    return True
            if len(s.out.tokens) == s.prompt.max_new_tokens:
                return True
        return False

    def _complete(self, slot: int, s: "_Live") -> Completion:
        n = len(s.out.tokens)
        ids = self.step.top_ids[slot, :n].tolist()
        values = self.step.top_values[slot, :n].tolist()
        bad = next(((t, v) for t, row in enumerate(values) for v in row if not math.isfinite(v)), None)
        if bad is not None:  # NaN or inf weights (or config numbers) make garbage tokens, never a result
            raise K3Error(
                f"logit {bad[1]} at generated token {bad[0]} of request {s.out.id!r}: the checkpoint's weights "
                "hold NaN/inf or overflow in this dtype"
            )
        s.out.top_logits = [[[i, v] for i, v in zip(a, b, strict=True)] for a, b in zip(ids, values, strict=True)]
        if s.assembler is not None:
            if s.out.finish_reason != "stop" or s.out.tokens[-1] in self.eos:
                tail = s.assembler.finish()
                if tail and self.on_text:
                    self.on_text(s.index, tail)
            s.out.text = s.assembler.text
        return s.out

    def _finish(self, done: dict, index: int, completion: Completion) -> None:
        done[index] = completion
        if self.on_done:
            self.on_done(index, completion)
