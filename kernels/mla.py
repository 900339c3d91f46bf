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

    q: [B, T, H, dqk]; k: [B, past + T, H, dqk]; v: [B, past + T, H, dv]. Returns [B, T, H, dv] in q's dtype.
    Memory stays O(T) in the number of keys: no [T, past + T] score matrix is ever formed (see _flash_cpu).
    """
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, *, d]
    if past == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    elif q.device.type == "cpu":
        out = _flash_cpu(q, k, v, scale, past)
    else:  # CUDA's fused kernels take a lower-right causal bias without materialising it
        from torch.nn.attention.bias import causal_lower_right  # imported here: the module costs ~140 MiB of RSS

        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)
    return out.transpose(1, 2).contiguous()


def _flash_cpu(q: Tensor, k: Tensor, v: Tensor, scale: float, past: int) -> Tensor:
    """A chunk after `past` tokens on the CPU (see attend_blocks): the past keys all visible, the chunk's causal."""
    blocks = [(k[:, :, :past], v[:, :, :past], False), (k[:, :, past:], v[:, :, past:], True)]
    return attend_blocks(q, blocks, scale)


def attend_blocks(q: Tensor, blocks, scale: float) -> Tensor:
    """Attention of q [B, H, T, dqk] over key blocks given as (k [B, H, S_i, dqk], v [B, H, S_i, dv], causal),
    merged by log-sum-exp, in q's dtype.

    torch's CPU SDPA forms the whole [T, S] score matrix whenever a mask is given; its flash kernel, used here block by
    block (no mask, or causal within the chunk's own keys), never does. v is zero-padded to q's head size, which the
    kernel requires. Blocks may come from a generator, so the caller can expand one block of keys at a time.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out = lse = None
    for k, v, causal in blocks:
        dv = v.shape[-1]
        if dv < q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - dv))
        o, block_lse = flash(q, k, v, 0.0, causal, scale=scale)[:2]
        o = o[..., :dv].float()
        if out is None:
            out, lse = o, block_lse
            continue
        top = torch.maximum(lse, block_lse)
        w_old, w_new = (lse - top).exp(), (block_lse - top).exp()
        out = (out * w_old.unsqueeze(-1) + o * w_new.unsqueeze(-1)) / (w_old + w_new).unsqueeze(-1)
        lse = top + (w_old + w_new).log()
    return out.to(q.dtype)
