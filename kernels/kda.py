"""Kimi Delta Attention (KDA): gated delta rule with per-channel decay, plain torch.

Inputs are q, k, v after the short conv + SiLU; the kernel l2-normalises q and k itself (eps `l2_eps`: 1e-6, fla's)
and scales q by d**-0.5, like fla's `use_qk_l2norm_in_kernel=True`. The recurrent state S[b, h, k, v] is key-major
and decays along the key dim before each delta write:

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

All math runs in the state's dtype (fp32 in the model); outputs are cast back to q's dtype.
"""

import torch
from torch import Tensor

L2_EPS = 1e-6  # inside q's and k's l2 norm: fla's (Kimi-Linear); K3 runs rms_norm_eps, as llama.cpp's port does


def kda_gate(g_raw: Tensor, A_log: Tensor, dt_bias: Tensor, lower: float = 0.0) -> Tensor:
    """Per-channel log decay, fp32, in one of the two forms a model chooses once (`lower`, its gate_lower_bound):

    lower == 0 (Kimi-Linear): g = -exp(A_log) * softplus(g_raw + dt_bias), unbounded below;
    lower < 0 (Kimi K3): g = lower * sigmoid(exp(A_log) * (g_raw + dt_bias)), in [lower, 0]: a channel's decay per
    token never falls below exp(lower), so no token wipes the state.

    g_raw: [..., H, d]; A_log: [H]; dt_bias: [H*d] or [H, d]. Returns [..., H, d] fp32, <= 0. Softplus is written as
    transformers writes it (log(1 + exp(z)), identity above 20), not log1p, to match its output bit for bit.
    """
    z = g_raw.float() + dt_bias.float().view(g_raw.shape[-2:])
    a = torch.exp(A_log.float()).unsqueeze(-1)
    if lower < 0:
        return lower * torch.sigmoid(a * z)
    softplus = torch.where(z > 20.0, z, torch.log(1.0 + torch.exp(z)))
    return -a * softplus


def _norm_qk(q: Tensor, k: Tensor, dtype: torch.dtype, eps: float) -> tuple[Tensor, Tensor]:
    """l2norm over the last dim with eps inside the sqrt (fla's form), then q * d**-0.5."""
    q, k = q.to(dtype), k.to(dtype)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + eps)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + eps)
    return q * q.shape[-1] ** -0.5, k


def kda_decode_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, l2_eps: float = L2_EPS
) -> Tensor:
    """One token per sequence. q, k, v, g: [B, H, d]; beta: [B, H]; state: [B, H, d, d], updated in place.

    Returns o: [B, H, d] in q's dtype, read from the updated state.
    """
    out_dtype, dtype = q.dtype, state.dtype
    q, k = _norm_qk(q, k, dtype, l2_eps)
    state.mul_(g.to(dtype).exp().unsqueeze(-1))
    u = beta.to(dtype).unsqueeze(-1) * (v.to(dtype) - torch.einsum("bhk,bhkv->bhv", k, state))
    state.add_(k.unsqueeze(-1) * u.unsqueeze(-2))
    return torch.einsum("bhk,bhkv->bhv", q, state).to(out_dtype)


CHUNK = 16  # tokens per chunk of the chunked form (the memory plan sizes its decay tensors by it)


def kda_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    chunk_size: int = CHUNK,
    l2_eps: float = L2_EPS,
) -> Tensor:
    """Chunked (WY) form of the recurrence; equals `kda_decode_step` applied token by token.

    q, k, v, g: [B, T, H, d]; beta: [B, T, H]; state: [B, H, d, d], the state before the first token (zeros for a
    fresh sequence), overwritten in place with the state after the last one. Returns o: [B, T, H, d] in q's dtype.
    Any T works: the last chunk is simply shorter. Sequences are taken one at a time: a chunk's [H, C, C, d] decay
    tensors stay cache-sized, where a whole batch's would spill to memory (4 sequences took 10x one, not 4x).
    """
    out_dtype, dtype = q.dtype, state.dtype
    q, k = _norm_qk(q, k, dtype, l2_eps)
    q, k, v, g = (x.to(dtype).transpose(1, 2) for x in (q, k, v, g))  # [B, H, T, d]
    beta = beta.to(dtype).transpose(1, 2)  # [B, H, T]
    out = torch.empty_like(v)
    for b in range(q.shape[0]):
        one = slice(b, b + 1)
        for s in range(0, q.shape[2], chunk_size):
            c = (one, slice(None), slice(s, s + chunk_size))
            out[c] = _chunk(q[c], k[c], v[c], g[c], beta[c], state[one])
    return out.transpose(1, 2).to(out_dtype).contiguous()


def _chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    """One chunk of C tokens, head-major ([B, H, C, d], beta [B, H, C]); advances `state` in place.

    With G = cumsum(g) inside the chunk and S0 the incoming state, the deltas u_t = beta_t (v_t - k_t^T D_t S_{t-1})
    solve the unit lower-triangular system (I + diag(beta) L) u = diag(beta) (v - (k * exp G) S0), where
    L[t, j] = k_t . (exp(G_t - G_j) * k_j) for j < t. Then o_t = (q_t * exp G_t)^T S0 + sum_{j<=t} q_t . (exp(G_t - G_j)
    * k_j) u_j and S_C = exp(G_C) * S0 + sum_j (exp(G_C - G_j) * k_j) u_j^T. Every exponent is <= 0: the non-causal
    entries of G_t - G_j are set to -inf before exp.
    """
    n = q.shape[2]
    G = g.cumsum(dim=2)
    noncausal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill_(noncausal.unsqueeze(-1), float("-inf")).exp_()
    kk = torch.einsum("bhtd,bhtjd,bhjd->bhtj", k, decay, k)
    qk = torch.einsum("bhtd,bhtjd,bhjd->bhtj", q, decay, k)
    # solve_triangular reads only the strict lower triangle of this (unit diagonal assumed): I + diag(beta) L.
    u = torch.linalg.solve_triangular(
        beta.unsqueeze(-1) * kk,
        beta.unsqueeze(-1) * (v - (k * G.exp()) @ state),
        upper=False,
        unitriangular=True,
    )
    out = (q * G.exp()) @ state + qk @ u
    G_last = G[:, :, -1:]  # [B, H, 1, d]
    state.mul_(G_last.exp().transpose(-1, -2)).add_((k * (G_last - G).exp()).transpose(-1, -2) @ u)
    return out
