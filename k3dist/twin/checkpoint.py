"""Seeded random checkpoints in the original Hugging Face layout, for any Kimi-Linear or Kimi K3 config.

Initialised the way the real model is (normal(0, 0.02) projections, unit norms, fla's A_log and dt_bias) so that
decoding stays numerically sane. Written once per (config, seed, dtype) into a cache dir, atomically, under a file
lock, so concurrent ranks never see a partial checkpoint. A K3 config (weights/k3_config.model_variant) is written in
K3's packaging by k3_checkpoint.py, in either of its two variants (MXFP4 or dequantized experts).
"""

import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..base.dtypes import BY_NAME
from ..config import KIMI_K3, model_variant, parse_config, text_fields
from ..weights.inventory import INDEX
from ..weights.schema import expected_tensors
from .k3_checkpoint import K3_TWIN_VERSION, k3_twin_sizes, variant_config, write_k3_shards
from .tokenizer import K3_TOKENIZER_VERSION, KIMI_K2, TWIN_TOKENIZER_VERSION, write_tokenizer

log = logging.getLogger("k3dist")


def cache_root() -> Path:
    return Path(os.environ.get("K3DIST_CACHE") or Path.home() / ".cache" / "k3dist")


def init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float = 0.02) -> torch.Tensor:
    """One tensor, fp32, drawn like the real model's initialisation."""
    return fill_tensor(torch.empty(shape), name, gen, std)


def fill_tensor(out: torch.Tensor, name: str, gen: torch.Generator, std: float = 0.02) -> torch.Tensor:
    """`out` drawn in place like the real model's initialisation, on its own device with `gen` (one of that device):
    the small tensors with a shape of their own in fp32 first, the projections straight in out's dtype (a 48B
    model's weights are drawn where they live, benchmarks/decode_48b.py). Returns `out`."""
    if name.endswith("norm.weight"):
        return out.fill_(1.0)
    if name.endswith("e_score_correction_bias") or name.endswith("conv1d.weight"):
        bound = 0.05 if name.endswith("bias") else 1 / math.sqrt(out.shape[-1])  # trained checkpoints carry a bias;
        return out.uniform_(-bound, bound, generator=gen)  # conv: nn.Conv1d's default, fan_in = the kernel size
    if name.endswith("A_log") or name.endswith("dt_bias"):
        value = torch.empty(out.shape, device=out.device)
        if name.endswith("A_log"):
            return out.copy_(value.uniform_(1.0, 16.0, generator=gen).log_())
        dt = value.uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp_().clamp_min_(1e-4)
        return out.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
    return out.normal_(0.0, std, generator=gen)


def shard_layout(schema: dict[str, tuple[int, ...]], itemsize: int, shard_bytes: int) -> dict[str, list[str]]:
    """File name -> tensor names, in schema order, each file up to `shard_bytes` (HF's model-0000i-of-0000n)."""
    return sized_shard_layout({name: math.prod(shape) * itemsize for name, shape in schema.items()}, shard_bytes)


def sized_shard_layout(sizes: dict[str, int], shard_bytes: int) -> dict[str, list[str]]:
    """As shard_layout, from each tensor's bytes (tensors of mixed dtypes)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": names for i, names in enumerate(shards)}


def write_index(out_dir: Path, raw_config: dict, layout: dict[str, list[str]], total: int, dtype: str) -> None:
    weight_map = {name: file for file, names in layout.items() for name in names}
    (out_dir / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out_dir / "config.json").write_text(json.dumps(raw_config | {"dtype": dtype}, indent=2))


def write_checkpoint(
    raw_config: dict,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "bfloat16",
    shard_bytes: int = 200 * 2**20,
    tokenizer: bool = True,
    variant: str | None = None,
    chat_format: str | None = None,
) -> Path:
    """Write config.json, `model-0000i-of-0000n.safetensors` shards and the index into `out_dir`.

    With `tokenizer`, also the twin's tokenizer files (tiktoken.model, tokenizer_config.json, chat_template.jinja,
    generation_config.json) when the vocabulary holds Kimi's 256-id special block and more (vocab_size >= 512), in
    `chat_format` (twin/tokenizer.py's kimi_k2 or kimi_k3; None: the model's own, K3's for a K3 config).
    `variant` picks a K3 twin's experts ("mxfp4" or "dequantized"; None: as the config says) and must be None for a
    Kimi-Linear config.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch_dtype = BY_NAME[dtype].torch
    if model_variant(raw_config) == KIMI_K3:
        raw_config = variant_config(raw_config, variant or default_variant(raw_config), dtype)
        sizes = k3_twin_sizes(raw_config, torch_dtype)
        layout = sized_shard_layout(sizes, shard_bytes)
        write_k3_shards(raw_config, out_dir, layout, torch_dtype, seed)
        total = sum(sizes.values())
    elif variant is not None:
        raise ValueError(f"variant={variant!r}: only a K3 config has variants")
    else:
        schema = expected_tensors(parse_config(raw_config))
        gen = torch.Generator().manual_seed(seed)
        layout = shard_layout(schema, torch_dtype.itemsize, shard_bytes)
        for file, names in layout.items():
            tensors = {n: init_tensor(n, schema[n], gen).to(torch_dtype) for n in names}
            save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
            del tensors
        total = sum(math.prod(s) for s in schema.values()) * torch_dtype.itemsize
    write_index(out_dir, raw_config, layout, total, dtype)
    vocab_size = text_fields(raw_config)["vocab_size"]
    if tokenizer and vocab_size >= 512:
        chat_format = chat_format or (KIMI_K3 if model_variant(raw_config) == KIMI_K3 else KIMI_K2)
        ids = raw_config.get("eos_token_id"), raw_config.get("bos_token_id")
        write_tokenizer(out_dir, vocab_size, *ids, chat_format)
    return out_dir


def default_variant(raw_config: dict) -> str:
    """A K3 config's own variant: MXFP4 experts when it carries a quantization_config, dequantized otherwise."""
    return "mxfp4" if "quantization_config" in text_fields(raw_config) else "dequantized"


def ensure_twin(
    config_path: str | Path,
    seed: int = 0,
    dtype: str = "bfloat16",
    root: Path | None = None,
    variant: str | None = None,
) -> Path:
    """The cached twin checkpoint for this config, written once (atomic rename, file lock against races).

    A K3 config's twin is keyed by its variant too (None: the config's own, see default_variant)."""
    raw = json.loads(Path(config_path).read_text())
    versions = {"tokenizer": TWIN_TOKENIZER_VERSION}  # a new version rewrites twins cached before it
    name = f"{Path(config_path).stem}-seed{seed}-{dtype}"
    if model_variant(raw) == KIMI_K3:  # Kimi-Linear keys stay as they were
        variant = variant or default_variant(raw)
        versions |= {"k3": K3_TWIN_VERSION, "variant": variant, "k3_tokenizer": K3_TOKENIZER_VERSION}
        name += f"-{variant}"
    key = hashlib.sha256(json.dumps([raw, seed, dtype, versions], sort_keys=True).encode()).hexdigest()[:12]
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-{key}"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / INDEX).exists():
            tmp = root / f".tmp-{final.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("k3_twin_write dir=%s", final)
            write_checkpoint(raw, tmp, seed, dtype, variant=variant)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
    return final
