"""The C++ CPU ops (kernels/cpu_ops.py) against the torch references they replace, on odd shapes too; the KDA prefill
op against decoding its tokens one by one (bit for bit) and against the chunked reference."""

import pytest
import torch
import torch.nn.functional as F

from k3dist.kernels import cpu_ops, kda, kda_fused, mla
from k3dist.kernels.activation import SILU, SiTU, glu
from k3dist.kernels.backend import select
from k3dist.kernels.conv import causal_conv_prefill
from k3dist.kernels.moe import experts_gathered
from k3dist.kernels.norm import gated_rmsnorm, res_mix, rmsnorm
from k3dist.model.moe import route

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason=f"CPU ops do not build: {cpu_ops.build_error()}")

DTYPES = [torch.float32, torch.bfloat16]


def _core(op, a: dict):
    """Call a KDA core (kda_fused's signature) on named inputs."""
    layer = kda_fused.KDALayer(a["conv_w"], a["A_log"], a["dt_bias"], a["o_norm"], a["eps"], a["lower"])
    return op(a["qkv"], a["g_raw"], a["beta_raw"], a["gate"], a["conv_state"], a["state"], layer)


def _kda_inputs(B, H, d, K, dtype, seed=0, lower=0.0):
    g = torch.Generator().manual_seed(seed)
    P = H * d
    rand = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    proj = rand(B, 3 * P + 2 * d + H + 3).to(dtype)  # a fused projection's row: strided views, as the model passes
    return dict(
        qkv=proj[:, : 3 * P].unflatten(-1, (3, -1)),
        conv_state=rand(B, K - 1, 3, P).to(dtype),
        conv_w=rand(3, P, K, scale=0.5).to(dtype),
        g_raw=rand(B, P).to(dtype),
        beta_raw=proj[:, 3 * P + 2 * d : 3 * P + 2 * d + H],
        gate=rand(B, P).to(dtype),
        A_log=torch.rand(H, generator=g).mul(4).add(0.5).log(),
        dt_bias=rand(P, scale=0.1),
        o_norm=(torch.rand(d, generator=g) + 0.5).to(dtype),
        eps=1e-5,
        lower=lower,
        state=rand(B, H, d, d, scale=0.1),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, d, K", [(1, 8, 128, 4), (3, 4, 16, 3), (2, 3, 20, 1), (8, 2, 33, 2)])
def test_kda_decode_equals_the_reference(B, H, d, K, dtype):
    ref_in, got_in = _kda_inputs(B, H, d, K, dtype), _kda_inputs(B, H, d, K, dtype)
    for _ in range(3):  # three steps: the states the op writes are the ones it reads next
        ref = _core(kda_fused.kda_decode_fused, ref_in)
        got = _core(cpu_ops.kda_decode, got_in)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: at most a last-bit difference in a few outputs
        assert (got.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()
        assert torch.equal(got_in["conv_state"], ref_in["conv_state"])
        assert (got_in["state"] - ref_in["state"]).abs().max().item() <= 1e-5 * ref_in["state"].abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, d, K", [(1, 8, 128, 4), (3, 4, 16, 3), (2, 3, 20, 1)])
def test_kda_decode_with_k3s_gate_equals_the_reference(B, H, d, K, dtype):
    """K3's lower-bounded forget gate (lower = -5) reaches the op: its outputs and states are the reference's."""
    ref_in, got_in = (_kda_inputs(B, H, d, K, dtype, lower=-5.0) for _ in range(2))
    for _ in range(3):
        ref = _core(kda_fused.kda_decode_fused, ref_in)
        got = _core(cpu_ops.kda_decode, got_in)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert (got.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()
        assert torch.equal(got_in["conv_state"], ref_in["conv_state"])
        assert (got_in["state"] - ref_in["state"]).abs().max().item() <= 1e-5 * ref_in["state"].abs().max().item()


def _kda_prefill_inputs(B, T, H, d, K, dtype, seed=0, lower=0.0):
    g = torch.Generator().manual_seed(seed)
    P = H * d
    rand = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    proj = rand(B, T, 3 * P + 2 * d + H + 3).to(dtype)
    return dict(
        qkv=proj[..., : 3 * P].unflatten(-1, (3, -1)),
        conv_state=rand(B, K - 1, 3, P).to(dtype),
        conv_w=rand(3, P, K, scale=0.5).to(dtype),
        g_raw=rand(B, T, P).to(dtype),
        beta_raw=proj[..., 3 * P + 2 * d : 3 * P + 2 * d + H],
        gate=rand(B, T, P).to(dtype),
        A_log=torch.rand(H, generator=g).mul(4).add(0.5).log(),
        dt_bias=rand(P, scale=0.1),
        o_norm=(torch.rand(d, generator=g) + 0.5).to(dtype),
        eps=1e-5,
        lower=lower,
        state=rand(B, H, d, d, scale=0.1),
    )


def _tokens(args: dict, a: int, b: int, one: bool = False) -> dict:
    """Tokens [a, b) of the per-token inputs (token a alone, without its axis, for the decode op when `one`)."""
    pick = (lambda v: v[:, a]) if one else (lambda v: v[:, a:b])  # noqa: E731
    return {n: pick(v) if n in ("qkv", "g_raw", "beta_raw", "gate") else v for n, v in args.items()}


def _chunked_reference(qkv, conv_state, conv_w, g_raw, beta_raw, gate, A_log, dt_bias, o_norm, eps, lower, state):
    """The model's torch prefill (conv, gate, the chunked delta rule, gated norm), as KDA.prefill runs it."""
    n, T, _, P = qkv.shape
    heads = (n, T, beta_raw.shape[-1], P // beta_raw.shape[-1])
    q, k, v = (causal_conv_prefill(qkv[:, :, i], conv_w[i], conv_state[:, :, i]).view(heads) for i in range(3))
    o = kda.kda_prefill(
        q.float(), k, v, kda.kda_gate(g_raw.view(heads), A_log, dt_bias, lower), beta_raw.float().sigmoid(), state
    )
    return gated_rmsnorm(o, gate.view(heads), o_norm, eps).to(qkv.dtype).reshape(n, T, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, H, d, K", [(1, 40, 8, 128, 4), (2, 7, 3, 20, 1), (3, 19, 2, 33, 2), (1, 2, 4, 16, 4)])
def test_kda_prefill_is_decode_token_by_token(B, T, H, d, K, dtype):
    """States bit-identical to T decode steps, and to the same tokens prefilled in two chunks; outputs too."""
    whole, steps, split = (_kda_prefill_inputs(B, T, H, d, K, dtype) for _ in range(3))
    got = _core(cpu_ops.kda_prefill, whole)
    want = torch.stack([_core(cpu_ops.kda_decode, _tokens(steps, t, t + 1, one=True)) for t in range(T)], dim=1)
    cut = T // 3 + 1
    parts = [_core(cpu_ops.kda_prefill, _tokens(split, a, b)) for a, b in ((0, cut), (cut, T))]
    parts = torch.cat(parts, 1)
    for other, out in ((steps, want), (split, parts)):
        assert torch.equal(got, out)
        assert torch.equal(whole["state"], other["state"]) and torch.equal(whole["conv_state"], other["conv_state"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, H, d, K", [(1, 40, 8, 128, 4), (2, 23, 3, 20, 3)])
def test_kda_prefill_equals_the_chunked_reference(B, T, H, d, K, dtype):
    ref_in, got_in = _kda_prefill_inputs(B, T, H, d, K, dtype), _kda_prefill_inputs(B, T, H, d, K, dtype)
    ref, got = _chunked_reference(**ref_in), _core(cpu_ops.kda_prefill, got_in)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: last-bit differences in a few outputs
    assert (got.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()
    assert torch.equal(got_in["conv_state"], ref_in["conv_state"])
    assert (got_in["state"] - ref_in["state"]).abs().max().item() <= 1e-4 * ref_in["state"].abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, H, d, K", [(1, 40, 8, 128, 4), (2, 23, 3, 20, 3)])
def test_kda_prefill_with_k3s_gate_equals_the_chunked_reference(B, T, H, d, K, dtype):
    """A multi-token prefill with K3's gate (lower = -5): the chunked reference's outputs and states."""
    ref_in, got_in = (_kda_prefill_inputs(B, T, H, d, K, dtype, lower=-5.0) for _ in range(2))
    ref, got = _chunked_reference(**ref_in), _core(cpu_ops.kda_prefill, got_in)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()
    assert torch.equal(got_in["conv_state"], ref_in["conv_state"])
    assert (got_in["state"] - ref_in["state"]).abs().max().item() <= 1e-4 * ref_in["state"].abs().max().item()


def _moe_reference(x, logits, bias, w13, w2, s13, s2, k, renorm, scale, biased):
    scores = logits.sigmoid()
    choice = scores + bias
    ids = choice.topk(k, dim=-1, sorted=False).indices
    weights = (choice if biased else scores).gather(1, ids)
    if renorm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    flat = x.to(w13.dtype)
    out = experts_gathered(flat, ids, weights * scale, w13, w2)
    if s13 is not None:
        gate, up = F.linear(flat, s13).chunk(2, dim=-1)
        out = out + F.linear(F.silu(gate) * up, s2).float()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "N, D, E, I, k, Is, renorm, biased",
    [
        (1, 1024, 16, 64, 2, 64, True, False),  # the twin
        (3, 64, 8, 32, 2, 32, True, True),
        (2, 96, 12, 24, 3, 48, False, False),
        (1, 72, 8, 20, 1, 0, True, False),  # no shared expert, odd sizes
    ],
)
def test_moe_decode_equals_the_reference(N, D, E, I, k, Is, renorm, biased, dtype):
    g = torch.Generator().manual_seed(N + D)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, gate, bias = rand(N, D), rand(E, D) * 0.05, rand(E) * 0.1
    w13, w2 = (rand(E, 2 * I, D) * 0.05).to(dtype), (rand(E, D, I) * 0.05).to(dtype)
    s13, s2 = ((rand(2 * Is, D) * 0.05).to(dtype), (rand(D, Is) * 0.05).to(dtype)) if Is else (None, None)
    logits = F.linear(x, gate)
    args = (x, logits, bias, w13, w2, s13, s2, k, renorm, 2.446, biased)
    names = ("bias", "w13", "w2", "shared13", "shared2", "top_k", "renormalize", "scale", "biased")
    named = dict(zip(names, args[2:], strict=True))
    ref, got = _moe_reference(*args), cpu_ops.moe_decode(x, logits, **named)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_kda_decode_traces_under_torch_compile():
    """decode.compile=on traces through the op (its fake) and keeps its in-place state writes."""
    ref_in, got_in = _kda_inputs(2, 4, 16, 4, torch.float32), _kda_inputs(2, 4, 16, 4, torch.float32)
    ref = _core(cpu_ops.kda_decode, ref_in) * 2
    got = torch.compile(lambda kw: _core(cpu_ops.kda_decode, kw) * 2, fullgraph=True)(got_in)
    assert torch.equal(ref, got) and torch.equal(ref_in["state"], got_in["state"])


def test_auto_picks_the_cpu_ops_on_a_cpu():
    assert select("auto", torch.device("cpu")).name == "cpu"
    assert select("torch", torch.device("cpu")).name == "torch"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, V, k", [(1, 163840, 5), (8, 20000, 5), (3, 37, 5), (2, 9000, 1), (1, 4, 4)])
def test_topk_lse_equals_torch(B, V, k, dtype):
    g = torch.Generator().manual_seed(V + k)
    x = (torch.randn(B, V, generator=g) * 4).to(dtype)
    x[0, V // 3] = float("-inf")
    values, ids, lse = cpu_ops.topk_lse(x, k)
    want = x.float().topk(k, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(x.float().gather(1, ids), want.values)
    torch.testing.assert_close(lse, torch.logsumexp(x.float(), dim=-1), rtol=1e-6, atol=1e-5)


def test_topk_lse_breaks_ties_to_the_lower_id_as_argmax():
    x = torch.zeros(2, 30000)
    x[0, [29000, 17, 9000]] = 3.0  # three equal maxima in different chunks, the highest id first
    x[1, :] = float("-inf")  # no mass at all: -inf, as torch's logsumexp
    values, ids, lse = cpu_ops.topk_lse(x, 3)
    assert ids[0].tolist() == [17, 9000, 29000] and ids[0, 0] == x[0].argmax()
    assert lse[1].item() == float("-inf") and torch.isfinite(lse[0])


def test_topk_lse_of_a_masked_row():
    """A grammar mask leaves a run of finite logits after -inf ones: every vector of that run beats the k-th value
    (still -inf), and must be looked at."""
    x = torch.full((1, 512), float("-inf"))
    x[0, 128:192] = torch.linspace(-1, 1, 64)
    values, ids, lse = cpu_ops.topk_lse(x, 5)
    assert ids[0].tolist() == list(range(191, 186, -1)) and torch.equal(values, x.topk(5).values)
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1))


def _mla_torch(q, latent, lengths, w_kb, w_vb, scale):
    """model/mla.py's torch path after the cache write."""
    dn = w_kb.shape[1]
    q_abs = torch.bmm(q[..., :dn].transpose(0, 1), w_kb).transpose(0, 1)
    ctx = mla.mla_decode(q_abs, q[..., dn:], latent, lengths, scale)
    return torch.bmm(ctx.transpose(0, 1), w_vb.transpose(1, 2)).transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, dn, dr, dv, r, L", [(1, 8, 64, 32, 64, 128, 96), (3, 2, 24, 8, 40, 48, 17)])
def test_mla_absorbed_equals_the_torch_path(B, H, dn, dr, dv, r, L, dtype):
    g = torch.Generator().manual_seed(B + L)
    rand = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    wkvb = rand(H * (dn + dv), r) * 0.2
    per_head = wkvb.view(H, dn + dv, r)
    w_kb, w_vb = per_head[:, :dn], per_head[:, dn:]  # views, as the model holds them
    q, cache = rand(B, H, dn + dr), rand(B, L + 5, r + dr)
    latent = cache[:, :L]  # a row bound: a strided slice of the cache
    lengths = torch.tensor([L - 3 * b for b in range(B)])
    scale = (dn + dr) ** -0.5
    ref, got = (
        _mla_torch(q, latent, lengths, w_kb, w_vb, scale),
        cpu_ops.mla_absorbed(q, latent, lengths, w_kb, w_vb, scale),
    )
    assert got.dtype == dtype and got.shape == (B, H * dv)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the same roundings, sums in another order
    assert (got.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "lengths, L, H, r, dr",
    [
        ([0, 1, 2], 9, 8, 128, 32),  # an empty sequence (zeros, as before), one row, two
        ([1], 1, 3, 20, 5),  # one row; heads, r and r + dr not multiples of the vector width
        ([7, 33, 17, 1], 40, 5, 24, 8),  # lengths around the vector width and the 16-row blocks
        ([4099], 4100, 8, 128, 32),  # one long sequence: cut into pieces on every thread, their sums merged
        ([3000, 1500, 61, 2049], 3000, 2, 48, 16),  # long and short together
    ],
)
def test_mla_absorbed_at_depth(lengths, L, H, r, dr, dtype):
    """The pieces, the blocked score and context kernels and their tails give the torch path's values, on random rows
    at several lengths and for sequences of different lengths in one batch."""
    dn, dv, B = 24, 40, len(lengths)
    g = torch.Generator().manual_seed(L + H)
    rand = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    per_head = (rand(H * (dn + dv), r) * 0.2).view(H, dn + dv, r)
    w_kb, w_vb = per_head[:, :dn], per_head[:, dn:]
    q, latent = rand(B, H, dn + dr), rand(B, L, r + dr)
    lengths = torch.tensor(lengths)
    scale = (dn + dr) ** -0.5
    got = cpu_ops.mla_absorbed(q, latent, lengths, w_kb, w_vb, scale)
    live = lengths > 0  # the torch path's softmax over no row is NaN; the op returns zeros there
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))
    ref = _mla_torch(q[live], latent[live], lengths[live], w_kb, w_vb, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the same roundings, sums in another order
    assert (got[live].float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


def test_mla_absorbed_threads_agree():
    """One thread or two: the same pieces, summed in the same order, so the same values (the thread governor changes
    the count in the middle of a run)."""
    g = torch.Generator().manual_seed(1)
    per_head = (torch.randn(8 * 128, 128, generator=g) * 0.2).to(torch.bfloat16).view(8, 128, 128)
    q = torch.randn(1, 8, 96, generator=g).to(torch.bfloat16)
    latent = torch.randn(1, 5000, 160, generator=g).to(torch.bfloat16)
    args = (q, latent, torch.tensor([4999]), per_head[:, :64], per_head[:, 64:], 96**-0.5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.mla_absorbed(*args)
        torch.set_num_threads(2)
        two = cpu_ops.mla_absorbed(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def _mla_layer(kernels, dtype, batch: int, cap: int):
    """An MLA mixer of odd sizes (4 heads, dn 24, dr 8, dv 20, r 48) on seeded weights, with its own latent cache."""
    from types import SimpleNamespace

    from k3dist.model.layers import Binding
    from k3dist.model.linear import Linear
    from k3dist.model.mla import MLA
    from k3dist.model.tp import TPComm

    H, dn, dr, dv, r, D = 4, 24, 8, 20, 48, 64
    g = torch.Generator().manual_seed(5)
    weights = {
        "q_kv_a_proj.weight": torch.randn(H * (dn + dr) + r + dr, D, generator=g) * 0.2,
        "kv_a_layernorm.weight": torch.rand(r, generator=g) + 0.5,
        "kv_b_proj.weight": torch.randn(H * (dn + dv), r, generator=g) * 0.2,
        "o_proj.weight": torch.randn(D, H * dv, generator=g) * 0.2,
    }
    weights = {name: w.to(dtype) for name, w in weights.items()}
    cfg = SimpleNamespace(qk_nope_dim=dn, qk_rope_dim=dr, v_head_dim=dv, kv_lora_rank=r, q_lora_rank=0)
    bind = Binding(weights.__getitem__, lambda n: Linear(weights[n]), cfg, TPComm(1, 0, 8), kernels, dtype)
    return MLA(bind, "", torch.zeros(batch, cap, r + dr, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start, T", [(37, 1), (37, 5), (1100, 48), (1100, 49)])
def test_a_short_piece_after_a_past_attends_as_decode_does(start, T, dtype):
    """A piece of up to ABSORBED_ROWS tokens after a past attends in the absorbed form (the CPU op, one query a
    token): the outputs and the cache rows are the expanded form's, two slots at once, each over its own rows; a
    longer piece keeps the expanded form (the same code on both backends: equal bit for bit)."""
    from k3dist.kernels.backend import TORCH
    from k3dist.model.mla import ABSORBED_ROWS

    layers = [_mla_layer(k, dtype, batch=3, cap=start + T) for k in (select("cpu", torch.device("cpu")), TORCH)]
    g = torch.Generator().manual_seed(start + T)
    past = torch.randn(3, start, layers[0].latent.shape[-1], generator=g).to(dtype)
    x = torch.randn(2, T, 64, generator=g).to(dtype)
    slots = torch.tensor([2, 0])  # out of order: each query must read its own slot's rows
    outs = []
    for layer in layers:
        layer.latent[:, :start] = past
        outs.append(layer.prefill(x, slots, start))
    assert torch.equal(layers[0].latent, layers[1].latent)
    if T > ABSORBED_ROWS:
        assert torch.equal(outs[0], outs[1])
        return
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: other roundings (the op's, the flash kernel's)
    assert (outs[0] - outs[1]).abs().max().item() <= tol * outs[1].abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "M, N, K",
    [
        (1, 300, 1024),
        (2, 301, 100),
        (3, 70, 37),
        (16, 33, 96),
        (7, 50, 1000),
        (13, 40, 100),
        (5, 64, 32),
        (8, 1077, 128),
    ],
)
def test_linear_rows_equal_fp32_sums_rounded_once_and_each_row_alone(M, N, K, dtype):
    """Decode rows' GEMV: what F.linear computes (fp32 sums of the weight's values, one rounding to x's dtype), and a
    row's result bit for bit the same whatever rows come with it."""
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g).to(dtype), (0.1 * torch.randn(N, K, generator=g)).to(dtype)
    got = cpu_ops.linear_rows(x, w)
    want = F.linear(x.double(), w.double())
    assert got.dtype == dtype and got.shape == (M, N)
    ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-22}[dtype]
    assert ((got.double() - want).abs() <= want.abs() * ulp + 1e-6 * want.abs().max()).all()
    for m in range(M):
        assert torch.equal(cpu_ops.linear_rows(x[m : m + 1], w), got[m : m + 1])


@pytest.mark.parametrize(
    "shape, dtype, weight_dtype",
    [
        ((1, 1024), torch.float32, torch.bfloat16),  # the residual stream, a bf16 checkpoint's weight
        ((600, 1024), torch.float32, torch.bfloat16),  # a prefill chunk: rows on several threads
        ((3, 5, 384), torch.bfloat16, torch.bfloat16),
        ((7, 100), torch.float16, torch.float16),
        ((4, 37), torch.float32, torch.float32),
    ],
)
def test_the_rmsnorm_op_meets_the_reference_and_each_row_is_alone(shape, dtype, weight_dtype):
    """KimiRMSNorm as one op: the reference's dtype and shape, within rounding of it (another summation order), and a
    row's result bit for bit the same whatever rows come with it."""
    g = torch.Generator().manual_seed(shape[-1])
    x, w = (3 * torch.randn(shape, generator=g)).to(dtype), torch.randn(shape[-1], generator=g).to(weight_dtype)
    got, want = cpu_ops.rmsnorm(x, w, 1e-5), rmsnorm(x, w, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}[dtype]
    assert (got.float() - want.float()).abs().max() <= ulp * want.float().abs().max()
    rows = x.reshape(-1, shape[-1])
    assert torch.equal(cpu_ops.rmsnorm(rows[-1:], w, 1e-5), got.reshape(-1, shape[-1])[-1:])


@pytest.mark.parametrize("banked", [0, 1, 4])
def test_the_mixing_site_op_meets_the_reference(banked):
    """K3's mixing site as one op: p itself while the bank is empty, else within rounding of the reference's
    softmax mixture, a row's result the same alone."""
    g = torch.Generator().manual_seed(banked)
    bank = tuple(torch.randn(5, 256, generator=g) for _ in range(banked))
    p, score = torch.randn(5, 256, generator=g), torch.randn(256, generator=g)
    got = cpu_ops.res_mix(p, bank, score, 1e-5)
    if not banked:
        assert got is p
        return
    want = res_mix(p, bank, score, 1e-5)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(cpu_ops.res_mix(p[2:3], tuple(b[2:3] for b in bank), score, 1e-5), got[2:3])


@pytest.mark.parametrize("act", [SILU, SiTU(4.0, 25.0)], ids=["silu", "situ"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 40])
def test_the_glu_op_is_the_activation_of_gate_and_up(act, dtype, rows):
    """A gated MLP's activation as one op: the reference's dtype and shape, within one rounding of it (its vector
    exp and tanh may differ from torch's in the last bit), and a row's result the same alone."""
    g = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * 72, generator=g)).to(dtype)
    got, want = cpu_ops.glu(gate_up, act), glu(gate_up, act)
    assert got.dtype == want.dtype and got.shape == want.shape == (rows, 72)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}[dtype]
    assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-6).all()
    assert torch.equal(cpu_ops.glu(gate_up[-1:], act), got[-1:])


@pytest.mark.parametrize("N, E, k", [(1, 64, 16), (8, 64, 16), (300, 64, 8), (3, 256, 8)])
@pytest.mark.parametrize("renormalize, biased, scale", [(True, False, 1.0), (False, True, 2.5)])
def test_moe_route_chooses_as_the_torch_router(N, E, k, renormalize, biased, scale):
    """The router's choice as one op: the same experts, best first (the reference's sorted order), and the same
    weights to fp32 rounding (its sums run in another order)."""
    g = torch.Generator().manual_seed(N * E + k)
    x, gate = torch.randn(N, 128, generator=g), 0.1 * torch.randn(E, 128, generator=g)
    bias = 0.01 * torch.randn(E, generator=g)
    want_ids, want = route(x, gate, bias, k, 1, 1, renormalize, scale, biased, sort=True)
    ids, weights = route(x, gate, bias, k, 1, 1, renormalize, scale, biased, choose=cpu_ops.moe_route)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    assert (weights - want).abs().max().item() <= 1e-6 * scale
