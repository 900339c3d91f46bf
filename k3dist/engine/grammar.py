"""Grammar masks on rank 0: one matcher per constrained slot, advanced by the tokens the engine reads after each window,
and the bitmask rows every rank needs for the next one.

A matcher is whatever the front made (serve/structured.py wraps xgrammar's); the engine only asks it for the next
token mask and tells it the token chosen. A constrained slot runs one decode step per window, so its mask is always
made from every token before the one it masks; its first token's mask is made at admission, and the window that
admits it runs no decode step for anyone (the new slot's second token would need the first one read).
"""

import logging
from typing import Protocol

import torch
from torch import Tensor

log = logging.getLogger("k3dist")


class Matcher(Protocol):
    def fill(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit t % 32 of word t // 32 set: token t allowed)."""

    def accept(self, token: int) -> bool:
        """Advance by the chosen token; False if the grammar does not allow it."""


class Masks:
    def __init__(self, batch: int, vocab_size: int):
        self.words = -(-vocab_size // 32)
        self.bitmask = torch.zeros(batch, self.words, dtype=torch.int32)
        self.matchers: dict[int, Matcher] = {}

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def start(self, slot: int, make) -> None:
        self.matchers[slot] = make()

    def end(self, slot: int) -> None:
        self.matchers.pop(slot, None)

    def window(self) -> dict:
        """The Window fields carrying the masks of every constrained slot's next token (none: no field)."""
        if not self.matchers:
            return {}
        slots = tuple(sorted(self.matchers))
        for slot in slots:
            self.matchers[slot].fill(self.bitmask, slot)
        return {"masks": slots, "mask_words": self.words, "bitmask": self.bitmask[list(slots)]}

    def accept(self, slot: int, token: int, request_id: str) -> bool:
        """Advance the slot's matcher (True without one); a token its grammar refuses is logged, never raised: the
        request ends there and the engine serves on."""
        matcher = self.matchers.get(slot)
        if matcher is None or matcher.accept(token):
            return True
        log.warning("k3_grammar_refused request=%s token=%d (the request ends here)", request_id, token)
        return False
