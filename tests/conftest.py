"""Shared fixtures and the test kinds.

tests/unit (one process), tests/ranks (real gloo ranks), tests/cli (launch.py, sweeps, signals), tests/serve (a real
server), tests/gpu (marker `gpu`, skipped without CUDA). Tests marked `slow` are left out of the default run (README:
Tests). Without CUDA, Triton kernels run under Triton's interpreter on the CPU.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

ROOT = Path(__file__).resolve().parent.parent
TWIN_CONFIG = ROOT / "k3dist" / "configs" / "Kimi-K3-0.40B-config.json"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def k3_cache(tmp_path_factory) -> Path:
    """Twin checkpoints for the whole session ($K3DIST_TEST_CACHE keeps them between runs). Under pytest-xdist the
    workers share one (each worker's temporary folder sits in the run's): the twin is written once, under a lock."""
    run_tmp = tmp_path_factory.getbasetemp()
    shared = run_tmp.parent / "k3cache" if os.environ.get("PYTEST_XDIST_WORKER") else run_tmp / "k3cache"
    path = Path(os.environ.get("K3DIST_TEST_CACHE") or shared)
    os.environ["K3DIST_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def twin_dir(k3_cache) -> Path:
    """The 0.40B twin, bf16, written once."""
    from k3dist.twin.checkpoint import ensure_twin

    return ensure_twin(TWIN_CONFIG, root=k3_cache)
