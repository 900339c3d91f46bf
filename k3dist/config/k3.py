"""Which model family a config.json describes (`model_variant`, decided once), and a Kimi K3 config read into a
ModelConfig of variant `kimi_k3`.

K3 is packaged as a multimodal model: `model_type: kimi_k3` at the top, the text model's fields nested in
`text_config`, its tensors under `language_model.`, a vision tower beside it (`vision_config`), which k3dist does not
serve. The text model's fields read with the same field checks as Kimi-Linear's, so a bad field reads as the same
`error:` line; a field k3dist does not implement is refused, naming it, never ignored.
"""

import math

from ..base.dtypes import compute_dtype
from ..base.errors import K3Error
from .fields import (
    KIMI_K3,
    KIMI_LINEAR,
    LayerSpec,
    ModelConfig,
    _get,
    _layer_mixers,
    _layer_mlps,
    _token_id,
    check_sizes,
)

MXFP4_FORMAT = "mxfp4-pack-quantized"  # compressed-tensors' name for MXFP4 with uint8 E8M0 scales
MXFP4_GROUP = 32  # elements per E8M0 scale (weights/mxfp4.py's GROUP)
# Shape-changing switches every K3 checkpoint sets; the K3 layout has no tensors for the other setting.
K3_SWITCHES = (
    ("mla_use_nope", None),
    ("mla_use_output_gate", None),
    ("latent_moe_use_norm", None),
    ("use_full_rank_gate", "linear_attn_config"),
)


def model_variant(raw: dict) -> str:
    """`kimi_k3` when the config says model_type kimi_k3, nests its text model in `text_config` (K3's packaging) or
    carries `attn_res_block_size` (K3's block attention residuals, which no Kimi-Linear has); `kimi_linear`
    otherwise."""
    if raw.get("model_type") == KIMI_K3 or isinstance(raw.get("text_config"), dict) or "attn_res_block_size" in raw:
        return KIMI_K3
    return KIMI_LINEAR


def text_fields(raw: dict) -> dict:
    """The text model's fields: `text_config` over the top level (as Hugging Face and llama.cpp read them)."""
    nested = raw.get("text_config")
    return raw | nested if isinstance(nested, dict) else raw


def read_k3(raw: dict, source: str = "config.json") -> ModelConfig:
    """The fields of a K3-packaged (or flattened) config.json; a missing or mistyped field is a K3Error."""
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
    router_act = t.get("moe_router_activation_func", "sigmoid")
    if router_act != "sigmoid":
        raise K3Error(f"{src}: moe_router_activation_func={router_act!r} is not supported (sigmoid)")
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
    cfg = ModelConfig(
        variant=KIMI_K3,
        dtype=compute_dtype(t.get("dtype", t.get("torch_dtype", "bfloat16")), f"{src}: dtype").name,
        renormalize=_get(t, src, "moe_renormalize", "norm_topk_prob", default=True, kind=bool),
        routed_scaling_factor=_get(t, src, "routed_scaling_factor", default=1.0, kind=float),
        num_expert_group=_get(t, src, "num_expert_group", "n_group", default=1),
        topk_group=_get(t, src, "topk_group", default=1),
        eos_token_id=_token_id(t.get("eos_token_id")),
        bos_token_id=_token_id(t.get("bos_token_id")),
        pad_token_id=_token_id(t.get("pad_token_id")),
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
    check_sizes(cfg)
    return cfg


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
        if weights.get("group_size") != MXFP4_GROUP or weights.get("num_bits") != 4:
            raise K3Error(
                f"{src}: quantization_config.config_groups.{name}: group_size={weights.get('group_size')!r} "
                f"num_bits={weights.get('num_bits')!r} (MXFP4 is 4 bits in groups of 32)"
            )
    return True
