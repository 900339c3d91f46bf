"""The two MoE paths without host syncs (decode: gathered expert weights; prefill: tokens sorted by expert, grouped
GEMMs) equal a loop over experts, and MoE's routing honours groups, bias and renormalisation."""

import pytest
import torch
from k3dist.kernels.moe import experts_gathered, experts_grouped, experts_loop, experts_sorted


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
    torch.testing.assert_close(experts_sorted(x, ids, weights, w13, w2), experts_loop(x, ids, weights, w13, w2))
