"""The weights the model multiplies by: plain `F.linear`, oneDNN's prepacked layout on CPUs with bf16 units, or
weight-only int8 (`model.quant=int8`). These are the model's holders of its weights; the arithmetic they call is in
kernels/ (kernels/quant.py for int8).

Widening: on a CPU without bf16 (or fp16) units, torch's low-precision GEMM runs several times slower than the fp32
GEMM over the same values (BENCHMARKS.md, "Measurements behind the code"). There a prefill's projections widen the
input and a block of WIDE_BLOCK weight rows at a time to fp32: fp32 products of bf16 values summed in fp32 are what
the bf16 GEMM computes too, and the result is rounded once to the compute dtype as it rounds it. Decode rows keep the
low-precision weight: they stream it, through the CPU ops' `linear_rows` (each weight row read once at the memory
bandwidth for every row of the batch, fp32 sums, one rounding) where they built, else torch's GEMM.

Prepacking: on CPUs with bf16 units torch's bf16 `F.linear` reads the weight at well under the memory bandwidth for one
token; the same oneDNN kernel on a weight reordered once at bind time streams it faster, with bit-identical results
(BENCHMARKS.md). The packed copy replaces the plain one, so it costs memory only while it is made (the plan's
`derived_bytes`). Packed weights are opaque to torch.compile, so a compiled step keeps plain ones. On a CPU with AMX
a run of up to ROWS_OP_MAX slots keeps plain weights instead (`packs`): there the decode-rows op multiplies them on
AMX tiles as they are stored, at the memory's rate, faster than oneDNN reads its packed layout for a few rows, and
oneDNN's prefill GEMMs read plain weights in place.

A decode row through `linear_rows` gives the same values whatever rows come with it (batch invariance).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..base import compat
from ..kernels.quant import int8_mm, quantize_int8


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether packing pays here: bf16 on a CPU whose oneDNN has bf16 kernels."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


DECODE_ROWS = 8  # inputs of at most this many rows (decode) take the plain (or int8) GEMM; wider ones are blocked
ROWS_OP_MAX = 16  # the most rows `linear_rows` takes (kernels/csrc/linear_rows.cpp)
PLAIN_SLOTS = ROWS_OP_MAX  # the most decode rows for which plain weights and the decode-rows op beat packed ones on AMX


def has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch's own probe; False on a torch without it)."""
    return compat.amx_tile_supported()


def packs(dtype: torch.dtype, device: torch.device, batch: int, rows_op: bool) -> bool:
    """Whether a run of `batch` slots packs its weights: where packing pays (`packable`), but not on a CPU with AMX
    decoding at most PLAIN_SLOTS rows through the decode-rows op (`rows_op`). oneDNN's bf16 GEMM there reads a packed
    weight well under the memory's rate for a few rows, where the op's tiles take the plain weight as their A operand
    and stream it near that rate for any row count up to 16 (BENCHMARKS.md, "Measurements behind the code"). Plain
    weights cost no memory beyond their own: oneDNN's prefill GEMMs read them in place."""
    amx = device.type == "cpu" and has_amx()
    return packable(dtype, device) and not (amx and rows_op and batch <= PLAIN_SLOTS)


def widened(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a prefill's GEMMs widen to fp32 here: bf16 or fp16 on a CPU whose oneDNN has no units for it."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported()


WIDE_BLOCK = 1024  # weight rows widened to fp32 at a time: the transient stays WIDE_BLOCK x in x 4 bytes


def widened_linear(x: Tensor, weight: Tensor, block: int = WIDE_BLOCK) -> Tensor:
    """x @ weight^T in fp32, `block` weight rows widened at a time; rounded once to x's dtype."""
    flat = x.reshape(-1, x.shape[-1]).float()
    y = x.new_empty(flat.shape[0], weight.shape[0])
    for a in range(0, weight.shape[0], block):
        y[:, a : a + block] = F.linear(flat, weight[a : a + block].float())
    return y.view(*x.shape[:-1], weight.shape[0])


# fp32 rows too: torch's fp32 GEMM rounds a row's sums differently by how many rows come with it on some CPUs (an
# AMX Xeon: 1 row against 2), so a prompt's first logits would depend on which others finished in its window
ROWS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Linear:
    """x @ weight^T for a [out, in] weight: plain, prepacked, or widened for prefill (`widen`); a plain
    low-precision weight's decode rows go through `rows` where the backend has it (Kernels.linear_rows)."""

    def __init__(self, weight: Tensor, pack: bool = False, widen: bool = False, rows=None):
        self.shape = weight.shape
        self.packed, self.widen = pack, widen and not pack
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if pack else weight
        plain = not pack and weight.dtype in ROWS_DTYPES and weight.is_contiguous() and weight.device.type == "cpu"
        self.rows = rows if plain else None

    def __call__(self, x: Tensor) -> Tensor:
        n = x.numel() // x.shape[-1]
        if self.rows is not None and n <= ROWS_OP_MAX:
            return self.rows(x.reshape(n, -1), self.weight).view(*x.shape[:-1], self.shape[0])
        if self.widen and n > DECODE_ROWS:
            return widened_linear(x, self.weight)
        if not self.packed:
            return F.linear(x, self.weight)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.weight, None, "none", [], "")
        return y.view(*x.shape[:-1], self.shape[0])


ALIGN = 16  # torch 2.13's CPU _weight_int8pack_mm reads garbage or crashes unless in % 16 == 0 (and checks nothing)
BLOCK = 4096  # weight rows dequantised at a time for a wide input: the bf16 transient stays BLOCK x in


class Int8Linear:
    """`Linear`'s interface over an int8 weight (made here, at bind time, from the compute-dtype one).

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
