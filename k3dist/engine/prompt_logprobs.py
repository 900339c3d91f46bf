"""Log-probabilities of a prompt's own tokens (echo with logprobs, prompt_logprobs): scored during its prefill.

The prefill of a request that asks keeps each chunk's final hidden states and turns them into logits SCORE_ROWS
positions at a time; from each block every rank takes its shard's top-k and log-sum-exp, gathered across the
vocabulary shards as the decode step gathers them (model/tp.py), plus the logit of the prompt's next token, which
lives on one shard (the others add 0, so the sum is that logit exactly). Only requests that ask pay for it, and its
memory is one block's logits whatever the prompt's length (memory/runtime.py's `scoring`).

A token's log-probability and its entry among the top ones are the same float: both are a float32 logit of the same
tensor minus the same log-sum-exp, so an evaluator that checks greediness by equality (lm-eval) sees it exactly.
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor

SCORE_ROWS = 64  # positions turned into logits at once: the scoring's memory is this many rows of logits


@dataclass
class PromptScores:
    """One prompt's scored positions, chunk by chunk: position p scores token p + 1 (device tensors until `host`)."""

    k: int
    parts: list = field(default_factory=list)  # (values [n, k], ids [n, k], lse [n], chosen [n]) per chunk

    def entries(self) -> list:
        """Per prompt token: None for the first (nothing precedes it), then (logprob, [(id, logprob) x k])."""
        out: list = [None]
        for values, ids, lse, chosen in self.parts:
            values, ids, lse, chosen = values.tolist(), ids.tolist(), lse.tolist(), chosen.tolist()
            for v, i, z, c in zip(values, ids, lse, chosen, strict=True):
                out.append((c - z, [(t, x - z) for t, x in zip(i[: self.k], v[: self.k], strict=True)]))
        return out


def score(model, h: Tensor, next_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """h [n, D]: final hidden states of n consecutive positions of one sequence; next_ids [n]: the token that follows
    each. Returns the k best logits and their ids [n, max(k, 1)], the log-sum-exp [n] and the next token's logit [n]
    over the whole vocabulary, fp32 (a collective on every rank: all ranks call it with the same shapes)."""
    comm, width = model.comm, max(k, 1)
    parts = []
    for at in range(0, h.shape[0], SCORE_ROWS):
        local = model.logits(h[at : at + SCORE_ROWS])  # [rows, V_local]
        values, ids, lse = comm.gather_topk(local, width, model.kernels.topk_lse)
        mine = next_ids[at : at + SCORE_ROWS] - comm.vocab_start
        inside = (mine >= 0) & (mine < local.shape[-1])
        picked = local.gather(1, mine.clamp(0, max(local.shape[-1] - 1, 0))[:, None]).squeeze(1).float()
        chosen = comm.all_reduce(torch.where(inside, picked, torch.zeros_like(picked)))
        parts.append((values, ids, lse, chosen))
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))
