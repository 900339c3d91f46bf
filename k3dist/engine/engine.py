"""The engine, on rank 0: requests in (`add`, `abort`), events out (`run_window`), over a fixed batch of slots.

Words: a *decode step* is one token for every live slot (engine/decode_step.py's `DecodeStep` runs one); a *window*
is what `run_window()` does, nano-vllm's `step()`: schedule, run, postprocess. Schedule plans the window's prefill
(admission.py: newcomers take free slots, long prompts go in pieces within a token budget) and sizes its decode (at
most `decode.sync_every` decode steps, fewer when a slot reaches its budget sooner); the window goes to every rank
(control.py) and every rank runs it (runner.py); postprocess (postprocess.py) reads the new tokens once, ends
sequences at an eos id, a stop string or their budget, and the engine frees their slots for the next window. The host
looks at the device only there. The offline run and the server drive this same engine; the other ranks only follow
its records. Requests under a grammar also have their matchers advanced there, and their next masks go out with the
next window (grammar.py).
"""

from collections.abc import Callable
from dataclasses import replace

from .admission import Admission
from .control import Channel, Window
from .decode_step import TOP, WIDEST
from .grammar import Masks
from .postprocess import Live, Postprocess
from .prefix import PrefixIndex
from .runner import Runner
from .sampling import BadValue, SamplingMode, SamplingParams
from .sequences import Completion, Event, Prompt
from .watch import MemoryWatch

ROW_BUCKET = 256  # eager decode attends to MLA cache rows in multiples of this (few distinct shapes)


class Engine:
    def __init__(
        self,
        runner: Runner,
        channel: Channel,
        *,
        sync_every: int,
        eos_ids: tuple[int, ...] = (),
        make_assembler: Callable | None = None,
        prefix: PrefixIndex | None = None,
        watch: MemoryWatch | None = None,
        prefill_budget: int | None = None,
    ):
        """`prefix`: the index of prefix snapshots (None: no reuse); `watch`: every rank's memory against its plan,
        reported with a window now and then (a server's); `prefill_budget`: prompt tokens a window may prefill (None:
        one prefill chunk)."""
        self.runner, self.channel, self.decode_step = runner, channel, runner.decode_step
        self.cache, self.watch = runner.cache, watch
        self.sync_every, self.make_assembler = sync_every, make_assembler
        self.admission = Admission(runner.prefill_chunk, prefill_budget or runner.prefill_chunk, prefix)
        self.live: dict[int, Live] = {}
        self.free = list(range(self.cache.batch))
        self.ended: list[int] = []  # slots freed since the last window, told to every rank with the next one
        self.done: list[Event] = []  # requests ended outside a window (aborted while waiting, empty budget)
        self.scoring: dict[int, Prompt] = {}  # prompts only scored (max_new_tokens 0) whose prefill ends in this window
        self.masks = Masks(self.cache.batch, runner.model.cfg.vocab_size)
        self.post = Postprocess(self.decode_step, self.masks, eos_ids, make_assembler)

    @property
    def timings(self):
        return self.runner.timings

    @property
    def waiting(self):
        return self.admission.waiting

    @property
    def prefix(self) -> PrefixIndex | None:
        return self.admission.prefix

    @prefix.setter
    def prefix(self, index: PrefixIndex | None) -> None:
        self.admission.prefix = index

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live or self.admission.filling or self.done)

    def add(self, prompt: Prompt) -> None:
        """Queue a request (checked again: `check`) behind the waiting ones of its priority or a lower value; it takes
        a free slot when the prefill budget reaches it."""
        self.check(prompt)
        after = [i for i, p in enumerate(self.waiting) if p.priority > prompt.priority]
        self.waiting.insert(after[0] if after else len(self.waiting), prompt)

    def check(self, p: Prompt) -> None:
        """The types and ranges of everything a window will read from `p`, a BadValue naming the field otherwise. A
        front calls it on its own side before handing the prompt over (a server on its HTTP thread), so a slip in a
        front is refused at its edge: nothing inside run_window may fail on a request's value."""
        vocab, cap = self.runner.model.cfg.vocab_size, self.cache.cap

        def ids(name: str, values, least: int = 0) -> None:
            if not isinstance(values, tuple) or len(values) < least or any(type(t) is not int for t in values):
                raise BadValue(name, f"must be a tuple of at least {least} token ids, got {values!r:.60}")
            if values and not 0 <= min(values) <= max(values) < vocab:
                raise BadValue(name, f"holds token ids outside the vocabulary (0..{vocab - 1})")

        def flag(name: str, value) -> None:
            if type(value) is not bool:
                raise BadValue(name, f"must be true or false, got {value!r:.40}")

        if not isinstance(p, Prompt) or not isinstance(p.id, str) or not p.id:
            raise BadValue("id", f"a request is a Prompt with a non-empty id, got {p!r:.60}")
        ids("ids", p.ids, least=1)
        room = cap - len(p.ids)
        if type(p.max_new_tokens) is not int or not 0 <= p.max_new_tokens <= room:
            raise BadValue("max_new_tokens", f"must be an integer in 0..{room} (cache.cap={cap} less the prompt)")
        if not isinstance(p.sampling, SamplingParams):
            raise BadValue("sampling", f"must be a SamplingParams, got {type(p.sampling).__name__}")
        ids("logit_bias", tuple(t for t, _ in p.sampling.logit_bias))
        ids("held", p.sampling.held)
        ids("stop_ids", p.stop_ids)
        if not isinstance(p.stop, tuple) or not all(isinstance(s, str) and s for s in p.stop):
            raise BadValue("stop", f"must be a tuple of non-empty strings, got {p.stop!r:.60}")
        for name, k in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
            if k is not None and (type(k) is not int or not 0 <= k <= min(WIDEST, vocab)):
                raise BadValue(name, f"must be null or an integer in 0..{min(WIDEST, vocab)}, got {k!r:.40}")
        for name, value in (("ignore_eos", p.ignore_eos), ("skip_special", p.skip_special)):
            flag(name, value)
        flag("spaced_special", p.spaced_special)
        if type(p.priority) is not int:
            raise BadValue("priority", f"must be an integer, got {p.priority!r:.40}")
        if p.grammar is not None and not (callable(p.grammar) and p.sampling.grammar):
            raise BadValue("grammar", "a grammar is a matcher factory, with sampling.grammar set")

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is (its slot is free from the next window on); False if it is not here."""
        for p in self.waiting:
            if p.id == request_id:
                self.waiting.remove(p)
                self.done.append(Event(p.id, finish_reason="abort", completion=Completion(p.id, list(p.ids))))
                return True
        f = self.admission.filling
        if f is not None and f.prompt.id == request_id:  # in the middle of its prefill
            self.admission.forget(f)
            self.admission.filling = None
            self._release(f.slot)
            self.done.append(Event(request_id, finish_reason="abort", completion=Completion(request_id, list(f.ids))))
            return True
        for slot, s in self.live.items():
            if s.prompt.id == request_id:
                self._release(slot)
                s.out.finish_reason = "abort"
                self.done.append(Event(s.prompt.id, finish_reason="abort", completion=s.out))
                return True
        return False

    def run_window(self) -> list[Event]:
        """One window: schedule, run on every rank, postprocess. Returns what happened to each request."""
        events, self.done = self.done, []
        window = self._reporting(self._schedule(events))
        self.channel.send(window)
        self.runner.run(window)
        self.timings.decode_tokens += window.steps * len(self.live)
        self.channel.compare(window, self.decode_step.out_tokens)
        self._report(window)
        return events + self.post.window(window, self.live, self.scoring, self.runner.scores, self._ended)

    def heartbeat(self) -> None:
        """Idle: an empty record, so the other ranks' wait for the next one never times out."""
        window = self._reporting(Window())
        self.channel.send(window)
        self._report(window)

    def _reporting(self, window: Window) -> Window:
        """The window, asking every rank for its memory when a report is due."""
        return replace(window, report=True) if self.watch is not None and self.watch.due() else window

    def _report(self, window: Window) -> None:
        if window.report:
            self.watch.record(self.channel.gather_memory(self.runner.device))

    def shutdown(self, code: int = 0) -> None:
        """Every other rank leaves its loop (and exits with `code` when it is not 0)."""
        self.channel.send(Window(stop=code))

    # ------------------------------------------------------------------ schedule

    def _schedule(self, events: list[Event]) -> Window:
        def empty(p: Prompt) -> None:  # no slot, no token: its text is empty (not None) where there is a tokenizer
            events.append(Event(p.id, finish_reason="length", completion=Completion(p.id, list(p.ids), text=text)))

        text = "" if self.make_assembler else None
        plan = self.admission.plan(self.free, empty)
        for f in plan.started:
            if f.prompt.grammar is not None:  # its first token's mask goes out with every window until it comes
                self.masks.start(f.slot, f.prompt.grammar)
        self.scoring, constrained = {}, False
        for f in plan.filled:
            if f.prompt is None:  # a finished request's snapshot
                continue
            if f.prompt.max_new_tokens == 0:  # only scored: its slot was lent for its prefill
                self.scoring[f.slot] = f.prompt
                continue
            assembler = self.make_assembler(f.prompt) if self.make_assembler else None
            self.live[f.slot] = Live(f.prompt, Completion(f.prompt.id, list(f.ids)), assembler)
            constrained |= f.prompt.grammar is not None  # its first token comes out of this window's prefill
        self.free = sorted(self.free + list(self.scoring))
        ended, self.ended = tuple(self.ended), []
        record = dict(admit=tuple(plan.admit), prefill=tuple(plan.pieces), ended=ended)
        record |= dict(drop=tuple(plan.moves.drop), demote=tuple(plan.moves.demote)) | self.masks.window()
        if not self.live:
            return Window(**record)
        new = {f.slot for f in plan.filled if f.prompt is not None}
        steps = min(self.sync_every, *(s.prompt.max_new_tokens - s.produced for s in self.live.values()))
        if new or self.admission.filling is not None or self.masks:  # one step: new first tokens are out at once,
            steps = min(steps, 1)  # a prompt prefilled over several windows gets a piece after every step, masks fresh
        if constrained or new.issuperset(self.live):  # with no other slot live a step would only hold the new first
            steps = 0  # tokens back; a new constrained slot's second token needs its first one read (grammar.py)
        rows = active = None
        if self.decode_step.kind == "eager":  # no slot of interest gets past this row or this slot in the window
            last = max(len(s.prompt.ids) + s.produced for s in self.live.values()) + steps
            rows = min(self.cache.cap, -(-last // ROW_BUCKET) * ROW_BUCKET)
            active = max(self.live) + 1  # slots are taken lowest first, so the live ones gather at the front
        mode = SamplingMode.covering(s.prompt.mode for s in self.live.values())
        top = max([TOP, *(s.prompt.logprobs or 0 for s in self.live.values())])  # wider only where a slot asks
        return Window(**record, steps=steps, rows=rows, active=active, mode=mode, top=top)

    def _ended(self, slot: int, s: Live) -> None:
        """A sequence the window ended: its slot freed, its prompt + completion remembered for the prefix index."""
        self._release(slot)
        if self.prefix is not None:
            self.admission.finished(s.prompt.ids + tuple(s.out.tokens), len(s.out.tokens))

    def _release(self, slot: int) -> None:
        self.live.pop(slot, None)
        self.masks.end(slot)
        self.free.append(slot)
        self.free.sort()
        self.ended.append(slot)


def follow(runner: Runner, channel: Channel) -> int:
    """What every rank but 0 does: run rank 0's windows until its shutdown record; returns the exit code it sent."""
    while True:
        window = channel.receive()
        if window.stop is not None:
            return window.stop
        runner.run(window)
        channel.compare(window, runner.decode_step.out_tokens)
        if window.report:
            channel.gather_memory(runner.device)
