"""The CPU routed-experts op (kernels/csrc/moe_experts.cpp, cpu_ops.moe_experts) against the torch oracle
(kernels/moe.py experts_loop on the dequantized stack), for MXFP4-packed and dense weights, SiLU and SiTU.

Exactness, path by path:
- packed against dense through the op: bit for bit (the op widens a packed row to the fp32 values the dequantized
  row holds, then sums the same products in the same order: fp32 FMAs, or in bf16 on CPUs with AVX-512 bf16 the
  dot-product instruction over input pairs), in fp32 and bf16;
- a token alone against the same token in a batch: bit for bit (each output is one FMA chain over its inputs);
- the op against the oracle: within 1e-5 of the largest output in fp32 (summation order only); in bf16 within one
  bf16 rounding (2^-7 of it: an intermediate can round the other way).
Also the activation in the one-op decode block (moe_decode), and the op's refusals."""

import pytest
import torch
import torch.nn.functional as F

from k3dist.kernels import cpu_ops
from k3dist.kernels.activation import SILU, SiTU
from k3dist.kernels.moe import experts_gathered, experts_loop
from k3dist.kernels.mxfp4 import PackedExperts
from k3dist.weights import mxfp4
from tests.support.moe_cases import case, rank_slice
from tests.support.tiers import slow_but

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the CPU ops do not build here")

K3_SITU = SiTU(4.0, 25.0)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.dtype == torch.float32 and got.shape == want.shape and torch.isfinite(got).all()
    return ((got - want).abs().max() / want.abs().max()).item()


SHAPES = [  # (N, E, k, Z, I, used): the K3 twin's widths (top-16 of 64) at odd token counts; real K3's at world 8
    (1, 64, 16, 512, 128, None),  # decode: 48 experts chosen by no token
    (7, 64, 16, 512, 128, None),
    (33, 64, 16, 512, 128, 20),  # prefill-like: many tokens on 20 experts, 44 never chosen
    (3, 16, 4, 3584, 384, None),  # K3's latent, a world-8 rank's expert width
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", [SILU, K3_SITU], ids=["silu", "situ"])
@pytest.mark.parametrize("N, E, k, Z, I, used", slow_but(SHAPES, SHAPES[:3], ids=lambda s: f"N{s[0]}-Z{s[3]}-I{s[4]}"))
def test_packed_op_equals_dense_op_and_the_oracle(N, E, k, Z, I, used, act, dtype):
    c = case(N, E, k, Z, I, dtype, seed=N + Z, used=used)
    d13, d2 = c.dense()
    got = cpu_ops.moe_experts(c.z, c.ids, c.weights, c.w13, c.w2, act=act)
    assert torch.equal(got, cpu_ops.moe_experts(c.z, c.ids, c.weights, d13, d2, act=act))
    assert _rel(got, experts_loop(c.z, c.ids, c.weights, d13, d2, act)) <= TOL[dtype]


def test_a_token_gets_the_same_bits_alone_or_in_a_batch():
    c = case(9, 64, 16, 512, 128, torch.bfloat16, seed=1, used=18)  # 18 experts: each chosen by many tokens
    whole = cpu_ops.moe_experts(c.z, c.ids, c.weights, c.w13, c.w2, act=K3_SITU)
    for n in range(len(c.z)):
        alone = cpu_ops.moe_experts(c.z[n : n + 1], c.ids[n : n + 1], c.weights[n : n + 1], c.w13, c.w2, act=K3_SITU)
        assert torch.equal(alone, whole[n : n + 1])


@pytest.mark.parametrize("world", [2, 4])
def test_a_tp_slice_runs_alone_and_the_slices_sum_to_the_whole(world):
    """Each rank holds I / world of the expert width (whole MXFP4 groups); its partial equals the oracle on its
    dequantized slice, and the partials sum (the all-reduce) to the unsliced result within fp32 rounding."""
    c = case(5, 64, 16, 512, 256, torch.float32, seed=world)
    full = cpu_ops.moe_experts(c.z, c.ids, c.weights, c.w13, c.w2, act=K3_SITU)
    parts = []
    for rank in range(world):
        s = rank_slice(c, rank, world)
        assert s.w13.shape[1] == 2 * 256 // world and s.w2.shape[2] == 256 // world
        part = cpu_ops.moe_experts(s.z, s.ids, s.weights, s.w13, s.w2, act=K3_SITU)
        d13, d2 = s.dense()
        assert torch.equal(part, cpu_ops.moe_experts(s.z, s.ids, s.weights, d13, d2, act=K3_SITU))
        assert _rel(part, experts_loop(s.z, s.ids, s.weights, d13, d2, K3_SITU)) <= 1e-5
        parts.append(part)
    assert _rel(torch.stack(parts).sum(0), full) <= 1e-5


@pytest.mark.parametrize("Z, I", [(72, 20), (33, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dense_weights_of_any_width(Z, I, dtype):
    """Dense stacks need no whole groups: widths off every vector and panel size, odd ones (bf16 then takes the fp32
    panel: its pairs need even widths)."""
    gen = torch.Generator().manual_seed(Z)
    E, k = 6, 2
    w13, w2 = (torch.randn(E, 2 * I, Z, generator=gen) * 0.1).to(dtype), (torch.randn(E, Z, I) * 0.1).to(dtype)
    z, ids = torch.randn(4, Z, generator=gen).to(dtype), torch.stack([torch.randperm(E)[:k] for _ in range(4)])
    weights = torch.rand(4, k, generator=gen)
    for act in (SILU, K3_SITU):
        got = cpu_ops.moe_experts(z, ids, weights, w13, w2, act=act)
        assert _rel(got, experts_loop(z, ids, weights, w13, w2, act)) <= TOL[dtype]
    assert cpu_ops.moe_experts(z[:0], ids[:0], weights[:0], w13, w2).shape == (0, Z)


def test_refusals_name_the_problem():
    c = case(2, 8, 2, 64, 32, torch.float32)
    d13, d2 = c.dense()
    op = torch.ops.k3dist.moe_experts
    with pytest.raises(RuntimeError, match="expert id 8"):
        cpu_ops.moe_experts(c.z, torch.tensor([[0, 8], [1, 2]]), c.weights, c.w13, c.w2)
    with pytest.raises(RuntimeError, match="w13_scale"):
        op(c.z, c.ids, c.weights, c.w13.packed, c.w13.scale[..., :1].contiguous(), c.w2.packed, c.w2.scale, 0, 0, 0)
    with pytest.raises(RuntimeError, match="both projections"):
        op(c.z, c.ids, c.weights, c.w13.packed, c.w13.scale, d2, None, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="both projections"):
        cpu_ops.moe_experts(c.z, c.ids, c.weights, c.w13, d2)
    with pytest.raises(RuntimeError, match="dense weights in z's dtype"):
        cpu_ops.moe_experts(c.z, c.ids, c.weights, d13.bfloat16(), d2.bfloat16())
    with pytest.raises(RuntimeError, match="SiTU"):
        op(c.z, c.ids, c.weights, d13, None, d2, None, 1, 0.0, 25.0)


def test_scratch_bytes_cover_the_op_buffers_and_grow_with_tokens():
    """What the memory plan counts: at least the activations [pairs, I] and z and the result in fp32."""
    at = [cpu_ops.moe_experts_scratch_bytes(n, 16, 3584, 384, threads=8) for n in (1, 8, 512)]
    assert at[0] < at[1] < at[2]
    assert at[2] >= 512 * 16 * 384 * 4 + 2 * 512 * 3584 * 4
    assert cpu_ops.moe_experts_scratch_bytes(8, 16, 3584, 384, threads=16) > at[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_one_op_decode_block_takes_the_activation(dtype):
    """moe_decode (routing, routed and shared experts in one op) with SiTU against experts_gathered and a shared
    SiTU MLP in torch; SiLU stays its default (tests/unit/test_cpu_kernels.py holds it to the reference)."""
    gen = torch.Generator().manual_seed(7)
    N, D, E, I, k, Is = 3, 128, 16, 64, 4, 64
    x, gate, bias = torch.randn(N, D, generator=gen), torch.randn(E, D, generator=gen) * 0.05, torch.zeros(E)
    w13, w2 = (torch.randn(E, 2 * I, D, generator=gen) * 0.05).to(dtype), (torch.randn(E, D, I) * 0.05).to(dtype)
    s13, s2 = (torch.randn(2 * Is, D, generator=gen) * 0.05).to(dtype), (torch.randn(D, Is) * 0.05).to(dtype)
    logits = F.linear(x, gate)
    scores = logits.sigmoid()
    ids = scores.topk(k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    flat = x.to(dtype)
    shared = F.linear(K3_SITU(*F.linear(flat, s13).chunk(2, -1)), s2)
    want = experts_gathered(flat, ids, weights, w13, w2, K3_SITU) + shared
    named = dict(bias=bias, w13=w13, w2=w2, shared13=s13, shared2=s2, top_k=k, renormalize=True, scale=1.0)
    got = cpu_ops.moe_decode(x, logits, **named, biased=False, act=K3_SITU)
    assert _rel(got, want.float()) <= TOL[dtype]
    assert not torch.equal(got, cpu_ops.moe_decode(x, logits, **named, biased=False))  # SiLU is another function


def test_packed_experts_refuse_a_split_group():
    """A TP slice that cut an MXFP4 group could not be stacked: the values' widths must be whole groups."""
    with pytest.raises(ValueError, match="scale"):
        PackedExperts(torch.zeros(2, 4, 24, dtype=torch.uint8), torch.zeros(2, 4, 1, dtype=torch.uint8), torch.float32)


@pytest.mark.parametrize("low, z_scale", [(0, 1.0), (124, 2.0**-120)], ids=["subnormal-to-normal", "large"])
def test_every_scale_widens_as_the_dequantized_weight(low, z_scale):
    """The op's per-scale code tables (mxfp4.h) against weights/mxfp4.py's dequantization, scale by scale: 2^-128
    (subnormal products) up to 2^124, bit for bit through the op (z scaled so the large ones stay finite; there the
    down projection keeps its own scales)."""
    c = case(3, 8, 4, 512, 128, torch.bfloat16, seed=7)

    def spanned(w: PackedExperts) -> PackedExperts:
        scales = (torch.arange(w.scale.numel()) % 129 + low).to(torch.uint8).view_as(w.scale)
        return PackedExperts(w.packed, scales, w.dtype)

    w13, w2 = spanned(c.w13), spanned(c.w2) if low == 0 else c.w2
    z = (c.z.float() * z_scale).to(c.z.dtype)
    d13, d2 = mxfp4.dequantize(w13.packed, w13.scale, z.dtype), mxfp4.dequantize(w2.packed, w2.scale, z.dtype)
    got = cpu_ops.moe_experts(z, c.ids, c.weights, w13, w2, act=SILU)
    assert torch.isfinite(got).all()
    assert torch.equal(got, cpu_ops.moe_experts(z, c.ids, c.weights, d13, d2, act=SILU))
