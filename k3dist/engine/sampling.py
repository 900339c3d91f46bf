"""Choosing tokens on the device, identically on every rank, with no collective and no host sync.

Greedy is the argmax. Sampling (temperature, top-k, top-p) is an exponential race: the token with the largest
`logit / T + Gumbel noise` among those the filters keep. The noise is a counter-based hash of (the request's seed,
the index of the token in its output, the token id), so a request draws the same tokens on every rank and whatever
else shares its batch, and no generator state has to live across steps or ranks.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

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
    process: int = 0  # logits.py's NONE, MASKS or PENALTIES

    @staticmethod
    def of(temperature: float, top_p: float, top_k: int, process: int = 0) -> "SamplingMode":
        """The least mode one request needs."""
        sample = temperature > 0
        return SamplingMode(sample, sample and (top_p < 1 or top_k > 0), process)

    @staticmethod
    def covering(modes) -> "SamplingMode":
        """The least mode covering all of `modes` (greedy for none): each ability any of them needs."""
        modes = list(modes)
        sample, filtered = (any(getattr(m, f) for m in modes) for f in ("sample", "filtered"))
        return SamplingMode(sample, filtered, max((m.process for m in modes), default=0))

    def covers(self, other: "SamplingMode") -> bool:
        return self == SamplingMode.covering((self, other))


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
