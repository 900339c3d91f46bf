"""Stacked MXFP4 expert weights as the kernels take them, and their widening in torch.

A stacked logical weight [E, O, In] is kept as compressed-tensors stores each expert (weights/mxfp4.py has the
format, packing and quantizing): `packed` uint8 [E, O, In/2], element 2i in a byte's low nibble, and `scale` uint8
[E, O, In/32], one E8M0 exponent per 32 inputs. The C++ and Triton kernels read these bytes and widen them a block
at a time inside the kernel; the torch paths (kernels/moe.py) widen only what they touch: the experts a decode step
chose (`index_select`), or one expert at a time (`[e]`), never the whole stack.

Widening is exact and computes what ggml and weights/mxfp4.py's dequantize compute (doubled E2M1 value times
2^(scale - 128) built from its bits, one fp32 multiply, code 8 as +0), so a path fed the packed pair and the same
path fed the dequantized stack get the same bits.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

GROUP = 32  # inputs per E8M0 scale
_DOUBLED = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)


def widen(packed: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """uint8 `packed` [..., O, In/2] and `scale` [..., O, In/32] -> the weight [..., O, In] in `dtype` (exact in fp32
    and bf16)."""
    table = torch.tensor(_DOUBLED, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    s = scale.to(torch.int32)
    bits = torch.where(s < 2, torch.tensor(0x00200000, dtype=torch.int32, device=s.device) << s, (s - 1) << 23)
    values = table[codes].unflatten(-1, (scale.shape[-1], GROUP)) * bits.view(torch.float32).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


@dataclass(frozen=True)
class PackedExperts:
    """Stacked MXFP4 experts [E, O, In] (`packed` [E, O, In/2], `scale` [E, O, In/32], uint8) that widen to `dtype`.

    It answers the few questions the torch MoE paths ask of a stacked weight tensor (`shape`, `[e]`,
    `index_select(0, ids)`), widening only the experts asked for.
    """

    packed: Tensor
    scale: Tensor
    dtype: torch.dtype

    def __post_init__(self):
        p, s = self.packed, self.scale
        if p.dtype != torch.uint8 or s.dtype != torch.uint8 or p.dim() != 3:
            raise ValueError(f"MXFP4 experts: uint8 [E, O, In/2] and [E, O, In/32], got {p.dtype} {s.dtype}")
        if s.shape != (*p.shape[:2], p.shape[2] * 2 // GROUP) or p.shape[2] * 2 % GROUP:
            raise ValueError(f"MXFP4 experts: packed {tuple(p.shape)} needs scale [E, O, In/32], got {tuple(s.shape)}")

    @property
    def shape(self) -> torch.Size:
        """The logical [E, O, In]."""
        return torch.Size((*self.packed.shape[:2], self.packed.shape[2] * 2))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes

    def __getitem__(self, e: int) -> Tensor:
        return widen(self.packed[e], self.scale[e], self.dtype)

    def index_select(self, dim: int, ids: Tensor) -> Tensor:
        assert dim == 0, "experts are selected along dim 0"
        return widen(self.packed.index_select(0, ids), self.scale.index_select(0, ids), self.dtype)
