"""Routed experts as Triton kernels, the weights packed (MXFP4, mxfp4.PackedExperts) or dense in the compute dtype;
kernels/moe.py's paths are the oracle (same arguments, same fp32 result).

Packed weights are widened inside the kernels, a [rows, block of inputs] tile at a time: each code's doubled E2M1
value from its bits, times 2^(scale - 128) built from the scale's bits, one fp32 multiply (what weights/mxfp4.py
and ggml compute; exact in fp32 and bf16), then the tile goes to the product as a dense one would. So a packed
stack and its dequantization give the same bits through the same kernel.

- `experts_gathered` (decode, few pairs): one program per (token, choice) and block of expert rows computes the gate
  and up GEMVs and the activation; one program per (token, block of output rows) runs the token's chosen experts'
  down GEMVs and combines them in fp32, in top-k order.
- `experts_grouped` (prefill): the pairs sorted by expert, each expert's rows padded to BM (static shapes, no host
  sync: the sort, the padding and each block's expert are device tensors); tl.dot tiles for both projections, then
  a combine in top-k order.

Roundings follow the references: each projection's output and the activation round to the compute dtype, the
combine is fp32. The activation is a value (activation.py), passed as ACT and its betas.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .activation import SILU, Activation
from .moe import _group_counts, padded_rows
from .mxfp4 import PackedExperts
from .triton_cast import round_to

Experts = Tensor | PackedExperts


@triton.jit
def _weights(w_ptr, s_ptr, rows, row_mask, cols, n, s_w, s_s, PACKED: tl.constexpr):
    """The [rows, cols] tile of one expert's weight (row strides s_w and, packed, s_s) as fp32, zeros outside."""
    mask = row_mask[:, None] & (cols < n)[None, :]
    if PACKED:
        byte = tl.load(w_ptr + rows[:, None] * s_w + (cols // 2)[None, :], mask=mask, other=0)
        code = tl.where((cols % 2 == 0)[None, :], byte & 15, byte >> 4).to(tl.int32)
        m = code & 7  # E2M1 doubled: 0, 1, 2, 3, then 4, 6, 8, 12 = (2 + low bit) << (m / 2 - 1)
        mag = tl.where(m < 4, m, (2 + (m & 1)) << ((m >> 1) - 1))
        value = tl.where(code >= 8, -mag, mag).to(tl.float32)  # code 8: -0 as an integer, +0.0
        s = tl.load(s_ptr + rows[:, None] * s_s + (cols // 32)[None, :], mask=mask, other=0).to(tl.int32)
        bits = tl.where(s < 2, 0x00200000 << s, (s - 1) << 23)
        return value * bits.to(tl.float32, bitcast=True)
    else:
        return tl.load(w_ptr + rows[:, None] * s_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp (no libdevice under the interpreter): a Taylor series below |x| = 0.3 (terms past x^11
    are under 1e-9 relative there), 1 - 2 / (e^(2|x|) + 1) above."""
    a = tl.abs(x)
    x2 = x * x
    series = x2 * (-17.0 / 315 + x2 * (62.0 / 2835 - x2 * 1382.0 / 155925))
    series = x * (1.0 + x2 * (-1.0 / 3 + x2 * (2.0 / 15 + series)))
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    return tl.where(a < 0.3, series, tl.where(x < 0, -big, big))


@triton.jit
def _act(g, u, ACT: tl.constexpr, beta, inv, linear_beta, linear_inv, DT: tl.constexpr):
    """activation.py's SiLU (ACT 0) or SiTU (1) of the compute dtype's g and u, rounded to it."""
    if ACT == 0:
        s = round_to(g / (1.0 + tl.exp(-g)), DT).to(tl.float32)
        return round_to(s * u, DT)
    else:
        a = _tanh(g * inv) * beta * (1.0 / (1.0 + tl.exp(-g)))
        return round_to(a * (_tanh(u * linear_inv) * linear_beta), DT)


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """a @ b with fp32 accumulation (fp32 operands on the CPU interpreter, whose dot would multiply bf16 bit
    patterns as integers; bf16 products are exact in fp32, so nothing changes)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _gate_up_gathered(
    z_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, s_z, s_we, s_wr, s_se, s_sr, Z, I, beta, inv, lbeta, linv,
    K: tl.constexpr, PACKED: tl.constexpr, ACT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pair, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + pair)
    w_ptr, s_ptr = w_ptr + e * s_we, s_ptr + e * s_se
    rows = nb * BN + tl.arange(0, BN)
    mask = rows < I
    g = tl.zeros([BN], dtype=tl.float32)
    u = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, Z, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(z_ptr + (pair // K) * s_z + cols, mask=cols < Z, other=0.0).to(tl.float32)
        g += tl.sum(_weights(w_ptr, s_ptr, rows, mask, cols, Z, s_wr, s_sr, PACKED) * x[None, :], axis=1)
        u += tl.sum(_weights(w_ptr, s_ptr, rows + I, mask, cols, Z, s_wr, s_sr, PACKED) * x[None, :], axis=1)
    DT: tl.constexpr = act_ptr.dtype.element_ty
    a = _act(round_to(g, DT).to(tl.float32), round_to(u, DT).to(tl.float32), ACT, beta, inv, lbeta, linv, DT)
    tl.store(act_ptr + pair * I + rows, a, mask=mask)


@triton.jit
def _down_gathered(
    act_ptr, ids_ptr, wt_ptr, w_ptr, s_ptr, out_ptr, s_we, s_wr, s_se, s_sr, Z, I,
    K: tl.constexpr, PACKED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    n, nb = tl.program_id(0), tl.program_id(1)
    rows = nb * BN + tl.arange(0, BN)
    mask = rows < Z
    DT: tl.constexpr = act_ptr.dtype.element_ty
    out = tl.zeros([BN], dtype=tl.float32)
    for j in range(K):  # the token's choices in top-k order
        e = tl.load(ids_ptr + n * K + j)
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            cols = k0 + tl.arange(0, BK)
            x = tl.load(act_ptr + (n * K + j) * I + cols, mask=cols < I, other=0.0).to(tl.float32)
            w = _weights(w_ptr + e * s_we, s_ptr + e * s_se, rows, mask, cols, I, s_wr, s_sr, PACKED)
            acc += tl.sum(w * x[None, :], axis=1)
        out += round_to(acc, DT).to(tl.float32) * tl.load(wt_ptr + n * K + j)
    tl.store(out_ptr + n * Z + rows, out, mask=mask)


@triton.jit
def _gate_up_grouped(
    z_ptr, pairs_ptr, experts_ptr, w_ptr, s_ptr, act_ptr, s_z, s_we, s_wr, s_se, s_sr, Z, I, E,
    beta, inv, lbeta, linv,
    K: tl.constexpr, PACKED: tl.constexpr, ACT: tl.constexpr, F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    b, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(experts_ptr + b)
    if e < E:  # blocks past the last expert's padded group do nothing
        slots = b * BM + tl.arange(0, BM)
        pair = tl.load(pairs_ptr + slots)
        live = pair >= 0
        w_ptr, s_ptr = w_ptr + e * s_we, s_ptr + e * s_se
        rows = nb * BN + tl.arange(0, BN)
        mask = rows < I
        DT: tl.constexpr = act_ptr.dtype.element_ty
        g = tl.zeros([BM, BN], dtype=tl.float32)
        u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, Z, BK):
            cols = k0 + tl.arange(0, BK)
            x_mask = live[:, None] & (cols < Z)[None, :]
            x = tl.load(z_ptr + (pair // K)[:, None] * s_z + cols[None, :], mask=x_mask, other=0.0)
            wg = _weights(w_ptr, s_ptr, rows, mask, cols, Z, s_wr, s_sr, PACKED).to(DT)
            wu = _weights(w_ptr, s_ptr, rows + I, mask, cols, Z, s_wr, s_sr, PACKED).to(DT)
            g += _dot(x, tl.trans(wg), F32)
            u += _dot(x, tl.trans(wu), F32)
        a = _act(round_to(g, DT).to(tl.float32), round_to(u, DT).to(tl.float32), ACT, beta, inv, lbeta, linv, DT)
        tl.store(act_ptr + slots[:, None] * I + rows[None, :], a, mask=live[:, None] & mask[None, :])


@triton.jit
def _down_grouped(
    act_ptr, pairs_ptr, experts_ptr, w_ptr, s_ptr, y_ptr, s_we, s_wr, s_se, s_sr, Z, I, E,
    PACKED: tl.constexpr, F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    b, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(experts_ptr + b)
    if e < E:
        slots = b * BM + tl.arange(0, BM)
        pair = tl.load(pairs_ptr + slots)
        live = pair >= 0
        rows = nb * BN + tl.arange(0, BN)
        mask = rows < Z
        DT: tl.constexpr = act_ptr.dtype.element_ty
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            cols = k0 + tl.arange(0, BK)
            x = tl.load(act_ptr + slots[:, None] * I + cols[None, :], mask=live[:, None] & (cols < I)[None, :])
            w = _weights(w_ptr + e * s_we, s_ptr + e * s_se, rows, mask, cols, I, s_wr, s_sr, PACKED).to(DT)
            acc += _dot(x, tl.trans(w), F32)
        y = round_to(acc, DT).to(tl.float32)
        tl.store(y_ptr + pair[:, None] * Z + rows[None, :], y, mask=live[:, None] & mask[None, :])


@triton.jit
def _combine(y_ptr, wt_ptr, out_ptr, Z, K: tl.constexpr, BN: tl.constexpr):
    """out[n] = sum over the token's choices, in top-k order, of weight * y (fp32)."""
    n, nb = tl.program_id(0), tl.program_id(1)
    rows = nb * BN + tl.arange(0, BN)
    mask = rows < Z
    out = tl.zeros([BN], dtype=tl.float32)
    for j in range(K):
        out += tl.load(y_ptr + (n * K + j) * Z + rows, mask=mask, other=0.0) * tl.load(wt_ptr + n * K + j)
    tl.store(out_ptr + n * Z + rows, out, mask=mask)


def _operands(z: Tensor, w13: Experts, w2: Experts) -> tuple:
    """(packed?, (w13 bytes or values, its scales, strides), the same for w2), checking the shapes."""
    packed = isinstance(w13, PackedExperts)
    if packed != isinstance(w2, PackedExperts):
        raise ValueError("moe_triton: both projections packed, or neither")
    E, I2, Z = w13.shape
    if Z != z.shape[1] or w2.shape != (E, Z, I2 // 2):
        raise ValueError(f"moe_triton: z {tuple(z.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if not packed and not (w13.dtype == w2.dtype == z.dtype):
        raise ValueError(f"moe_triton: dense weights in z's dtype ({z.dtype}), got {w13.dtype} and {w2.dtype}")

    def parts(w):
        data, scale = (w.packed, w.scale) if packed else (w, w)
        if data.stride(-1) != 1 or scale.stride(-1) != 1:
            raise ValueError("moe_triton: weights with contiguous rows")
        return data, scale, data.stride(0), data.stride(1), scale.stride(0), scale.stride(1)

    return packed, parts(w13), parts(w2)


def _act_args(act: Activation) -> tuple:
    inv, linear_inv = act.inverses if act.code else (0.0, 0.0)
    return (act.beta, inv, act.linear_beta, linear_inv)


def experts_gathered(
    z: Tensor, ids: Tensor, weights: Tensor, w13: Experts, w2: Experts, act: Activation = SILU
) -> Tensor:
    """Decode: z [N, Z] in the compute dtype, ids and weights [N, k]; w13 [E, 2I, Z] and w2 [E, Z, I], dense or
    packed. Returns [N, Z] fp32, as kernels/moe.py's experts_gathered."""
    packed, (w1, s1, *st1), (w2_, s2, *st2) = _operands(z, w13, w2)
    (N, K), (Z, I) = ids.shape, (z.shape[1], w13.shape[1] // 2)
    z, ids, weights = z.contiguous(), ids.contiguous(), weights.float().contiguous()
    act_buf = torch.empty(N * K, I, dtype=z.dtype, device=z.device)
    out = torch.empty(N, Z, dtype=torch.float32, device=z.device)
    if N == 0:
        return out
    BN, BK = 32, 64
    _gate_up_gathered[(N * K, triton.cdiv(I, BN))](
        z, ids, w1, s1, act_buf, z.stride(0), *st1, Z, I, *_act_args(act),
        K=K, PACKED=packed, ACT=act.code, BN=BN, BK=BK,
    )  # fmt: skip
    _down_gathered[(N, triton.cdiv(Z, BN))](
        act_buf, ids, weights, w2_, s2, out, *st2, Z, I, K=K, PACKED=packed, BN=BN, BK=BK
    )
    return out


BM = 16  # rows of sorted pairs per grouped block (each expert's group padded to it)


def sorted_blocks(ids: Tensor, experts: int, block: int = BM) -> tuple[Tensor, Tensor]:
    """The pairs sorted by expert, each expert's group padded to `block` rows: (pair index per slot, -1 for padding,
    [padded_rows]; the expert of each block of slots, `experts` past the last group). Device ops only."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = _group_counts(flat, experts)
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    expert = flat[order]
    dest = (ends - padded)[expert] + torch.arange(len(flat), device=ids.device) - (counts.cumsum(0) - counts)[expert]
    rows = padded_rows(ids.shape[0], ids.shape[1], experts, block)
    pairs = torch.full((rows,), -1, dtype=torch.int64, device=ids.device).index_copy_(0, dest, order)
    starts = torch.arange(0, rows, block, device=ids.device)
    return pairs, torch.searchsorted(ends, starts, right=True)


def experts_grouped(
    z: Tensor, ids: Tensor, weights: Tensor, w13: Experts, w2: Experts, act: Activation = SILU
) -> Tensor:
    """Prefill: experts_gathered's arguments and result, through sorted, padded groups and tl.dot tiles."""
    packed, (w1, s1, *st1), (w2_, s2, *st2) = _operands(z, w13, w2)
    (N, K), (E, Z, I) = ids.shape, (w13.shape[0], z.shape[1], w13.shape[1] // 2)
    z, weights = z.contiguous(), weights.float().contiguous()
    out = torch.empty(N, Z, dtype=torch.float32, device=z.device)
    if N == 0:
        return out
    pairs, block_expert = sorted_blocks(ids, E)
    act_buf = torch.empty(len(pairs), I, dtype=z.dtype, device=z.device)
    y = torch.empty(N * K, Z, dtype=torch.float32, device=z.device)
    f32 = z.dtype == torch.float32 or z.device.type == "cpu"
    BN, BK = 64, 64
    grid = len(block_expert)
    _gate_up_grouped[(grid, triton.cdiv(I, BN))](
        z, pairs, block_expert, w1, s1, act_buf, z.stride(0), *st1, Z, I, E, *_act_args(act),
        K=K, PACKED=packed, ACT=act.code, F32=f32, BM=BM, BN=BN, BK=BK,
    )  # fmt: skip
    _down_grouped[(grid, triton.cdiv(Z, BN))](
        act_buf, pairs, block_expert, w2_, s2, y, *st2, Z, I, E, PACKED=packed, F32=f32, BM=BM, BN=BN, BK=BK
    )
    _combine[(N, triton.cdiv(Z, BN))](y, weights, out, Z, K=K, BN=BN)
    return out


def moe_experts(z: Tensor, ids: Tensor, weights: Tensor, w13: Experts, w2: Experts, *, act: Activation = SILU):
    """The routed experts for any number of tokens: gathered GEMVs where the pairs are fewer than the experts
    (decode), grouped tiles otherwise. The choice depends on the shapes only (CUDA-graph friendly)."""
    few = ids.numel() < w13.shape[0]
    return (experts_gathered if few else experts_grouped)(z, ids, weights, w13, w2, act)
