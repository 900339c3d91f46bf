"""MLA (NoPE) attention: absorbed decode over the latent cache, and plain causal attention for prefill.

Decode never expands the cache: q_nope is pre-multiplied by W_kb (q_abs_h = W_kb[h]^T q_nope_h), scores are taken
against the cached latent rows [c_t, k_pe_t] directly, and the caller applies W_vb to the returned latent context.
Softmax runs in fp32 and is cast back to the input dtype, like transformers' eager attention.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right


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

    q: [B, T, H, dqk]; k: [B, past + T, H, dqk]; v: [B, past + T, H, dv]. Returns [B, T, H, dv] in q's dtype.
    Memory stays O(T) in the number of keys: no [T, past + T] score matrix is ever formed (see _flash_cpu).
    """
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, *, d]
    if past == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    elif q.device.type == "cpu":
        out = _flash_cpu(q, k, v, scale, past)
    else:  # CUDA's fused kernels take a lower-right causal bias without materialising it
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)
    return out.transpose(1, 2).contiguous()


def _flash_cpu(q: Tensor, k: Tensor, v: Tensor, scale: float, past: int) -> Tensor:
    """A chunk after `past` tokens on the CPU: torch's CPU SDPA forms the whole score matrix whenever a mask is
    given, so attend to the past keys (all visible, no mask) and to the chunk's own keys (causal) separately with the
    flash kernel, and merge the two by their log-sum-exps. v is zero-padded to q's head size (the kernel needs one)."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, lse1 = flash(q, k[:, :, :past], v[:, :, :past], 0.0, False, scale=scale)[:2]
    o2, lse2 = flash(q, k[:, :, past:], v[:, :, past:], 0.0, True, scale=scale)[:2]
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp().unsqueeze(-1), (lse2 - top).exp().unsqueeze(-1)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2))[..., :dv].to(q.dtype)
