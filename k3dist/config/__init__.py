"""The model's config.json: which variant it is (Kimi-Linear or Kimi K3, decided once from its fields by
k3.model_variant), read into one typed ModelConfig, and the world sizes it can be split over.

fields.py holds the dataclass and the field readers both variants share; kimi_linear.py and k3.py read each
variant's fields. Everything downstream reads the ModelConfig, never the raw JSON.
"""

from pathlib import Path

from ..base.errors import K3Error
from ..base.files import read_json
from ..kinds.registry import present
from .fields import KIMI_K3, KIMI_LINEAR, LayerSpec, ModelConfig
from .k3 import MXFP4_FORMAT, MXFP4_GROUP, model_variant, read_k3, text_fields
from .kimi_linear import MODEL_TYPES, parse_kimi_linear

__all__ = [
    "KIMI_K3",
    "KIMI_LINEAR",
    "MODEL_TYPES",
    "MXFP4_FORMAT",
    "MXFP4_GROUP",
    "LayerSpec",
    "ModelConfig",
    "load_config",
    "model_variant",
    "parse_config",
    "read_k3",
    "text_fields",
    "validate_topology",
]


def parse_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """Typed config from a config.json's raw JSON, by its variant (model_variant: the only place it is decided)."""
    if not isinstance(raw, dict):
        raise K3Error(f"{source}: must hold a JSON object")
    if model_variant(raw) == KIMI_K3:
        return read_k3(raw, source)
    return parse_kimi_linear(raw, source)


def load_config(path: str | Path) -> ModelConfig:
    """Read and parse a config.json (a model dir or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise K3Error(f"{path}: config.json not found")
    return parse_config(read_json(path), str(path))


def validate_topology(cfg: ModelConfig, world: int) -> None:
    """Refuse a world size that cannot split heads or experts, or would cut an MXFP4 group of 32 across ranks, before
    any weight file is opened."""
    if world < 1:
        raise K3Error(f"world size {world} must be >= 1")
    checks = [(what, getattr(cfg, attr)) for kind in present(cfg) for what, attr in kind.splits]
    fits = lambda w: all(n % w == 0 for _, n in checks) and not _cuts_groups(cfg, w)  # noqa: E731
    bad = [f"{what}={n}" for what, n in checks if n % world]
    if bad:
        ok = [w for w in range(1, 65) if fits(w)]
        raise K3Error(
            f"{cfg.source}: world size {world} does not divide {', '.join(bad)}; world sizes that fit: {ok[:12]}"
        )
    if _cuts_groups(cfg, world):
        n = cfg.expert_size
        ok = [w for w in range(1, 65) if fits(w)]
        raise K3Error(
            f"{cfg.source}: world size {world} splits the MXFP4 experts' moe_intermediate_size={n} into {n // world} "
            f"columns per rank, which cuts their groups of {MXFP4_GROUP} ({n // MXFP4_GROUP} groups do not split "
            f"into {world}); world sizes that fit: {ok[:12]}"
        )


def _cuts_groups(cfg: ModelConfig, world: int) -> bool:
    """MXFP4 experts' down projection (w2 [latent, moe_intermediate_size]) is row-split by input column
    (docs/model.md, "Kimi K3's TP plan"); a rank's share must be whole groups of 32 (w1/w3 split by output row, and
    their groups run along the input, so any split keeps them whole)."""
    share = cfg.expert_size // world
    return cfg.mxfp4_experts and bool(cfg.expert_size % world or share % MXFP4_GROUP)
