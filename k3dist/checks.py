"""A config key is declared once, as a settings field (`key`): its default, its check and its meaning.

A check is a value that reads one config value into what the field holds (`512MiB` -> 536870912) or raises
ValueError saying why not (`must be ...`); it gets the whole job too, for the few checks that look at another key.
`read_group` applies each field's check to its config group and names `group.key` and the value in a refusal.
"""

import math
from dataclasses import dataclass, field, fields

from .base.errors import K3Error
from .base.units import byte_size


def key(default, check, help: str):
    """A settings field: its default (what its conf/ yaml line says, as the field holds it), the check that reads a
    config value into it, and its meaning (README's configuration table has it word for word)."""
    return field(default=default, metadata={"check": check, "help": help})


def read_group(cls, job: dict, group: str):
    """The settings dataclass `cls` from the config group `group` of `job`: every field's check applied to its
    value (a key the group lacks takes the field's default). A refusal is one `error:` line naming the key."""
    values, read = job.get(group) or {}, {}
    for f in fields(cls):
        if f.name not in values:
            read[f.name] = f.default
            continue
        try:
            read[f.name] = f.metadata["check"](values[f.name], job)
        except ValueError as why:
            raise K3Error(f"{group}.{f.name}={values[f.name]!r} {why}") from None
    return cls(**read)


@dataclass(frozen=True)
class Int:
    low: int = 0

    def __call__(self, value, job=None) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < self.low:
            raise ValueError(f"must be an integer >= {self.low}")
        return value


@dataclass(frozen=True)
class Number:
    """A finite number in [low, high] ((low, high] with open_low): NaN and infinity are refused too."""

    low: float = 0.0
    high: float | None = None
    open_low: bool = False

    def __call__(self, value, job=None) -> float:
        low, high = self.low, self.high
        bad = not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
        if bad or value < low or (self.open_low and value == low) or (high is not None and value > high):
            bounds = f"{'(' if self.open_low else '['}{low}, {high if high is not None else 'inf)'}"
            raise ValueError(f"must be a finite number in {bounds}{']' if high is not None else ''}")
        return float(value)


class Choice:
    def __init__(self, *choices: str):
        self.choices = choices

    def __call__(self, value, job=None) -> str:
        if isinstance(value, bool) and "on" in self.choices:  # YAML reads a bare on/off as a boolean
            value = "on" if value else "off"
        if value not in self.choices:
            raise ValueError(f"must be one of {list(self.choices)}")
        return value


@dataclass(frozen=True)
class Flag:
    def __call__(self, value, job=None) -> bool:
        if not isinstance(value, bool):
            raise ValueError("must be true or false")
        return value


@dataclass(frozen=True)
class Text:
    """A string or null; `cast`: any value, as its text (a path Hydra read as a number)."""

    cast: bool = False

    def __call__(self, value, job=None) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if self.cast:
            return str(value)
        raise ValueError("must be a string")


@dataclass(frozen=True)
class Size:
    """Bytes: an int or e.g. 512MiB, 2GiB, 1GB; null is `null`."""

    null: int | None = None

    def __call__(self, value, job=None) -> int | None:
        return self.null if value is None else byte_size(value)


@dataclass(frozen=True)
class OrNull:
    """`check`'s value, or null."""

    check: object

    def __call__(self, value, job=None):
        return None if value is None else self.check(value, job)
