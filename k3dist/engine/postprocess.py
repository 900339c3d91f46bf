"""Rank 0 after a window ran (the engine's postprocess, engine.py): read every live slot's new tokens once (one
device-to-host copy, with their log-probabilities when a slot asked), end each sequence at an eos id, a stop id or
string, a grammar's end or its budget, and turn it all into events. The window's size is the engine's business; what
happened in it, this module's."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..base.errors import K3Error
from .control import Window
from .decode_step import TOP, DecodeStep
from .grammar import Masks
from .sequences import Completion, Event, Prompt


@dataclass
class Live:
    """A request holding a slot on rank 0: what it asked, what it produced, what the host has read of it."""

    prompt: Prompt
    out: Completion
    assembler: object | None  # text/stream.py's TextAssembler when there is a tokenizer
    produced: int = 1  # tokens produced on the device (the first comes from the prefill)
    read: int = 0  # tokens the host has looked at
    events: list = field(default_factory=list)


class Postprocess:
    def __init__(
        self, decode_step: DecodeStep, masks: Masks, eos_ids: tuple[int, ...], make_assembler: Callable | None
    ):
        """`masks`: the engine's grammar masks (a matcher advanced by every token); `make_assembler`: Prompt -> its
        text assembler (None: no tokenizer, no text)."""
        self.decode_step, self.masks = decode_step, masks
        self.eos, self.make_assembler = set(eos_ids), make_assembler

    def window(
        self,
        window: Window,
        live: dict[int, Live],
        scoring: dict[int, Prompt],
        scores: dict,
        end: Callable[[int, Live], None],
    ) -> list[Event]:
        """Look at the new tokens of every live slot (one device-to-host copy); end the finished sequences (`end`:
        the engine frees the slot). `scoring`: the prompts only scored whose prefill ended in the window, by slot;
        `scores`: every prompt scored in its prefills, by slot."""
        events = [self._scored_only(p, scores[slot]) for slot, p in scoring.items()]
        if not live:
            return events
        for s in live.values():
            s.produced += window.steps
        lo = min(s.read for s in live.values())
        hi = max(s.produced for s in live.values())
        tokens = self.decode_step.out_tokens[:, lo:hi].tolist()
        wanted = any(s.prompt.logprobs is not None for s in live.values())
        scored = self._logprobs(lo, hi, window.top) if wanted else None
        for slot, s in list(live.items()):
            at = s.read - lo
            new = tokens[slot][at : s.produced - lo]
            s.read = s.produced
            event = Event(s.prompt.id)
            if slot in scores and s.prompt.prompt_logprobs is not None:
                event.prompt_logprobs = scores[slot].entries()
            finished = self._accept_tokens(slot, s, new, event)
            if scored is not None and s.prompt.logprobs is not None:
                event.logprobs = [scored(slot, at + i, s.prompt.logprobs) for i in range(len(event.tokens))]
                s.out.logprobs += event.logprobs
            if finished:
                end(slot, s)
                event.finish_reason, event.completion = s.out.finish_reason, self._complete(slot, s, event)
            if event.tokens or event.finished:
                events.append(event)
        return events

    def _scored_only(self, p: Prompt, scores) -> Event:
        """The end of a prompt that was only scored (max_new_tokens 0): its prompt log-probabilities, no token."""
        empty = Completion(p.id, list(p.ids), text="" if self.make_assembler else None)
        return Event(p.id, finish_reason="length", completion=empty, prompt_logprobs=scores.entries())

    def _logprobs(self, lo: int, hi: int, k: int):
        """The window's log-probabilities, read once: (slot, index, k) -> (chosen token's, [(id, logprob) x k])."""
        st = self.decode_step
        ids, top = st.top_ids[:, lo:hi, :k].tolist(), st.top_values[:, lo:hi, :k].tolist()
        lse, chosen = st.out_lse[:, lo:hi].tolist(), st.out_logit[:, lo:hi].tolist()

        def scored(slot: int, i: int, k: int):  # tokens a mask or a ban took out (-inf) are no candidates
            z, best = lse[slot][i], zip(ids[slot][i][:k], top[slot][i][:k], strict=True)
            return chosen[slot][i] - z, [(t, v - z) for t, v in best if v != -math.inf]

        return scored

    def _accept_tokens(self, slot: int, s: Live, new: list[int], event: Event) -> bool:
        """Append tokens up to the first stop; True when the sequence is over. Before `min_tokens` tokens no stop
        string counts (eos and stop ids cannot come: the step holds them back)."""
        p = s.prompt
        for token in new:
            s.out.tokens.append(token)
            event.tokens.append(token)
            if (
                not self.masks.accept(slot, token, p.id)
                or token in p.stop_ids
                or (token in self.eos and not p.ignore_eos)
            ):
                s.out.finish_reason = "stop"
                return True
            if s.assembler is not None:
                text, stopped = s.assembler.feed([token], stops=len(s.out.tokens) > p.min_tokens)
                event.text += text
                if stopped is not None:
                    s.out.finish_reason = "stop"
                    return True
            if len(s.out.tokens) == s.prompt.max_new_tokens:
                return True
        return False

    def _complete(self, slot: int, s: Live, event: Event) -> Completion:
        n = len(s.out.tokens)
        ids = self.decode_step.top_ids[slot, :n, :TOP].tolist()
        values = self.decode_step.top_values[slot, :n, :TOP].tolist()
        # a mask or a ban puts -inf among a row's top logits, but never first
        bad = next(((t, v) for t, row in enumerate(values) for v in row if _bad(v, row[0])), None)
        if bad is not None:  # NaN or inf weights (or config numbers) make garbage tokens, never a result
            raise K3Error(
                f"logit {bad[1]} at generated token {bad[0]} of request {s.out.id!r}: the checkpoint's weights "
                "hold NaN/inf or overflow in this dtype"
            )
        s.out.top_logits = [[[i, v] for i, v in zip(a, b, strict=True)] for a, b in zip(ids, values, strict=True)]
        if s.assembler is not None:
            event.text += s.assembler.finish()  # nothing after a stop string
            s.out.text = s.assembler.text
        return s.out


def _bad(value: float, best: float) -> bool:
    return math.isnan(value) or value == math.inf or not math.isfinite(best)
