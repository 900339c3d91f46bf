"""Seeded random Kimi K3 checkpoints in K3's own packaging, in two variants that hold the same values.

The tensor list is weights/schema.py's `k3_tensors` (names under `language_model.`, K3's dtypes: F32 convs, A_log,
dt_bias, o_norm and router bias, the rest in the twin's dtype). Routed experts are drawn in fp32 and quantized to
MXFP4 whatever the variant, then written either packed (`weight_packed` / `weight_scale`, with the config's
`quantization_config`: the `mxfp4` variant) or as their exact dequantization in the twin's dtype, with
`quantization_config` removed (the `dequantized` variant). Both variants draw from one generator in one order, so
every tensor is equal, and the experts' values are equal bit for bit.

Initialisation follows the Kimi-Linear twin (normal(0, 0.02) projections, fla's A_log, nn.Conv1d's conv bound), with
three K3 choices:
- norm weights are drawn in (0.75, 1.25), not ones, so that a norm weight dropped or misplaced (the residual sites'
  norm folded into the score vector, q_a/kv_a, the latent norm) changes the logits;
- dt_bias is drawn in (-1.5, 0.5): K3's gate is -5 * sigmoid(exp(A_log) * (f + dt_bias)), and fla's softplus-range
  dt_bias (about -5) would pin every channel at no decay; this spread covers the whole range (e^-5, 1);
- `A_log` is padded to 128 slots as K3 stores it: the first num_heads are real, the rest zero.
A `vision_config` in the config gets two small stub tensors under `vision_tower.` and `mm_projector.` (names of the
twin's own, not MoonViT's): the text model never reads them, and a loader proves it skips them by name.
"""

import copy
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import read_k3
from ..kinds.kda import A_LOG_SLOTS
from ..weights.mxfp4 import dequantize, quantize
from ..weights.schema import PACKED, SCALE, is_routed_expert, k3_logical_tensors, k3_tensors

K3_TWIN_VERSION = 1  # part of the twin cache key for K3 configs: bump when what is written here changes
VARIANTS = ("mxfp4", "dequantized")
VISION_STUBS = ("vision_tower.stub.weight", "mm_projector.stub.weight")


def variant_config(raw: dict, variant: str, dtype: str) -> dict:
    """The config.json a variant is written with: `dtype` at both levels, `quantization_config` kept for mxfp4 and
    removed for dequantized (at both levels)."""
    if variant not in VARIANTS:
        raise ValueError(f"K3 twin variant {variant!r} is not one of {VARIANTS}")
    if not isinstance(raw.get("text_config"), dict):
        raise ValueError("a K3 twin is written in K3's packaging: its config must nest the text model in text_config")
    out = copy.deepcopy(raw)
    out["dtype"] = out["text_config"]["dtype"] = dtype
    if variant == "dequantized":
        out.pop("quantization_config", None)
        out["text_config"].pop("quantization_config", None)
    elif not read_k3(out).mxfp4_experts:
        raise ValueError("K3 twin variant 'mxfp4' needs the config's quantization_config (compressed-tensors MXFP4)")
    return out


def k3_init(name: str, shape: tuple[int, ...], gen: torch.Generator, heads: int) -> torch.Tensor:
    """One K3 tensor, fp32 (see the module docstring)."""
    if name.endswith("norm.weight"):
        return torch.empty(shape).uniform_(0.75, 1.25, generator=gen)
    if name.endswith("A_log"):
        a_log = torch.zeros(shape)
        a_log[:heads] = torch.empty(heads).uniform_(1.0, 16.0, generator=gen).log()
        return a_log
    if name.endswith("dt_bias"):
        return torch.empty(shape).uniform_(-1.5, 0.5, generator=gen)
    if name.endswith("conv1d.weight"):
        bound = 1 / math.sqrt(shape[-1])  # nn.Conv1d default, fan_in = kernel size (depthwise)
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    if name.endswith("e_score_correction_bias"):
        return torch.empty(shape).uniform_(-0.05, 0.05, generator=gen)
    return torch.empty(shape).normal_(0.0, 0.02, generator=gen)


def k3_twin_tensors(raw: dict, dtype: torch.dtype, seed: int):
    """(name, tensor) in checkpoint order for a variant's config (variant_config); deterministic per seed, and equal
    values across the two variants."""
    cfg = read_k3(raw)
    if A_LOG_SLOTS < cfg.kda_heads:
        raise ValueError(f"A_log holds {A_LOG_SLOTS} slots, fewer than {cfg.kda_heads} KDA heads")
    gen = torch.Generator().manual_seed(seed)
    experts: dict[str, torch.Tensor] = {}  # one layer's routed experts, drawn in order, quantized together
    for name, (shape, dt) in k3_logical_tensors(cfg, dtype).items():
        value = k3_init(name, shape, gen, cfg.kda_heads)
        if is_routed_expert(name):
            experts[name] = value
            continue
        yield from _experts_out(experts, cfg.mxfp4_experts, dtype)
        experts = {}
        yield name, value.to(dt)
    yield from _experts_out(experts, cfg.mxfp4_experts, dtype)
    vision = raw.get("vision_config")
    if isinstance(vision, dict):
        width = vision.get("hidden_size", 64)
        for name, shape in zip(VISION_STUBS, ((width, width), (cfg.hidden_size, width)), strict=True):
            yield name, torch.empty(shape).normal_(0.0, 0.02, generator=gen).to(dtype)


def _experts_out(experts: dict[str, torch.Tensor], packed: bool, dtype: torch.dtype):
    """MXFP4-quantize a run of expert weights (stacked by shape: one call per projection kind, not per expert), then
    yield each packed, or as its exact dequantization in `dtype`, in the run's order."""
    by_shape: dict[tuple, list[str]] = {}
    for name, value in experts.items():
        by_shape.setdefault(tuple(value.shape), []).append(name)
    out = {}
    for names in by_shape.values():
        codes, scales = quantize(torch.stack([experts[n] for n in names]))
        exact = dequantize(codes, scales)
        widened = exact.to(dtype)
        if not packed and not torch.equal(widened.float(), exact):
            raise ValueError(f"{names[0]}: MXFP4 values are not exact in {dtype}; write the twin in bf16 or fp32")
        for i, name in enumerate(names):
            base = name.removesuffix("weight")
            out[name] = {base + PACKED: codes[i], base + SCALE: scales[i]} if packed else {name: widened[i]}
    for name in experts:
        yield from out[name].items()


def k3_twin_sizes(raw: dict, dtype: torch.dtype) -> dict[str, int]:
    """Name -> bytes of every tensor a variant's config writes, in order (the shard layout is planned from it)."""
    cfg = read_k3(raw)
    sizes = {n: math.prod(s) * d.itemsize for n, (s, d) in k3_tensors(cfg, dtype).items()}
    vision = raw.get("vision_config")
    if isinstance(vision, dict):
        width = vision.get("hidden_size", 64)
        sizes |= {
            VISION_STUBS[0]: width * width * dtype.itemsize,
            VISION_STUBS[1]: cfg.hidden_size * width * dtype.itemsize,
        }
    return sizes


def write_k3_shards(raw: dict, out_dir: Path, layout: dict[str, list[str]], dtype: torch.dtype, seed: int) -> None:
    """Write the shards `layout` names (file -> tensor names, in the order k3_twin_tensors yields them)."""
    stream = k3_twin_tensors(raw, dtype, seed)
    for file, names in layout.items():
        tensors = dict(next(stream) for _ in names)
        if list(tensors) != names:
            raise RuntimeError(f"K3 twin: {file} got tensors out of the planned order")
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
    if next(stream, None) is not None:
        raise RuntimeError("K3 twin: more tensors drawn than planned")
