"""The tensors a Kimi-Linear checkpoint must hold (original Hugging Face names, full shapes), and where each one
lands in the weight store.

The dense layer-0 MLP is canonically `mlp.`; transformers 5.x `save_pretrained` writes `block_sparse_moe.` for it,
which the inventory accepts and maps back (docs/model.md).

Store layout: small projections that read the same input are fused into one buffer, row after row, so a decode step
runs one GEMV where the checkpoint has several (KDA q/k/v/f_a/g_a/b; MLA q and kv_a; gate and up of dense and shared
MLPs; each expert's w1 and w3), and tensors of one kind are stacked along a leading dim (the three short convs, the
experts). The loader places every rank-local slice straight into its place: no second copy, `derived_bytes` stays 0.
"""

from dataclasses import dataclass
from functools import cache

import torch

from ..config import ModelConfig, parse_config
from .k3_config import KIMI_K3, K3TextConfig, model_variant, read_k3
from .mxfp4 import GROUP

# Tensors the model keeps in fp32 whatever the compute dtype (transformers `_keep_in_fp32_modules_strict`, fla).
FP32_SUFFIXES = ("A_log", "dt_bias", "gate.weight", "gate.e_score_correction_bias")


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> full shape, in checkpoint order."""
    D, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
    for spec in cfg.layers:
        p = f"model.layers.{spec.index}."
        out[p + "input_layernorm.weight"] = (D,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        out |= {p + "self_attn." + k: s for k, s in (_kda(cfg) if spec.mixer == "kda" else _mla(cfg)).items()}
        out |= {p + k: s for k, s in (_dense(cfg) if spec.mlp == "dense" else _moe(cfg)).items()}
    out["model.norm.weight"] = (D,)
    out["lm_head.weight"] = (V, D)
    return out


def checkpoint_tensors(raw: dict, dtype: torch.dtype, source: str = "config.json") -> dict[str, tuple]:
    """Checkpoint name -> (shape, dtype) of the checkpoint a raw config.json describes, by its variant (decided once,
    k3_config.model_variant). A Kimi-Linear twin holds every tensor in `dtype`."""
    if model_variant(raw) == KIMI_K3:
        return k3_tensors(read_k3(raw, source), dtype)
    return {name: (shape, dtype) for name, shape in expected_tensors(parse_config(raw, source)).items()}


def _kda(cfg: ModelConfig) -> dict:
    D, H, d, P, K = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_dim, cfg.conv_kernel
    return {
        "q_proj.weight": (P, D),
        "k_proj.weight": (P, D),
        "v_proj.weight": (P, D),
        "q_conv1d.weight": (P, 1, K),
        "k_conv1d.weight": (P, 1, K),
        "v_conv1d.weight": (P, 1, K),
        "A_log": (1, 1, H, 1),
        "f_a_proj.weight": (d, D),
        "f_b_proj.weight": (P, d),
        "dt_bias": (P,),
        "b_proj.weight": (H, D),
        "g_a_proj.weight": (d, D),
        "g_b_proj.weight": (P, d),
        "o_norm.weight": (d,),
        "o_proj.weight": (D, P),
    }


def _mla(cfg: ModelConfig) -> dict:
    D, Ha, r, dr = cfg.hidden_size, cfg.mla_heads, cfg.kv_lora_rank, cfg.qk_rope_dim
    return {
        "q_proj.weight": (Ha * cfg.qk_head_dim, D),
        "kv_a_proj_with_mqa.weight": (r + dr, D),
        "kv_a_layernorm.weight": (r,),
        "kv_b_proj.weight": (Ha * (cfg.qk_nope_dim + cfg.v_head_dim), r),
        "o_proj.weight": (D, Ha * cfg.v_head_dim),
    }


def _dense(cfg: ModelConfig) -> dict:
    D, Id = cfg.hidden_size, cfg.intermediate_size
    return {"mlp.gate_proj.weight": (Id, D), "mlp.up_proj.weight": (Id, D), "mlp.down_proj.weight": (D, Id)}


def _moe(cfg: ModelConfig) -> dict:
    D, E, Ie, Is = cfg.hidden_size, cfg.num_experts, cfg.expert_size, cfg.shared_size
    p = "block_sparse_moe."
    out = {p + "gate.weight": (E, D), p + "gate.e_score_correction_bias": (E,)}
    for e in range(E):
        out |= {
            f"{p}experts.{e}.w1.weight": (Ie, D),
            f"{p}experts.{e}.w2.weight": (D, Ie),
            f"{p}experts.{e}.w3.weight": (Ie, D),
        }
    if Is:
        out |= {
            p + "shared_experts.gate_proj.weight": (Is, D),
            p + "shared_experts.up_proj.weight": (Is, D),
            p + "shared_experts.down_proj.weight": (D, Is),
        }
    return out


def canonical_name(key: str) -> str:
    """Map the dense MLP's `block_sparse_moe.{gate,up,down}_proj` (transformers save_pretrained) to `mlp.`."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if key.endswith(f".block_sparse_moe.{proj}.weight"):
            return key.replace(".block_sparse_moe.", ".mlp.")
    return key


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint tensor lands: store key `dest`, stack index `slot`, part number `part` of a fused buffer."""

    dest: str
    slot: int | None = None
    part: int | None = None


KDA_FUSED_IN = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")  # all read the normed input


@cache
def placements(cfg: ModelConfig) -> dict[str, Placement]:
    """Canonical name -> placement, for every tensor that is not simply its own store entry."""
    out: dict[str, Placement] = {}
    for spec in cfg.layers:
        a = f"model.layers.{spec.index}.self_attn."
        if spec.mixer == "kda":
            out |= {f"{a}{n}.weight": Placement(a + "in_proj.weight", part=i) for i, n in enumerate(KDA_FUSED_IN)}
            out |= {f"{a}{n}_conv1d.weight": Placement(a + "conv1d.weight", slot=i) for i, n in enumerate("qkv")}
            out |= {f"{a}{n}_b_proj.weight": Placement(a + "fg_b_proj.weight", slot=i) for i, n in enumerate("fg")}
        else:
            out[a + "q_proj.weight"] = Placement(a + "q_kv_a_proj.weight", part=0)
            out[a + "kv_a_proj_with_mqa.weight"] = Placement(a + "q_kv_a_proj.weight", part=1)
        m = f"model.layers.{spec.index}." + ("mlp." if spec.mlp == "dense" else "block_sparse_moe.shared_experts.")
        out |= {
            f"{m}{n}.weight": Placement(m + "gate_up_proj.weight", part=i)
            for i, n in enumerate(("gate_proj", "up_proj"))
        }
        if spec.mlp == "moe":
            x = f"model.layers.{spec.index}.block_sparse_moe.experts."
            for e in range(cfg.num_experts):
                out[f"{x}{e}.w1.weight"] = Placement(x + "w13", slot=e, part=0)
                out[f"{x}{e}.w3.weight"] = Placement(x + "w13", slot=e, part=1)
                out[f"{x}{e}.w2.weight"] = Placement(x + "w2", slot=e)
    return out


# --- Kimi K3: the text model under `language_model.`, in K3's own dtypes -----------------------------------------

K3_PREFIX = "language_model."
A_LOG_SLOTS = 128  # K3 stores A_log as [128] whatever its head count; the first num_heads entries are real
K3_FP32 = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")  # F32 on disk
PACKED, SCALE = "weight_packed", "weight_scale"


def k3_tensors(cfg: K3TextConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple]:
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


def k3_logical_tensors(cfg: K3TextConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple]:
    """As k3_tensors, with every routed expert as its logical `.weight` [out, in] in `dtype` (what MXFP4 packs)."""
    D, V, p = cfg.hidden_size, cfg.vocab_size, K3_PREFIX + "model."
    shapes: dict[str, tuple[int, ...]] = {p + "embed_tokens.weight": (V, D)}
    for spec in cfg.layers:
        layer = f"{p}layers.{spec.index}."
        shapes |= {layer + k: s for k, s in _k3_residual(D).items()}
        mixer = _k3_kda(cfg) if spec.mixer == "kda" else _k3_mla(cfg)
        shapes |= {layer + "self_attn." + k: s for k, s in mixer.items()}
        shapes |= {layer + k: s for k, s in (_dense(cfg) if spec.mlp == "dense" else _k3_moe(cfg)).items()}
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


def _k3_kda(cfg: K3TextConfig) -> dict:
    D, H, d, K = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel
    P = H * d
    out = {f"{n}_proj.weight": (P, D) for n in "qkv"}
    out |= {f"{n}_conv1d.weight": (P, 1, K) for n in "qkv"}
    out |= {"f_a_proj.weight": (d, D), "f_b_proj.weight": (P, d), "b_proj.weight": (H, D)}
    out |= {"A_log": (max(A_LOG_SLOTS, H),), "dt_bias": (P,), "g_proj.weight": (P, D)}
    return out | {"o_norm.weight": (d,), "o_proj.weight": (D, P)}


def _k3_mla(cfg: K3TextConfig) -> dict:
    D, Ha, r, dr, q = cfg.hidden_size, cfg.mla_heads, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.q_lora_rank
    return {
        "q_a_proj.weight": (q, D),
        "q_a_layernorm.weight": (q,),
        "q_b_proj.weight": (Ha * (cfg.qk_nope_dim + dr), q),
        "kv_a_proj_with_mqa.weight": (r + dr, D),
        "kv_a_layernorm.weight": (r,),
        "kv_b_proj.weight": (Ha * (cfg.qk_nope_dim + cfg.v_head_dim), r),
        "g_proj.weight": (Ha * cfg.v_head_dim, D),
        "o_proj.weight": (D, Ha * cfg.v_head_dim),
    }


def _k3_moe(cfg: K3TextConfig) -> dict:
    D, E, Ie, Z = cfg.hidden_size, cfg.num_experts, cfg.expert_size, cfg.latent_size
    Is = Ie * cfg.num_shared_experts  # the shared MLP's width
    p = "block_sparse_moe."
    out = {p + "gate.weight": (E, D), p + "gate.e_score_correction_bias": (E,)}
    out |= {p + "routed_expert_down_proj.weight": (Z, D), p + "routed_expert_norm.weight": (Z,)}
    out[p + "routed_expert_up_proj.weight"] = (D, Z)
    out |= {p + f"shared_experts.{n}_proj.weight": (Is, D) for n in ("gate", "up")}
    out[p + "shared_experts.down_proj.weight"] = (D, Is)
    for e in range(E):
        x = f"{p}experts.{e}."
        out |= {x + "w1.weight": (Ie, Z), x + "w2.weight": (Z, Ie), x + "w3.weight": (Ie, Z)}
    return out
