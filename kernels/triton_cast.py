"""Round-to-nearest-even casts for Triton kernels that must reproduce torch's roundings.

On GPUs `x.to(tl.bfloat16)` rounds to nearest even, like torch; Triton's CPU interpreter truncates instead, which
would make the interpreter tests disagree with the GPU by an ulp on half the values. `round_to` rounds fp32 to
bf16 with integer ops (same bits as the hardware conversion, NaN kept) and defers to `.to` for every other dtype
(fp16 and fp32 round to nearest even in both places).
"""

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """x: fp32 tensor; returns it rounded to `dtype` (nearest, ties to even)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x == x, rounded, x.to(tl.bfloat16))
    else:
        return x.to(dtype)
