"""Shared fixtures: one cache dir of twin checkpoints per test session, small configs, a rank spawner."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def k3_cache(tmp_path_factory) -> Path:
    """Twin checkpoints for the whole session ($K3DIST_TEST_CACHE keeps them between runs)."""
    path = Path(os.environ.get("K3DIST_TEST_CACHE") or tmp_path_factory.mktemp("k3cache"))
    os.environ["K3DIST_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def twin_dir(k3_cache) -> Path:
    """The 0.40B twin, bf16, written once."""
    from k3dist.weights.twin import ensure_twin

    return ensure_twin(ROOT / "k3dist" / "configs" / "Kimi-K3-0.40B-config.json", root=k3_cache)
