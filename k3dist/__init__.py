"""k3dist: tensor-parallel serving of Kimi-Linear-family hybrid models (KDA + MLA + MoE)."""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def _mount_kernels() -> None:
    """Expose the top-level `kernels/` folder as `k3dist.kernels`.

    The folder keeps the design card's layout, but it is never importable as plain `kernels`, the name of
    Hugging Face's kernel-hub package that transformers probes at import time. Wheels map it in pyproject.
    """
    if (Path(__file__).parent / "kernels").is_dir() or "k3dist.kernels" in sys.modules:
        return
    folder = Path(__file__).resolve().parent.parent / "kernels"
    spec = importlib.machinery.ModuleSpec("k3dist.kernels", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)
    sys.modules["k3dist.kernels"] = module


_mount_kernels()
