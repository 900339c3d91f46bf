"""MXFP4 as compressed-tensors packs K3's experts: the nibble order and code table, exactness of the dequantized
values in bf16, the byte round trip, the quantizer's scale and rounding, and gguf-py's dequantizer as a second,
independent decoder (where gguf imports)."""

import pytest
import torch

from k3dist.weights.mxfp4 import E2M1, GROUP, dequantize, pack_codes, quantize, scale_values, unpack_codes

ALL_BYTES = torch.arange(256, dtype=torch.uint8)


def every_code_at_every_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """One row per E8M0 scale (0..255), each row holding every byte value (so every code in both nibbles)."""
    packed = ALL_BYTES.repeat(256, 1)  # [256 rows, 256 bytes] = 512 values a row, 16 groups
    scale = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 512 // GROUP)
    return packed, scale


def test_pack_of_unpack_is_the_same_bytes():
    packed = torch.randint(0, 256, (3, 7, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pack_codes(unpack_codes(packed)), packed)
    assert torch.equal(pack_codes(unpack_codes(ALL_BYTES)), ALL_BYTES)


def test_element_2i_is_the_low_nibble_and_bit_3_the_sign():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x21  # element 0: code 1 (0.5), element 1: code 2 (1.0)
    packed[0, 1] = 0xF9  # element 2: code 9 (-0.5), element 3: code 15 (-6)
    packed[0, 2] = 0x07  # element 4: code 7 (6), element 5: code 0
    w = dequantize(packed, torch.tensor([[128]], dtype=torch.uint8))  # scale 2^(128 - 127) = 2
    assert w[0, :6].tolist() == [1.0, 2.0, -1.0, -12.0, 12.0, 0.0]
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # 32 values: every code twice
    table = dequantize(pack_codes(codes).unsqueeze(0), torch.tensor([[127]], dtype=torch.uint8))[0, :16]
    assert table.tolist() == list(E2M1) + [-v for v in E2M1]
    assert table[8].item() == 0.0 and not table[8].signbit()  # code 8, a negative zero, reads as +0 (as ggml's)


def test_every_dequantized_value_is_exact_in_bf16():
    packed, scale = every_code_at_every_scale()
    w = dequantize(packed, scale)
    finite = torch.isfinite(w)
    assert finite[:253].all() and not finite[253].all()  # from scale 253 on, 6 * 2^(s - 127) passes fp32's max
    assert torch.equal(w.to(torch.bfloat16).float(), w)
    assert torch.equal(dequantize(packed, scale, torch.bfloat16).float(), w)
    assert (w[:, 0::2][:, :1] == 0).all() and w[0, 2] == 2**-128  # code 1 at scale 0: 0.5 * 2^-127, subnormal


def test_scale_values_are_exact_powers_of_two():
    s = scale_values(torch.arange(256, dtype=torch.uint8)).double()
    assert torch.equal(s, torch.pow(2.0, torch.arange(256, dtype=torch.float64) - 128))


def test_quantize_picks_the_smallest_scale_that_holds_the_group_and_rounds_to_nearest_even():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    w[5, :32] = 0  # an all-zero group
    packed, scale = quantize(w)
    assert packed.shape == (64, 128) and scale.shape == (64, 8) and packed.dtype == scale.dtype == torch.uint8
    step = 2.0 ** (scale.double() - 127)
    amax = w.double().abs().unflatten(-1, (8, GROUP)).amax(-1)
    nonzero = amax > 0
    assert (6 * step >= amax)[nonzero].all() and (3 * step < amax)[nonzero].all()  # fits; half the scale would not
    assert scale[5, 0] == 0 and (dequantize(packed, scale)[5, :32] == 0).all()
    grid = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)
    candidates = grid * step.repeat_interleave(GROUP, -1).unsqueeze(-1)  # every value the group could hold
    best = (candidates - w.double().unsqueeze(-1)).abs().amin(-1)
    assert torch.equal((dequantize(packed, scale).double() - w.double()).abs(), best)
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0] + [0.0] * 23])
    assert dequantize(*quantize(ties))[0, :9].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0]
    again = dequantize(packed, scale)
    assert torch.equal(dequantize(*quantize(again)), again)  # dequantized values quantize to themselves


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="must be torch.uint8"):
        unpack_codes(torch.zeros(2, 16, dtype=torch.int8))
    with pytest.raises(ValueError, match="needs weight_scale"):
        dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.ones(2, 48))
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.full((1, 32), float("inf")))


def ggml_blocks(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """ggml's block_mxfp4 bytes [rows, groups * 17]: per group its E8M0 byte, then 16 bytes whose byte j holds
    element j in the low nibble and element j + 16 in the high one (llama.cpp repacks compressed-tensors so)."""
    rows, groups = scale.shape
    codes = unpack_codes(packed).view(rows, groups, GROUP)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scale.unsqueeze(-1), qs], -1).view(rows, groups * 17)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # scales 253-255, as ours
def test_gguf_py_dequantizes_the_same_bits():
    quants = pytest.importorskip("gguf.quants", reason="gguf (gguf-py) is not installed")
    from gguf import GGMLQuantizationType

    packed, scale = every_code_at_every_scale()
    random = torch.randint(0, 256, (64, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    for p, s in ((packed, scale), (random, torch.randint(100, 140, (64, 16), dtype=torch.uint8))):
        theirs = quants.dequantize(ggml_blocks(p, s).numpy(), GGMLQuantizationType.MXFP4)
        ours = dequantize(p, s)
        assert torch.equal(torch.from_numpy(theirs).view(torch.int32), ours.view(torch.int32))
