"""The fused KDA decode step as one Triton kernel; `kda_fused.kda_decode_fused` is its oracle (same signature).

Grid: one program per (sequence, head), B * H programs. A program computes its head's q and k (conv + SiLU, l2norm)
in full, then walks the value dim in blocks of BV columns: the delta rule is column-separable (column j of the state
needs only k, the decay, beta and v_j), so each [d, BV] state tile is loaded once, decayed, updated, read for the
output and stored once. The block outputs are gathered into a register vector of the whole head, so the gated
RMSNorm runs after the loop without a scratch buffer. The conv states are shifted last, behind one barrier: every
lane has read the old inputs before any is overwritten.

Roundings follow the reference: conv products summed in fp32, rounded once to the conv weight's dtype, SiLU, rounded
to the weight's then the compute dtype; everything after that runs in fp32 (state, gate, beta, norm); the output is
rounded once to the compute dtype. No host syncs in the launcher, so it can be captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .kda_fused import KDALayer
from .triton_cast import round_to


@triton.jit
def _conv_silu(x_ptr, s_x, cs_ptr, s_cs_p, s_cs_k, w_ptr, s_w_p, s_w_k, ch, mask, KW: tl.constexpr):
    """Depthwise causal conv over K taps + SiLU for channels `ch` (the conv state is only read here).

    x_ptr: this token's row of one projection (channel stride s_x); cs_ptr: its conv state [C, K-1], oldest first;
    w_ptr: its weight [C, K]. Taps are summed in order, like torch's sum over the window. Returns the activations
    as fp32 values of the compute dtype (x's), after the reference's roundings.
    """
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for i in tl.static_range(KW):
        if i < KW - 1:
            xi = tl.load(cs_ptr + ch * s_cs_p + i * s_cs_k, mask=mask, other=0.0)
        else:
            xi = tl.load(x_ptr + ch * s_x, mask=mask, other=0.0)
        wi = tl.load(w_ptr + ch * s_w_p + i * s_w_k, mask=mask, other=0.0)
        acc += xi.to(tl.float32) * wi.to(tl.float32)
    w_dtype: tl.constexpr = w_ptr.dtype.element_ty
    y = round_to(acc, w_dtype).to(tl.float32)  # products summed in fp32, rounded once to the weight's dtype
    y = round_to(y / (1.0 + tl.exp(-y)), w_dtype)  # SiLU in fp32, rounded like torch's silu on that dtype
    return round_to(y.to(tl.float32), x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _next_window(x_ptr, s_x, cs_ptr, s_cs_p, s_cs_k, ch, mask, KW: tl.constexpr, BKW: tl.constexpr):
    """[BD, BKW] tile whose column j (1 <= j <= K-1) is the new slot j-1: old slot j, or x for j = K-1."""
    col = tl.arange(0, BKW)
    old = (col >= 1) & (col < KW - 1)
    win = tl.load(cs_ptr + ch[:, None] * s_cs_p + col[None, :] * s_cs_k, mask=mask[:, None] & old, other=0.0)
    x = tl.load(x_ptr + ch * s_x, mask=mask, other=0.0).to(cs_ptr.dtype.element_ty)
    return tl.where(col[None, :] == KW - 1, x[:, None], win)


@triton.jit
def _store_window(cs_ptr, s_cs_p, s_cs_k, ch, mask, win, KW: tl.constexpr, BKW: tl.constexpr):
    """Writes _next_window's columns 1..K-1 to conv-state slots 0..K-2."""
    col = tl.arange(0, BKW)
    keep = (col >= 1) & (col < KW)
    tl.store(cs_ptr + ch[:, None] * s_cs_p + (col[None, :] - 1) * s_cs_k, win, mask=mask[:, None] & keep)


@triton.jit
def _kda_decode_kernel(
    qkv_ptr,
    cs_ptr,
    cw_ptr,
    graw_ptr,
    braw_ptr,
    gate_ptr,
    alog_ptr,
    dtb_ptr,
    onorm_ptr,
    state_ptr,
    out_ptr,
    s_qkv_b,
    s_qkv_i,
    s_qkv_p,
    s_cs_b,
    s_cs_i,
    s_cs_p,
    s_cs_k,
    s_cw_i,
    s_cw_p,
    s_cw_k,
    s_graw_b,
    s_graw_p,
    s_braw_b,
    s_braw_h,
    s_gate_b,
    s_gate_p,
    s_st_b,
    s_st_h,
    s_st_k,
    s_st_v,
    s_out_b,
    H,
    scale,
    eps,
    lower,
    l2_eps,
    D: tl.constexpr,
    KW: tl.constexpr,
    BKW: tl.constexpr,
    BD: tl.constexpr,
    BV: tl.constexpr,
):
    """One program per (sequence b, head h): pid = b * H + h. Strides are in elements."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = pid % H
    offs_k = tl.arange(0, BD)
    mk = offs_k < D
    ch_k = h * D + offs_k

    x_row = qkv_ptr + b * s_qkv_b
    cs_row = cs_ptr + b * s_cs_b
    q = _conv_silu(x_row, s_qkv_p, cs_row, s_cs_p, s_cs_k, cw_ptr, s_cw_p, s_cw_k, ch_k, mk, KW)
    k = _conv_silu(
        x_row + s_qkv_i, s_qkv_p, cs_row + s_cs_i, s_cs_p, s_cs_k, cw_ptr + s_cw_i, s_cw_p, s_cw_k, ch_k, mk, KW
    )
    # l2norm with eps inside the sqrt (a division, like the reference), then q * d**-0.5
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + l2_eps) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + l2_eps)

    # forget gate in the layer's form (kda.kda_gate), z = g_raw + dt_bias, a = exp(A_log); decay = exp(g)
    z = tl.load(graw_ptr + b * s_graw_b + ch_k * s_graw_p, mask=mk, other=0.0).to(tl.float32)
    z = z + tl.load(dtb_ptr + ch_k, mask=mk, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    if lower < 0:  # K3: g = lower * sigmoid(a z), never below lower
        g = lower * (1.0 / (1.0 + tl.exp(-(a * z))))
    else:  # Kimi-Linear: g = -a * softplus(z), softplus the identity above 20
        g = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z)))
    decay = tl.exp(g)
    beta_raw = tl.load(braw_ptr + b * s_braw_b + h * s_braw_h).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-beta_raw))

    st_head = state_ptr + b * s_st_b + h * s_st_h
    o = tl.zeros([BD], dtype=tl.float32)
    for v0 in tl.static_range(0, BD, BV):
        offs_v = v0 + tl.arange(0, BV)
        mv = offs_v < D
        v = _conv_silu(
            x_row + 2 * s_qkv_i,
            s_qkv_p,
            cs_row + 2 * s_cs_i,
            s_cs_p,
            s_cs_k,
            cw_ptr + 2 * s_cw_i,
            s_cw_p,
            s_cw_k,
            h * D + offs_v,
            mv,
            KW,
        )
        p_s = st_head + offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v
        m_s = mk[:, None] & mv[None, :]
        s = tl.load(p_s, mask=m_s, other=0.0) * decay[:, None]  # decay along the key dim
        u = beta * (v - tl.sum(k[:, None] * s, axis=0))  # [BV]
        s = s + k[:, None] * u[None, :]
        tl.store(p_s, s, mask=m_s)
        o_blk = tl.sum(q[:, None] * s, axis=0)  # [BV], read from the updated state
        # place the block's outputs at their columns of the head vector (a [BD, BV] select, no memory traffic)
        o += tl.sum(tl.where(offs_k[:, None] == offs_v[None, :], o_blk[None, :], 0.0), axis=1)

    # gated RMSNorm over the head, fp32: o * rsqrt(mean(o^2) + eps) * o_norm * sigmoid(gate)
    o = tl.where(mk, o, 0.0)
    rstd = tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)
    y = o * rstd * tl.load(onorm_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
    gt = tl.load(gate_ptr + b * s_gate_b + ch_k * s_gate_p, mask=mk, other=0.0).to(tl.float32)
    y = y * (1.0 / (1.0 + tl.exp(-gt)))
    tl.store(out_ptr + b * s_out_b + ch_k, round_to(y, out_ptr.dtype.element_ty), mask=mk)

    # shift the new inputs into the conv states. Lanes holding copies of one channel may sit in different warps, so
    # every read of the old states (the convs above, the windows here) completes before the barrier, writes after.
    wq = _next_window(x_row, s_qkv_p, cs_row, s_cs_p, s_cs_k, ch_k, mk, KW, BKW)
    wk = _next_window(x_row + s_qkv_i, s_qkv_p, cs_row + s_cs_i, s_cs_p, s_cs_k, ch_k, mk, KW, BKW)
    wv = _next_window(x_row + 2 * s_qkv_i, s_qkv_p, cs_row + 2 * s_cs_i, s_cs_p, s_cs_k, ch_k, mk, KW, BKW)
    tl.debug_barrier()
    _store_window(cs_row, s_cs_p, s_cs_k, ch_k, mk, wq, KW, BKW)
    _store_window(cs_row + s_cs_i, s_cs_p, s_cs_k, ch_k, mk, wk, KW, BKW)
    _store_window(cs_row + 2 * s_cs_i, s_cs_p, s_cs_k, ch_k, mk, wv, KW, BKW)


def _num_warps(tile: int) -> int:
    """Warps for a [d, BV] state tile: d = 128, BV = 32 compiles for sm_90 to 162 registers and no spills with 8
    warps (255 and a small spill with 4)."""
    return 8 if tile >= 4096 else 4 if tile >= 1024 else 2


def kda_decode_fused(*args, **kwargs) -> Tensor:
    """One token per sequence through KDA's recurrent core: the arguments, shapes and semantics of
    `kda_fused.kda_decode_fused` (the two states updated in place). Any strides for the per-token tensors and the
    two states. Returns [B, P] in qkv's dtype."""
    return _kda_decode_fused(*args, **kwargs)


def _kda_decode_fused(qkv, g_raw, beta_raw, gate, conv_state, state, layer: KDALayer, *, block_v=None) -> Tensor:
    """The launcher, with the value-block width exposed (tests use a narrow one to walk several blocks)."""
    conv_w, A_log, dt_bias, o_norm, eps = layer.conv_w, layer.A_log, layer.dt_bias, layer.o_norm, layer.eps
    B, three, P = qkv.shape
    H = beta_raw.shape[-1]
    d = P // H
    KW = conv_w.shape[-1]
    if three != 3 or P != H * d or KW < 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} with {H} heads and conv width {KW}: want [B, 3, H*d], K >= 2")
    if conv_state.shape != (B, KW - 1, 3, P) or conv_w.shape != (3, P, KW) or state.shape != (B, H, d, d):
        raise ValueError(
            f"conv_state {tuple(conv_state.shape)}, conv_w {tuple(conv_w.shape)}, state {tuple(state.shape)} do not "
            f"fit B={B}, P={P}, H={H}, d={d}, K={KW}"
        )
    if state.dtype != torch.float32:
        raise ValueError(f"the recurrent state must be fp32, got {state.dtype}")
    g_raw, gate = g_raw.reshape(B, P), gate.reshape(B, P)
    conv_state = conv_state.permute(0, 2, 3, 1)  # the kernel indexes [B, 3, P, K-1] by strides
    A_log, dt_bias, o_norm = (t.reshape(-1).contiguous() for t in (A_log, dt_bias, o_norm))
    BD = triton.next_power_of_2(d)
    BV = min(BD, block_v or 32)
    out = torch.empty(B, P, dtype=qkv.dtype, device=qkv.device)
    _kda_decode_kernel[(B * H,)](
        qkv,
        conv_state,
        conv_w,
        g_raw,
        beta_raw,
        gate,
        A_log,
        dt_bias,
        o_norm,
        state,
        out,
        *qkv.stride(),
        *conv_state.stride(),
        *conv_w.stride(),
        *g_raw.stride(),
        *beta_raw.stride(),
        *gate.stride(),
        *state.stride(),
        out.stride(0),
        H,
        d**-0.5,
        eps,
        layer.lower,
        layer.l2_eps,
        D=d,
        KW=KW,
        BKW=triton.next_power_of_2(KW),
        BD=BD,
        BV=BV,
        num_warps=_num_warps(BD * BV),
        enable_fp_fusion=False,  # products rounded before each add, like the reference's separate torch ops
    )
    return out
