"""The residual stream between layers: Kimi-Linear's plain add, or Kimi K3's block attention residuals.

K3 keeps a bank of snapshots of the stream, one per block of `attn_res_block_size` layers, taken at each block's
first layer. Before each mixer, each MLP and the final norm, a mixing site lets the input be a softmax mixture of the
bank and the current stream: each candidate's score is its weightless RMS norm dotted with the site's vector (the
checkpoint's norm and projection weights, folded into one fp32 vector as llama.cpp's converter folds them), and the
mixture sums the raw candidates. A block's first layer restarts the stream from its mixer's output (docs/k3.md, "The
layer loop and block attention residuals").

The bank mixes across depth only: it holds the current tokens' activations, never a past token's, so decode needs no
cache for it and a prefix snapshot restores K3's state as it restores Kimi-Linear's. Everything here is fp32 and
replicated on every rank.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels.norm import res_mix

Stream = tuple[Tensor, tuple[Tensor, ...]]  # (the stream p, the bank of block snapshots), all [..., D] fp32


@dataclass(frozen=True)
class BlockResiduals:
    """What one K3 decoder layer mixes: its two sites' folded vectors, whether it starts a block (`banked`), and the
    backend's mixing site (kernels/norm.py's reference, or the CPU op)."""

    mixer_score: Tensor  # [D] fp32
    mlp_score: Tensor
    banked: bool
    eps: float
    mix: Callable = res_mix

    def layer(self, stream: Stream, mixer, mlp, norm_in: Callable, norm_post: Callable, dtype: torch.dtype) -> Stream:
        """One layer over the stream: `mixer` and `mlp` take the normed input (the layer's `norm_in` and `norm_post`)
        and return fp32 (summed over ranks)."""
        p, bank = stream
        h = self.mix(p, bank, self.mixer_score, self.eps)
        if self.banked:
            bank = (*bank, p)
        a = mixer(norm_in(h).to(dtype))
        p = a if self.banked else p + a
        h = self.mix(p, bank, self.mlp_score, self.eps)
        return p + mlp(norm_post(h)), bank


def folded(norm: Tensor, proj: Tensor) -> Tensor:
    """A site's score vector: its norm weight times its projection [1, D], in fp32 (exact for bf16 inputs)."""
    return norm.float() * proj.float().view(-1)
