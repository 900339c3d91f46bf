"""The engine, on rank 0: requests in (`add`, `abort`), events out (`step`), over a fixed batch of slots.

`step()` is nano-vllm's: schedule, run, postprocess. Schedule gives waiting requests the free slots and sizes the
window (at most `decode.sync_every` steps, fewer when a slot reaches its budget sooner); the window goes to every
rank (control.py) and every rank runs it (runner.py); postprocess reads the new tokens once, ends sequences at an eos
id, a stop string or their budget, and frees their slots for the next window. The host looks at the device only
there. The offline run and the server drive this same engine; the other ranks only follow its records.
"""

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..base.errors import K3Error
from .control import Admit, Channel, Window
from .prefix import Moves, PrefixIndex
from .requests import Completion, Event, Prompt
from .runner import Runner, prefills_together
from .sampling import SamplingMode

ROW_BUCKET = 256  # eager decode attends to MLA cache rows in multiples of this (few distinct shapes)


@dataclass
class _Live:
    prompt: Prompt
    out: Completion
    assembler: object | None  # text/stream.py's TextAssembler when there is a tokenizer
    produced: int = 1  # tokens produced on the device (the first comes from the prefill)
    read: int = 0  # tokens the host has looked at
    events: list = field(default_factory=list)


class Engine:
    def __init__(
        self,
        runner: Runner,
        channel: Channel,
        sync_every: int,
        eos_ids: tuple[int, ...] = (),
        make_assembler: Callable | None = None,
        prefix: PrefixIndex | None = None,
    ):
        """`prefix`: the index of prefix snapshots (None: no reuse)."""
        self.runner, self.channel, self.step_fn = runner, channel, runner.step
        self.cache, self.prefix = runner.cache, prefix
        self.sync_every, self.eos, self.make_assembler = sync_every, set(eos_ids), make_assembler
        # admissions per window: all free slots where they prefill together, else one, so each first token is out
        # after its own prefill rather than after every prefill of a burst
        self.admit_per_window = self.cache.batch if prefills_together(runner.device.type) else 1
        self.extend: list[tuple[int, ...]] = []  # finished requests' prompt + completion ids, to snapshot
        self.waiting: deque[Prompt] = deque()
        self.live: dict[int, _Live] = {}
        self.free = list(range(self.cache.batch))
        self.ended: list[int] = []  # slots freed since the last window, told to every rank with the next one
        self.done: list[Event] = []  # requests ended outside a window (aborted while waiting, empty budget)

    @property
    def timings(self):
        return self.runner.timings

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live or self.done)

    def add(self, prompt: Prompt) -> None:
        """Queue a request; it takes a free slot at the next window."""
        self.waiting.append(prompt)

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is (its slot is free from the next window on); False if it is not here."""
        for p in self.waiting:
            if p.id == request_id:
                self.waiting.remove(p)
                self.done.append(Event(p.id, finish_reason="abort", completion=Completion(p.id, list(p.ids))))
                return True
        for slot, s in self.live.items():
            if s.prompt.id == request_id:
                self._release(slot)
                s.out.finish_reason = "abort"
                self.done.append(Event(s.prompt.id, finish_reason="abort", completion=s.out))
                return True
        return False

    def step(self) -> list[Event]:
        """One window: schedule, run on every rank, postprocess. Returns what happened to each request."""
        events, self.done = self.done, []
        window = self._schedule(events)
        self.channel.send(window)
        self.runner.run(window)
        self.timings.decode_tokens += window.steps * len(self.live)
        self.channel.compare(window, self.step_fn.out_tokens)
        return events + self._postprocess(window)

    def heartbeat(self) -> None:
        """Idle: an empty record, so the other ranks' wait for the next one never times out."""
        self.channel.send(Window())

    def shutdown(self, code: int = 0) -> None:
        """Every other rank leaves its loop (and exits with `code` when it is not 0)."""
        self.channel.send(Window(stop=code))

    # ------------------------------------------------------------------ schedule

    def _schedule(self, events: list[Event]) -> Window:
        moves, pinned = Moves(), set()
        admitted = self._extensions(moves, pinned)
        taken: list[Prompt] = []
        while len(taken) < len(self.free) and self.waiting and len(admitted) + len(taken) < self.admit_per_window:
            p = self.waiting.popleft()
            if p.max_new_tokens == 0:  # no slot, no token: its text is empty (not None) where there is a tokenizer
                empty = Completion(p.id, list(p.ids), text="" if self.make_assembler else None)
                events.append(Event(p.id, finish_reason="length", completion=empty))
                continue
            taken.append(p)
        for i, p in enumerate(taken):
            slot = self.free.pop(0)
            assembler = self.make_assembler(p) if self.make_assembler else None
            self.live[slot] = _Live(p, Completion(p.id, list(p.ids)), assembler)
            restore, saves = self._reuse(p.ids, moves, pinned, [q.ids for q in taken[i + 1 :]])
            admitted.append(Admit(slot, p.ids, p.temperature, p.top_p, p.top_k, p.seed, restore, saves))
        for p in taken if self.prefix is not None else ():
            self.prefix.remember(p.ids)
        ended, self.ended = tuple(self.ended), []
        drops = dict(drop=tuple(moves.drop), demote=tuple(moves.demote))
        if not self.live:
            return Window(tuple(admitted), ended, **drops)
        steps = min(self.sync_every, *(s.prompt.max_new_tokens - s.produced for s in self.live.values()))
        if any(a.emit for a in admitted):  # one step, so the new requests' first tokens are out without delay
            steps = min(steps, 1)
        rows = active = None
        if self.step_fn.kind == "eager":  # no slot of interest gets past this row or this slot in the window
            last = max(len(s.prompt.ids) + s.produced for s in self.live.values()) + steps
            rows = min(self.cache.cap, -(-last // ROW_BUCKET) * ROW_BUCKET)
            active = max(self.live) + 1  # slots are taken lowest first, so the live ones gather at the front
        mode = SamplingMode.covering(s.prompt.mode for s in self.live.values())
        return Window(tuple(admitted), ended, steps=steps, rows=rows, active=active, mode=mode, **drops)

    def _reuse(self, ids: tuple[int, ...], moves: Moves, pinned: set[int], beside: list[tuple[int, ...]]):
        """(snapshot to restore, snapshots to take) for a prompt: the longest snapshot of a prefix of it, then one
        every `prefix.every` tokens past it, one where it branches from a recent prompt or from a prompt admitted
        `beside` it (which then restores it), and one at its end."""
        if self.prefix is None:
            return None, ()
        hit = self.prefix.lookup(ids)
        start = len(hit.ids) if hit else 0
        if hit:
            pinned.add(hit.id)
        branch = self.prefix.branch_point(ids, beside)
        saves = []
        for at in self.prefix.boundaries(len(ids), start, branch):
            snap = self.prefix.plan(ids[:at], moves, pinned, branch=at == branch)
            if snap is not None:
                saves.append((at, snap))
                pinned.add(snap)
        return (hit.id if hit else None), tuple(saves)

    def _extensions(self, moves: Moves, pinned: set[int]) -> list[Admit]:
        """Snapshots of finished requests' prompt + completion (the next chat turn starts with it): a free slot
        restores the request's prompt snapshot and prefills just the completion."""
        out, pending, self.extend = [], self.extend, []
        for ids, completion in pending:
            hit = self.prefix.lookup(ids, count=False)
            if not self.free or hit is None or len(ids) - len(hit.ids) > completion:
                continue  # its prompt's snapshot is gone: recomputing all of it is not worth it
            pinned.add(hit.id)
            snap = self.prefix.plan(ids, moves, pinned)
            if snap is not None:
                pinned.add(snap)
                out.append(Admit(self.free[0], ids, restore=hit.id, saves=((len(ids), snap),), emit=False))
        return out

    def _release(self, slot: int) -> None:
        del self.live[slot]
        self.free.append(slot)
        self.free.sort()
        self.ended.append(slot)

    # ------------------------------------------------------------------ postprocess

    def _postprocess(self, window: Window) -> list[Event]:
        """Look at the new tokens of every live slot (one device-to-host copy); end the finished sequences."""
        if not self.live:
            return []
        for s in self.live.values():
            s.produced += window.steps
        lo = min(s.read for s in self.live.values())
        hi = max(s.produced for s in self.live.values())
        tokens = self.step_fn.out_tokens[:, lo:hi].tolist()
        scored = self._logprobs(lo, hi) if any(s.prompt.logprobs is not None for s in self.live.values()) else None
        events = []
        for slot, s in list(self.live.items()):
            at = s.read - lo
            new = tokens[slot][at : s.produced - lo]
            s.read = s.produced
            event = Event(s.prompt.id)
            finished = self._take(s, new, event)
            if scored is not None and s.prompt.logprobs is not None:
                event.logprobs = [scored(slot, at + i, s.prompt.logprobs) for i in range(len(event.tokens))]
                s.out.logprobs += event.logprobs
            if finished:
                self._release(slot)
                event.finish_reason, event.completion = s.out.finish_reason, self._complete(slot, s, event)
                if self.prefix is not None:
                    self.extend.append((s.prompt.ids + tuple(s.out.tokens), len(s.out.tokens)))
                    self.prefix.remember(self.extend[-1][0])
            if event.tokens or event.finished:
                events.append(event)
        return events

    def _logprobs(self, lo: int, hi: int):
        """The window's log-probabilities, read once: (slot, index, k) -> (chosen token's, [(id, logprob) x k])."""
        st = self.step_fn
        ids, top = st.top_ids[:, lo:hi].tolist(), st.top_values[:, lo:hi].tolist()
        lse, chosen = st.out_lse[:, lo:hi].tolist(), st.out_logit[:, lo:hi].tolist()

        def scored(slot: int, i: int, k: int):
            z = lse[slot][i]
            return chosen[slot][i] - z, [(t, v - z) for t, v in zip(ids[slot][i][:k], top[slot][i][:k], strict=True)]

        return scored

    def _take(self, s: _Live, new: list[int], event: Event) -> bool:
        """Append tokens up to the first stop; True when the sequence is over."""
        for token in new:
            s.out.tokens.append(token)
            event.tokens.append(token)
            if token in self.eos:
                s.out.finish_reason = "stop"
                return True
            if s.assembler is not None:
                text, stopped = s.assembler.feed([token])
                event.text += text
                if stopped is not None:
                    s.out.finish_reason = "stop"
                    return True
            if len(s.out.tokens) == s.prompt.max_new_tokens:
                return True
        return False

    def _complete(self, slot: int, s: _Live, event: Event) -> Completion:
        n = len(s.out.tokens)
        ids = self.step_fn.top_ids[slot, :n].tolist()
        values = self.step_fn.top_values[slot, :n].tolist()
        bad = next(((t, v) for t, row in enumerate(values) for v in row if not math.isfinite(v)), None)
        if bad is not None:  # NaN or inf weights (or config numbers) make garbage tokens, never a result
            raise K3Error(
                f"logit {bad[1]} at generated token {bad[0]} of request {s.out.id!r}: the checkpoint's weights "
                "hold NaN/inf or overflow in this dtype"
            )
        s.out.top_logits = [[[i, v] for i, v in zip(a, b, strict=True)] for a, b in zip(ids, values, strict=True)]
        if s.assembler is not None:
            if s.out.finish_reason != "stop" or s.out.tokens[-1] in self.eos:
                event.text += s.assembler.finish()
            s.out.text = s.assembler.text
        return s.out


def follow(runner: Runner, channel: Channel) -> int:
    """What every rank but 0 does: run rank 0's windows until its shutdown record; returns the exit code it sent."""
    while True:
        window = channel.receive()
        if window.stop is not None:
            return window.stop
        runner.run(window)
        channel.compare(window, runner.step.out_tokens)
