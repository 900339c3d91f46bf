"""ModelConfig: a Hugging Face `config.json` of model_type `kimi_linear` read into typed fields and a layer graph.

Everything downstream (inventory, TP plan, model, cache) reads these fields, never the raw JSON.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

from .base.dtypes import compute_dtype
from .base.errors import K3Error
from .base.files import read_json
from .kinds.mlps import DENSE, MOE
from .kinds.registry import MIXERS, MLPS, present

MODEL_TYPES = {"kimi_linear", "kimi_k3", "Kimi-K3"}


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


def parse_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """Typed config from the raw JSON of an HF kimi_linear config (original names or transformers 5.x aliases)."""
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
    _check_sizes(cfg)
    return cfg


def _token_id(value):
    if isinstance(value, list):
        return value[0] if value else None
    return value if isinstance(value, int) else None


# Sizes every model needs positive (config field, attribute); each layer kind adds its own (kinds/).
_SIZES = (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"))


def _check_sizes(cfg: ModelConfig) -> None:
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


def load_config(path: str | Path) -> ModelConfig:
    """Read and parse a config.json (a model dir or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise K3Error(f"{path}: config.json not found")
    return parse_config(read_json(path), str(path))


def validate_topology(cfg: ModelConfig, world: int) -> None:
    """Refuse a world size that cannot split heads or experts, before any weight file is opened."""
    if world < 1:
        raise K3Error(f"world size {world} must be >= 1")
    checks = [(what, getattr(cfg, attr)) for kind in present(cfg) for what, attr in kind.splits]
    bad = [f"{what}={n}" for what, n in checks if n % world]
    if bad:
        ok = [w for w in range(1, 65) if all(n % w == 0 for _, n in checks)]
        raise K3Error(
            f"{cfg.source}: world size {world} does not divide {', '.join(bad)}; world sizes that fit: {ok[:12]}"
        )
