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

from ..config import ModelConfig

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
