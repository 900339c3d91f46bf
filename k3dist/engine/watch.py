"""Every rank's memory, watched against its plan while a server runs (docs/memory.md).

The plan promises that a rank never holds more than its `admitted`; a server's lifetime is long, so the promise is
checked, not assumed. At most every `every_s` rank 0 marks the window record it sends anyway (or an idle
heartbeat) as a report: after running it, every rank gives back its free heap pages (base/allocator.py) and sends
rank 0 what it holds, two numbers over the control group. No step pays for it and an idle server needs no extra
record. Rank 0 exports the figures in /metrics and logs a rank past `admitted` plus OVER once, with the figures.
"""

import logging
import time
from dataclasses import dataclass

from ..base.units import fmt_bytes

log = logging.getLogger("k3dist")

REPORT_S = 2.0  # seconds between reports: fresher than any scrape, and a trim now and then costs nothing
OVER = 0.10  # a rank holding more than admitted + this share of it is logged (once)


@dataclass
class RankMemory:
    admitted: int  # the plan's figure for the rank
    resident: int = 0  # what it holds: the resident set (CPU) or the allocator's reserved bytes (CUDA)
    base: int = 0  # the bare process's resident set, which `admitted` does not count (0 on CUDA)

    @property
    def held(self) -> int:
        """What the run holds on the rank: the figure `admitted` bounds."""
        return self.resident - self.base


class MemoryWatch:
    def __init__(self, admitted: list[int], every_s: float = REPORT_S, clock=time.monotonic):
        self.ranks = [RankMemory(a) for a in admitted]
        self.every_s, self.clock = every_s, clock
        self.next_at = 0.0  # the first record reports at once: the figures are there from the start
        self.logged: set[int] = set()

    def due(self) -> bool:
        return self.clock() >= self.next_at

    def record(self, figures: list[list[int]]) -> None:
        """Every rank's (resident, base), as the control channel gathered them after a report."""
        self.next_at = self.clock() + self.every_s
        for rank, ((resident, base), r) in enumerate(zip(figures, self.ranks, strict=True)):
            r.resident, r.base = resident, base
            if r.held > r.admitted * (1 + OVER) and rank not in self.logged:
                self.logged.add(rank)
                log.warning(
                    "k3_memory_over rank=%d held=%s admitted=%s margin=%d%% resident=%s base=%s: the rank holds "
                    "more than its memory plan admitted (docs/memory.md)",
                    rank,
                    fmt_bytes(r.held),
                    fmt_bytes(r.admitted),
                    round(100 * OVER),
                    fmt_bytes(r.resident),
                    fmt_bytes(r.base),
                )
