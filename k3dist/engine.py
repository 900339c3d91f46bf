"""Prefill, then one small decode step at a time; sampling that gives the same tokens on every rank.

Logits are gathered identically on every rank, and every rank draws from a generator seeded with
`generate.seed`, so the sampled tokens agree without another collective.
"""

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .cache import DeviceHybridCache
from .model.transformer import K3Model


@dataclass
class Generation:
    tokens: list[list[int]]
    top_logits: list[list[list[list[float]]]]  # [sequence][step][5][token_id, logit]
    prefill_seconds: float
    step_seconds: list[float] = field(default_factory=list)

    @property
    def decode_tokens_per_second(self) -> float:
        total = sum(self.step_seconds)
        return len(self.tokens) * len(self.step_seconds) / total if total else 0.0

    def step_ms(self) -> dict:
        ms = sorted(s * 1e3 for s in self.step_seconds)
        pick = lambda q: ms[min(int(q * len(ms)), len(ms) - 1)] if ms else 0.0  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9)}


class Sampler:
    """Greedy at temperature 0; otherwise temperature + top-p (nucleus) from a seeded generator."""

    def __init__(self, temperature: float, top_p: float, seed: int, device: torch.device):
        self.temperature, self.top_p = temperature, top_p
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: Tensor) -> Tensor:
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.top_p  # keep the smallest prefix reaching top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(
    model: K3Model,
    cache: DeviceHybridCache,
    prompts: Tensor,
    max_new_tokens: int,
    sampler: Sampler,
    eos: int | None = None,
) -> Generation:
    """prompts: [B, T] on the device. Each sequence stops at EOS or after `max_new_tokens` tokens."""
    device = prompts.device
    _sync(device)
    start = time.perf_counter()
    logits = model.forward(prompts, cache)
    _sync(device)
    out = Generation([[] for _ in prompts], [[] for _ in prompts], time.perf_counter() - start)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        token = sampler(logits)
        top = torch.topk(logits.float(), min(5, logits.shape[-1]), dim=-1)
        finished = done.tolist()
        for b, (ids, vals, t) in enumerate(zip(top.indices.tolist(), top.values.tolist(), token.tolist(), strict=True)):
            if not finished[b]:
                out.tokens[b].append(t)
                out.top_logits[b].append([[i, v] for i, v in zip(ids, vals, strict=True)])
        if eos is not None:
            done |= token == eos
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        t0 = time.perf_counter()
        logits = model.forward(token[:, None], cache)
        _sync(device)
        out.step_seconds.append(time.perf_counter() - t0)
    return out
