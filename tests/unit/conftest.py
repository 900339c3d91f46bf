"""Fixtures of the bad-checkpoint tests: a small valid checkpoint in four files and a safetensors file outside it."""

import shutil
from pathlib import Path

import pytest

from k3dist.config import load_config
from k3dist.twin.checkpoint import write_checkpoint
from k3dist.weights.inventory import scan
from tests.support.bad_files import SHARD
from tests.support.configs import small_config


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A small valid checkpoint in 4 files + index (written once per module, copied per case)."""
    d = write_checkpoint(small_config(), tmp_path_factory.mktemp("good") / "model", seed=7, shard_bytes=200_000)
    assert sorted(p.name for p in d.glob("*.safetensors"))[1] == SHARD
    scan(d, load_config(d))  # valid to begin with
    return d


@pytest.fixture(scope="module")
def outside(tmp_path_factory, good) -> Path:
    """A valid safetensors file outside any model dir (a copy of a real shard), for escapes to aim at."""
    path = tmp_path_factory.mktemp("outside") / "outside.safetensors"
    shutil.copy(good / SHARD, path)
    return path
