"""MXFP4 as compressed-tensors stores it (`mxfp4-pack-quantized`, K3's routed experts): pack, unpack, quantize.

A logical weight [out, in] is two uint8 tensors: `weight_packed` [out, in/2], two 4-bit E2M1 codes a byte (element
2i in the low nibble, 2i+1 in the high one), and `weight_scale` [out, in/32], one E8M0 exponent per 32 consecutive
inputs. A code's low 3 bits index {0, 0.5, 1, 1.5, 2, 3, 4, 6}, bit 3 is the sign; the weight is
E2M1(code) * 2^(scale - 127). There is no global scale and no zero point.

Dequantization is exact: a value has at most two significant bits, so it is exactly representable in fp32 and in
bf16 (whose exponent range is fp32's). It is computed as ggml computes it (doubled E2M1 values times 2^(scale - 128),
one fp32 multiply, code 8, a negative zero, read as +0), so every code at every scale gives the same bits as ggml's
MXFP4 blocks after llama.cpp's lossless repack, even where E8M0's top scales overflow the largest codes to inf.
"""

import torch

from ..config import MXFP4_GROUP as GROUP  # inputs per E8M0 scale

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes by the code's low 3 bits
SIGN = 8  # bit 3 of a code


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> uint8 codes [..., n]: element 2i from the low nibble, 2i+1 from the high one."""
    _check_uint8(packed, "weight_packed")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (each < 16, n even) -> uint8 [..., n/2]; the inverse of unpack_codes."""
    _check_uint8(codes, "codes")
    if codes.shape[-1] % 2:
        raise ValueError(f"MXFP4 codes: last dim {codes.shape[-1]} must be even")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 [...] -> fp32 2^(scale - 128), built from its bits (ggml's e8m0_to_fp32_half): exact everywhere,
    subnormal for scale 0 and 1."""
    _check_uint8(scale, "weight_scale")
    s = scale.to(torch.int32)
    bits = torch.where(s < 2, torch.tensor(0x00200000, dtype=torch.int32) << s, (s - 1) << 23)
    return bits.view(torch.float32)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`weight_packed` [..., out, in/2] and `weight_scale` [..., out, in/32] -> the weight [..., out, in] in `dtype`.

    Exact in fp32 and bf16 (see the module docstring); float16's narrower range may not hold every value.
    """
    codes = unpack_codes(packed)
    n = codes.shape[-1]
    if scale.shape[:-1] != codes.shape[:-1] or scale.shape[-1] * GROUP != n:
        raise ValueError(
            f"MXFP4: weight_packed {tuple(packed.shape)} (in={n}) needs weight_scale "
            f"{(*codes.shape[:-1], n // GROUP)}, got {tuple(scale.shape)}"
        )
    doubled = torch.tensor([2 * v for v in E2M1] + [-2 * v or 0.0 for v in E2M1], dtype=torch.float32)
    values = doubled[codes.long()].unflatten(-1, (n // GROUP, GROUP))
    return (values * scale_values(scale).unsqueeze(-1)).flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [..., out, in] (in a multiple of 32) -> (`weight_packed`, `weight_scale`).

    Each group of 32 gets the smallest E8M0 scale at which its largest magnitude fits under 6 (so nothing clips),
    and each value rounds to the nearest E2M1 step, ties to even (OCP MX). An all-zero group gets scale 0.
    """
    w = weight.float()
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4: the input dim {w.shape[-1]} must be a multiple of {GROUP}")
    if not torch.isfinite(w).all():
        raise ValueError("MXFP4: the weight holds a non-finite value")
    groups = w.unflatten(-1, (w.shape[-1] // GROUP, GROUP))
    amax = groups.abs().amax(-1)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, 0.5 <= m < 1, so 6 * 2^(exp - 3) = 0.75 * 2^exp
    s = 127 + exp - 3 + (amax > torch.ldexp(torch.full_like(amax, 0.75), exp)).to(exp.dtype)
    s = torch.where(amax > 0, s, 0)
    if (s < 0).any() or (s > 254).any():
        raise ValueError("MXFP4: a group's largest magnitude is outside E8M0's range")
    scale = s.to(torch.uint8)
    ratio = groups / (2 * scale_values(scale)).unsqueeze(-1)  # exact: a power of two; |ratio| <= 6
    mag = ratio.abs()
    # E2M1 steps are 0.5 below 2, 1 below 4, 2 up to 6; torch.round rounds half to even, which on these grids is
    # OCP's ties-to-even, so each band rounds on its own grid and the band's offset gives the code.
    idx = torch.where(
        mag < 2, torch.round(mag * 2), torch.where(mag < 4, torch.round(mag) + 2, torch.round(mag / 2) + 4)
    )
    codes = (idx.to(torch.uint8) | torch.where((ratio < 0) & (idx > 0), SIGN, 0).to(torch.uint8)).to(torch.uint8)
    return pack_codes(codes.flatten(-2)), scale


def _check_uint8(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.uint8:
        raise ValueError(f"MXFP4 {what}: dtype {t.dtype} must be torch.uint8")
