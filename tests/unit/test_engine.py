"""The engine's scheduling in one process (engine/engine.py, admission.py): a fake runner stands for every rank, so
a change to scheduling is checked in seconds, without ranks, a model or a checkpoint.

The fake has what the engine uses of a Runner (`run(window)`, the decode step's buffers and kind, the cache's batch
and cap, the prefill chunk, the vocabulary size, timings, the prompts scored in the last window) and follows the
window record as runner.py does: ended slots first, then the pieces in order (a new piece takes the next Admit,
resets its slot and restores its snapshot), each prompt's first token after its last piece, then `steps` decode
steps over the first `active` slots. It checks the record on the way: a piece starts where its slot's prompt
stopped, a restore names a snapshot taken before and holding a prefix of the prompt, every Admit is used, at most
one prompt is partly prefilled during decode steps. Its tokens follow one rule, next = NEXT(last), so every
request's completion is known beforehand, whatever else shares the batch and however its prompt was cut.
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from k3dist.engine.control import Channel, Window
from k3dist.engine.decode_step import TOP
from k3dist.engine.engine import Engine
from k3dist.engine.prefix import PrefixIndex
from k3dist.engine.runner import Timings
from k3dist.engine.sampling import BadValue, SamplingParams
from k3dist.engine.sequences import Prompt

VOCAB, CAP = 512, 96


def NEXT(token: int) -> int:
    return (5 * token + 3) % VOCAB


def chain(ids: tuple[int, ...], n: int) -> list[int]:
    """The completion of n tokens the fake gives a prompt."""
    out, t = [], ids[-1]
    for _ in range(n):
        out.append(t := NEXT(t))
    return out


class FakeScores:
    def __init__(self, ids):
        self.ids = ids

    def entries(self) -> list:
        return [None, *((-1.0, [(t, -1.0)]) for t in self.ids[1:])]


class FakeStep:
    """DecodeStep's buffers as the engine reads them; `gen`: the index of each slot's next output token."""

    kind = "eager"

    def __init__(self, batch: int):
        self.out_tokens = torch.zeros(batch, CAP, dtype=torch.int64)
        self.top_ids = torch.zeros(batch, CAP, TOP, dtype=torch.int64)
        self.top_values = torch.zeros(batch, CAP, TOP)
        self.out_lse, self.out_logit = torch.zeros(batch, CAP), torch.zeros(batch, CAP)
        self.tokens, self.gen = [0] * batch, [0] * batch

    def emit(self, slot: int, token: int) -> None:
        at = min(self.gen[slot], CAP - 1)  # a finished slot may step on until the host looks, as decode_step.py's
        self.out_tokens[slot, at] = self.top_ids[slot, at, 0] = token
        self.tokens[slot], self.gen[slot] = token, self.gen[slot] + 1


class FakeRunner:
    def __init__(self, batch: int, prefill_chunk: int):
        self.decode_step, self.prefill_chunk = FakeStep(batch), prefill_chunk
        self.cache = SimpleNamespace(batch=batch, cap=CAP)
        self.model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=VOCAB))
        self.device, self.timings, self.scores = torch.device("cpu"), Timings(), {}
        self.windows: list[Window] = []
        self.admitted: list[tuple[int, int, tuple]] = []  # (window, slot, prompt ids)
        self.filling: dict[int, list] = {}  # slot -> [Admit, prompt tokens in it]
        self.snapshots: dict[int, tuple] = {}  # snapshot id -> the ids it holds

    def run(self, window: Window) -> None:
        self.windows.append(window)
        self.scores = {}
        for snap in window.drop:
            del self.snapshots[snap]
        for slot in window.ended:
            self.filling.pop(slot, None)
        admits = iter(window.admit)
        for slot, start, end, new in window.prefill:
            if new:
                a = next(admits)
                assert a.slot == slot, (a, window.prefill)
                self.admitted.append((len(self.windows) - 1, slot, a.ids))
                held = self.snapshots[a.restore] if a.restore is not None else ()
                assert a.ids[: len(held)] == held, "a restore of a snapshot that is no prefix of the prompt"
                self.filling[slot] = [a, len(held)]
            a, at = self.filling[slot]
            assert start == at <= end <= len(a.ids), f"piece {start}:{end} of slot {slot}, which holds {at} tokens"
            self.filling[slot][1] = end
            self.snapshots.update({snap: a.ids[:end] for pos, snap in a.saves if pos == end})
            if end == len(a.ids):
                del self.filling[slot]
                if a.score is not None:
                    self.scores[slot] = FakeScores(a.ids)
                if a.emit:
                    self.decode_step.gen[slot] = 0
                    self.decode_step.emit(slot, NEXT(a.ids[-1]))
        assert next(admits, None) is None, "an Admit no piece took"
        if window.steps:
            assert len(self.filling) <= 1, "two prompts partly prefilled during decode steps"
        for _ in range(window.steps):
            for slot in range(window.active or self.cache.batch):
                self.decode_step.emit(slot, NEXT(self.decode_step.tokens[slot]))


class Recording(Channel):
    """A world of one (sends nowhere) that keeps what it was given to send."""

    def __init__(self):
        super().__init__(None)
        self.sent: list[Window] = []

    def send(self, window: Window) -> None:
        self.sent.append(window)
        super().send(window)


def make(batch=2, chunk=16, budget=None, sync_every=4, eos=(), prefix=None):
    runner = FakeRunner(batch, chunk)
    return Engine(runner, Recording(), sync_every=sync_every, eos_ids=eos, prefix=prefix, prefill_budget=budget), runner


def prompt(k: int, length: int, budget: int, **kw) -> Prompt:
    """Request r<k>: ids of its own (40k, 40k+1, ...)."""
    return Prompt(f"r{k}", tuple((40 * k + i) % VOCAB for i in range(length)), budget, **kw)


def drive(engine: Engine, limit: int = 200) -> list[list]:
    """run_window() until the engine is idle; the events of each window."""
    out = []
    while engine.busy:
        out.append(engine.run_window())
        assert len(out) < limit
    assert engine.channel.sent == engine.runner.windows  # the record every rank runs is the one sent
    return out


def finals(windows: list[list]) -> dict:
    return {e.id: e for events in windows for e in events if e.finished}


def names(runner: FakeRunner, prompts) -> list[tuple[int, int, str]]:
    """(window, slot, request) of every admission, in record order."""
    by_ids = {p.ids: p.id for p in prompts}
    return [(w, slot, by_ids.get(ids, "?")) for w, slot, ids in runner.admitted]


def test_prompts_take_slots_first_come_first_served_and_a_freed_slot_goes_to_the_next():
    engine, runner = make(batch=2)
    prompts = [prompt(k, 3, budget) for k, budget in enumerate([2, 6, 3, 3, 3, 4])]
    for p in prompts[:5]:
        engine.add(p)
    windows = []
    while engine.busy and len(windows) < 50:
        free, waiting = len(engine.free), [p.id for p in engine.waiting]
        windows.append(engine.run_window())
        took = [name for w, _, name in names(runner, prompts) if w == len(windows) - 1]
        assert took == waiting[: min(free, len(waiting))]  # no slot left free while a prompt waits, in order
        if len(windows) == 3:
            engine.add(prompts[5])  # a latecomer queues behind the others
    admitted = names(runner, prompts)
    assert [name for *_, name in admitted] == [p.id for p in prompts]
    assert [slot for _, slot, _ in admitted] == [0, 1, 0, 0, 0, 1]
    when = {e.id: w for w, events in enumerate(windows) for e in events if e.finished}
    assert admitted[2][0] == when["r0"] + 1  # r0's slot goes to r2 in the very next window
    done = finals(windows)
    for p in prompts:
        assert (done[p.id].finish_reason, done[p.id].completion.tokens) == ("length", chain(p.ids, p.max_new_tokens))


def test_a_request_aborted_while_waiting_never_runs_and_the_queue_keeps_its_order():
    engine, runner = make(batch=1)
    prompts = [prompt(k, 3, 3) for k in range(4)]
    for p in prompts:
        engine.add(p)
    first = engine.run_window()
    assert engine.abort("r2") and not engine.abort("r2") and not engine.abort("nobody")
    windows = [first, *drive(engine)]
    aborted = windows[1][0]  # told with the next window
    assert (aborted.id, aborted.finish_reason, aborted.tokens) == ("r2", "abort", [])
    assert aborted.completion.prompt == list(prompts[2].ids) and aborted.completion.tokens == []
    assert [name for *_, name in names(runner, prompts)] == ["r0", "r1", "r3"]
    assert [e.tokens for events in windows for e in events if e.id == "r2"] == [[]]
    assert finals(windows)["r3"].completion.tokens == chain(prompts[3].ids, 3)


def test_a_request_aborted_while_running_frees_its_slot_for_the_next_window():
    engine, runner = make(batch=2, sync_every=4)
    prompts = [prompt(0, 3, 30), prompt(1, 5, 30), prompt(2, 4, 5)]
    for p in prompts:
        engine.add(p)
    windows = [engine.run_window(), engine.run_window()]
    got = [t for events in windows for e in events if e.id == "r0" for t in e.tokens]
    assert engine.abort("r0")
    windows += drive(engine)
    ended = next(e for e in windows[2] if e.id == "r0")
    assert ended.finish_reason == "abort" and ended.completion.tokens == got == chain(prompts[0].ids, len(got))
    assert [e for events in windows[3:] for e in events if e.id == "r0"] == []  # nothing after its end
    assert runner.windows[2].ended == (0,)  # every rank hears of it with the next window ...
    assert names(runner, prompts)[2] == (2, 0, "r2")  # ... whose admission reuses the slot
    done = finals(windows)
    assert done["r1"].completion.tokens == chain(prompts[1].ids, 30)  # the other sequence is untouched
    assert done["r2"].completion.tokens == chain(prompts[2].ids, 5)


def test_a_request_aborted_in_the_middle_of_its_prefill_frees_its_slot():
    engine, runner = make(batch=2, chunk=4)
    live, long, after = prompt(0, 3, 12), prompt(1, 19, 4), prompt(2, 3, 2)
    engine.add(live)
    windows = [engine.run_window()]
    engine.add(long)
    engine.add(after)
    windows += [engine.run_window(), engine.run_window()]
    assert engine.admission.filling is not None and engine.admission.filling.prompt is long
    slot = engine.admission.filling.slot
    assert engine.abort("r1")
    windows += drive(engine)
    ended = next(e for e in windows[3] if e.id == "r1")
    assert (ended.finish_reason, ended.completion.tokens) == ("abort", [])
    assert slot in runner.windows[3].ended and not runner.filling
    assert (slot, "r2") in [(s, name) for _, s, name in names(runner, [live, long, after])]
    done = finals(windows)
    assert done["r0"].completion.tokens == chain(live.ids, 12)
    assert done["r2"].completion.tokens == chain(after.ids, 2)


def test_a_budget_of_zero_takes_no_slot_and_a_scored_one_only_lends_its_slot():
    engine, runner = make(batch=1)
    plain = prompt(1, 3, 0)
    scored = prompt(2, 5, 0, prompt_logprobs=1)
    prompts = [prompt(0, 3, 4), plain, scored, prompt(3, 3, 2)]
    for p in prompts:
        engine.add(p)
    windows, lives = [], []
    while engine.busy and len(windows) < 50:
        windows.append(engine.run_window())
        lives.append({s.prompt.id for s in engine.live.values()})
    done = finals(windows)
    assert (done["r1"].finish_reason, done["r1"].completion.tokens, done["r1"].tokens) == ("length", [], [])
    assert [name for *_, name in names(runner, prompts)] == ["r0", "r2", "r3"]  # r1 never took a slot
    (admit,) = [a for w in runner.windows for a in w.admit if a.ids == scored.ids]
    assert not admit.emit and admit.score == 1
    assert done["r2"].tokens == [] and done["r2"].completion.tokens == []
    assert done["r2"].prompt_logprobs == FakeScores(scored.ids).entries()
    assert not any("r2" in live for live in lives)  # never decoded
    assert done["r3"].completion.tokens == chain(prompts[3].ids, 2)


@pytest.mark.parametrize("chunk, budget", [(4, 4), (4, 8)])
def test_a_long_prompt_is_prefilled_in_pieces_within_the_budget_while_the_others_decode(chunk, budget):
    engine, runner = make(batch=5, chunk=chunk, budget=budget)
    live, long, *shorts = prompt(0, 3, 40), prompt(1, 19, 3), *(prompt(k, 3, 3) for k in (2, 3, 4))
    engine.add(live)
    windows = [engine.run_window()]
    for p in (long, *shorts):  # newcomers queue behind the long one
        engine.add(p)
    windows += drive(engine)
    for w in runner.windows:
        assert sum(end - start for _, start, end, _ in w.prefill) <= budget
    admitted = names(runner, [live, long, *shorts])
    assert [name for *_, name in admitted] == ["r0", "r1", "r2", "r3", "r4"]
    slot = admitted[1][1]
    pieces = [(i, p[1], p[2]) for i, w in enumerate(runner.windows) for p in w.prefill if p[0] == slot]
    assert [p[1] for p in pieces] == [0] + [p[2] for p in pieces[:-1]] and pieces[-1][2] == 19  # all, in order
    assert all(end % chunk == 0 or end == 19 for _, _, end in pieces)  # cut where its chunks end
    first, last = pieces[0][0], pieces[-1][0]
    assert last - first + 1 >= -(-19 // budget)  # over several windows
    ran = {i for i, *_ in pieces}
    assert all(i in ran or i + 1 in ran for i in range(first, last))  # newcomers never hold it two windows
    assert admitted[2][0] <= first + 1  # nor it them
    took = {w for w, *_ in admitted}
    assert all(i in ran or i in took for i in range(first, last + 1))  # and the budget never idles
    for i in range(first, last + 1):  # the live stream gets a token every window the prompt fills
        assert runner.windows[i].steps == 1  # one decode step: the prompt's next piece comes after it
        assert [e.tokens for e in windows[i] if e.id == "r0"] != [[]], i
    done = finals(windows)
    for p in (live, long, *shorts):
        assert done[p.id].completion.tokens == chain(p.ids, p.max_new_tokens)


def test_a_window_runs_no_more_steps_than_the_nearest_budget():
    engine, runner = make(batch=3, sync_every=8)
    prompts = [prompt(0, 3, 3), prompt(1, 3, 10), prompt(2, 3, 20)]
    for p in prompts:
        engine.add(p)
    windows, at_end, slots = [], {}, {}
    while engine.busy and len(windows) < 50:
        windows.append(engine.run_window())
        slots |= {name: s for _, s, name in names(runner, prompts)}
        for e in windows[-1]:
            if e.finished:
                at_end[e.id] = runner.decode_step.gen[slots[e.id]]
    # the first window only prefills (no other slot is live: its first tokens go out at once), then each window runs
    # min(sync_every, the nearest budget)
    assert [w.steps for w in runner.windows] == [0, 2, 7, 8, 2]
    assert at_end == {p.id: p.max_new_tokens for p in prompts}  # no slot stepped past its budget
    done = finals(windows)
    assert all(done[p.id].completion.tokens == chain(p.ids, p.max_new_tokens) for p in prompts)
    assert runner.timings.decode_tokens == 3 * 2 + 2 * 7 + 8 + 2  # live slots x steps


def test_eos_and_stop_ids_end_a_sequence_inside_a_window_and_ignore_eos_runs_on():
    base = prompt(0, 3, 10)
    eos = chain(base.ids, 3)[2]
    twin = Prompt("r1", (99, base.ids[-1]), 10, ignore_eos=True)  # the same tokens, eos ignored
    stopped = prompt(2, 3, 10)
    stopped = Prompt("r2", stopped.ids, 10, stop_ids=(chain(stopped.ids, 2)[1],))
    engine, runner = make(batch=3, sync_every=8, eos=(eos,))
    for p in (base, twin, stopped):
        engine.add(p)
    done = finals(drive(engine))
    assert (done["r0"].finish_reason, done["r0"].completion.tokens) == ("stop", chain(base.ids, 3))
    assert (done["r1"].finish_reason, done["r1"].completion.tokens) == ("length", chain(base.ids, 10))
    assert (done["r2"].finish_reason, done["r2"].completion.tokens) == ("stop", chain(stopped.ids, 2))
    assert max(w.steps for w in runner.windows) > 3  # the eos came in the middle of a window


def test_a_finished_requests_snapshot_is_extended_for_the_next_turn():
    """prefix reuse: a finished request's prompt + completion is snapshotted from its prompt's snapshot (an
    extension, admission.py) in the window the next turn arrives, which then restores it in that same window."""
    index = PrefixIndex(device_bytes=10_000, host_bytes=0, every=64, nbytes=lambda n: n)
    engine, runner = make(batch=2, chunk=16, prefix=index)
    turn, other = prompt(0, 6, 4), prompt(1, 3, 30)
    engine.add(turn)
    engine.add(other)
    windows = []
    while "r0" not in finals(windows) and len(windows) < 50:
        windows.append(engine.run_window())
    before = len(runner.windows)
    ids = turn.ids + tuple(chain(turn.ids, 4))
    nxt = Prompt("r2", ids + (7, 8, 9), 3)
    engine.add(nxt)
    windows.append(engine.run_window())
    w = runner.windows[before]
    extension, admit = w.admit
    assert extension.ids == ids and not extension.emit
    assert runner.snapshots[extension.restore] == turn.ids  # the prompt's own snapshot ...
    assert w.prefill[:2] == ((extension.slot, 6, 10, True), (admit.slot, 10, 13, True))  # ... plus the completion
    ((at, snap),) = extension.saves
    assert (at, admit.ids, admit.restore) == (10, nxt.ids, snap)  # the next turn restores it at once
    assert [e.tokens for e in windows[-1] if e.id == "r1"] != [[]]  # the other stream decodes on
    windows += drive(engine)
    done = finals(windows)
    assert done["r2"].completion.tokens == chain(nxt.ids, 3)
    assert done["r1"].completion.tokens == chain(other.ids, 30)


def test_a_completion_shorter_than_an_eighth_of_a_chunk_is_prefilled_by_the_next_turn():
    """No extension for a short completion (3 tokens < 32 / 8): the next turn restores the prompt's snapshot and
    prefills the completion with its own new tokens, in one piece."""
    index = PrefixIndex(device_bytes=10_000, host_bytes=0, every=64, nbytes=lambda n: n)
    engine, runner = make(batch=2, chunk=32, prefix=index)
    turn = prompt(0, 6, 3)
    engine.add(turn)
    drive(engine)
    ids = turn.ids + tuple(chain(turn.ids, 3))
    nxt = Prompt("r1", ids + (7, 8, 9), 3)
    before = len(runner.windows)
    engine.add(nxt)
    done = finals(drive(engine))
    w = runner.windows[before]
    (admit,) = w.admit  # no extension beside it
    assert runner.snapshots[admit.restore] == turn.ids
    assert w.prefill[0] == (admit.slot, 6, 12, True)
    assert done["r1"].completion.tokens == chain(nxt.ids, 3)


def test_an_idle_engine_sends_heartbeats_and_the_shutdown():
    engine, runner = make()
    engine.add(prompt(0, 3, 2))
    drive(engine)
    assert not engine.busy and not engine.live and engine.free == [0, 1]
    engine.heartbeat()
    engine.shutdown(3)
    assert engine.channel.sent[-2:] == [Window(), Window(stop=3)]
    assert len(runner.windows) == len(engine.channel.sent) - 2  # neither runs anything on rank 0


@pytest.mark.parametrize(
    "field, change",
    [
        ("max_new_tokens", {"max_new_tokens": 1.5}),  # the float that once reached a window and ended every rank
        ("max_new_tokens", {"max_new_tokens": CAP}),
        ("ids", {"ids": (1, VOCAB)}),
        ("ids", {"ids": [1, 2]}),
        ("stop", {"stop": ["a"]}),
        ("stop_ids", {"stop_ids": (VOCAB,)}),
        ("logprobs", {"logprobs": 21}),
        ("prompt_logprobs", {"prompt_logprobs": 2.0}),
        ("ignore_eos", {"ignore_eos": 1}),
        ("priority", {"priority": "0"}),
        ("logit_bias", {"sampling": SamplingParams(logit_bias=((VOCAB, 1.0),))}),
        ("grammar", {"grammar": object()}),
    ],
)
def test_a_prompt_is_checked_before_any_window_naming_its_field(field, change):
    """Engine.check (a server calls it on its HTTP thread; add calls it again): whatever a front slips through is a
    BadValue naming the field, never a failure inside run_window."""
    engine, _ = make()
    bad = replace(prompt(0, 3, 2), **change)
    with pytest.raises(BadValue) as refused:
        engine.check(bad)
    assert refused.value.field == field
    with pytest.raises(BadValue):
        engine.add(bad)
    assert not engine.waiting and not engine.busy


def test_waiting_prompts_go_by_priority_then_first_come():
    engine, runner = make(batch=1)
    prompts = [replace(prompt(k, 3, 2), priority=p) for k, p in enumerate([0, 5, -1, 5, 0])]
    for p in prompts:
        engine.add(p)
    drive(engine)
    assert [name for _, _, name in names(runner, prompts)] == ["r2", "r0", "r4", "r1", "r3"]
