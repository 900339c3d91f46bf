"""The one table of dtypes: config names, safetensors codes, torch dtypes and element sizes."""

from dataclasses import dataclass

import torch

from .errors import K3Error


@dataclass(frozen=True)
class DType:
    name: str  # as config.json and the settings write it
    code: str  # as a safetensors header writes it
    torch: torch.dtype

    @property
    def itemsize(self) -> int:
        return self.torch.itemsize


TABLE = (
    DType("bfloat16", "BF16", torch.bfloat16),
    DType("float16", "F16", torch.float16),
    DType("float32", "F32", torch.float32),
    DType("float64", "F64", torch.float64),  # accepted on disk, never a compute dtype
)
MXFP4_BYTES = DType("uint8", "U8", torch.uint8)  # K3's MXFP4 experts: packed codes and E8M0 scales, nothing else
BY_NAME = {d.name: d for d in (*TABLE, MXFP4_BYTES)}
BY_CODE = {d.code: d for d in (*TABLE, MXFP4_BYTES)}
BY_TORCH = {d.torch: d for d in (*TABLE, MXFP4_BYTES)}
COMPUTE = ("bfloat16", "float16", "float32")  # dtypes a model may compute in
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

# Bits per element of every safetensors dtype, to explain a header that safetensors refused.
ELEMENT_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8}
ELEMENT_BITS |= {"F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32}
ELEMENT_BITS |= {"I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def compute_dtype(name: str, where: str = "dtype") -> DType:
    """A compute dtype by config name or alias (`bf16`, `fp32`, ...)."""
    name = ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in COMPUTE:
        raise K3Error(f"{where}={name!r} is not one of {list(COMPUTE)}")
    return BY_NAME[name]
