"""MLA token mixer, NoPE (docs/kimi-linear.md section 4): caches the normalised latent plus the shared key slice.

Prefill expands the latent through kv_b_proj and runs causal attention; decode uses the absorbed form (q folded
through kv_b_proj's key rows, the latent context through its value rows), so the cache is never expanded.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.mla import mla_decode, mla_prefill
from .layers import rmsnorm

LATENT_EPS = 1e-6  # kv_a_layernorm: KimiRMSNorm default eps (HF remote code, transformers), pitfall 2


class MLA:
    def __init__(self, w: dict[str, Tensor], prefix: str, cfg, comm):
        self.wq = w[prefix + "q_proj.weight"]
        self.wkva = w[prefix + "kv_a_proj_with_mqa.weight"]
        self.kv_norm = w[prefix + "kv_a_layernorm.weight"]
        self.wkvb = w[prefix + "kv_b_proj.weight"]
        self.o_proj = w[prefix + "o_proj.weight"]
        self.dn, self.dr, self.dv, self.r = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.heads = self.wq.shape[0] // (self.dn + self.dr)
        per_head = self.wkvb.view(self.heads, self.dn + self.dv, self.r)
        self.w_kb, self.w_vb = per_head[:, : self.dn], per_head[:, self.dn :]  # views: no derived bytes
        self.scale = (self.dn + self.dr) ** -0.5
        self.comm = comm

    def __call__(self, x: Tensor, latent: Tensor, start: int) -> Tensor:
        """x: [B, T, D] normed; latent: [B, cap, r + dr] cache, rows [start, start + T) are written in place."""
        B, T, _ = x.shape
        q = F.linear(x, self.wq).view(B, T, self.heads, self.dn + self.dr)
        ckv = F.linear(x, self.wkva)
        latent[:, start : start + T, : self.r] = rmsnorm(ckv[..., : self.r], self.kv_norm, LATENT_EPS)
        latent[:, start : start + T, self.r :] = ckv[..., self.r :]
        if T == 1:
            q_abs = torch.einsum("bhn,hnr->bhr", q[:, 0, :, : self.dn], self.w_kb)
            ctx = mla_decode(q_abs, q[:, 0, :, self.dn :], latent, start + 1, self.scale)  # [B, H, r]
            o = torch.einsum("bhr,hvr->bhv", ctx, self.w_vb).reshape(B, 1, -1)
        else:
            rows = latent[:, : start + T]
            kv = F.linear(rows[..., : self.r], self.wkvb).view(B, start + T, self.heads, self.dn + self.dv)
            k_pe = rows[..., None, self.r :].expand(B, start + T, self.heads, self.dr)
            k = torch.cat([kv[..., : self.dn], k_pe], dim=-1)
            o = mla_prefill(q, k, kv[..., self.dn :], self.scale, past=start).reshape(B, T, -1)
        return self.comm.all_reduce(F.linear(o, self.o_proj).float())
