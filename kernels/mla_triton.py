"""Absorbed MLA decode as a Triton flash-decoding kernel; `mla.mla_decode` is its oracle (same signature).

The latent cache is shared by all heads (MQA-like), so a program owns one sequence and all its heads: each latent
row is read once per step, not once per head. Grid (B, S): program (b, s) takes the s-th of S equal slices of the
first lengths[b] rows, lengths read from device memory, so the grid never depends on them (CUDA-graph friendly),
and rows at or past lengths[b] are never loaded. Inside a slice, blocks of BL rows run an online softmax in fp32.
With S > 1 each program writes its running max, sum and unnormalised context, and a second small kernel merges the
slices. S is fixed by the batch and the cache capacity (a captured graph's grid cannot follow the lengths): one wave
of programs over the GPU's SMs (a program holds q and an fp32 [H, r] context in the registers of 8 warps beside two
stages of row tiles, so about one fits on an SM at a time: a second wave only queues). Each program then takes its
share of the *live* rows: a sequence uses only as many slices as its length fills at MIN_SLICE_BLOCKS blocks or more
(`live_splits`, the same formula in both kernels), the other programs return at once and the merge reads only the
live slices' partials, so a cache filled to a fraction of its capacity pays for that fraction. The merge runs one
program per (sequence, head, block of r) and reads BS slices at a time.

Roundings follow the reference where it is cheap: scores are rounded to q's dtype after the dot and again after the
scale (torch's `(q @ c^T) * scale` in bf16); probabilities enter the p @ c dot in q's dtype, unnormalised (the
reference rounds the normalised ones), so bf16 results differ from it by about an ulp of the probabilities.
"""

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_cast import round_to


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """a @ b with fp32 accumulation; F32: exact fp32 products (fp32 inputs, or the CPU interpreter, whose dot
    would multiply bf16 bit patterns as integers; bf16 and fp16 products are exact in fp32, so nothing changes)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _slices(length, n_split, BL: tl.constexpr, MIN_BLOCKS: tl.constexpr):
    """(live slices, blocks per slice) of a sequence of `length` rows on a grid of n_split slices: at most n_split
    slices of at least MIN_BLOCKS blocks, every live slice with rows (`live_splits` in Python)."""
    blocks = tl.cdiv(length, BL)
    per = tl.cdiv(blocks, tl.maximum(tl.minimum(n_split, tl.cdiv(blocks, MIN_BLOCKS)), 1))
    return tl.maximum(tl.cdiv(blocks, tl.maximum(per, 1)), 1), per


@triton.jit
def _mla_decode_kernel(
    qn_ptr,
    qp_ptr,
    lat_ptr,
    len_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    s_qn_b,
    s_qn_h,
    s_qn_r,
    s_qp_b,
    s_qp_h,
    s_qp_r,
    s_lat_b,
    s_lat_l,
    s_lat_r,
    s_out_b,
    s_out_h,
    H,
    L,
    scale,
    R: tl.constexpr,
    DR: tl.constexpr,
    BH: tl.constexpr,
    BR: tl.constexpr,
    BDR: tl.constexpr,
    BL: tl.constexpr,
    SPLIT: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Program (b, s): rows [lo, hi) of sequence b's slice s. Partials are [B, S, H] (m, l) and [B, S, H, R]."""
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    n_split = tl.num_programs(1)
    length = tl.minimum(tl.load(len_ptr + b).to(tl.int32), L)
    live, per = _slices(length, n_split, BL, MIN_BLOCKS)
    if sp >= live:  # no rows for this slice at this length: the merge never reads it
        return
    lo = sp * per * BL
    hi = tl.minimum(lo + per * BL, length)

    offs_h = tl.arange(0, BH)
    offs_r = tl.arange(0, BR)
    mh = offs_h < H
    mr = offs_r < R
    dtype: tl.constexpr = qn_ptr.dtype.element_ty
    qn = tl.load(
        qn_ptr + b * s_qn_b + offs_h[:, None] * s_qn_h + offs_r[None, :] * s_qn_r, mask=mh[:, None] & mr, other=0.0
    )
    if DR > 0:
        offs_dr = tl.arange(0, BDR)
        mdr = offs_dr < DR
        p_qp = qp_ptr + b * s_qp_b + offs_h[:, None] * s_qp_h + offs_dr[None, :] * s_qp_r
        qp = tl.load(p_qp, mask=mh[:, None] & mdr, other=0.0)

    m = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BR], dtype=tl.float32)
    lat_b = lat_ptr + b * s_lat_b
    for start in range(lo, hi, BL):
        rows = start + tl.arange(0, BL)
        mrow = rows < hi
        c = tl.load(lat_b + rows[:, None] * s_lat_l + offs_r[None, :] * s_lat_r, mask=mrow[:, None] & mr, other=0.0)
        s = _dot(qn, tl.trans(c), DOT_F32)  # [BH, BL] fp32
        if DR > 0:
            kp = tl.load(
                lat_b + rows[:, None] * s_lat_l + (R + offs_dr[None, :]) * s_lat_r, mask=mrow[:, None] & mdr, other=0.0
            )
            s += _dot(qp, tl.trans(kp), DOT_F32)
        s = round_to(round_to(s, dtype).to(tl.float32) * scale, dtype).to(tl.float32)
        s = tl.where(mrow[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every block has a row below hi
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(round_to(p, dtype), c, DOT_F32)
        m = m_new

    if SPLIT:
        part = (b * n_split + sp) * H + offs_h  # [BH] index into [B, S, H]
        tl.store(m_ptr + part, m, mask=mh)
        tl.store(l_ptr + part, l_sum, mask=mh)
        tl.store(acc_ptr + part[:, None] * R + offs_r[None, :], acc, mask=mh[:, None] & mr)
    else:
        out = acc / l_sum[:, None]
        p_out = out_ptr + b * s_out_b + offs_h[:, None] * s_out_h + offs_r[None, :]
        tl.store(p_out, round_to(out, out_ptr.dtype.element_ty), mask=mh[:, None] & mr)


@triton.jit
def _mla_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    len_ptr,
    out_ptr,
    s_out_b,
    s_out_h,
    H,
    S,
    L,
    R: tl.constexpr,
    BL: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    BS: tl.constexpr,
    BRC: tl.constexpr,
):
    """Program (b, h, c): merges the live slices' (max, sum, context) into columns [c BRC, (c + 1) BRC) of the
    normalised context, fp32, BS slices at a time."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_r = tl.program_id(2) * BRC + tl.arange(0, BRC)
    mr = offs_r < R
    live, _ = _slices(tl.minimum(tl.load(len_ptr + b).to(tl.int32), L), S, BL, MIN_BLOCKS)
    first = b * S * H + h  # index of (b, slice 0, h) in [B, S, H]
    m_max = tl.full([BS], float("-inf"), dtype=tl.float32)
    for s0 in range(0, live, BS):
        offs_s = s0 + tl.arange(0, BS)
        m_max = tl.maximum(m_max, tl.load(m_ptr + first + offs_s * H, mask=offs_s < live, other=float("-inf")))
    m_all = tl.max(m_max, axis=0)
    denom = tl.zeros([BS], dtype=tl.float32)
    acc = tl.zeros([BRC], dtype=tl.float32)
    for s0 in range(0, live, BS):
        offs_s = s0 + tl.arange(0, BS)
        ms = offs_s < live
        part = first + offs_s * H  # [BS]
        w = tl.exp(tl.load(m_ptr + part, mask=ms, other=float("-inf")) - m_all)  # empty slices (m = -inf) weigh 0
        denom += tl.load(l_ptr + part, mask=ms, other=0.0) * w
        a = tl.load(acc_ptr + part[:, None] * R + offs_r[None, :], mask=ms[:, None] & mr[None, :], other=0.0)
        acc += tl.sum(a * w[:, None], axis=0)
    out = acc / tl.sum(denom, axis=0)
    tl.store(out_ptr + b * s_out_b + h * s_out_h + offs_r, round_to(out, out_ptr.dtype.element_ty), mask=mr)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def block_rows(r: int, itemsize: int) -> int:
    """Latent rows per block. Tiles are sized to stay in registers on sm_90 (no spills): [BL, r] latent rows, [BH, r]
    queries and context; r > 256 (e.g. 512) takes shorter row blocks; fp32 tiles are twice the bytes, so their
    blocks are half as tall."""
    return (32 if max(16, triton.next_power_of_2(r)) > 256 else 64) // (2 if itemsize == 4 else 1)


MIN_SLICE_BLOCKS = 2  # the fewest row blocks a slice takes: below that its partials cost as much as its rows


def split_count(batch: int, cap: int, block_l: int, sms: int) -> int:
    """Slices per sequence (the grid's second axis, fixed for a captured graph): one wave of programs over `sms` SMs,
    at most one slice per MIN_SLICE_BLOCKS blocks of the capacity."""
    return max(1, min(triton.cdiv(sms, batch), triton.cdiv(cap, MIN_SLICE_BLOCKS * block_l)))


def live_splits(length: int, splits: int, block_l: int) -> int:
    """The slices with rows for a sequence of `length` rows on a grid of `splits` (the kernels' `_slices`)."""
    blocks = triton.cdiv(length, block_l)
    per = triton.cdiv(blocks, max(1, min(splits, triton.cdiv(blocks, MIN_SLICE_BLOCKS))))
    return max(1, triton.cdiv(blocks, max(per, 1)))


def _num_splits(B: int, L: int, block_l: int, device: torch.device) -> int:
    """split_count on this CUDA device; 1 elsewhere (the interpreter gains nothing from slices)."""
    if device.type != "cuda":
        return 1
    return split_count(
        B, L, block_l, _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    )


def mla_decode(q_nope_absorbed: Tensor, q_pe: Tensor, latent: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """One query token per sequence against the first `lengths[b]` rows of sequence b's latent cache.

    q_nope_absorbed: [B, H, r]; q_pe: [B, H, dr]; latent: [B, L, r + dr] (any strides, e.g. a view of a larger
    cache); lengths: [B] int device tensor, read by the kernel; rows >= lengths[b] are never loaded. Returns
    [B, H, r] in q's dtype, like `mla.mla_decode`.
    """
    return _mla_decode(q_nope_absorbed, q_pe, latent, lengths, scale)


def _mla_decode(
    q_nope_absorbed: Tensor,
    q_pe: Tensor,
    latent: Tensor,
    lengths: Tensor,
    scale: float,
    block_l: int | None = None,
    num_splits: int | None = None,
    partials_fill: float | None = None,
) -> Tensor:
    """The launcher, with the row-block height and the number of slices exposed for tests (and `partials_fill`: a
    value the slices' partials start as, so a test sees a merge read a slice no program wrote)."""
    B, H, R = q_nope_absorbed.shape
    DR = q_pe.shape[-1]
    L = latent.shape[1]
    if q_pe.shape[:2] != (B, H) or latent.shape != (B, L, R + DR) or lengths.shape != (B,):
        raise ValueError(
            f"q_nope_absorbed {tuple(q_nope_absorbed.shape)}, q_pe {tuple(q_pe.shape)}, latent "
            f"{tuple(latent.shape)}, lengths {tuple(lengths.shape)}: want [B, H, r], [B, H, dr], [B, L, r+dr], [B]"
        )
    if not (q_nope_absorbed.dtype == q_pe.dtype == latent.dtype):
        raise ValueError(f"dtypes differ: {q_nope_absorbed.dtype}, {q_pe.dtype}, {latent.dtype}")
    BR = max(16, triton.next_power_of_2(R))
    BH = max(16, triton.next_power_of_2(H))
    elt = latent.element_size()
    BL = block_l or block_rows(R, elt)
    num_warps = 8 if BH * BR * elt >= 16384 else 4
    S = num_splits or _num_splits(B, L, BL, latent.device)
    out = torch.empty(B, H, R, dtype=q_nope_absorbed.dtype, device=q_nope_absorbed.device)
    f32 = dict(dtype=torch.float32, device=out.device)
    m, l_sum, acc = (
        (torch.empty(B, S, H, **f32), torch.empty(B, S, H, **f32), torch.empty(B, S, H, R, **f32))
        if S > 1
        else (out, out, out)  # unused
    )
    if S > 1 and partials_fill is not None:
        for t in (m, l_sum, acc):
            t.fill_(partials_fill)
    _mla_decode_kernel[(B, S)](
        q_nope_absorbed,
        q_pe,
        latent,
        lengths,
        out,
        m,
        l_sum,
        acc,
        *q_nope_absorbed.stride(),
        *q_pe.stride(),
        *latent.stride(),
        out.stride(0),
        out.stride(1),
        H,
        L,
        scale,
        R=R,
        DR=DR,
        BH=BH,
        BR=BR,
        BDR=max(16, triton.next_power_of_2(DR)),
        BL=BL,
        SPLIT=S > 1,
        MIN_BLOCKS=MIN_SLICE_BLOCKS,
        DOT_F32=latent.dtype == torch.float32 or latent.device.type == "cpu",
        num_warps=num_warps,
        num_stages=2,
    )
    if S > 1:
        BRC = min(BR, 128)
        _mla_combine_kernel[(B, H, triton.cdiv(R, BRC))](
            m,
            l_sum,
            acc,
            lengths,
            out,
            out.stride(0),
            out.stride(1),
            H,
            S,
            L,
            R=R,
            BL=BL,
            MIN_BLOCKS=MIN_SLICE_BLOCKS,
            BS=min(triton.next_power_of_2(S), 8192 // BRC),
            BRC=BRC,
        )
    return out
