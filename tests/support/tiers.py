"""The test tiers, declared once: CI (.ci/run), the README's commands and the tier check (tests/support/tier_check.py)
all read them from here, so a marker expression cannot differ between what CI runs and what the check proves.

The default tier proves each behaviour once; the other points of a parametrized test and the long proofs go to the
`slow` tier; the `timing` tests bound wall-clock times, so they run alone on the cores. Together the tiers select every
test but those that need CUDA (`gpu`, which the default tier selects and a CPU machine skips).

`python -m tests.support.tiers NAME [pytest arguments]` runs tier NAME as CI does (README: Tests).
"""

import os
import shlex
import sys
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Tier:
    """A pytest invocation of CI: the tests `marks` selects, run on `workers` pytest-xdist workers (0: in one
    process), a test file to each worker, so a module's fixtures (a started server, a group of ranks) stay in one."""

    name: str
    marks: str
    workers: int = 0

    @property
    def command(self) -> str:
        """The command line, as the README prints it."""
        spread = f" -n {self.workers} --dist loadfile" if self.workers else ""
        return f'python -m pytest -q{spread} -m "{self.marks}"'

    @property
    def argv(self) -> list[str]:
        return [sys.executable, *shlex.split(self.command)[1:]]


# In the order CI runs them: the README's test command first, the timing tests last, alone on the cores.
TIERS = (
    Tier("default", "not slow and not timing", workers=2),
    Tier("slow", "slow and not timing", workers=2),
    Tier("timing", "timing"),
)
BY_NAME = {tier.name: tier for tier in TIERS}
EXEMPT = "gpu"  # needs CUDA: a CPU machine skips it, whichever tier selects it


def slow_but(points: list, keep: list, ids=None) -> list:
    """`points` as pytest params, each marked `slow` unless it is one of `keep`; `ids` names them (a function of the
    point, as in parametrize)."""
    params = []
    for point in points:
        values = point if isinstance(point, tuple) else (point,)
        marks = () if point in keep else pytest.mark.slow
        params.append(pytest.param(*values, marks=marks, id=ids(point) if ids else None))
    return params


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in BY_NAME:
        sys.exit(f"usage: python -m tests.support.tiers {{{','.join(BY_NAME)}}} [pytest arguments]")
    command = BY_NAME[argv[0]].argv + argv[1:]
    print("+", shlex.join(["python", *command[1:]]), flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
