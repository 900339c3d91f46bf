"""Streamed detokenizing: text printed as tokens arrive, never a broken character, never part of a stop string.

Tokens are turned into bytes one at a time and the bytes into text by an incremental UTF-8 decoder, so a character
split across tokens appears once its last byte does. Printed text also holds back any tail that could still grow
into a stop string. A stop string ends the text where it starts; when one token completes several, the one that
ends first wins (ties: the one that starts first), which is the answer a character-by-character reader would give,
so the final text does not depend on how the ids were cut into tokens or feeds.
"""

import codecs
from collections.abc import Collection, Sequence

from .tokenizer import Tokenizer


class TextAssembler:
    """Assembles one sequence's text. Everything feed() and finish() return, joined, equals `.text`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_ids: Collection[int] = (),
        spaced_ids: Collection[int] = (),
    ):
        """`skip_ids` add no text (eos; the special tokens too under skip_special_tokens); `spaced_ids`: tokens set
        apart by a space from the text beside them (vLLM's spaces_between_special_tokens for a tokenizer such as
        Kimi's: the text is its pieces, each run of other tokens and each of these, joined by spaces)."""
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._stops = tuple(dict.fromkeys(stop))
        self._longest = max(map(len, self._stops), default=0)
        self._skip = frozenset(int(i) for i in skip_ids)
        self._spaced = frozenset(int(i) for i in spaced_ids)
        self._last_spaced: bool | None = None  # whether the last piece of text was a spaced token (None: no text yet)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._printed: list[str] = []  # text already returned
        self._held = ""  # text decoded but held back: it may still become a stop string
        self._tail = ""  # the last (longest stop - 1) characters of the text, where a stop could have begun
        self.stop_string: str | None = None  # the stop string that ended the text
        self.finished = False

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    @property
    def text(self) -> str:
        """The text so far (after finish(): the final text), cut before the stop string."""
        return "".join(self._printed) + self._held

    def feed(self, ids: Sequence[int], stops: bool = True) -> tuple[str, int | None]:
        """Take tokens in order: (newly printable text, index in `ids` of the token that completed a stop or None).

        Tokens after a stop are not consumed; once stopped (or finished) the assembler takes no more tokens.
        Ids in skip_ids (eos) add no text. With `stops` False (a request's first min_tokens tokens) a stop string
        they complete does not count; one that ends in a later token does.
        """
        if self.stopped or self.finished:
            return "", None
        pending = [self._held]
        for position, token_id in enumerate(ids):
            token_id = int(token_id)
            if token_id in self._skip:
                continue
            new = self._decoder.decode(self._tokenizer.decode_bytes([token_id]))
            if new and self._spaced:
                spaced = token_id in self._spaced
                if self._last_spaced is not None and (spaced or self._last_spaced):
                    new = " " + new
                self._last_spaced = spaced
            if new and self._add(pending, new, stops):
                return self._print("".join(pending), hold=False), position
        return self._print("".join(pending), hold=True), None

    def finish(self) -> str:
        """The rest of the text once the sequence has ended: the held-back tail, an unfinished character as U+FFFD."""
        if self.finished:
            return ""
        self.finished = True
        if self.stopped:
            return ""
        pending = [self._held]
        if new := self._decoder.decode(b"", final=True):
            self._add(pending, new)
        return self._print("".join(pending), hold=False)

    def _add(self, pending: list[str], new: str, stops: bool = True) -> bool:
        """Append `new` to the pending text; on a completed stop string cut the pending text before it, True."""
        if not self._stops:
            pending.append(new)
            return False
        window = self._tail + new
        hits = [(i + len(s), i, s) for s in self._stops if (i := window.find(s)) >= 0] if stops else []
        if not hits:
            pending.append(new)
            self._tail = window[max(0, len(window) - (self._longest - 1)) :]
            return False
        _, start, self.stop_string = min(hits)
        text = "".join(pending) + new
        keep = len(text) - len(window) + start  # a stop never begins in printed text, so keep >= 0
        pending[:] = [text[:keep]]
        return True

    def _print(self, pending: str, hold: bool) -> str:
        """Return `pending` but, with `hold`, its longest tail that is the start of a stop string; keep that."""
        held = 0
        if hold:
            for size in range(min(self._longest - 1, len(pending)), 0, -1):
                if any(s.startswith(pending[-size:]) for s in self._stops):
                    held = size
                    break
        out, self._held = pending[: len(pending) - held], pending[len(pending) - held :]
        self._printed.append(out)
        return out
