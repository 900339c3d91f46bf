"""The path guard for everything read from a model dir: a name resolves inside the dir, or is refused in one line."""

import os
from pathlib import Path

from .errors import K3Error

INDEX = "model.safetensors.index.json"


def inside(model_dir: Path, name: str, what: str) -> Path:
    """Resolve `name` inside `model_dir`; refuse absolute paths, `..` and symlinks that leave the dir."""
    if os.path.isabs(name) or ".." in Path(name).parts or not name:
        raise K3Error(f"{model_dir / INDEX}: {what} names {name!r}, which is outside the model dir")
    path = model_dir / name
    try:
        real = path.resolve()
        outside, exists = not real.is_relative_to(model_dir.resolve()), real.is_file()
    except (OSError, ValueError, RuntimeError) as exc:  # NUL byte, name too long, symlink loop (3.11)
        why = getattr(exc, "strerror", None) or exc
        raise K3Error(f"{model_dir}: {what} names {name[:200]!r}, which cannot be resolved ({why})") from None
    if outside:
        raise K3Error(f"{path}: {what} resolves to {real}, outside the model dir {model_dir}")
    if not exists:
        kind = "a file that does not exist"
        if real.exists():
            kind = "a directory, not a file" if real.is_dir() else "something that is not a regular file"
        raise K3Error(f"{path}: {what} names {kind}")
    return path
