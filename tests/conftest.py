"""Shared fixtures and the test kinds.

tests/unit (one process), tests/ranks (real gloo ranks), tests/cli (launch.py, sweeps, signals), tests/serve (a real
server), tests/gpu (the CUDA path: each test's CPU points run everywhere, its `gpu` points are skipped without
CUDA). Tests marked `slow` are left out of the default run (README: Tests). Without CUDA, Triton kernels run under
Triton's interpreter on the CPU.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

ROOT = Path(__file__).resolve().parent.parent
TWIN_CONFIG = ROOT / "k3dist" / "configs" / "Kimi-K3-0.40B-config.json"

# Test files and folders that import packages of pyproject's `test` and `serve` extras as they load (directly or
# through what they import): where one is missing they are not collected, and the header says so, so that
# `pytest -m gpu` collects on a GPU machine with torch, Triton and the carried wheels only (issue 38).
NEEDS = {
    "serve": ("httpx", "openai", "fastapi", "uvicorn", "prometheus_client"),
    "serve/test_structured.py": ("jsonschema",),
    "serve/test_fuzz.py": ("hypothesis",),
    "serve/test_responses.py": ("jsonschema",),
    "serve/test_responses_agents.py": ("agents",),
    "serve/test_gateway.py": ("smg",),
    "serve/test_kv_events.py": ("zmq", "msgspec"),
    "unit/test_kv_events.py": ("zmq", "msgspec"),
    "cli/test_plan_is_the_run.py": ("httpx",),
    "unit/test_grammars.py": ("fastapi", "xgrammar"),
    "unit/test_tool_calls.py": ("fastapi", "xgrammar", "hypothesis"),
    "unit/test_k3_chat_format.py": ("fastapi", "pydantic", "xgrammar"),
    "unit/test_kernels.py": ("transformers",),
    "unit/test_copy_shard.py": ("hypothesis",),
    "unit/test_fuzz_checkpoints.py": ("hypothesis",),
    "unit/test_text_stream.py": ("hypothesis",),
    "unit/test_sampling_doors.py": ("fastapi", "pydantic"),
    "unit/test_serve_schema.py": ("fastapi", "pydantic"),
    "unit/test_responses_output.py": ("fastapi", "openai"),
}


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


MISSING = {path: [n for n in needs if not _importable(n)] for path, needs in NEEDS.items()}
collect_ignore = [path for path, missing in MISSING.items() if missing]


def pytest_report_header(config):
    if collect_ignore:
        return "not collected, for want of optional packages: " + ", ".join(
            f"{path} ({' '.join(MISSING[path])})" for path in collect_ignore
        )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the folder's name (tests/gpu/ runs on CPU)
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


@pytest.fixture(scope="module")
def shared_ranks():
    """Called as run_ranks (tests/support/ranks.py) is, but the module's calls at one world size share one group of
    spawned ranks, each call in a process group of its own: one process start per world, not one per call. For
    tests that prove nothing about a process's first call (a step's host reads would: those start fresh ranks)."""
    from tests.support.ranks import RankGroups

    groups = RankGroups()
    yield groups
    groups.close()
