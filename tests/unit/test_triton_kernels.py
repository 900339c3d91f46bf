"""Triton decode kernels (kernels/kda_triton.py, mla_triton.py) against their torch oracles (kda_fused.py, mla.py).

Without CUDA the kernels run on Triton's CPU interpreter (TRITON_INTERPRET=1, set here before any kernel module is
imported) at small shapes; the tests marked `gpu` repeat the comparisons at the twin's real shapes on CUDA.
Errors are measured against the reference's largest magnitude (`_check`).
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton  # noqa: F401
except ImportError as err:  # not installed, or installed but broken
    pytest.skip(
        f"triton is not importable ({err}); pip install -e '.[gpu]' to test the kernels", allow_module_level=True
    )

from k3dist.kernels.kda_fused import KDALayer  # noqa: E402
from k3dist.kernels.kda_fused import kda_decode_fused as kda_ref  # noqa: E402
from k3dist.kernels.kda_triton import _kda_decode_fused, kda_decode_fused  # noqa: E402
from k3dist.kernels.mla import mla_decode as mla_ref  # noqa: E402
from k3dist.kernels.mla_triton import _mla_decode, mla_decode  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (max, mean) |got - want| allowed, relative to max |want|. fp32: rounding noise only (seen <= 3e-7). bf16 / fp16:
# about an ulp of the largest output (2**-7 relative for bf16, 2**-10 for fp16); KDA matches the reference's
# roundings (seen: bit-equal under the interpreter), MLA's softmax probabilities are rounded before normalising
# rather than after (seen: 3e-3 max, 2e-4 mean for bf16). The KDA state stays fp32 whatever the compute dtype.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (8e-3, 5e-4), torch.float16: (1e-3, 1e-4)}


def _state_tol(dtype: torch.dtype, device: torch.device) -> float:
    """KDA state (fp32) error allowed, relative to max |state|. Under the interpreter the kernel rounds exactly like
    the reference (seen: 3e-7). On GPUs torch's CUDA sum and exp differ from the kernel's by an fp32 ulp, so a bf16 /
    fp16 conv output can round the other way now and then; one such flip moves a state column by up to
    beta * 2**-8 * |v_j| * |k_i| (~4e-3), hence 1e-2 there."""
    return 1e-2 if device.type == "cuda" and dtype != torch.float32 else 1e-5


def _check(got: torch.Tensor, want: torch.Tensor, rel: float, what: str, mean_rel: float | None = None) -> float:
    """Asserts got is finite and max |got - want| <= rel * max |want| (and the mean error <= mean_rel * that
    scale); returns the max error over the scale."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = (got.double() - want.double()).abs()
    scale = want.double().abs().max().item()
    assert err.max().item() <= rel * scale, f"{what}: max err {err.max().item():.3g} > {rel:g} * {scale:.3g}"
    if mean_rel is not None:
        assert err.mean().item() <= mean_rel * scale, f"{what}: mean err {err.mean().item():.3g} too large"
    return err.max().item() / scale


# ---------------------------------------------------------------- KDA


def _kda_inputs(B: int, H: int, d: int, K: int, dtype: torch.dtype, seed: int = 0, device=DEV) -> list:
    """Arguments of kda_decode_fused. g_raw has channels above softplus' threshold (20) whose decay underflows."""
    gen = torch.Generator().manual_seed(seed)
    P = H * d

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    g_raw = 3.0 * randn(B, P)
    g_raw[:, ::7] = 25.0
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()
    dt = torch.empty(P).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    args = [
        randn(B, 3, P).to(dtype),  # qkv
        randn(B, K - 1, 3, P).to(dtype),  # conv_state
        (0.5 * randn(3, P, K)).to(dtype),  # conv_w
        g_raw.to(dtype),
        randn(B, H).to(dtype),  # beta_raw
        randn(B, P).to(dtype),  # gate
        A_log,
        dt + torch.log(-torch.expm1(-dt)),  # dt_bias
        (1.0 + 0.1 * randn(d)).to(dtype),  # o_norm
        1e-5,  # eps
        0.1 * randn(B, H, d, d),  # state, fp32
    ]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def _kda(op, a: list, lower: float = 0.0, **kw):
    """Call a KDA core (kda_fused's signature) on _kda_inputs' list: qkv, conv_state, conv_w, g_raw, beta_raw, gate,
    A_log, dt_bias, o_norm, eps, state; `lower` the layer's forget-gate form."""
    return op(a[0], a[3], a[4], a[5], a[1], a[10], KDALayer(a[2], a[6], a[7], a[8], a[9], lower), **kw)


def _clone(args: list) -> list:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _kda_steps(B, H, d, K, dtype, steps, block_v=None, device=DEV, lower=0.0) -> list[float]:
    """`steps` decode steps on both sides, new tokens each step, states carried; returns the relative max errors."""
    want_args = _kda_inputs(B, H, d, K, dtype, device=device)
    got_args = _clone(want_args)
    ptrs = (got_args[1].data_ptr(), got_args[-1].data_ptr())
    gen = torch.Generator().manual_seed(1)
    errs = []
    for step in range(steps):
        if step:  # next token: new projections, same weights and states
            for i, shape in ((0, (B, 3, H * d)), (3, (B, H * d)), (4, (B, H)), (5, (B, H * d))):
                want_args[i] = torch.randn(*shape, generator=gen).to(dtype).to(device)
                got_args[i] = want_args[i].clone()
        want = _kda(kda_ref, want_args, lower)
        got = _kda(_kda_decode_fused, got_args, lower, block_v=block_v)
        errs.append(_check(got, want, TOL[dtype][0], f"out step {step}", mean_rel=TOL[dtype][1]))
        errs.append(_check(got_args[-1], want_args[-1], _state_tol(dtype, device), f"state step {step}"))
        torch.testing.assert_close(got_args[1], want_args[1], rtol=0, atol=0)  # conv state: the inputs, shifted
    assert (got_args[1].data_ptr(), got_args[-1].data_ptr()) == ptrs
    return errs


@pytest.mark.parametrize(
    "B, H, d, K, dtype",
    [
        (1, 2, 16, 4, torch.float32),
        (3, 3, 16, 3, torch.float32),  # P = 48: not a power of two
        (2, 2, 32, 4, torch.bfloat16),
        (2, 3, 16, 2, torch.float16),
        (1, 1, 128, 4, torch.float32),  # four value blocks of 32
        (2, 1, 128, 3, torch.bfloat16),
    ],
)
def test_kda_matches_reference_over_steps(B, H, d, K, dtype):
    _kda_steps(B, H, d, K, dtype, steps=3)


@pytest.mark.parametrize("block_v", [8, 16])
def test_kda_value_blocks_walk_the_state(block_v):
    """Narrow value blocks (4 and 2 of them for d = 32) give the reference's output and state."""
    _kda_steps(2, 2, 32, 4, torch.float32, steps=2, block_v=block_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_k3s_gate_matches_reference(dtype):
    """K3's lower-bounded forget gate (lower = -5) over steps, the state walked in two value blocks."""
    _kda_steps(2, 2, 32, 4, dtype, steps=2, block_v=16, lower=-5.0)


def test_kda_strided_views_are_read_and_updated_in_place():
    """Projections and states as views with unusual strides, like slices of larger buffers; public entry point."""
    B, H, d, K, dtype = 2, 2, 16, 4, torch.bfloat16
    P = H * d
    want_args = _kda_inputs(B, H, d, K, dtype)
    qkv_buf = torch.zeros(3, B, P, dtype=dtype, device=DEV)
    qkv_buf.copy_(want_args[0].transpose(0, 1))
    cs_buf = torch.zeros(B, 3, K - 1, P, dtype=dtype, device=DEV)  # projection-major: taps not outermost
    cs_buf.copy_(want_args[1].transpose(1, 2))
    w_buf = want_args[2].transpose(1, 2).contiguous()  # [3, K, P]
    proj = torch.zeros(B, 2 * P, dtype=dtype, device=DEV)  # g_raw and gate as column slices of one projection
    proj[:, :P], proj[:, P:] = want_args[3], want_args[5]
    state_buf = torch.zeros(B + 2, H, d, d, device=DEV)
    state_buf[1 : B + 1] = want_args[-1]
    got_args = [
        qkv_buf.transpose(0, 1),
        cs_buf.transpose(1, 2),
        w_buf.transpose(1, 2),
        proj[:, :P],
        want_args[4].clone(),
        proj[:, P:],
        *_clone(want_args[6:10]),
        state_buf[1 : B + 1],
    ]
    want = _kda(kda_ref, want_args)
    got = _kda(kda_decode_fused, got_args)
    _check(got, want, TOL[dtype][0], "out", mean_rel=TOL[dtype][1])
    _check(state_buf[1 : B + 1], want_args[-1], _state_tol(dtype, DEV), "state")
    assert (state_buf[0] == 0).all() and (state_buf[B + 1] == 0).all(), "wrote outside the state view"
    torch.testing.assert_close(cs_buf.transpose(1, 2), want_args[1], rtol=0, atol=0)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("lower", [0.0, -5.0])
def test_kda_real_shapes_cuda(B, dtype, lower):
    """Per-rank heads 8, d = 128, K = 4, 4 steps carrying the states; both forget-gate forms."""
    _kda_steps(B, 8, 128, 4, dtype, steps=4, device=torch.device("cuda"), lower=lower)


# ---------------------------------------------------------------- MLA


def _mla_inputs(B, H, r, dr, L, dtype, seed=0, device=DEV):
    """q's, a latent cache and per-sequence lengths (1 for the first sequence, L for the last)."""
    gen = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(B, H, r, generator=gen).to(dtype)
    q_pe = torch.randn(B, H, dr, generator=gen).to(dtype)
    latent = torch.randn(B, L, r + dr, generator=gen).to(dtype)
    lengths = torch.randint(1, L + 1, (B,), generator=gen)
    lengths[0], lengths[-1] = 1, L
    return q_nope.to(device), q_pe.to(device), latent.to(device), lengths.to(device)


def _poison(latent: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A copy with every row at or past lengths[b] set to NaN (and +inf in one column): they must never be read."""
    bad = latent.clone()
    past = torch.arange(latent.shape[1], device=latent.device) >= lengths[:, None]
    bad[past] = float("nan")
    bad[..., 0][past] = float("inf")
    return bad


@pytest.mark.parametrize(
    "B, H, r, dr, L, dtype, block_l, splits",
    [
        (3, 3, 24, 8, 37, torch.float32, 16, 1),  # non-power-of-two heads, r, dr and L
        (3, 3, 24, 8, 37, torch.float32, 16, 3),
        (2, 8, 32, 16, 50, torch.bfloat16, 16, 1),
        (2, 8, 32, 16, 50, torch.bfloat16, 16, 4),
        (4, 2, 16, 16, 33, torch.float16, 16, 2),
        (2, 4, 32, 0, 20, torch.float32, 16, 2),  # no rope part
        (1, 8, 32, 16, 1, torch.float32, 16, 3),  # a single row, more slices than rows
    ],
)
def test_mla_matches_reference_and_never_reads_past_lengths(B, H, r, dr, L, dtype, block_l, splits):
    q_nope, q_pe, latent, lengths = _mla_inputs(B, H, r, dr, L, dtype)
    scale = 3.0 * (r + dr) ** -0.5  # sharper than the model's softmax: more weight on single rows
    want = mla_ref(q_nope, q_pe, latent, lengths, scale)
    bad = _poison(latent, lengths)
    before = bad.clone()
    got = _mla_decode(q_nope, q_pe, bad, lengths, scale, block_l=block_l, num_splits=splits)
    _check(got, want, TOL[dtype][0], "ctx", mean_rel=TOL[dtype][1])
    assert torch.equal(bad.isnan(), before.isnan()) and torch.equal(bad.nan_to_num(), before.nan_to_num())


def test_mla_strided_views_int32_lengths_default_launch():
    """q_pe a slice of the full q, the latent a view of a larger cache (poisoned past L), int32 lengths."""
    B, H, r, dr, L, cap, dtype = 3, 4, 32, 16, 40, 64, torch.bfloat16
    q_nope, q_pe, latent, lengths = _mla_inputs(B, H, r, dr, L, dtype, seed=3)
    q_full = torch.cat([torch.randn(B, H, 8, device=DEV).to(dtype), q_pe], dim=-1)  # [B, H, dn + dr]
    cache = torch.full((B, cap, r + dr), float("nan"), dtype=dtype, device=DEV)
    cache[:, :L] = _poison(latent, lengths)
    want = mla_ref(q_nope, q_pe, latent, lengths, (r + dr) ** -0.5)
    got = mla_decode(q_nope, q_full[..., 8:], cache[:, :L], lengths.to(torch.int32), (r + dr) ** -0.5)
    _check(got, want, TOL[dtype][0], "ctx", mean_rel=TOL[dtype][1])


def test_mla_consecutive_steps_over_a_growing_cache():
    """Decode steps appending one row per sequence; lengths differ per sequence and grow on the device."""
    B, H, r, dr, cap, dtype = 2, 4, 32, 16, 24, torch.float32
    q_nope, q_pe, cache, _ = _mla_inputs(B, H, r, dr, cap, dtype, seed=5)
    lengths = torch.tensor([1, 9], device=DEV)
    gen = torch.Generator().manual_seed(6)
    for _ in range(4):
        q_nope = torch.randn(B, H, r, generator=gen).to(DEV)
        q_pe = torch.randn(B, H, dr, generator=gen).to(DEV)
        want = mla_ref(q_nope, q_pe, cache, lengths, (r + dr) ** -0.5)
        got = _mla_decode(q_nope, q_pe, _poison(cache, lengths), lengths, (r + dr) ** -0.5, block_l=16, num_splits=2)
        _check(got, want, TOL[dtype][0], "ctx", mean_rel=TOL[dtype][1])
        lengths += torch.tensor([1, 3], device=DEV)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_mla_real_shapes_cuda(B, dtype):
    """Heads 8, r = 128, dr = 32, L = 4096, random lengths (1 and L included), default blocks and slices."""
    H, r, dr, L = 8, 128, 32, 4096
    q_nope, q_pe, latent, lengths = _mla_inputs(B, H, r, dr, L, dtype, device=torch.device("cuda"))
    want = mla_ref(q_nope, q_pe, latent, lengths, (r + dr) ** -0.5)
    got = mla_decode(q_nope, q_pe, _poison(latent, lengths), lengths, (r + dr) ** -0.5)
    _check(got, want, TOL[dtype][0], "ctx", mean_rel=TOL[dtype][1])


@pytest.mark.gpu
@cuda_only
def test_kernels_replay_in_a_cuda_graph():
    """Both launchers captured once, replayed with new tokens and new (device) lengths: no host syncs, no stale
    shapes. Capture only records, so the first replay is the first step."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    kda_args, (q_nope, q_pe, latent, lengths) = (
        _kda_inputs(8, 8, 128, 4, dtype, device=dev),
        _mla_inputs(8, 8, 128, 32, 512, dtype, device=dev),
    )
    want_args = _clone(kda_args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        _kda(kda_decode_fused, _clone(kda_args))
        mla_decode(q_nope, q_pe, latent, lengths, 0.1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _kda(kda_decode_fused, kda_args)
        ctx = mla_decode(q_nope, q_pe, latent, lengths, 0.1)
    gen = torch.Generator(device=dev).manual_seed(7)
    for _ in range(3):
        qkv = torch.randn(kda_args[0].shape, generator=gen, device=dev).to(dtype)
        kda_args[0].copy_(qkv)
        want_args[0].copy_(qkv)
        lengths.copy_(torch.randint(1, latent.shape[1] + 1, lengths.shape, generator=gen, device=dev))
        graph.replay()
        _check(out, _kda(kda_ref, want_args), TOL[dtype][0], "kda out", mean_rel=TOL[dtype][1])
        _check(kda_args[-1], want_args[-1], _state_tol(dtype, dev), "kda state")
        _check(ctx, mla_ref(q_nope, q_pe, latent, lengths, 0.1), TOL[dtype][0], "mla ctx", mean_rel=TOL[dtype][1])
