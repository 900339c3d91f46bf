"""`pytest -m gpu` collects on a machine with torch, Triton and the project's own dependencies only (issue 38: the
GPU machine's collection stopped at a module-level `import jsonschema`). Here the optional packages are made
unimportable in a fresh interpreter and the whole suite is collected there."""

import os
import re
import subprocess
import sys

from tests.support.cli_run import ROOT

# the import names of pyproject's test, serve and bench extras (and of what they bring that k3dist imports), Triton
# and pytest aside
OPTIONAL = {
    "pytest-xdist": "xdist",
    "hypothesis": "hypothesis",
    "transformers": "transformers",
    "openai": "openai",
    "httpx": "httpx",
    "jsonschema": "jsonschema",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "prometheus-client": "prometheus_client",
    "xgrammar": "xgrammar",
    "lm-eval[api]": "lm_eval",
    "matplotlib": "matplotlib",
    "langchain-openai": "langchain_openai",
    "instructor": "instructor",
    "openai-agents": "agents",
    "llama-cpp-python": "llama_cpp",
    "gguf": "gguf",
    "smg": "smg",
    "pyzmq": "zmq",
    "msgspec": "msgspec",
    "pydantic (fastapi's)": "pydantic",
    "starlette (fastapi's)": "starlette",
}
BLOCKED = """
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, Blocked())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]))
"""


def test_every_optional_package_of_pyproject_is_blocked():
    text = (ROOT / "pyproject.toml").read_text()
    extras = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    named = {re.match(r"[A-Za-z0-9_.\-\[\]]+?(?=[<>=\[]|$)", d).group(0) for d in re.findall(r'"([^"]+)"', extras)}
    named -= {"pytest", "triton", "numpy", "ruff", "k3dist"}
    assert {n.split("[")[0] for n in named} <= {k.split("[")[0].split(" ")[0] for k in OPTIONAL}, named


def test_gpu_tests_collect_without_the_optional_packages():
    code = BLOCKED.format(names=set(OPTIONAL.values()))
    env = os.environ | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # no plugin of an optional package loads either
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "tests/gpu/test_cuda.py::test_replays_never_sync_the_host[triton-cuda]" in out, out[-3000:]
    assert "tests/unit/test_triton_kernels.py::" in out and "error" not in out.lower(), out[-3000:]
