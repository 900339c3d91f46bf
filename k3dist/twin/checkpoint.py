"""Seeded random checkpoints in the original Hugging Face layout, for any Kimi-Linear config.

Initialised the way the real model is (normal(0, 0.02) projections, unit norms, fla's A_log and dt_bias) so that
decoding stays numerically sane. Written once per (config, seed, dtype) into a cache dir, atomically, under a file
lock, so concurrent ranks never see a partial checkpoint.
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
from ..config import parse_config
from ..weights.inventory import INDEX
from ..weights.schema import expected_tensors
from .tokenizer import TWIN_TOKENIZER_VERSION, write_tokenizer

log = logging.getLogger("k3dist")


def cache_root() -> Path:
    return Path(os.environ.get("K3DIST_CACHE") or Path.home() / ".cache" / "k3dist")


def init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float = 0.02) -> torch.Tensor:
    """One tensor, fp32, drawn like the real model's initialisation."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith("dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp().clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if name.endswith("conv1d.weight"):
        bound = 1 / math.sqrt(shape[-1])  # nn.Conv1d default, fan_in = kernel size (depthwise)
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    if name.endswith("e_score_correction_bias"):
        return torch.empty(shape).uniform_(-0.05, 0.05, generator=gen)  # trained checkpoints carry a bias
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def shard_layout(schema: dict[str, tuple[int, ...]], itemsize: int, shard_bytes: int) -> dict[str, list[str]]:
    """File name -> tensor names, in schema order, each file up to `shard_bytes` (HF's model-0000i-of-0000n)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in schema.items():
        nbytes = math.prod(shape) * itemsize
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
) -> Path:
    """Write config.json, `model-0000i-of-0000n.safetensors` shards and the index into `out_dir`.

    With `tokenizer`, also the twin's tokenizer files (tiktoken.model, tokenizer_config.json, chat_template.jinja,
    generation_config.json) when the vocabulary holds Kimi's 256-id special block and more (vocab_size >= 512).
    """
    schema = expected_tensors(parse_config(raw_config))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch_dtype = BY_NAME[dtype].torch
    gen = torch.Generator().manual_seed(seed)
    layout = shard_layout(schema, torch_dtype.itemsize, shard_bytes)
    for file, names in layout.items():
        tensors = {n: init_tensor(n, schema[n], gen).to(torch_dtype) for n in names}
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        del tensors
    write_index(out_dir, raw_config, layout, sum(math.prod(s) for s in schema.values()) * torch_dtype.itemsize, dtype)
    vocab_size = raw_config["vocab_size"]
    if tokenizer and vocab_size >= 512:
        write_tokenizer(out_dir, vocab_size, raw_config.get("eos_token_id"), raw_config.get("bos_token_id"))
    return out_dir


def ensure_twin(config_path: str | Path, seed: int = 0, dtype: str = "bfloat16", root: Path | None = None) -> Path:
    """The cached twin checkpoint for this config, written once (atomic rename, file lock against races)."""
    raw = json.loads(Path(config_path).read_text())
    versions = {"tokenizer": TWIN_TOKENIZER_VERSION}  # a new version rewrites twins cached before it
    key = hashlib.sha256(json.dumps([raw, seed, dtype, versions], sort_keys=True).encode()).hexdigest()[:12]
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{Path(config_path).stem}-seed{seed}-{dtype}-{key}"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / INDEX).exists():
            tmp = root / f".tmp-{final.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("k3_twin_write dir=%s", final)
            write_checkpoint(raw, tmp, seed, dtype)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
    return final
