"""A weight the model multiplies by: plain `F.linear`, or on CPUs with bf16 units oneDNN's prepacked layout.

On such CPUs torch's bf16 `F.linear` reads the weight at well under the memory bandwidth for one token; the same
oneDNN kernel on a weight reordered once at bind time streams it 1.3-2x faster (the LM head's GEMV: 22 -> 14 ms on
the twin), with bit-identical results. The packed copy replaces the plain one, so it costs memory only while it is
made (the plan's `derived_bytes`). Packed weights are opaque to torch.compile, so a compiled step keeps plain ones.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether packing pays here: bf16 on a CPU whose oneDNN has bf16 kernels."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class Linear:
    """x @ weight^T for a [out, in] weight, plain or prepacked."""

    def __init__(self, weight: Tensor, pack: bool = False):
        self.shape = weight.shape
        self.packed = pack
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if pack else weight

    def __call__(self, x: Tensor) -> Tensor:
        if not self.packed:
            return F.linear(x, self.weight)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.weight, None, "none", [], "")
        return y.view(*x.shape[:-1], self.shape[0])
