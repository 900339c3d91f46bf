"""Inventory of a checkpoint from its headers only: every expected tensor present once, right shape and dtype.

safetensors parses and validates each header (offsets, dtype, coverage); this module checks the result against
the config's schema, keeps every path inside the model dir, and fingerprints the headers for the agreement.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..config import ModelConfig
from ..errors import K3Error
from .schema import canonical_name, expected_tensors
from .tp_plan import DTYPE_BYTES

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    name: str  # canonical name
    key: str  # name in the file
    file: str  # file name relative to the model dir
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string

    def as_plan_input(self):
        return self.name, self.key, self.file, self.shape, self.dtype


@dataclass(frozen=True)
class Inventory:
    model_dir: Path
    files: tuple[str, ...]
    entries: dict[str, TensorEntry]
    fingerprint: str
    file_bytes: int

    def plan_inputs(self):
        return [e.as_plan_input() for e in self.entries.values()]


def inside(model_dir: Path, name: str, what: str) -> Path:
    """Resolve `name` inside `model_dir`; refuse absolute paths, `..` and symlinks that leave the dir."""
    if os.path.isabs(name) or ".." in Path(name).parts or not name:
        raise K3Error(f"{model_dir / INDEX}: {what} names {name!r}, which is outside the model dir")
    path = model_dir / name
    real = path.resolve()
    if not real.is_relative_to(model_dir.resolve()):
        raise K3Error(f"{path}: {what} resolves to {real}, outside the model dir {model_dir}")
    if not real.is_file():
        raise K3Error(f"{path}: {what} names a file that does not exist")
    return path


def _index_map(model_dir: Path) -> dict[str, str] | None:
    path = model_dir / INDEX
    if not path.exists():
        return None
    inside(model_dir, INDEX, "the index")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise K3Error(f"{path}: not valid JSON ({exc})") from None
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise K3Error(f"{path}: needs a weight_map object of tensor name -> file name")
    return wm


def _header_digest(path: Path, digest) -> None:
    """Feed the raw header (length prefix + JSON) to the fingerprint; safetensors already validated it."""
    with open(path, "rb") as f:
        head = f.read(8)
        digest.update(head)
        digest.update(f.read(int.from_bytes(head, "little")))


def scan(model_dir: str | Path, cfg: ModelConfig) -> Inventory:
    """Headers only: list every tensor, check it against the schema, fingerprint the checkpoint."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise K3Error(f"{model_dir}: model dir does not exist")
    index = _index_map(model_dir)
    files = (
        sorted(set(index.values())) if index is not None else sorted(p.name for p in model_dir.glob("*.safetensors"))
    )
    if not files:
        raise K3Error(f"{model_dir}: no *.safetensors files")
    found: dict[str, TensorEntry] = {}
    digest = hashlib.sha256()
    total = 0
    for name in files:
        path = inside(model_dir, name, "the weight_map" if index is not None else "a checkpoint file")
        size = path.stat().st_size
        total += size
        digest.update(f"{name}:{size}:".encode())
        try:
            with safe_open(path, framework="pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    entry = TensorEntry(canonical_name(key), key, name, tuple(piece.get_shape()), piece.get_dtype())
                    if entry.name in found:
                        raise K3Error(f"{path}: tensor {key} is duplicated (also in {found[entry.name].file})")
                    found[entry.name] = entry
        except SafetensorError as exc:
            raise K3Error(f"{path}: not a valid safetensors file ({exc})") from None
        except OSError as exc:
            raise K3Error(f"{path}: cannot read ({exc})") from None
        _header_digest(path, digest)
    _check(model_dir, cfg, found, index)
    ordered = {n: found[n] for n in expected_tensors(cfg)}
    return Inventory(model_dir, tuple(files), ordered, digest.hexdigest(), total)


def _check(model_dir: Path, cfg: ModelConfig, found: dict[str, TensorEntry], index: dict | None) -> None:
    expected = expected_tensors(cfg)
    problems = []
    for name, shape in expected.items():
        entry = found.get(name)
        if entry is None:
            where = f"{model_dir / index[name]}" if index and name in index else str(model_dir)
            problems.append(f"{where}: tensor {name} is missing (expected shape {list(shape)})")
        elif entry.shape != shape:
            problems.append(
                f"{model_dir / entry.file}: tensor {entry.key} has shape {list(entry.shape)}, "
                f"the config needs {list(shape)}"
            )
        elif entry.dtype not in DTYPE_BYTES:
            problems.append(
                f"{model_dir / entry.file}: tensor {entry.key} has dtype {entry.dtype}, "
                f"supported: {sorted(DTYPE_BYTES)}"
            )
        elif index is not None and index.get(entry.key) not in (None, entry.file):
            problems.append(
                f"{model_dir / INDEX}: tensor {entry.key} is mapped to {index[entry.key]} but stored in {entry.file}"
            )
    for name, entry in found.items():
        if name not in expected:
            problems.append(f"{model_dir / entry.file}: tensor {entry.key} is unexpected for this config")
    if index is not None:
        stored = {e.key for e in found.values()}
        for key, file in index.items():
            if key not in stored:
                problems.append(f"{model_dir / INDEX}: weight_map lists tensor {key} in {file}, which lacks it")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise K3Error(problems[0] + more)
