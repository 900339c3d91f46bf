"""k3dist runs on every torch from the declared minimum on (issue 38: a GPU image's torch 2.11 lacked
`torch.accelerator.empty_host_cache`, and every CUDA load failed): an API newer than the minimum is named only in
k3dist/base/compat.py, and every other torch name the code reaches was resolved on the minimum itself."""

import ast
import re

import torch

from k3dist.base import compat
from k3dist.weights.staging import Ring, release_pinned
from tests.support.torch_api import COMPAT, ROOT, names_in, sources, used, verified


def _newer(name: str) -> str | None:
    return next((api for api in compat.NEWER if name == api or name.startswith(api + ".")), None)


def test_apis_newer_than_the_minimum_are_named_only_in_compat():
    """Attribute chains (through import aliases) and the strings getattr/hasattr would take."""
    tails = {api.rsplit(".", 1)[1] for api in compat.NEWER}
    found = []
    for path in sources():
        if path == COMPAT:
            continue
        found += [f"{path.relative_to(ROOT)}: {n}" for n in sorted(names_in(path)) if _newer(n)]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in tails:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: the string {node.value!r}")
    assert not found, f"use these through k3dist/base/compat.py: {found}"


def test_every_other_torch_name_was_resolved_on_the_minimum():
    """A name missing from tests/support/torch_api_min.txt is new to the code: check it on the minimum torch
    (`python -m tests.support.torch_api --write` there) or add it to compat.NEWER with a fallback."""
    new = {name: sorted(files) for name, files in used().items() if name not in verified()}
    assert not new, new


def test_the_minimum_is_pyproject_bound_and_the_torch_the_list_was_made_on():
    bound = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    made_on = re.search(r"on torch ([\d.]+)", (ROOT / "tests/support/torch_api_min.txt").read_text()).group(1)
    assert bound == compat.MINIMUM and made_on.startswith(compat.MINIMUM + ".")
    readme = (ROOT / "README.md").read_text()
    assert f"torch>={compat.MINIMUM}" in readme and f"torch {made_on}" in readme


def test_every_newer_api_is_tested_for_and_each_door_runs_here():
    for api, (since, fallback) in compat.NEWER.items():
        assert compat.has(api) == (compat._find(api) is not None) and fallback
        assert compat.version_tuple(since) > compat.version_tuple(compat.MINIMUM), api
    assert compat._find("torch.no_such_api", "torch.cuda.is_available") is torch.cuda.is_available
    assert compat._find("torch.no_such_api") is None
    assert isinstance(compat.amx_tile_supported(), bool)
    compat.empty_host_cache()  # on a CPU build too: nothing pinned, nothing to give back
    release_pinned()


def test_the_staging_ring_closes_on_this_torch():
    """The load's last step that failed on torch 2.11 (Ring.close gives the pinned slots back)."""
    ring = Ring(2, 64, cuda=torch.cuda.is_available())
    ring.take().buffer.fill_(1)
    ring.close()
    assert ring.slots == [None, None]


def test_the_triton_floor_is_the_gpu_extra_and_versions_compare_as_numbers():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'gpu = ["triton>={compat.TRITON_MINIMUM}"]' in text
    assert compat.version_tuple("2.11.0+cu130") == (2, 11, 0) and compat.version_tuple("3.10.0rc1") == (3, 10, 0)
    assert compat.version_tuple("3.10.0") > compat.version_tuple(compat.TRITON_MINIMUM) > compat.version_tuple("3.0.0")
    found = compat.triton_version()
    assert compat.triton_usable() == (found is not None and compat.version_tuple(found) >= (3, 6))
