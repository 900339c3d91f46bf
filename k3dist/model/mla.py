"""MLA token mixer, NoPE (docs/model.md): caches the normalised latent plus the shared key slice, per slot.

One fused projection gives q and the latent input. Prefill expands the latent through kv_b_proj and runs causal
attention; decode writes each slot's row at its own position and attends in the absorbed form (q folded through
kv_b_proj's key rows, the latent context through its value rows), so the cache is never expanded. On the CPU a short
piece after a past (a chat turn's rest) attends in the absorbed form too.

Kimi K3's MLA adds two parts, both from its config: a low-rank query (q_a_proj, an RMSNorm, then q_b_proj by head)
where Kimi-Linear has one q_proj, and an output gate, sigmoid(g_proj x) on the same normed input, multiplying the
heads' outputs before o_proj. Its two low-rank norms take the config's rms_norm_eps, as llama.cpp's port (the
reference) does, where Kimi-Linear's kv_a_layernorm takes KimiRMSNorm's default 1e-6.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.mla import attend_blocks, mla_prefill
from ..kinds.mla import KEY_BLOCK  # CPU prefill expands the cached latent this many positions at a time
from .layers import Binding, rmsnorm

LATENT_EPS = 1e-6  # kv_a_layernorm: KimiRMSNorm's default eps (transformers), not rms_norm_eps (K3 takes that)
ABSORBED_ROWS = 48  # a piece of at most this many tokens after a past attends as decode does (MLA._absorbed)


class MLA:
    def __init__(self, b: Binding, prefix: str, latent: Tensor):
        w, lin, cfg = b.weight, b.linear, b.cfg
        # [H * (dn + dr) + r + dr, D]: q, then the latent's input; K3: [r + dr + q_lora_rank + H * dv, D]: the
        # latent's input, the q-LoRA down projection, the output gate
        self.q_kv_a = lin(prefix + "q_kv_a_proj.weight")
        self.q_lora = cfg.q_lora_rank > 0  # K3: q from q_b(norm(q_a x)), and an output gate
        if self.q_lora:
            self.q_b, self.q_norm = lin(prefix + "q_b_proj.weight"), w(prefix + "q_a_layernorm.weight")
        self.kv_norm = w(prefix + "kv_a_layernorm.weight")
        self.lora_eps = cfg.rms_norm_eps if self.q_lora else LATENT_EPS  # K3: llama.cpp's port, the reference
        self.wkvb = w(prefix + "kv_b_proj.weight")  # [H * (dn + dv), r]
        self.o_proj = lin(prefix + "o_proj.weight")
        self.dn, self.dr, self.dv, self.r = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.heads = self.wkvb.shape[0] // (self.dn + self.dv)  # kv_b stays plain: decode uses its per-head views
        per_head = self.wkvb.view(self.heads, self.dn + self.dv, self.r)
        self.w_kb, self.w_vb = per_head[:, : self.dn], per_head[:, self.dn :]  # views: no derived bytes
        row, q_rows = self.r + self.dr, self.heads * (self.dn + self.dr)  # a cache row's input, Kimi-Linear's q
        self.split = (row, cfg.q_lora_rank, self.heads * self.dv) if self.q_lora else (q_rows, row)
        self.scale = (self.dn + self.dr) ** -0.5
        self.comm, self.kernels = b.comm, b.kernels
        self.latent = latent  # [B, cap, r + dr]

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """x: [..., D] -> q [..., H, dn + dr], the cache row [..., r + dr] (normed latent, raw k_pe) and K3's output
        gate before its sigmoid [..., H * dv] (None without one)."""
        parts = self.q_kv_a(x).split(self.split, dim=-1)
        gate = None
        if self.q_lora:
            ckv, q_a, gate = parts
            q = self.q_b(self.kernels.rmsnorm(q_a, self.q_norm, self.lora_eps))
        else:
            q, ckv = parts
        row = torch.cat([rmsnorm(ckv[..., : self.r], self.kv_norm, self.lora_eps), ckv[..., self.r :]], dim=-1)
        return q.unflatten(-1, (self.heads, -1)), row, gate

    def _out(self, o: Tensor, gate: Tensor | None) -> Tensor:
        """The heads' outputs [..., H * dv] through o_proj (K3: times the output gate first), summed over ranks."""
        if gate is not None:
            o = (o.float() * gate.float().sigmoid()).to(o.dtype)
        return self.comm.all_reduce(self.o_proj(o).float())

    def decode(self, x: Tensor, positions: Tensor, rows: int | None = None) -> Tensor:
        """x: [n, D] normed, for the first n slots; positions: [n] where each slot's token goes (a device tensor).
        Returns [n, D] fp32.

        `rows` (eager steps only) bounds the cache rows attended to, when the host knows no slot is past it."""
        B = x.shape[0]
        q, row, gate = self._project(x)
        self.latent.index_put_((torch.arange(B, device=x.device), positions), row.to(self.latent.dtype))
        latent = self.latent[:B] if rows is None else self.latent[:B, :rows]
        if self.kernels.mla_absorbed is not None:  # the CPU ops: the rest as one op
            o = self.kernels.mla_absorbed(q.contiguous(), latent, positions + 1, self.w_kb, self.w_vb, self.scale)
            return self._out(o, gate)
        q_abs = torch.bmm(q[..., : self.dn].transpose(0, 1), self.w_kb).transpose(0, 1)  # per head: q_nope W_kb
        ctx = self.kernels.mla_decode(q_abs, q[..., self.dn :], latent, positions + 1, self.scale)
        o = torch.bmm(ctx.transpose(0, 1), self.w_vb.transpose(1, 2)).transpose(0, 1).reshape(B, -1)
        return self._out(o, gate)

    def _keys(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Cached rows [n, S, r + dr] expanded through kv_b_proj: keys [n, S, H, dn + dr], values [n, S, H, dv]."""
        n, S, _ = rows.shape
        kv = F.linear(rows[..., : self.r], self.wkvb).view(n, S, self.heads, self.dn + self.dv)
        k_pe = rows[..., None, self.r :].expand(n, S, self.heads, self.dr)
        return torch.cat([kv[..., : self.dn], k_pe], dim=-1), kv[..., self.dn :]

    def prefill(self, x: Tensor, slots: Tensor, start: int) -> Tensor:
        """x: [n, T, D] normed, continuing slots `slots` [n] at position `start`. Returns [n, T, D] fp32.

        On the CPU the past is expanded KEY_BLOCK positions at a time and merged by log-sum-exp, so memory and GEMM
        shapes do not grow with the prompt; on CUDA one fused attention reads every expanded key. A short piece after
        a past (a chat turn's rest after its restored history) skips the expansion where the CPU ops are built.
        """
        n, T, _ = x.shape
        q, row, gate = self._project(x)
        at = torch.arange(start, start + T, device=x.device)
        self.latent[slots[:, None], at[None, :]] = row.to(self.latent.dtype)
        if start and T <= ABSORBED_ROWS and self.kernels.mla_absorbed is not None:
            o = self._absorbed(q, slots, start, T)
        elif x.device.type == "cpu" and start:
            o = attend_blocks(q.transpose(1, 2), self._blocks(slots, start, T), self.scale).transpose(1, 2)
        else:
            k, v = self._keys(self.latent[slots, : start + T])
            o = mla_prefill(q, k, v, self.scale, past=start)
        return self._out(o.reshape(n, T, -1), gate)

    def _absorbed(self, q: Tensor, slots: Tensor, start: int, T: int) -> Tensor:
        """q [n, T, H, dn + dr] -> [n, T, H * dv]: each of the piece's T tokens as one decode query (the CPU op) over
        its slot's rows up to its own. Expanding every past row through kv_b costs the same for 1 token as for 500,
        while this costs per token, so it pays for pieces up to ABSORBED_ROWS (about where the two cross on a Xeon
        with AMX, after 4k and after 32k rows: docs/decode.md). The rows are read in place: one slot's, repeated T
        times by a stride of 0."""
        lengths = torch.arange(start + 1, start + T + 1, device=q.device)
        rows = self.latent[:, : start + T]
        attend = self.kernels.mla_absorbed
        return torch.stack(
            [
                attend(q[i].contiguous(), rows[slot].expand(T, -1, -1), lengths, self.w_kb, self.w_vb, self.scale)
                for i, slot in enumerate(slots.tolist())
            ]
        )

    def _blocks(self, slots: Tensor, start: int, T: int):
        """(keys, values, causal) head-major, block by block: the past in KEY_BLOCK pieces, then the chunk itself."""
        for a in [*range(0, start, KEY_BLOCK), start]:
            b = min(a + KEY_BLOCK, start) if a < start else start + T
            k, v = self._keys(self.latent[slots, a:b])
            yield k.transpose(1, 2), v.transpose(1, 2), a == start
