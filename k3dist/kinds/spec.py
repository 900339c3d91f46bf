"""What a layer kind declares: the shape of one spec, shared by every mixer (KDA, MLA) and MLP (dense, MoE) kind.

A kind's spec is the one place its name is looked at: the config reads its layer lists and sizes, the schema its
tensors and placements, the TP plan its policy rows, the cache its entries, the memory plan its activation bytes,
and model/kinds.py how to build it. A new kind is a new spec, not a new branch in each of those.
Specs take the model config duck-typed (`cfg`): ModelConfig, or K3's K3TextConfig for `k3_tensors`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Axis:
    """How one tensor family is split: `dim` None = replicated; `vocab` = gathered (or masked) over vocab."""

    name: str
    dim: int | None


REPLICATED = Axis("replicated", None)
VOCAB = Axis("vocab", 0)
COLUMN = Axis("column", 0)
ROW = Axis("row", 1)
HEADS = Axis("heads", 2)  # A_log [1, 1, H, 1]


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint tensor lands: store key `dest`, stack index `slot`, part number `part` of a fused buffer."""

    dest: str
    slot: int | None = None
    part: int | None = None


@dataclass(frozen=True)
class CacheEntry:
    """One cache tensor per layer of its kind, named `{name}.{layer}`, for every slot of the batch (dim 0).

    `grows`: it holds one row per token along dim 1 (up to cache.cap), so a snapshot keeps the first L rows; else it
    is a state of fixed size the sequence overwrites as it advances, kept whole by a snapshot and set aside (the
    runner's guard) while a prompt prefilled over several windows sits out the decode steps, which write every slot.
    """

    name: str
    shape: Callable[..., tuple[int, ...]]  # (cfg, world, batch, cap) -> the rank's shape
    dtype: torch.dtype | None  # None: the compute dtype
    grows: bool


@dataclass(frozen=True)
class LayerKind:
    """One mixer or MLP kind. Names of tensors and placements are relative to the layer (`model.layers.{i}.`)."""

    name: str  # what LayerSpec.mixer / LayerSpec.mlp hold
    role: str  # "mixer" or "mlp"
    layer_type: str  # its name in config.json's layer_types / mlp_layer_types
    sizes: tuple[tuple[str, str], ...]  # (config field, ModelConfig attribute) that must be > 0 where it is present
    splits: tuple[tuple[str, str], ...]  # (what, ModelConfig attribute) the world size must divide
    tensors: Callable[..., dict[str, tuple[int, ...]]]  # cfg -> a Kimi-Linear checkpoint's tensors, full shapes
    k3_tensors: Callable[..., dict[str, tuple[int, ...]]]  # K3TextConfig -> a K3 checkpoint's (K3's variant of it)
    placements: Callable[..., dict[str, Placement]]  # (cfg, layer prefix) -> fused and stacked tensors' places
    policy: tuple[tuple[str, Axis], ...]  # TP rules (regex on canonical names, first match wins) for its tensors
    activation: Callable[..., int]  # (cfg, world, *, tokens, seqs, longest, s, cpu, dense) -> prefill peak bytes
    widest_input: Callable[..., int]  # (cfg, world) -> its widest projection input (a widened prefill's fp32 copy)
    cache: tuple[CacheEntry, ...] = ()  # what a layer of this kind keeps per slot (mixers)
    layer_list: str = ""  # its list of 1-based layers in linear_attn_config (mixers)
    decode_op_bytes: Callable[..., int] = lambda cfg, world, batch, cap: 0  # a CPU decode op's kept buffers
    quantized: str = ""  # regex of its store keys model.quant=int8 turns into int8 ("": none)

    def present(self, cfg) -> int:
        """How many of `cfg`'s layers are of this kind."""
        return cfg.count(**{self.role: self.name})
