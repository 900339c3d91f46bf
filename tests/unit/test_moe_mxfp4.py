"""The activation as a value (SiLU for Kimi-Linear, SiTU-GLU for K3) and MXFP4 experts through the torch MoE paths
(kernels/moe.py): widening in torch equals weights/mxfp4.py's dequantization at every code and scale, and each path
fed the packed stack equals the same path fed its dequantization (bit for bit where the path widens exactly the
experts it multiplies; within 1e-5 where the dense stack takes torch's grouped GEMM and the packed one its loop)."""

import pytest
import torch
import torch.nn.functional as F

from k3dist.kernels.activation import SILU, SiTU, from_config
from k3dist.kernels.moe import experts_gathered, experts_grouped, experts_loop, experts_sorted
from k3dist.kernels.mxfp4 import PackedExperts, widen
from k3dist.weights import mxfp4
from tests.support.moe_cases import case

K3_SITU = SiTU(4.0, 25.0)


def test_widening_equals_dequantize_at_every_code_and_scale():
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # every byte, so every code in both nibbles
    scale = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 16)  # every E8M0 scale, one per row
    for dtype in (torch.float32, torch.bfloat16):
        want = mxfp4.dequantize(packed, scale, dtype)
        got = widen(packed, scale, dtype)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())  # code 8 as +0 in both


def test_packed_experts_widen_only_what_is_asked():
    c = case(N=1, E=6, k=2, Z=64, I=32, dtype=torch.bfloat16)
    dense13, _ = c.dense()
    assert c.w13.shape == dense13.shape and c.w13.nbytes == dense13.numel() // 2 + dense13.numel() // 32
    ids = torch.tensor([4, 1, 4])
    assert torch.equal(c.w13.index_select(0, ids), dense13.index_select(0, ids)) and torch.equal(c.w13[3], dense13[3])
    with pytest.raises(ValueError, match="scale"):
        PackedExperts(c.w13.packed, c.w13.scale[..., :1], torch.float32)


def test_silu_is_swiglu_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        g, u = (torch.randn(257, generator=gen) * 4).to(dtype), torch.randn(257, generator=gen).to(dtype)
        assert torch.equal(SILU(g, u), F.silu(g) * u)


def test_situ_follows_its_formula_in_fp32_and_rounds_once():
    gen = torch.Generator().manual_seed(1)
    g, u = torch.randn(4096, generator=gen) * 30, torch.randn(4096, generator=gen) * 80  # past both soft caps
    exact = 4 * torch.tanh(g.double() / 4) * torch.sigmoid(g.double()) * 25 * torch.tanh(u.double() / 25)
    got = K3_SITU(g, u)
    assert got.dtype == torch.float32 and (got.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
    assert got.abs().max() <= 4 * 25  # both branches capped
    assert K3_SITU.inverses == (0.25, torch.tensor(1 / 25, dtype=torch.float32).item())  # 1/25 as 0.04f
    gb, ub = g.bfloat16(), u.bfloat16()
    assert torch.equal(K3_SITU(gb, ub), K3_SITU(gb.float(), ub.float()).bfloat16())  # fp32 inside, one rounding


def test_the_config_names_the_activation_once():
    assert from_config("silu") is SILU
    assert from_config("situ", 4, 25) == K3_SITU
    with pytest.raises(ValueError, match="activation_situ_beta"):
        from_config("situ")
    with pytest.raises(ValueError, match="gelu"):
        from_config("gelu")
    with pytest.raises(ValueError, match="positive"):
        SiTU(0.0, 25.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", [SILU, K3_SITU], ids=["silu", "situ"])
def test_paths_on_packed_experts_equal_them_on_the_dequantized(dtype, act):
    """top-16 of 64 at the K3 twin's latent and expert widths, 5 tokens (about half the experts chosen by none)."""
    c = case(N=5, E=64, k=16, Z=512, I=128, dtype=dtype, seed=2)
    d13, d2 = c.dense()
    args = (c.z, c.ids, c.weights)
    for path in (experts_gathered, experts_loop):  # each widens exactly the experts it multiplies
        assert torch.equal(path(*args, c.w13, c.w2, act), path(*args, d13, d2, act))
    ref = experts_loop(*args, d13, d2, act)
    for path in (experts_grouped, experts_sorted):  # packed: the loop over experts; dense: torch's grouped GEMM
        got = path(*args, c.w13, c.w2, act)
        assert got.dtype == torch.float32 and got.shape == c.z.shape
        assert torch.equal(got, ref)  # the packed loop multiplies what the oracle multiplies, one expert at a time
        dense = path(*args, d13, d2, act)
        tol = 1e-5 if dtype == torch.float32 else 2**-7  # bf16: one rounding of an expert's output may differ
        assert (dense - got).abs().max() <= tol * ref.abs().max()


def test_silu_default_keeps_every_path_as_it_was():
    """Kimi-Linear's callers pass no activation: the default is SiLU, the SwiGLU they always computed."""
    c = case(N=3, E=8, k=2, Z=64, I=32, dtype=torch.float32, seed=4)
    d13, d2 = c.dense()
    gate, up = F.linear(c.z[:1], d13[c.ids[0, 0]]).chunk(2, dim=-1)
    y = F.linear(F.silu(gate) * up, d2[c.ids[0, 0]])
    both = experts_loop(c.z[:1], c.ids[:1, :1], c.weights[:1, :1], d13, d2)
    torch.testing.assert_close(both, y * c.weights[0, 0], rtol=0, atol=0)
