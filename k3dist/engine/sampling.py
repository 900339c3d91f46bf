"""Choosing tokens on the device, identically on every rank, with no collective and no host sync; and the one value
that says how a request's tokens are chosen (`SamplingParams`), made once by its checked constructor whichever door
the request came through.

Greedy is the argmax. Sampling (temperature, top-k, top-p) is an exponential race: the token with the largest
`logit / T + Gumbel noise` among those the filters keep. The noise is a counter-based hash of (the request's seed,
the index of the token in its output, the token id), so a request draws the same tokens on every rank and whatever
else shares its batch, and no generator state has to live across steps or ranks.
"""

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

import torch
from torch import Tensor

MAX_BIAS = 320  # logit_bias entries a request holds (the HTTP door takes 300) and the tokens it bans (tool tokens)
MAX_HELD = 32  # ids min_tokens holds back: the eos ids and the request's stop_token_ids
NONE, MASKS, PENALTIES = 0, 1, 2  # what logit processing a step runs (logits.py): each level includes the one before

# Which door takes each SamplingParams field, and by which name: `http` (serve/schema.py's request bodies), `file`
# (a prompts file's line, text/prompt_file.py), `cli` (a config key, settings.py). A field no door takes is made
# from other fields of a request (`derived`). tests/unit/test_sampling_doors.py holds every door to this table.
DOORS: dict[str, dict[str, str]] = {
    "temperature": {"http": "temperature", "file": "temperature", "cli": "generate.temperature"},
    "top_p": {"http": "top_p", "file": "top_p", "cli": "generate.top_p"},
    "top_k": {"http": "top_k", "file": "top_k", "cli": "generate.top_k"},
    "seed": {"http": "seed", "file": "seed", "cli": "generate.seed"},
    "presence_penalty": {"http": "presence_penalty"},
    "frequency_penalty": {"http": "frequency_penalty"},
    "repetition_penalty": {"http": "repetition_penalty"},
    "min_tokens": {"http": "min_tokens"},
    "logit_bias": {"http": "logit_bias"},
    "held": {"derived": "the eos ids and stop_token_ids, held back while min_tokens holds"},
    "grammar": {"derived": "response_format, structured_outputs or tools: a grammar masks the tokens"},
}

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # splitmix64's constants, as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(x: Tensor, n: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(z: Tensor) -> Tensor:
    """splitmix64's finaliser: every output bit depends on every input bit."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def slot_seed(seed: int) -> int:
    """Any integer seed as the int64 a slot holds: its low 64 bits, signed, so 0..2**64-1 each keep their own draws
    (2**64-1 draws as -1) and no seed a front lets through overflows the device tensor."""
    return (seed + 2**63) % 2**64 - 2**63


def gumbel_noise(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """[B] seeds and [B] token counters -> [B, vocab] standard Gumbel noise, a pure function of its inputs."""
    key = _mix(seed * _GOLDEN + counter)
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    bits = _shr(_mix(key[:, None] + (ids + 1) * _GOLDEN), 40)  # 24 random bits
    u = (bits.float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(-torch.log(u))


@dataclass(frozen=True, order=True)
class SamplingMode:
    """What a step must be able to do: greedy only, or sampling, with or without top-k/top-p filters (those sort the
    vocabulary), and which logit processors it runs (logits.py): none, masks (a grammar's, logit_bias, min_tokens:
    one pass over the logits) or masks and penalties (output counts: several passes). The step is captured once per
    mode it may need; a window runs the least mode covering its slots, so a window whose slots use no processor pays
    nothing for them, and one with grammars but no penalties pays only for masks."""

    sample: bool
    filtered: bool
    process: int = NONE  # NONE, MASKS or PENALTIES

    @staticmethod
    def covering(modes) -> "SamplingMode":
        """The least mode covering all of `modes` (greedy for none): each ability any of them needs."""
        modes = list(modes)
        sample, filtered = any(m.sample for m in modes), any(m.filtered for m in modes)
        return SamplingMode(sample, filtered, max((m.process for m in modes), default=NONE))

    def covers(self, other: "SamplingMode") -> bool:
        return self == SamplingMode.covering((self, other))


class BadValue(ValueError):
    """A value the engine cannot take: `field` names it (a door says it by its own name: DOORS), `why` says why."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field} {why}")
        self.field, self.why = field, why

    def named(self, name: str) -> "BadValue":
        return BadValue(name, self.why)


def _number(low: float, high: float = math.inf, *, low_open: bool = False, neg_inf: bool = False):
    def check(name: str, value) -> float:
        if type(value) not in (int, float) or not (math.isfinite(value) or (neg_inf and value == -math.inf)):
            raise BadValue(name, f"must be a finite number, got {value!r:.40}")
        if value < low or (low_open and value == low) or value > high:
            span = f"{'(' if low_open else '['}{low}, {high}]"
            raise BadValue(name, f"must be in {span}, got {value!r}")
        return float(value)

    return check


def _integer(low: int | None = None):
    def check(name: str, value) -> int:
        if type(value) is not int or (low is not None and value < low):
            raise BadValue(name, f"must be an integer{'' if low is None else f' >= {low}'}, got {value!r:.40}")
        return value

    return check


def _flag(name: str, value) -> bool:
    if type(value) is not bool:
        raise BadValue(name, f"must be true or false, got {value!r:.40}")
    return value


def _ids(most: int):
    def check(name: str, value) -> tuple[int, ...]:
        if not isinstance(value, tuple | list) or len(value) > most:
            raise BadValue(name, f"must be at most {most} token ids, got {value!r:.60}")
        return tuple(_integer(0)(name, t) for t in value)

    return check


def _bias(name: str, value) -> tuple[tuple[int, float], ...]:
    """(token id, added to its logit) pairs; -inf bans the token."""
    if not isinstance(value, tuple | list) or len(value) > MAX_BIAS:
        raise BadValue(name, f"must be at most {MAX_BIAS} (token id, bias) pairs, got {value!r:.60}")
    if not all(isinstance(pair, tuple | list) and len(pair) == 2 for pair in value):
        raise BadValue(name, f"must be (token id, bias) pairs, got {value!r:.60}")
    number = _number(-math.inf, math.inf, neg_inf=True)
    return tuple((_integer(0)(name, t), number(name, v)) for t, v in value)


_CHECKS = {
    "temperature": _number(0.0),
    "top_p": _number(0.0, 1.0, low_open=True),
    "top_k": _integer(0),  # past the vocabulary it cuts nothing
    "seed": _integer(),  # any integer: a slot keeps its low 64 bits (slot_seed)
    "presence_penalty": _number(-math.inf),
    "frequency_penalty": _number(-math.inf),
    "repetition_penalty": _number(0.0, low_open=True),
    "min_tokens": _integer(0),
    "logit_bias": _bias,
    "held": _ids(MAX_HELD),
    "grammar": _flag,
}


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen, the same on every rank: sampling (temperature, top_p, top_k, seed) and
    the logit processors (logits.py: penalties, min_tokens holding back `held`, logit_bias, a grammar's mask). The
    defaults are greedy and change no logit.

    Made only through its constructor, which checks every value's type and range (a BadValue naming the field), so
    whatever door a request came through, nothing a window reads from it can fail. The door's own names for each
    field are in DOORS; one method writes a slot's tensors from it (DecodeStep.load)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # `held` cannot be chosen before this many tokens are out
    logit_bias: tuple[tuple[int, float], ...] = ()
    held: tuple[int, ...] = ()
    grammar: bool = False  # a grammar masks the tokens (rank 0 sends the mask with every window)

    def __post_init__(self):
        given = vars(self)
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(name, given[name]))

    @classmethod
    def taken(cls, door: str, given: Mapping, base: "SamplingParams | None" = None) -> "SamplingParams":
        """`base` (the defaults) with each field `given` holds by its name at `door` (DOORS); a BadValue names the
        door's name."""
        names = {field: doors[door] for field, doors in DOORS.items() if door in doors}
        try:
            return replace(base or cls(), **{f: given[n] for f, n in names.items() if n in given})
        except BadValue as exc:
            raise exc.named(names.get(exc.field, exc.field)) from None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def level(self) -> int:
        """The logit processing it needs: none, masks (one pass) or penalties (several)."""
        if self.penalized:
            return PENALTIES
        return MASKS if self.logit_bias or self.min_tokens or self.held or self.grammar else NONE

    @property
    def mode(self) -> "SamplingMode":
        """The least step mode it needs."""
        sample = self.temperature > 0
        return SamplingMode(sample, sample and (self.top_p < 1 or self.top_k > 0), self.level)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(raw: dict) -> "SamplingParams":
        return SamplingParams(**{f.name: raw[f.name] for f in fields(SamplingParams)})


GREEDY, SAMPLE, FILTERED = SamplingMode(False, False), SamplingMode(True, False), SamplingMode(True, True)
ALL_MODES = tuple(SamplingMode(m.sample, m.filtered, p) for p in (0, 1, 2) for m in (GREEDY, SAMPLE, FILTERED))


def choose_tokens(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    seed: Tensor,
    counter: Tensor,
    mode: SamplingMode,
) -> Tensor:
    """logits [B, V] (the full vocabulary); per-slot temperature, top_p [B] fp32, top_k, seed, counter [B] int64.

    Rows with temperature 0 take the argmax. Returns tokens [B] int64.
    """
    greedy = logits.argmax(-1)
    if not mode.sample:
        return greedy
    scaled = logits.float() / temperature.clamp_min(1e-6)[:, None]
    noise = gumbel_noise(seed, counter, logits.shape[-1])
    if mode.filtered:
        scaled, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        drop = (top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None])  # top-k: keep the k best
        probs = torch.softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)
        drop |= probs.cumsum(-1) - probs > top_p[:, None]  # top-p: the smallest prefix reaching top_p
        pick = (scaled.masked_fill(drop, float("-inf")) + noise.gather(1, order)).argmax(-1)
        sampled = order.gather(1, pick[:, None]).squeeze(1)
    else:
        sampled = (scaled + noise).argmax(-1)
    return torch.where(temperature > 0, sampled, greedy)
