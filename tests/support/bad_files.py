"""Shared by the bad-checkpoint tests (the fixtures `good` and `outside` are in tests/unit/conftest.py): raw header
reads and writes, index and config edits, a deadline, and an inotify watch that sees any open of a file outside the
model dir."""

import ctypes
import json
import os
import signal
import struct
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from k3dist.weights.inventory import INDEX

ROOT = Path(__file__).resolve().parents[2]
SHARD = "model-00002-of-00004.safetensors"  # the file most cases corrupt (a middle one)


# ---------------------------------------------------------------------------------------------- helpers


def read_raw(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def write_raw(path: Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def tensors_by_offset(header: dict) -> list[tuple[str, list[int]]]:
    return sorted(((k, v["data_offsets"]) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1])


def load_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as h:
        return {k: h.get_tensor(k).clone() for k in h.keys()}


def edit_index(d: Path, fn) -> None:
    index = json.loads((d / INDEX).read_text())
    fn(index["weight_map"])
    (d / INDEX).write_text(json.dumps(index))


def edit_config(d: Path, fn) -> None:
    raw = json.loads((d / "config.json").read_text())
    fn(raw)
    (d / "config.json").write_text(json.dumps(raw))


@contextmanager
def deadline(seconds: float):
    """Fail (TimeoutError) instead of hanging."""

    def boom(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class OpenWatch:
    """inotify IN_OPEN on a directory: sees every open of its files, from Python or from safetensors' Rust."""

    IN_OPEN, IN_NONBLOCK = 0x20, os.O_NONBLOCK

    def __init__(self, directory: Path):
        self.fd = -1
        if not sys.platform.startswith("linux"):
            return
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(self.IN_NONBLOCK)
        if self.fd >= 0 and libc.inotify_add_watch(self.fd, str(directory).encode(), self.IN_OPEN) < 0:
            os.close(self.fd)
            self.fd = -1

    def opened(self) -> bool:
        """Any open since the last call."""
        seen = False
        while self.fd >= 0:
            try:
                seen |= bool(os.read(self.fd, 65536))
            except BlockingIOError:
                break
        return seen

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
