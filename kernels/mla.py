"""MLA (NoPE) attention: absorbed decode over the latent cache, and plain causal attention for prefill.

Decode never expands the cache: q_nope is pre-multiplied by W_kb (q_abs_h = W_kb[h]^T q_nope_h), scores are taken
against the cached latent rows [c_t, k_pe_t] directly, and the caller applies W_vb to the returned latent context.
Softmax runs in fp32 and is cast back to the input dtype, like transformers' eager attention.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def mla_decode(q_nope_absorbed: Tensor, q_pe: Tensor, latent: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """One query token per sequence against the first `lengths[b]` rows of sequence b's latent cache.

    q_nope_absorbed: [B, H, r]; q_pe: [B, H, dr]; latent: [B, L, r + dr]; lengths: [B] int (a device tensor, so
    the shapes never depend on it; rows >= lengths[b] are masked out, never read into the result).
    score_{h,t} = (q_abs_h . c_t + q_pe_h . k_pe_t) * scale; returns sum_t p_{h,t} c_t: [B, H, r] in q's dtype.
    """
    scores = torch.cat([q_nope_absorbed, q_pe], dim=-1) @ latent.transpose(1, 2) * scale  # [B, H, L]
    past = torch.arange(latent.shape[1], device=latent.device) >= lengths[:, None]  # [B, L]
    scores = scores.masked_fill(past[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope_absorbed.dtype)
    return p @ latent[..., : q_nope_absorbed.shape[-1]]


def mla_prefill(q: Tensor, k: Tensor, v: Tensor, scale: float, past: int = 0) -> Tensor:
    """Causal attention of T new queries over past + T keys (query i sees keys 0 .. past + i).

    q: [B, T, H, dqk]; k: [B, past + T, H, dqk]; v: [B, past + T, H, dv]. Returns [B, T, H, dv].
    """
    T, S = q.shape[1], k.shape[1]
    mask = None if past == 0 else torch.ones(T, S, dtype=torch.bool, device=q.device).tril(past)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=past == 0, scale=scale
    )
    return out.transpose(1, 2).contiguous()
