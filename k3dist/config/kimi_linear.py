"""A Hugging Face `config.json` of model_type `kimi_linear` (original names or transformers 5.x aliases) read into
a ModelConfig of variant `kimi_linear`."""

from ..base.dtypes import compute_dtype
from ..base.errors import K3Error
from .fields import KIMI_LINEAR, LayerSpec, ModelConfig, _get, _layer_mixers, _layer_mlps, _token_id, check_sizes

MODEL_TYPES = {KIMI_LINEAR}


def parse_kimi_linear(raw: dict, source: str = "config.json") -> ModelConfig:
    """Typed config from the raw JSON of an HF kimi_linear config."""
    if not isinstance(raw, dict):
        raise K3Error(f"{source}: must hold a JSON object")
    mt = raw.get("model_type")
    if not isinstance(mt, str) or mt not in MODEL_TYPES:
        raise K3Error(f"{source}: model_type={mt!r} is not one of {sorted(MODEL_TYPES)}")
    if raw.get("q_lora_rank") is not None:
        raise K3Error(f"{source}: q_lora_rank={raw['q_lora_rank']} is not supported (Kimi-Linear uses null)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise K3Error(f"{source}: hidden_act={act!r} is not supported (silu)")
    router_act = raw.get("moe_router_activation_func", "sigmoid")
    if router_act != "sigmoid":
        raise K3Error(f"{source}: moe_router_activation_func={router_act!r} is not supported (sigmoid)")
    lac = raw.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise K3Error(f"{source}: linear_attn_config must be an object")
    n = _get(raw, source, "num_hidden_layers")
    if n < 1:
        raise K3Error(f"{source}: num_hidden_layers={n} must be >= 1")
    num_experts = _get(raw, source, "num_experts", "num_local_experts", default=0)
    mixers = _layer_mixers(raw, n, source)
    mlps = _layer_mlps(raw, n, num_experts, source)
    dtype = compute_dtype(raw.get("dtype", raw.get("torch_dtype", "bfloat16")), f"{source}: dtype").name
    lac_src = f"{source}: linear_attn_config"
    cfg = ModelConfig(
        vocab_size=_get(raw, source, "vocab_size"),
        hidden_size=_get(raw, source, "hidden_size"),
        num_layers=n,
        intermediate_size=_get(raw, source, "intermediate_size", default=0),
        rms_norm_eps=_get(raw, source, "rms_norm_eps", default=1e-6, kind=float),
        dtype=dtype,
        kda_heads=_get(lac, lac_src, "num_heads", default=_get(raw, source, "linear_num_heads", default=0)),
        kda_head_dim=_get(lac, lac_src, "head_dim", default=_get(raw, source, "linear_head_dim", default=0)),
        conv_kernel=_get(
            lac, lac_src, "short_conv_kernel_size", default=_get(raw, source, "linear_conv_kernel_dim", default=4)
        ),
        mla_heads=_get(raw, source, "num_attention_heads"),
        qk_nope_dim=_get(raw, source, "qk_nope_head_dim", default=0),
        qk_rope_dim=_get(raw, source, "qk_rope_head_dim", default=0),
        v_head_dim=_get(raw, source, "v_head_dim", default=0),
        kv_lora_rank=_get(raw, source, "kv_lora_rank", default=0),
        num_experts=num_experts,
        top_k=_get(raw, source, "num_experts_per_token", "num_experts_per_tok", default=0),
        expert_size=_get(raw, source, "moe_intermediate_size", default=0),
        num_shared_experts=_get(raw, source, "num_shared_experts", "n_shared_experts", default=0),
        renormalize=_get(raw, source, "moe_renormalize", "norm_topk_prob", default=True, kind=bool),
        routed_scaling_factor=_get(raw, source, "routed_scaling_factor", default=1.0, kind=float),
        num_expert_group=_get(raw, source, "num_expert_group", "n_group", default=1),
        topk_group=_get(raw, source, "topk_group", default=1),
        layers=tuple(LayerSpec(i, m, p) for i, (m, p) in enumerate(zip(mixers, mlps, strict=True))),
        eos_token_id=_token_id(raw.get("eos_token_id")),
        bos_token_id=_token_id(raw.get("bos_token_id")),
        pad_token_id=_token_id(raw.get("pad_token_id")),
        source=source,
    )
    check_sizes(cfg)
    return cfg
