"""The MoE paths without host syncs (decode: gathered expert weights; prefill: tokens sorted by expert, grouped
GEMMs; dense experts where a batch covers them) equal a loop over experts; the two-stage top-k of the logits; short
prefill pieces through the one-op CPU block."""

import pytest
import torch

from k3dist.kernels import cpu_ops
from k3dist.kernels.moe import experts_gathered, experts_grouped, experts_loop, experts_sorted
from k3dist.model.experts import ONE_OP_PREFILL, ONE_OP_TOKENS, DenseExperts, dense_wanted
from k3dist.model.linear import packable
from k3dist.model.moe import MoE
from tests.support.configs import small_config
from tests.support.models import random_model


def _case(N: int, E: int = 12, k: int = 3, D: int = 64, I: int = 32, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (0.1 * torch.randn(E, 2 * I, D, generator=gen)).to(dtype)
    w2 = (0.1 * torch.randn(E, D, I, generator=gen)).to(dtype)
    x = torch.randn(N, D, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=gen)
    return x, ids, weights, w13, w2


@pytest.mark.parametrize("N", [1, 3, 8, 64])
@pytest.mark.parametrize(
    "path", [experts_gathered, experts_sorted, experts_grouped], ids=["gathered", "sorted", "grouped"]
)
def test_paths_equal_the_expert_loop(N, path):
    x, ids, weights, w13, w2 = _case(N)
    want = experts_loop(x, ids, weights, w13, w2)
    got = path(x, ids, weights, w13, w2)
    assert got.dtype == torch.float32 and got.shape == (N, x.shape[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_grouped_path_with_empty_experts_and_bf16():
    x, ids, weights, w13, w2 = _case(5, E=32, k=2, dtype=torch.bfloat16, seed=3)  # most experts get no token
    want = experts_loop(x, ids, weights, w13, w2)
    for path in (experts_gathered, experts_sorted, experts_grouped):
        got = path(x, ids, weights, w13, w2)
        assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_sorted_path_falls_back_where_the_grouped_kernel_cannot_run():
    x, ids, weights, w13, w2 = _case(6, D=48, I=20)  # 40-byte rows: not the 16-byte strides _grouped_mm needs
    for path in (experts_sorted, experts_grouped):
        torch.testing.assert_close(path(x, ids, weights, w13, w2), experts_loop(x, ids, weights, w13, w2))


@pytest.mark.parametrize("N", [1, 5, 16])
def test_dense_experts_equal_the_expert_loop(N):
    """Every expert for every token, routing weights zero where not chosen: the loop's sum (fp32, plain weights)."""
    x, ids, weights, w13, w2 = _case(N)
    dense = DenseExperts(w13, w2, pack=False)
    got = dense(x, ids, weights)
    assert got.dtype == torch.float32 and got.shape == (N, x.shape[1])
    torch.testing.assert_close(got, experts_loop(x, ids, weights, w13, w2), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not packable(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 on this CPU")
def test_dense_experts_packed_bf16_within_one_rounding_of_the_loop():
    """Packed bf16 weights: the weighted activations round once before w2 where the loop rounds each expert's
    output; the difference stays within bf16 rounding of the result."""
    x, ids, weights, w13, w2 = _case(16, E=16, k=2, D=128, I=64, dtype=torch.bfloat16, seed=5)
    want = experts_loop(x, ids, weights, w13, w2)
    got = DenseExperts(w13, w2, pack=True)(x, ids, weights)
    assert (got - want).abs().max() <= 0.01 * want.abs().max()
    exact = experts_loop(x.float(), ids, weights, w13.float(), w2.float())
    assert (got - exact).abs().max() <= 1.5 * (want - exact).abs().max() + 1e-6  # no farther from fp32 than the loop


def test_dense_only_where_the_batch_covers_few_experts_and_weights_are_packed():
    assert dense_wanted(experts=16, top_k=2, batch=8, pack=True)
    assert not dense_wanted(experts=16, top_k=2, batch=7, pack=True)  # 14 pairs < 16 experts: gathered
    assert not dense_wanted(experts=16, top_k=2, batch=8, pack=False)  # plain weights: the stacked paths
    assert not dense_wanted(experts=256, top_k=8, batch=64, pack=True)  # prefill would compute 32x the FLOPs


@pytest.mark.parametrize("V", [128 * 40, 128 * 40 + 3, 300])
def test_two_stage_topk_gives_the_top_values(V):
    """Block maxima first, then the top-k of the chosen blocks: the same values as topk (ids: same values), with
    ties made common by rounding; vocab widths that do not split into blocks take the plain topk."""
    from k3dist.model.tp import _topk

    gen = torch.Generator().manual_seed(V)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(4, V, generator=gen) * 2).round().to(dtype)  # many ties
        x[1, 7] = float("nan")  # NaN ranks first, as in topk: the engine's finiteness check still sees it
        for k in (1, 5):
            want, _ = x.topk(k, dim=-1)
            got, ids = _topk(x, k)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(x.gather(1, ids), got, rtol=0, atol=0, equal_nan=True)
            assert all(len(set(row.tolist())) == k for row in ids)


@pytest.mark.skipif(not cpu_ops.available(), reason="the CPU ops do not build here")
def test_short_prefill_pieces_take_the_one_op_block_and_agree_with_the_grouped_gemms():
    _, model, _ = random_model(small_config(), backend="auto", seed=3)
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE) and layer.mlp.kernel is not None]
    assert moes, "the small config's MoE layers take the one-op block"
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, ONE_OP_TOKENS + 3, ONE_OP_PREFILL, ONE_OP_PREFILL + 1):
        x = torch.randn(1, tokens, moes[0].gate.shape[1], generator=gen)
        with torch.inference_mode():
            got, grouped = moes[0].prefill(x), moes[0]._forward(x, moes[0]._chunk)
            blocks = [moes[0]._one_op(x[0, a : a + ONE_OP_TOKENS]) for a in range(0, tokens, ONE_OP_TOKENS)]
        torch.testing.assert_close(got, grouped, rtol=1e-5, atol=1e-5)
        want = torch.cat(blocks).view(x.shape) if tokens <= ONE_OP_PREFILL else grouped
        assert torch.equal(got, want)
