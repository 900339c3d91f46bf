"""Reference kernels (kernels/conv.py, kda.py, mla.py) against transformers' Kimi-Linear code and naive math."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear import modeling_kimi_linear as hf
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

from k3dist.kernels import conv, kda, mla


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _gate_params(gen: torch.Generator, H: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log and dt_bias drawn like fla / transformers initialise them."""
    A_log = torch.empty(H, dtype=torch.float64).uniform_(1.0, 16.0, generator=gen).log()
    dt = torch.empty(H * d, dtype=torch.float64).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    return A_log, dt + torch.log(-torch.expm1(-dt))


def _kda_inputs(B: int, T: int, H: int, d: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Post-conv q, k, v; g from kda_gate (decays spanning ~1 down to underflow); beta in (0, 1); non-zero state."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (F.silu(_randn(gen, B, T, H, d)) for _ in range(3))
    g = kda.kda_gate(3.0 * _randn(gen, B, T, H, d), *_gate_params(gen, H, d))
    beta = torch.sigmoid(_randn(gen, B, T, H))
    state = 0.1 * _randn(gen, B, H, d, d)
    return [x.to(dtype) for x in (q, k, v, g, beta, state)]


# ---------------------------------------------------------------- conv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(0)
    B, T, C, K = 2, 11, 24, 4
    x, weight = _randn(gen, B, T, C).to(dtype), (0.5 * _randn(gen, C, K)).to(dtype)
    state = torch.zeros(B, K - 1, C, dtype=dtype)
    got = conv.causal_conv_prefill(x, weight, state)
    want = hf.causal_conv1d_fn(x.transpose(1, 2), weight, activation="silu").transpose(1, 2)
    assert got.dtype == dtype and got.shape == (B, T, C)
    # bf16 is bit-exact; fp32 may differ by an ulp (conv1d's own zero padding vs explicitly prepended zeros).
    torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-7)
    torch.testing.assert_close(state, x[:, -(K - 1) :], rtol=0, atol=0)


def test_conv_pieces_and_steps_equal_one_prefill():
    gen = torch.Generator().manual_seed(1)
    B, C, K = 2, 16, 4
    x, weight = _randn(gen, B, 12, C).float(), (0.5 * _randn(gen, C, K)).float()
    full_state = torch.zeros(B, K - 1, C)
    want = conv.causal_conv_prefill(x, weight, full_state)

    state = torch.zeros(B, K - 1, C)
    ptr = state.data_ptr()
    pieces = [conv.causal_conv_prefill(x[:, a:b], weight, state) for a, b in [(0, 2), (2, 3), (3, 8)]]  # T < K-1 too
    pieces += [conv.causal_conv_step(x[:, t], weight, state).unsqueeze(1) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, full_state, rtol=0, atol=0)
    assert state.data_ptr() == ptr


# ---------------------------------------------------------------- KDA


def test_kda_gate_matches_transformers_forget_gate():
    H, d, D = 4, 8, 32
    gen = torch.Generator().manual_seed(2)
    module = hf.KimiLinearForgetGate(
        KimiLinearConfig(hidden_size=D, linear_attn_config={"head_dim": d, "num_heads": H})
    )
    A_log, dt_bias = _gate_params(gen, H, d)
    with torch.no_grad():
        module.A_log.copy_(A_log.view(1, 1, H, 1))
        module.dt_bias.copy_(dt_bias)
        module.f_a_proj.weight.copy_(_randn(gen, d, D))
        module.f_b_proj.weight.copy_(_randn(gen, H * d, d))
        h = _randn(gen, 2, 5, D).float()  # large enough to hit both softplus branches (z > 20 and z << 0)
        want = module(h)
        g_raw = module.f_b_proj(module.f_a_proj(h)).view(2, 5, H, d)
    assert (g_raw + dt_bias.view(H, d) > 20).any() and (g_raw < -20).any()
    for bias in (module.dt_bias, module.dt_bias.view(H, d)):
        got = kda.kda_gate(g_raw, module.A_log.view(H), bias)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_kda_gate_k3_form_is_the_bounded_sigmoid():
    """lower < 0: g = lower * sigmoid(exp(A_log) (g_raw + dt_bias)), K3's formula written here in float64 on the same
    fp32 inputs; every g in [lower, 0], saturating at both ends."""
    H, d, lower = 4, 8, -5.0
    gen = torch.Generator().manual_seed(8)
    A_log, dt_bias = (x.float() for x in _gate_params(gen, H, d))
    g_raw = (10.0 * _randn(gen, 3, 7, H, d)).float()  # |A z| from ~0 to ~500: both ends of the sigmoid
    got = kda.kda_gate(g_raw, A_log, dt_bias, lower)
    z = g_raw.double() + dt_bias.double().view(H, d)
    want = lower / (1.0 + torch.exp(-torch.exp(A_log.double()).view(H, 1) * z))
    assert got.dtype == torch.float32 and got.shape == g_raw.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert (got >= lower).all() and (got <= 0).all()
    assert (got == lower).any() and (got > -1e-6).any()


@pytest.mark.parametrize(
    "B,T,H,d,chunk",
    [(2, 1, 2, 8, 64), (1, 63, 2, 16, 64), (2, 64, 1, 16, 64), (1, 130, 2, 16, 64), (2, 130, 2, 8, 16)],
)
def test_kda_prefill_equals_decode_steps(B, T, H, d, chunk):
    q, k, v, g, beta, state = _kda_inputs(B, T, H, d, torch.float64, seed=T)
    step_state = state.clone()
    want = torch.stack(
        [kda.kda_decode_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], step_state) for t in range(T)], 1
    )
    ptr = state.data_ptr()
    got = kda.kda_prefill(q, k, v, g, beta, state, chunk_size=chunk)
    assert state.data_ptr() == ptr and got.shape == (B, T, H, d)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, step_state, rtol=0, atol=1e-10)


def test_kda_prefill_continues_a_prefix():
    q, k, v, g, beta, state = _kda_inputs(1, 100, 2, 16, torch.float64, seed=3)
    state.zero_()
    whole_state = state.clone()
    want = kda.kda_prefill(q, k, v, g, beta, whole_state)
    first = kda.kda_prefill(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state)
    rest = kda.kda_prefill(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], state)
    torch.testing.assert_close(torch.cat([first, rest], 1), want, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, whole_state, rtol=0, atol=1e-10)


def _assert_rel(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = (got.double() - want.double()).abs().max() / want.double().abs().max()
    assert err <= tol, f"max abs diff / max |want| = {err:.3g} > {tol}"


@pytest.mark.parametrize("T", [1, 50, 130])
def test_kda_matches_transformers(T):
    q, k, v, g, beta, state = _kda_inputs(2, T, 2, 32, torch.float32, seed=4)
    for hf_fn in (hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention):
        want, want_state = hf_fn(
            q, k, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        got_state = state.clone()
        got = kda.kda_prefill(q, k, v, g, beta, got_state)
        _assert_rel(got, want, 1e-4)
        _assert_rel(got_state, want_state, 1e-4)


def test_kda_decode_step_matches_transformers_bf16_inputs():
    q, k, v, g, beta, state = _kda_inputs(2, 1, 2, 32, torch.float32, seed=5)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    want, want_state = hf.recurrent_kimi_delta_attention(
        q, k, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    ptr = state.data_ptr()
    got = kda.kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    assert got.dtype == torch.bfloat16 and state.dtype == torch.float32 and state.data_ptr() == ptr
    torch.testing.assert_close(got, want[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(state, want_state, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- MLA


def test_mla_decode_absorbed_equals_expanded():
    """W_kb / W_vb applied to every cached latent (the expanded form) vs absorbed into q and onto the context, with a
        different length per sequence; rows past each length hold garbage that must not reach the result (the reference
    masks them; the Triton kernel does not even read them)."""
    gen = torch.Generator().manual_seed(6)
    B, H, r, dr, dn, dv, L = 3, 4, 32, 8, 16, 12, 20
    lengths = torch.tensor([13, 1, 20])
    scale = (dn + dr) ** -0.5
    W_kb, W_vb = 0.2 * _randn(gen, H, dn, r), 0.2 * _randn(gen, H, dv, r)
    q_nope, q_pe = _randn(gen, B, H, dn), _randn(gen, B, H, dr)
    latent = _randn(gen, B, L, r + dr)
    want = []
    for b, n in enumerate(lengths.tolist()):
        c, k_pe = latent[b, :n, :r], latent[b, :n, r:]
        k = torch.cat([torch.einsum("tr,hnr->thn", c, W_kb), k_pe[:, None].expand(n, H, dr)], -1)
        scores = torch.einsum("hd,thd->ht", torch.cat([q_nope[b], q_pe[b]], -1), k) * scale
        want.append(torch.einsum("ht,thv->hv", scores.softmax(-1), torch.einsum("tr,hvr->thv", c, W_vb)))
    for b, n in enumerate(lengths.tolist()):
        latent[b, n:] = 1e4  # garbage: any weight on these rows would swamp the result
    q_abs = torch.einsum("bhn,hnr->bhr", q_nope, W_kb)
    ctx = mla.mla_decode(q_abs.float(), q_pe.float(), latent.float(), lengths, scale)
    assert ctx.dtype == torch.float32 and ctx.shape == (B, H, r)
    _assert_rel(torch.einsum("bhr,hvr->bhv", ctx.double(), W_vb), torch.stack(want), 1e-5)


def _naive_causal_attention(q, k, v, scale, past):
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    T, S = q.shape[1], k.shape[1]
    future = torch.arange(S)[None, :] > past + torch.arange(T)[:, None]
    p = scores.masked_fill(future, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhts,bshv->bthv", p, v)


@pytest.mark.parametrize("past", [0, 5])
def test_mla_prefill_matches_naive_causal_softmax(past):
    gen = torch.Generator().manual_seed(7)
    B, T, H, dqk, dv = 2, 9, 3, 24, 16
    q = _randn(gen, B, T, H, dqk).float()
    k, v = _randn(gen, B, past + T, H, dqk).float(), _randn(gen, B, past + T, H, dv).float()
    got = mla.mla_prefill(q, k, v, dqk**-0.5, past=past)
    assert got.shape == (B, T, H, dv)
    _assert_rel(got, _naive_causal_attention(q, k, v, dqk**-0.5, past), 1e-5)


def test_conv_prefill_with_kernel_size_one_keeps_no_history():
    """short_conv_kernel_size=1: the conv is a per-channel scale, the state is empty, chunks change nothing."""
    from k3dist.kernels.conv import causal_conv_prefill

    x, w = torch.randn(2, 5, 8), torch.randn(8, 1)
    state = torch.zeros(2, 0, 8)
    torch.testing.assert_close(causal_conv_prefill(x, w, state), torch.nn.functional.silu(x * w[:, 0]))
