"""The small files of a model dir (JSON configs, templates): found inside the dir, read or refused in one line."""

import json
import os
from pathlib import Path
from typing import Any

from .errors import K3Error
from .paths import inside


def optional_file(model_dir: Path, name: str, what: str) -> Path | None:
    """`model_dir/name` if it exists (resolved inside the dir, so a symlink out of it is refused), else None."""
    if not os.path.lexists(model_dir / name):
        return None
    return inside(model_dir, name, what)


def read_text(path: Path) -> str:
    """The file as UTF-8 text; unreadable or non-UTF-8 bytes are a K3Error naming the file (and line)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise K3Error(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise K3Error(f"{path}:{line}: not UTF-8 (byte {data[exc.start]:#04x} at offset {exc.start})") from None


def read_json(path: Path) -> Any:
    """Parsed JSON; a syntax error names the file and the line it is on."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise K3Error(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise K3Error(f"{path}: not valid JSON (nested too deeply)") from None


def read_json_object(path: Path) -> dict:
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise K3Error(f"{path}: expected a JSON object, got a JSON {type(raw).__name__}")
    return raw
