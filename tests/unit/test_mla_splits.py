"""How kernels/mla_triton.py splits a long cache across programs (issue 38: at 32,768 rows and batch 1 it lost to the
torch reference on an H200). The grid is fixed by the batch and the capacity, one wave of programs over the SMs; each
sequence uses only the slices its live length fills, and the merge reads only those. Without CUDA the kernels run
under Triton's interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="pip install -e '.[gpu]' to test the Triton kernels")

from k3dist.kernels.mla import mla_decode as mla_ref  # noqa: E402
from k3dist.kernels.mla_triton import (  # noqa: E402
    MIN_SLICE_BLOCKS,
    _mla_decode,
    block_rows,
    live_splits,
    split_count,
)

H200_SMS = 132
BL = block_rows(512, 2)  # the 48B model's r = 512 in bf16: 32 rows a block


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("cap", [4096, 32768, 131072])
def test_one_wave_of_programs_whatever_the_capacity(batch, cap):
    """B x S programs never need a second wave on the SMs (the old choice, two programs per SM, ran 264 slices of four
    blocks at 32,768 rows and batch 1: two waves, then a 264-way merge by 32 programs), and no slice is shorter than
    MIN_SLICE_BLOCKS blocks of the capacity."""
    S = split_count(batch, cap, BL, H200_SMS)
    assert batch * S < H200_SMS + batch
    assert S * MIN_SLICE_BLOCKS * BL <= max(cap, MIN_SLICE_BLOCKS * BL)
    assert S == -(-cap // (MIN_SLICE_BLOCKS * BL)) or batch * S > H200_SMS - batch  # full where the capacity allows


def test_the_split_at_the_lengths_the_h200_ran():
    assert BL == 32
    assert split_count(1, 32768, BL, H200_SMS) == 132  # was 264: two waves, then a 264-way merge by 32 programs
    assert split_count(1, 4096, BL, H200_SMS) == 64
    assert split_count(64, 32768, BL, H200_SMS) == 3
    assert split_count(1, 256, BL, H200_SMS) == 4


@pytest.mark.parametrize(
    "length, live",
    [
        (32768, 128),  # full: 128 slices of 8 blocks (of 132 programs: 4 have no rows and return at once)
        (64, 1),  # short in a long cache: one program, a merge of one slice
        (8192, 128),  # a quarter filled: 128 slices of 2 blocks, not 132 slices of one block or none
        (2048, 32),  # a sixteenth: 32 slices of 2 blocks
        (160, 3),
    ],
)
def test_live_slices_follow_the_length_not_the_capacity(length, live):
    assert live_splits(length, split_count(1, 32768, BL, H200_SMS), BL) == live


def test_the_merge_reads_only_the_live_slices():
    """Long, short and partly filled sequences in one cache, on the fixed grid: slices past a sequence's live ones
    are never written, and their partials (NaN here) never reach the result."""
    B, H, r, dr, cap, block = 3, 4, 32, 16, 2048, 16
    S = split_count(B, cap, block, sms=48)
    lengths = torch.tensor([cap, 20, 200])
    assert S == 16 and [live_splits(int(n), S, block) for n in lengths] == [16, 1, 7]
    gen = torch.Generator().manual_seed(0)
    q_nope, q_pe = torch.randn(B, H, r, generator=gen), torch.randn(B, H, dr, generator=gen)
    latent = torch.randn(B, cap, r + dr, generator=gen)
    scale = (r + dr) ** -0.5
    got = _mla_decode(q_nope, q_pe, latent, lengths, scale, block_l=block, num_splits=S, partials_fill=float("nan"))
    want = mla_ref(q_nope, q_pe, latent, lengths, scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
