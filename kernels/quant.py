"""Weight-only int8 (`model.quant=int8`): per-output-channel symmetric scales, activations in the compute dtype.

A batch-1 decode step is memory-bound, so halving the weight bytes it streams is what llama.cpp's Q8_0 buys its users.
Here a weight becomes int8 [out, in] plus one scale per output row (in the compute dtype, as torch's
`_weight_int8pack_mm` takes it); that op multiplies bf16 activations by int8 weights with fp32 accumulation. The
scale is rounded to the compute dtype before the weights are divided by it, so the dequantised weight is exactly
q x scale and the error is the rounding of q alone (at most half a step: |w| max / 254 per row).
"""

import torch
import torch.nn.functional as F
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


DECODE_ROWS = 8  # inputs of at most this many rows (decode) take the int8 GEMM; wider ones (prefill) the blocks below
ALIGN = 16  # torch 2.13's CPU _weight_int8pack_mm reads garbage or crashes unless in % 16 == 0 (and checks nothing)
BLOCK = 4096  # weight rows dequantised at a time for a wide input: the bf16 transient stays BLOCK x in


class Int8Linear:
    """kernels.linear.Linear's interface over an int8 weight (made here, at bind time, from the compute-dtype one).

    Decode rows go through torch's `_weight_int8pack_mm` (int8 read once, fp32 accumulation), a single row through
    `one_row` where the backend has it (the CPU ops' int8_mm: the same sums at the memory bandwidth). A prefill chunk is
    compute-bound, where that op is several times slower than the bf16 GEMM: there the weight is widened a block of
    rows at a time (int8 is exact in bf16), multiplied by the bf16 GEMM and scaled per output, so no full-size copy
    of the weight ever exists."""

    def __init__(self, weight: Tensor, one_row=None):
        self.shape = weight.shape
        self.weight, self.scales = quantize_int8(weight)
        self.direct = weight.shape[1] % ALIGN == 0
        self.one_row = one_row

    def __call__(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] == 1 and self.one_row is not None:
            y = self.one_row(flat, self.weight, self.scales)
        elif flat.shape[0] <= DECODE_ROWS and self.direct:
            y = int8_mm(flat.contiguous(), self.weight, self.scales)
        else:
            y = flat.new_empty(flat.shape[0], self.shape[0])
            for a in range(0, self.shape[0], BLOCK):
                w, s = self.weight[a : a + BLOCK].to(x.dtype), self.scales[a : a + BLOCK].float()
                y[:, a : a + BLOCK] = F.linear(flat, w).float() * s
        return y.view(*x.shape[:-1], self.shape[0])
