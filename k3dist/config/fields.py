"""ModelConfig: a model's config.json as typed fields and a layer graph, and the field readers both variants share.

Everything downstream (inventory, TP plan, model, cache) reads these fields, never the raw JSON. Kimi-Linear
(kimi_linear.py) and Kimi K3 (k3.py) fill the same dataclass; `variant` says which one it is, decided once from the
config's fields (k3.model_variant), and the K3-only fields keep their zero defaults on a Kimi-Linear config.
"""

import math
from dataclasses import dataclass, field

from ..base.errors import K3Error
from ..kinds.mlps import DENSE, MOE
from ..kinds.registry import MIXERS, MLPS, present

KIMI_LINEAR, KIMI_K3 = "kimi_linear", "kimi_k3"  # the variants (ModelConfig.variant)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: the names of its token mixer kind and its MLP kind (kinds/registry.py)."""

    index: int
    mixer: str
    mlp: str


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    rms_norm_eps: float
    dtype: str
    # KDA
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    # MLA (NoPE)
    mla_heads: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    kv_lora_rank: int
    # MoE
    num_experts: int
    top_k: int
    expert_size: int
    num_shared_experts: int
    renormalize: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    layers: tuple[LayerSpec, ...] = field(repr=False)
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    source: str = "config.json"
    variant: str = KIMI_LINEAR
    # Kimi K3 only (k3.py); zero on Kimi-Linear
    q_lora_rank: int = 0  # MLA's low-rank query
    latent_size: int = 0  # the latent MoE's width (routed_expert_hidden_size)
    attn_res_block_size: int = 0  # block attention residuals: a snapshot every this many layers
    gate_lower_bound: float = 0.0  # KDA's g_min
    situ_beta: float = 0.0
    situ_linear_beta: float = 0.0
    mxfp4_experts: bool = False  # routed experts stored as compressed-tensors MXFP4

    @property
    def kda_dim(self) -> int:
        """P: KDA heads x head_dim."""
        return self.kda_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def shared_size(self) -> int:
        return self.expert_size * self.num_shared_experts

    def count(self, mixer: str | None = None, mlp: str | None = None) -> int:
        return sum(1 for s in self.layers if mixer in (None, s.mixer) and mlp in (None, s.mlp))


def _get(raw: dict, source: str, *names, default=KeyError, kind=int):
    """First present key among `names` (HF aliases), type-checked; missing without default is a K3Error."""
    for name in names:
        if name in raw and raw[name] is not None:
            value = raw[name]
            ok = (
                isinstance(value, bool)
                if kind is bool
                else (
                    isinstance(value, (int, float)) and not isinstance(value, bool)
                    if kind is float
                    else isinstance(value, kind) and not isinstance(value, bool)
                )
            )
            if not ok:
                raise K3Error(f"{source}: field {name}={value!r} must be {kind.__name__}")
            if kind is int and value < 0:
                raise K3Error(f"{source}: field {name}={value} must not be negative")
            if kind is float and not (math.isfinite(value) and value > 0):  # eps and scales: NaN logits otherwise
                raise K3Error(f"{source}: field {name}={value} must be a finite number > 0")
            return kind(value) if kind is float else value
    if default is KeyError:
        raise K3Error(f"{source}: required field {names[0]} is missing")
    return default


def _layer_mixers(raw: dict, n: int, source: str) -> list[str]:
    """Each layer's mixer kind, from linear_attn_config's 1-based list per kind or from `layer_types`."""
    lac, lists = raw.get("linear_attn_config"), "/".join(k.layer_list for k in MIXERS.values())
    if isinstance(lac, dict) and all(k.layer_list in lac for k in MIXERS.values()):
        given = {k.name: lac[k.layer_list] for k in MIXERS.values()}
        if not all(isinstance(x, list) and all(type(i) is int for i in x) for x in given.values()):
            raise K3Error(f"{source}: linear_attn_config.{lists} must be lists of 1-based layers")
        # length first: n may be huge
        if sum(map(len, given.values())) != n or sorted(i for x in given.values() for i in x) != list(range(1, n + 1)):
            named = " + ".join(f"{k.layer_list} {given[k.name]}" for k in MIXERS.values())
            raise K3Error(
                f"{source}: linear_attn_config {named} must list each of the {n} layers 1..{n} exactly once (1-based)"
            )
        by_layer = {i: name for name, layers in given.items() for i in layers}
        return [by_layer[i + 1] for i in range(n)]
    types, by_type = raw.get("layer_types"), {k.layer_type: k.name for k in MIXERS.values()}
    if isinstance(types, list) and len(types) == n and all(t in by_type for t in types):
        return [by_type[t] for t in types]
    raise K3Error(f"{source}: needs linear_attn_config.{lists} (or layer_types of length {n})")


def _layer_mlps(raw: dict, n: int, num_experts: int, source: str) -> list[str]:
    """An explicit `mlp_layer_types` (transformers 5.x writes it) wins; otherwise the HF remote code's rule.

    The two differ only for moe_layer_freq > 1, which transformers ignores when it derives the list itself.
    """
    types = raw.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise K3Error(f"{source}: mlp_layer_types must be a list")
        by_type = {k.layer_type: k.name for k in MLPS.values()}
        if len(types) != n or not all(t in by_type for t in types):
            listed = "/".join(repr(t) for t in by_type)
            raise K3Error(f"{source}: mlp_layer_types must list {listed} for each of the {n} layers")
        return [by_type[t] for t in types]
    first_dense = _get(raw, source, "first_k_dense_replace", default=0)
    freq = _get(raw, source, "moe_layer_freq", default=1)
    if freq < 1:
        raise K3Error(f"{source}: moe_layer_freq={freq} must be >= 1")
    return [MOE.name if num_experts and i >= first_dense and i % freq == 0 else DENSE.name for i in range(n)]


def _token_id(value):
    if isinstance(value, list):
        return value[0] if value else None
    return value if isinstance(value, int) else None


# Sizes every model needs positive (config field, attribute); each layer kind adds its own (kinds/).
_SIZES = (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"))


def check_sizes(cfg: ModelConfig) -> None:
    """Every size a present layer kind needs must be positive, and the router settings consistent."""
    src = cfg.source
    sizes = (*_SIZES, *(size for kind in present(cfg) for size in kind.sizes))
    need = {field: getattr(cfg, attr) for field, attr in sizes}
    for name, value in need.items():
        if value <= 0:
            raise K3Error(f"{src}: field {name}={value} must be > 0")
    if MOE.present(cfg):
        if cfg.top_k > cfg.num_experts:
            raise K3Error(f"{src}: num_experts_per_token={cfg.top_k} exceeds num_experts={cfg.num_experts}")
        if cfg.num_experts % cfg.num_expert_group or cfg.topk_group > cfg.num_expert_group:
            raise K3Error(
                f"{src}: num_experts={cfg.num_experts} must split into num_expert_group="
                f"{cfg.num_expert_group} groups with topk_group={cfg.topk_group} <= groups"
            )
