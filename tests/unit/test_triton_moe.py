"""The Triton routed-experts kernels (kernels/moe_triton.py) against the torch oracle (kernels/moe.py experts_loop on
the dequantized stack), MXFP4-packed and dense, SiLU and SiTU.

Without CUDA they run under Triton's CPU interpreter (TRITON_INTERPRET=1, set before the kernels import) at small
widths; the `gpu` test repeats them at the K3 twin's widths on CUDA. Exactness, path by path: packed against dense
through the same kernel, bit for bit (the tile is widened to the dequantized values, then multiplied as a dense tile
is); against the oracle, within 1e-5 of the largest output in fp32 (summation order only), within one bf16 rounding
(2^-7 of it) in bf16.
"""

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

from k3dist.kernels.activation import SILU, SiTU  # noqa: E402
from k3dist.kernels.moe import experts_loop  # noqa: E402
from k3dist.kernels.moe_triton import (  # noqa: E402
    BM,
    experts_gathered,
    experts_grouped,
    moe_experts,
    sorted_blocks,
)
from k3dist.kernels.mxfp4 import PackedExperts  # noqa: E402
from tests.support.moe_cases import case, rank_slice  # noqa: E402
from tests.support.tiers import slow_but  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K3_SITU = SiTU(4.0, 25.0)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def _on(c, device):
    move = lambda w: PackedExperts(w.packed.to(device), w.scale.to(device), w.dtype)  # noqa: E731
    return c.z.to(device), c.ids.to(device), c.weights.to(device), move(c.w13), move(c.w2)


def _check(path, c, act, dtype, device=DEV) -> None:
    z, ids, weights, w13, w2 = _on(c, device)
    d13, d2 = (d.to(device) for d in c.dense())
    got = path(z, ids, weights, w13, w2, act)
    assert got.dtype == torch.float32 and got.shape == z.shape and torch.isfinite(got).all()
    assert torch.equal(got, path(z, ids, weights, d13, d2, act))
    want = experts_loop(z, ids, weights, d13, d2, act)
    assert (got - want).abs().max() <= TOL[dtype] * want.abs().max()


def test_sorted_blocks_group_every_pair_once_padded_per_expert():
    ids = torch.tensor([[3, 0], [3, 5], [0, 3]])  # expert 3 thrice, 0 twice, 5 once; 1, 2, 4 never
    pairs, experts = sorted_blocks(ids, 6, block=4)
    flat = ids.reshape(-1)
    live = pairs[pairs >= 0]
    assert sorted(live.tolist()) == list(range(6))
    for b, e in enumerate(experts.tolist()):
        block = pairs[b * 4 : (b + 1) * 4]
        members = block[block >= 0]
        assert (flat[members] == e).all() if e < 6 else not len(members)  # past the last group: empty blocks
    assert experts.tolist() == [0, 3, 5, 6, 6, 6] and len(pairs) == 6 + 6 * 3  # padded_rows: pairs + min(E, pairs) 3


POINTS = [(p, a, d) for p in ("gathered", "grouped") for a in ("silu", "situ") for d in ("fp32", "bf16")]


@pytest.mark.parametrize(
    "path, act, dtype", slow_but(POINTS, [("gathered", "silu", "fp32"), ("grouped", "situ", "bf16")], ids="-".join)
)
def test_packed_kernels_equal_dense_ones_and_the_oracle(path, act, dtype):
    """top-16 of 64 experts, 3 tokens (most experts chosen by none)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    c = case(3, 64, 16, 64, 64, dtype, seed=3)
    fn = {"gathered": experts_gathered, "grouped": experts_grouped}[path]
    _check(fn, c, {"silu": SILU, "situ": K3_SITU}[act], dtype)


@pytest.mark.parametrize("world", slow_but([2, 4], [2]))
def test_a_tp_slice_runs_alone(world):
    """A rank's expert width I / world (whole MXFP4 groups), 5 tokens on 6 of 8 experts, grouped in blocks of BM."""
    c = case(5, 8, 4, 64, 128, torch.float32, seed=world, used=6)
    for rank in range(world):
        _check(experts_grouped, rank_slice(c, rank, world), K3_SITU, torch.float32)


def test_the_choice_of_kernel_depends_on_shapes_only():
    c = case(2, 64, 4, 64, 32, torch.float32, seed=5)  # 8 pairs < 64 experts: gathered
    z, ids, weights, w13, w2 = _on(c, DEV)
    assert torch.equal(moe_experts(z, ids, weights, w13, w2, act=SILU), experts_gathered(z, ids, weights, w13, w2))
    assert BM >= 16  # tl.dot's smallest tile


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_twin_widths_on_cuda(dtype):
    """The K3 twin's latent and expert widths, top-16 of 64, decode and a prefill chunk."""
    for N, fn in ((1, experts_gathered), (8, experts_gathered), (96, experts_grouped)):
        _check(fn, case(N, 64, 16, 512, 128, dtype, seed=N), K3_SITU, dtype, torch.device("cuda"))
