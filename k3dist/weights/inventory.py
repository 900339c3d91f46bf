"""Inventory of a checkpoint from its headers only: every expected tensor present once, right shape and dtype.

safetensors parses and validates each header (offsets, dtype, coverage); this module checks the result against
the config's schema, keeps every path inside the model dir, and fingerprints the headers for the agreement.
"""

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..base.dtypes import ELEMENT_BITS, MXFP4_BYTES, TABLE
from ..base.errors import K3Error
from ..base.files import read_json
from ..base.paths import INDEX, inside
from ..config import ModelConfig
from .schema import MXFP4_PARTS, VISION_PREFIXES, canonical_name, expected_tensors, is_vision

log = logging.getLogger("k3dist")
MAX_HEADER = 100_000_000  # safetensors' own limit on the header length


@dataclass(frozen=True)
class TensorEntry:
    name: str  # canonical name
    key: str  # name in the file
    file: str | None  # file name relative to the model dir; None when planned from the config alone
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code
    offset: int | None = None  # absolute byte offset of its data in the file; None when planned from the config


@dataclass(frozen=True)
class Inventory:
    config: ModelConfig
    model_dir: Path
    files: tuple[str, ...]
    entries: dict[str, TensorEntry]
    file_digests: dict[str, str]  # file -> sha256 of its name, size and raw header
    file_bytes: int

    @property
    def fingerprint(self) -> str:
        """One digest of every file's header, exchanged in the agreement to catch ranks seeing other checkpoints."""
        return hashlib.sha256(json.dumps(self.file_digests, sort_keys=True).encode()).hexdigest()


def _index_map(model_dir: Path) -> dict[str, str] | None:
    path = model_dir / INDEX
    if not path.exists():
        return None
    inside(model_dir, INDEX, "the index")
    raw = read_json(path)
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise K3Error(f"{path}: needs a weight_map object of tensor name -> file name")
    return wm


def header_digest(path: Path, size: int) -> str:
    """sha256 of the file's name, size and raw header (length prefix + JSON); safetensors already validated it."""
    digest = hashlib.sha256(f"{path.name}:{size}:".encode())
    with open(path, "rb") as f:
        head = f.read(8)
        digest.update(head)
        digest.update(f.read(int.from_bytes(head, "little")))
    return digest.hexdigest()


def layout(fd: int) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Each tensor's dtype, shape and absolute data offset (8 + header length + its data_offsets[0]; safetensors does
    not expose offsets), from a header safetensors has validated. Plain preads of the header's bytes only, so that
    a loader reading with readahead off touches no other page."""
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    header = json.loads(os.pread(fd, n, 8))
    return {
        key: (info["dtype"], tuple(info["shape"]), 8 + n + info["data_offsets"][0])
        for key, info in header.items()
        if key != "__metadata__"
    }


def _header_problem(path: Path, size: int) -> str | None:
    """What is wrong with a header safetensors refused, naming the tensor and the numbers (json only, no pickle)."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little")
        if len(head) < 8 or n > size - 8 or n > MAX_HEADER:
            return f"header length {n if len(head) == 8 else '?'} does not fit the file of {size} bytes"
        text = f.read(n)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return f"the {n}-byte header is not JSON ({exc})"
    if not isinstance(header, dict):
        return f"the header is a JSON {type(header).__name__}, not an object"
    data, spans = size - 8 - n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, offsets = (
            info.get(k) if isinstance(info, dict) else None for k in ("dtype", "shape", "data_offsets")
        )
        if not isinstance(dtype, str) or dtype not in ELEMENT_BITS:
            return f"tensor {name} has unknown dtype {dtype!r}"
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            return f"tensor {name} has invalid shape {shape!r}"
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
            return f"tensor {name} has invalid data_offsets {offsets!r}"
        begin, end = offsets
        if begin > end or end > data:
            return f"tensor {name} data_offsets [{begin}, {end}] fall outside the {data} data bytes of the file"
        bits = math.prod(shape) * ELEMENT_BITS[dtype]
        if bits != 8 * (end - begin):
            need = f"{bits // 8} bytes" if bits % 8 == 0 else f"{bits} bits"
            return (
                f"tensor {name} is {dtype} {shape} ({need}) but data_offsets [{begin}, {end}] hold {end - begin} bytes"
            )
        spans.append((begin, end, name))
    covered, last = 0, None
    for begin, end, name in sorted(spans):
        if begin != covered:
            how = (
                f"overlap tensor {last} (which ends at {covered})"
                if begin < covered
                else f"leave a gap after byte {covered}"
            )
            return f"tensor {name} data_offsets [{begin}, {end}] {how}"
        covered, last = end, name
    if covered != data:
        return f"the tensors cover {covered} of the {data} data bytes"
    return None


def scan(model_dir: str | Path, cfg: ModelConfig) -> Inventory:
    """Headers only: list every tensor, check it against the schema, fingerprint the checkpoint. A vision tower's
    tensors (K3's `vision_tower.`, `mm_projector.`) are skipped by name: never planned, so never read."""
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
    digests: dict[str, str] = {}
    total, vision = 0, 0
    for name in files:
        path = inside(model_dir, name, "the weight_map" if index is not None else "a checkpoint file")
        size = path.stat().st_size
        total += size
        try:
            with safe_open(path, framework="pt") as handle:
                fd = os.open(path, os.O_RDONLY)
                try:
                    offsets = {key: offset for key, (_, _, offset) in layout(fd).items()}
                finally:
                    os.close(fd)
                for key in handle.keys():
                    if is_vision(key):
                        vision += 1
                        continue
                    piece = handle.get_slice(key)
                    shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
                    entry = TensorEntry(canonical_name(key), key, name, shape, dtype, offsets[key])
                    if entry.name in found:
                        raise K3Error(f"{path}: tensor {key} is duplicated (also in {found[entry.name].file})")
                    found[entry.name] = entry
        except SafetensorError as exc:
            raise K3Error(f"{path}: not a valid safetensors file: {_header_problem(path, size) or exc}") from None
        except OSError as exc:
            raise K3Error(f"{path}: cannot read ({exc.strerror or exc})") from None
        digests[name] = header_digest(path, size)
    if vision:
        prefixes = ", ".join(VISION_PREFIXES)
        log.info(f"{model_dir}: skipping {vision} vision-tower tensors ({prefixes}): k3dist serves the text model")
    _check(model_dir, cfg, found, index)
    ordered = {n: found[n] for n in expected_tensors(cfg)}
    return Inventory(cfg, model_dir, tuple(files), ordered, digests, total)


def _codes(name: str) -> list[str]:
    """The safetensors dtypes a tensor may have: uint8 for an MXFP4 pair's part, a float dtype for any other."""
    return [MXFP4_BYTES.code] if name.endswith(MXFP4_PARTS) else sorted(d.code for d in TABLE)


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
        elif entry.dtype not in (codes := _codes(name)):
            problems.append(f"{model_dir / entry.file}: tensor {entry.key} has dtype {entry.dtype}, supported: {codes}")
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
            if key not in stored and not is_vision(key):
                problems.append(f"{model_dir / INDEX}: weight_map lists tensor {key} in {file}, which lacks it")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise K3Error(problems[0] + more)
