"""The tensors a Kimi-Linear checkpoint must hold (original Hugging Face names, full shapes), and where each one
lands in the weight store.

The dense layer-0 MLP is canonically `mlp.`; transformers 5.x `save_pretrained` writes `block_sparse_moe.` for it,
which the inventory accepts and maps back (docs/model.md). A Kimi K3 checkpoint's names carry `language_model.`;
its canonical names drop it, so the TP policy and the placements read both variants alike. Its vision tower
(`vision_tower.`, `mm_projector.`) is no tensor of the text model: the inventory skips it by name.

Store layout: small projections that read the same input are fused into one buffer, row after row, so a decode step
runs one GEMV where the checkpoint has several (KDA q/k/v/f_a/g_a/b; MLA q and kv_a; gate and up of dense and shared
MLPs; each expert's w1 and w3), and tensors of one kind are stacked along a leading dim (the three short convs, the
experts). The loader places every rank-local slice straight into its place: no second copy, `derived_bytes` stays 0.
"""

import math
from functools import cache

import torch

from ..config import KIMI_K3, ModelConfig, parse_config
from ..kinds.registry import kinds_of
from ..kinds.spec import Placement
from .mxfp4 import GROUP

# Tensors the model keeps in fp32 whatever the compute dtype (transformers `_keep_in_fp32_modules_strict`, fla).
FP32_SUFFIXES = ("A_log", "dt_bias", "gate.weight", "gate.e_score_correction_bias")


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> full shape, in checkpoint order (K3: its packed experts as their uint8 pairs)."""
    if cfg.variant == KIMI_K3:
        return {canonical_name(name): shape for name, (shape, _) in k3_tensors(cfg).items()}
    D, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
    for spec in cfg.layers:
        p = f"model.layers.{spec.index}."
        out[p + "input_layernorm.weight"] = (D,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        for kind in kinds_of(spec):
            out |= {p + k: s for k, s in kind.tensors(cfg).items()}
    out["model.norm.weight"] = (D,)
    out["lm_head.weight"] = (V, D)
    return out


def parameter_count(cfg: ModelConfig) -> int:
    """The model's parameters: K3's MXFP4 experts counted as their logical weights, not their packed bytes."""
    shapes = (
        (s for s, _ in k3_logical_tensors(cfg).values()) if cfg.variant == KIMI_K3 else expected_tensors(cfg).values()
    )
    return sum(math.prod(shape) for shape in shapes)


def checkpoint_tensors(raw: dict, dtype: torch.dtype, source: str = "config.json") -> dict[str, tuple]:
    """Checkpoint name -> (shape, dtype) of the checkpoint a raw config.json describes, by its variant (decided once,
    config.model_variant). A Kimi-Linear twin holds every tensor in `dtype`."""
    return checkpoint_entries(parse_config(raw, source), dtype)


def checkpoint_entries(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple]:
    """Checkpoint name (as stored) -> (shape, dtype) for `cfg`: K3's in its own dtypes (F32 where K3 stores F32,
    uint8 MXFP4 pairs), a Kimi-Linear one every tensor in `dtype`."""
    if cfg.variant == KIMI_K3:
        return k3_tensors(cfg, dtype)
    return {name: (shape, dtype) for name, shape in expected_tensors(cfg).items()}


VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # K3's vision tower: not the text model k3dist serves


def is_vision(key: str) -> bool:
    return key.startswith(VISION_PREFIXES)


def canonical_name(key: str) -> str:
    """Drop K3's `language_model.`; map the dense MLP's `block_sparse_moe.{gate,up,down}_proj` (transformers
    save_pretrained) to `mlp.`."""
    key = key.removeprefix(K3_PREFIX)
    if key.endswith(DENSE_AS_MOE):
        return key.replace(".block_sparse_moe.", ".mlp.")
    return key


DENSE_AS_MOE = tuple(f".block_sparse_moe.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj"))


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


def kept_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    """The dtype a tensor is kept in on the device: fp32 (FP32_SUFFIXES), K3's MXFP4 experts packed as stored (uint8
    codes and scales), the rest in the compute dtype."""
    if keeps_fp32(name):
        return torch.float32
    return torch.uint8 if name.endswith(MXFP4_PARTS) else compute


@cache
def placements(cfg: ModelConfig) -> dict[str, Placement]:
    """Canonical name -> placement, for every tensor that is not simply its own store entry."""
    out: dict[str, Placement] = {}
    for spec in cfg.layers:
        for kind in kinds_of(spec):
            out |= kind.placements(cfg, f"model.layers.{spec.index}.")
    return out


# --- Kimi K3: the text model under `language_model.`, in K3's own dtypes -----------------------------------------

K3_PREFIX = "language_model."
K3_FP32 = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")  # F32 on disk
PACKED, SCALE = "weight_packed", "weight_scale"
MXFP4_PARTS = ("." + PACKED, "." + SCALE)


def k3_tensors(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple]:
    """Checkpoint name -> (shape, dtype) of a K3 checkpoint's text model, in checkpoint order. Tensors K3 keeps in
    F32 stay F32, the rest take `dtype` (K3: bf16); routed experts are uint8 MXFP4 pairs when the config says so."""
    logical = k3_logical_tensors(cfg, dtype)
    if not cfg.mxfp4_experts:
        return logical
    out = {}
    for name, entry in logical.items():
        if is_routed_expert(name):
            out.update(mxfp4_entries(name, entry[0]))
        else:
            out[name] = entry
    return out


def k3_logical_tensors(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple]:
    """As k3_tensors, with every routed expert as its logical `.weight` [out, in] in `dtype` (what MXFP4 packs)."""
    D, V, p = cfg.hidden_size, cfg.vocab_size, K3_PREFIX + "model."
    shapes: dict[str, tuple[int, ...]] = {p + "embed_tokens.weight": (V, D)}
    for spec in cfg.layers:
        layer = f"{p}layers.{spec.index}."
        shapes |= {layer + k: s for k, s in _k3_residual(D).items()}
        for kind in kinds_of(spec):
            shapes |= {layer + k: s for k, s in kind.k3_tensors(cfg).items()}
    shapes |= {
        p + "norm.weight": (D,),
        p + "output_attn_res_norm.weight": (D,),
        p + "output_attn_res_proj.weight": (1, D),
    }
    shapes[K3_PREFIX + "lm_head.weight"] = (V, D)
    return {name: (shape, torch.float32 if name.endswith(K3_FP32) else dtype) for name, shape in shapes.items()}


def is_routed_expert(name: str) -> bool:
    return ".block_sparse_moe.experts." in name


def mxfp4_entries(name: str, shape: tuple[int, ...]) -> dict[str, tuple]:
    """A logical `...weight` [out, in] -> its `weight_packed` [out, in/2] and `weight_scale` [out, in/32], uint8."""
    out_dim, in_dim = shape
    if in_dim % GROUP:
        raise ValueError(f"{name}: input dim {in_dim} is not a multiple of MXFP4's group of {GROUP}")
    base = name.removesuffix("weight")
    return {
        base + PACKED: ((out_dim, in_dim // 2), torch.uint8),
        base + SCALE: ((out_dim, in_dim // GROUP), torch.uint8),
    }


def _k3_residual(D: int) -> dict:
    """Per layer: the two norms, and each block-attention-residual site's norm and score projection."""
    out = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}
    for site in ("self_attention_res", "mlp_res"):
        out |= {f"{site}_norm.weight": (D,), f"{site}_proj.weight": (1, D)}
    return out
