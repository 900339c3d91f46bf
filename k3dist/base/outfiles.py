"""The files rank 0 writes (result.json, outputs.jsonl): checked before any byte is loaded, written atomically."""

import os
import secrets
from pathlib import Path

from .errors import K3Error


def check_writable(path: str | Path, key: str) -> None:
    """Refuse now, not after a whole generation, a target that cannot be written: a directory in the file's place,
    a parent that is not a directory, or a directory this process cannot create files in (probed with a temp file
    in the nearest existing ancestor, which also answers for root and for ACLs)."""
    path = Path(path)
    if path.is_dir():
        raise K3Error(f"{key} {path}: is a directory, not a file to write")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise K3Error(f"{key} {path}: {ancestor} is not a directory")
    probe = ancestor / f".k3dist-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise K3Error(f"{key} {path}: cannot write in {ancestor} ({exc.strerror})") from None
    probe.unlink(missing_ok=True)


def atomic_write(path: str | Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a temp file beside it, fsync, then os.replace; the temp file never
    outlives a failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the mode a plain open gives, umask applied
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
