"""Rank 0's prefill plan for a window: which waiting prompts take slots, and which pieces of their prompts are
prefilled, within a budget of prompt tokens per window (one `generate.prefill_chunk` by default).

A long prompt is prefilled over as many windows as it takes while the live slots decode between them, so a stream
never waits for more than about one chunk of somebody else's prompt. A piece ends where the prompt's chunk ends (a
multiple of the chunk, counted from the prompt's start), where a prefix snapshot is taken, or at the prompt's end: a
request's chunks fall where they would if it ran alone, so its tokens and logits do not depend on what else arrived.

At most one prompt is partly prefilled at any time (every rank guards that slot's state while the others decode); it
and the newcomers take turns at the budget, so neither waits more than a window for the other. Prompts that fit in
what is left of the budget are prefilled whole in the window they arrive in. A prompt whose prefix snapshot is still
being made by the prompt ahead of it waits for it rather than computing the same prefix again.
"""

from collections import deque
from dataclasses import dataclass, field

from .control import Admit
from .prefix import Moves, PrefixIndex
from .sequences import Prompt

EXTEND_SHARE = 8  # completions of at least 1/8 of a chunk (64 of the default 512 tokens) are extended


@dataclass
class Filling:
    """A request holding a slot while its prompt is prefilled (or a finished request's prompt + completion, prefilled
    only to snapshot it: no request, nothing emitted)."""

    slot: int
    ids: tuple[int, ...]
    at: int  # prompt tokens in the slot so far (a restored snapshot's included)
    saves: dict[int, int]  # position -> snapshot id still to take there
    prompt: Prompt | None = None

    @property
    def done(self) -> bool:
        return self.at == len(self.ids)


@dataclass
class WindowPrefill:
    """One window's admissions and pieces, in the order every rank runs them."""

    left: int  # prompt tokens the window may still prefill
    admit: list[Admit] = field(default_factory=list)
    pieces: list[tuple[int, int, int, bool]] = field(default_factory=list)  # (slot, start, end, first of its Admit)
    started: list[Filling] = field(default_factory=list)  # newcomers admitted in this window
    filled: list[Filling] = field(default_factory=list)  # prompts whose last piece is in this window
    moves: Moves = field(default_factory=Moves)
    pinned: set[int] = field(default_factory=set)


class Admission:
    def __init__(self, chunk: int, budget: int, prefix: PrefixIndex | None):
        self.chunk, self.budget, self.prefix = chunk, budget, prefix
        self.waiting: deque[Prompt] = deque()
        self.filling: Filling | None = None  # the one prompt partly prefilled
        self.filling_waited = False  # it got no piece in the last window: it goes first in the next
        self.extend: list[tuple[tuple[int, ...], int]] = []  # finished (prompt + completion, completion): to snapshot

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens waiting to be prefilled (the waiting prompts whole, the rest of the partly prefilled one)."""
        left = len(self.filling.ids) - self.filling.at if self.filling else 0
        return left + sum(len(p.ids) for p in self.waiting)

    def plan(self, free: list[int], events_for_empty) -> WindowPrefill:
        """The window's prefill: finished requests' snapshots first (a next chat turn may restore one in this very
        window), then the partly prefilled prompt and the newcomers in turn. Takes the slots it admits into from
        `free`."""
        plan = WindowPrefill(self.budget)
        if self.prefix is not None:
            self._extensions(free, plan)
        first = self.filling is not None and self.filling_waited
        if first:
            self._continue(self.filling, plan)
        self._admit(free, plan, events_for_empty)
        if self.filling is not None and not first and not self._ran(plan, self.filling.slot):
            self._continue(self.filling, plan)
        self.filling_waited = self.filling is not None and not self._ran(plan, self.filling.slot)
        return plan

    # ------------------------------------------------------------------ pieces

    def _next_end(self, f: Filling) -> int:
        chunk_end = (f.at // self.chunk + 1) * self.chunk
        return min(len(f.ids), chunk_end, *(p for p in f.saves if p > f.at))

    def _continue(self, f: Filling, plan: WindowPrefill, first: bool = False) -> None:
        """As many of `f`'s pieces as the budget allows (at least one in a window that has none yet)."""
        while True:
            end = self._next_end(f) if not f.done else f.at
            if not first and (f.done or (plan.pieces and end - f.at > plan.left)):
                break
            plan.pieces.append((f.slot, f.at, end, first))
            plan.left -= end - f.at
            f.at, first = end, False
            if end in f.saves and self.prefix is not None:
                self.prefix.made(f.saves.pop(end))
        if f.done:
            plan.filled.append(f)
            if f is self.filling:
                self.filling = None

    @staticmethod
    def _ran(plan: WindowPrefill, slot: int) -> bool:
        return any(p[0] == slot for p in plan.pieces)

    # ------------------------------------------------------------------ newcomers

    def _admit(self, free: list[int], plan: WindowPrefill, events_for_empty) -> None:
        while free and self.waiting:
            p = self.waiting[0]
            scored = p.prompt_logprobs is not None  # a snapshot holds no logits of the positions before its end:
            reuse = self.prefix is not None and not scored  # a scored prompt restores none and takes none
            if p.max_new_tokens == 0 and not scored:  # no slot, no token
                events_for_empty(self.waiting.popleft())
                continue
            hit = self.prefix.lookup(p.ids, count=False) if reuse else None
            if hit is not None and not hit.ready:
                break  # the prompt ahead is making its snapshot: wait for it rather than compute it again
            start = len(hit.ids) if hit else 0
            beside = [q.ids for q in list(self.waiting)[1 : len(free)]]
            branch = self.prefix.branch_point(p.ids, beside) if reuse else 0
            points = self.prefix.boundaries(len(p.ids), start, branch) if reuse else [len(p.ids)]
            first_end = min((start // self.chunk + 1) * self.chunk, *(x for x in points if x > start), len(p.ids))
            if len(p.ids) - start > plan.left:  # it will not be prefilled whole in this window
                if self.filling is not None or (plan.pieces and first_end - start > plan.left):
                    break
            self.waiting.popleft()
            saves = self._reuse(p.ids, hit, points, branch, plan) if reuse else ()
            slot = free.pop(0)
            emit = p.max_new_tokens > 0  # else only scored: its slot is lent until its prefill is done
            restore = hit.id if hit else None
            scored_k = p.prompt_logprobs
            admit = Admit(slot, p.ids, sampling=p.sampling, restore=restore, saves=saves, emit=emit, score=scored_k)
            plan.admit.append(admit)
            f = Filling(slot, p.ids, at=start, saves=dict(saves), prompt=p)
            plan.started.append(f)
            if self.prefix is not None:
                self.prefix.remember(p.ids)
            self._continue(f, plan, first=True)
            if not f.done:
                self.filling = f

    def _reuse(self, ids, hit, points: list[int], branch: int, plan: WindowPrefill) -> tuple[tuple[int, int], ...]:
        """The snapshots a newcomer takes on the way (planned, made when its pieces reach them); counts its hit."""
        if self.prefix is None:
            return ()
        self.prefix.lookup(ids)  # the hit (or miss) counted, now that it is admitted
        if hit is not None:
            plan.pinned.add(hit.id)
        saves, digests = [], self.prefix.digests(ids, points)
        for at in points:
            snap = self.prefix.plan(ids[:at], plan.moves, plan.pinned, branch=at == branch, digest=digests[at])
            if snap is not None:
                saves.append((at, snap))
                plan.pinned.add(snap)
        return tuple(saves)

    def _extensions(self, idle: list[int], plan: WindowPrefill) -> None:
        """Snapshots of finished requests' prompt + completion (`finished`: the next chat turn starts with it): a free
        slot restores the request's prompt snapshot and prefills just the completion, first in the window (a
        newcomer admitted into that slot resets it afterwards). One that does not fit the budget waits for a later
        window."""
        pending, self.extend = self.extend, []
        for ids, completion in pending:
            hit = self.prefix.lookup(ids, count=False)
            if hit is None or len(ids) - len(hit.ids) > completion or not hit.ready:
                continue  # its prompt's snapshot is gone: recomputing all of it is not worth it
            if not idle or len(ids) - len(hit.ids) > plan.left:
                self.extend.append((ids, completion))  # no room in this window: the next one
                continue
            plan.pinned.add(hit.id)
            snap = self.prefix.plan(ids, plan.moves, plan.pinned)
            if snap is None:
                continue
            plan.pinned.add(snap)
            plan.admit.append(Admit(idle[0], ids, restore=hit.id, saves=((len(ids), snap),), emit=False))
            self._continue(Filling(idle[0], ids, at=len(hit.ids), saves={len(ids): snap}), plan, first=True)
        del self.extend[: -len(idle) or None]  # a bounded backlog: beyond one a slot, the oldest are given up

    def finished(self, ids: tuple[int, ...], completion: int) -> None:
        """A finished request's prompt + completion (`completion` tokens of it): remembered for the branch points,
        and snapshotted ahead of a next turn (an extension, `_extensions`) from EXTEND_SHARE of a chunk on.

        A piece costs a pass over the weights plus its tokens' arithmetic. An extension is such a pass for every
        finished request, next turn or not; what it saves the next turn is only the arithmetic of the completion's
        tokens, which that turn would otherwise prefill after the prompt's snapshot, in the piece it runs for its
        own tokens. Below EXTEND_SHARE of a chunk that arithmetic is worth less than the pass (docs/prefix.md)."""
        self.prefix.remember(ids)
        if completion >= max(1, self.chunk // EXTEND_SHARE):
            self.extend.append((ids, completion))

    def forget(self, f: Filling) -> None:
        """An aborted prompt's snapshots that its pieces never reached are no snapshots."""
        for snap in f.saves.values():
            self.prefix.unplan(snap)
        f.saves.clear()
