"""Which model family a config.json describes, and the K3 text-model fields the K3 tensor layout needs.

K3 is packaged as a multimodal model: `model_type: kimi_k3` at the top, the text model's fields nested in
`text_config`, its tensors under `language_model.`, a vision tower beside it. `K3TextConfig` is the minimal typed
reader the K3 schema and the twin writer need (sizes, the layer graph, whether routed experts are MXFP4). It reads
with config.py's field checks, so a bad field reads as the same `error:` line; it holds no model math, and it folds
into ModelConfig when the model learns K3.
"""

import math
from dataclasses import dataclass, field

from ..base.errors import K3Error
from ..config import LayerSpec, _get, _layer_mixers, _layer_mlps

KIMI_LINEAR, KIMI_K3 = "kimi_linear", "kimi_k3"
MXFP4_FORMAT = "mxfp4-pack-quantized"  # compressed-tensors' name for MXFP4 with uint8 E8M0 scales
# Shape-changing switches every K3 checkpoint sets; the K3 layout has no tensors for the other setting.
K3_SWITCHES = (
    ("mla_use_nope", None),
    ("mla_use_output_gate", None),
    ("latent_moe_use_norm", None),
    ("use_full_rank_gate", "linear_attn_config"),
)


def model_variant(raw: dict) -> str:
    """`kimi_k3` when the config nests its text model in `text_config` (K3's packaging) or carries
    `attn_res_block_size` (K3's block attention residuals, which no Kimi-Linear has); `kimi_linear` otherwise."""
    if isinstance(raw.get("text_config"), dict) or "attn_res_block_size" in raw:
        return KIMI_K3
    return KIMI_LINEAR


def text_fields(raw: dict) -> dict:
    """The text model's fields: `text_config` over the top level (as Hugging Face and llama.cpp read them)."""
    nested = raw.get("text_config")
    return raw | nested if isinstance(nested, dict) else raw


@dataclass(frozen=True)
class K3TextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    # KDA
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float
    # MLA (NoPE, q-LoRA, output gate)
    mla_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    # MLPs: the dense layer-0 MLP, the latent MoE
    intermediate_size: int
    num_experts: int
    top_k: int
    expert_size: int
    num_shared_experts: int
    latent_size: int
    # block attention residuals and SiTU
    attn_res_block_size: int
    situ_beta: float
    situ_linear_beta: float
    mxfp4_experts: bool
    layers: tuple[LayerSpec, ...] = field(repr=False)
    source: str = "config.json"


def read_k3(raw: dict, source: str = "config.json") -> K3TextConfig:
    """The K3 fields of a K3-packaged (or flattened) config.json; a missing or mistyped field is a K3Error."""
    t = text_fields(raw)
    src = f"{source}: text_config" if isinstance(raw.get("text_config"), dict) else source
    lac = t.get("linear_attn_config")
    if not isinstance(lac, dict):
        raise K3Error(f"{src}: linear_attn_config must be an object")
    for name, parent in K3_SWITCHES:
        value = (lac if parent else t).get(name)
        if value is not True:
            raise K3Error(
                f"{src}: {parent + '.' if parent else ''}{name}={value!r}: only true (K3's layout) is supported"
            )
    if t.get("hidden_act") != "situ":
        raise K3Error(f"{src}: hidden_act={t.get('hidden_act')!r} is not supported (K3: situ)")
    if t.get("num_nextn_predict_layers"):
        raise K3Error(
            f"{src}: num_nextn_predict_layers={t['num_nextn_predict_layers']!r}: MTP layers are not supported"
        )
    n = _get(t, src, "num_hidden_layers")
    lac_src = f"{src}: linear_attn_config"
    num_experts = _get(t, src, "num_experts")
    layers = tuple(
        LayerSpec(i, m, p)
        for i, (m, p) in enumerate(zip(_layer_mixers(t, n, src), _layer_mlps(t, n, num_experts, src), strict=True))
    )
    return K3TextConfig(
        vocab_size=_get(t, src, "vocab_size"),
        hidden_size=_get(t, src, "hidden_size"),
        num_layers=n,
        rms_norm_eps=_get(t, src, "rms_norm_eps", kind=float),
        kda_heads=_get(lac, lac_src, "num_heads"),
        kda_head_dim=_get(lac, lac_src, "head_dim"),
        conv_kernel=_get(lac, lac_src, "short_conv_kernel_size"),
        gate_lower_bound=_lower_bound(lac.get("gate_lower_bound"), lac_src),
        mla_heads=_get(t, src, "num_attention_heads"),
        q_lora_rank=_get(t, src, "q_lora_rank"),
        kv_lora_rank=_get(t, src, "kv_lora_rank"),
        qk_nope_dim=_get(t, src, "qk_nope_head_dim"),
        qk_rope_dim=_get(t, src, "qk_rope_head_dim"),
        v_head_dim=_get(t, src, "v_head_dim"),
        intermediate_size=_get(t, src, "intermediate_size"),
        num_experts=num_experts,
        top_k=_get(t, src, "num_experts_per_token", "num_experts_per_tok"),
        expert_size=_get(t, src, "moe_intermediate_size"),
        num_shared_experts=_get(t, src, "num_shared_experts"),
        latent_size=_get(t, src, "routed_expert_hidden_size"),
        attn_res_block_size=_get(t, src, "attn_res_block_size"),
        situ_beta=_get(t, src, "activation_situ_beta", kind=float),
        situ_linear_beta=_get(t, src, "activation_situ_linear_beta", kind=float),
        mxfp4_experts=_mxfp4_experts(t.get("quantization_config"), src),
        layers=layers,
        source=source,
    )


def _lower_bound(value, src: str) -> float:
    """K3's KDA forget-gate bound g_min (-5.0): g = g_min * sigmoid(...), so it must be a finite negative number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -math.inf < value < 0:
        raise K3Error(f"{src}: gate_lower_bound={value!r} must be a finite negative number (K3: -5.0)")
    return float(value)


def _mxfp4_experts(quant, src: str) -> bool:
    """True for compressed-tensors MXFP4 (group 32, uint8 scales) on the routed experts; absent means none."""
    if quant is None:
        return False
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    fmt = quant.get("format") if isinstance(quant, dict) else None
    if method != "compressed-tensors" or fmt != MXFP4_FORMAT:
        raise K3Error(
            f"{src}: quantization_config quant_method={method!r} format={fmt!r} is not supported "
            f"(compressed-tensors {MXFP4_FORMAT} on the routed experts)"
        )
    for name, group in (quant.get("config_groups") or {}).items():
        weights = group.get("weights") or {} if isinstance(group, dict) else {}
        if weights.get("group_size") != 32 or weights.get("num_bits") != 4:
            raise K3Error(
                f"{src}: quantization_config.config_groups.{name}: group_size={weights.get('group_size')!r} "
                f"num_bits={weights.get('num_bits')!r} (MXFP4 is 4 bits in groups of 32)"
            )
    return True
