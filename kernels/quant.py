"""Weight-only int8 (`model.quant=int8`): per-output-channel symmetric scales, activations in the compute dtype.

A batch-1 decode step is memory-bound, so halving the weight bytes it streams is what llama.cpp's Q8_0 buys its users.
Here a weight becomes int8 [out, in] plus one scale per output row (in the compute dtype, as torch's
`_weight_int8pack_mm` takes it); that op multiplies bf16 activations by int8 weights with fp32 accumulation. The
scale is rounded to the compute dtype before the weights are divided by it, so the dequantised weight is exactly
q x scale and the error is the rounding of q alone (at most half a step: |w| max / 254 per row).
"""

import torch
from torch import Tensor

ROWS = 8192  # rows quantised at a time: the fp32 transient stays ROWS x in x 4 bytes (32 MiB at in = 1024)


def quantize_int8(weight: Tensor, rows: int = ROWS) -> tuple[Tensor, Tensor]:
    """[out, in] float -> (int8 [out, in], scales [out] in weight's dtype), a block of rows at a time."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device)
    tiny = torch.finfo(weight.dtype).tiny
    for a in range(0, weight.shape[0], rows):
        w = weight[a : a + rows].float()
        s = (w.abs().amax(dim=1) / 127.0).clamp_min(tiny).to(weight.dtype)
        q[a : a + rows] = (w / s.float().unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
        scales[a : a + rows] = s
    return q, scales


def dequantize(q: Tensor, scales: Tensor) -> Tensor:
    """The weight an int8 Linear multiplies by, in fp32 (tests, accuracy checks)."""
    return q.float() * scales.float().unsqueeze(1)


def int8_bytes(rows: int, cols: int, dtype: torch.dtype) -> int:
    """What an int8 weight of [rows, cols] holds: the int8 values and one scale per row."""
    return rows * cols + rows * dtype.itemsize


def int8_mm(x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
    """x [M, in] (compute dtype) times the int8 weight's transpose: [M, out] in x's dtype."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scales)
