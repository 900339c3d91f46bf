"""The one door to torch APIs newer than the oldest torch k3dist declares (pyproject: `torch>=MINIMUM`).

Each such API is tested for here, once, and has a fallback that runs on MINIMUM; code anywhere else names only what
MINIMUM has (tests/unit/test_torch_compat.py scans the source for the names in NEWER outside this module, and holds
every other torch name k3dist reaches against the list checked on MINIMUM itself). A GPU machine's image often
carries an older torch than a fresh CPU install: torch 2.11 lacked `torch.accelerator.empty_host_cache`, and every
CUDA load failed on it.
"""

import importlib.metadata
import itertools

import torch
import torch.distributed as dist

MINIMUM = "2.4"  # pyproject's lower bound; the CPU default path and tests/unit ran on torch 2.4.1 (README: Versions)

# The Triton the kernels need: 3.6 ran them on an H200 (issue 38); the CPU tests run them under Triton's interpreter,
# which handles them from 3.7 on. An older Triton leaves the GPU on the torch kernels (kernels/backend.py).
TRITON_MINIMUM = "3.6"

# API -> (the torch that has it first, what runs where it is missing)
NEWER = {
    "torch.accelerator.empty_host_cache": ("2.12", "torch._C._host_emptyCache where present, else nothing"),
    "torch._C._host_emptyCache": ("2.11", "nothing: freed pinned blocks stay cached for reuse until the process ends"),
    "torch._grouped_mm": ("2.8", "a loop over the experts' groups, its offsets read on the host (prefill only)"),
    "torch.cpu._is_amx_tile_supported": ("2.5", "False: no AMX (packing then follows oneDNN's bf16 support alone)"),
    "torch.distributed.distributed_c10d._abort_process_group": ("2.6", "destroy_process_group, which aborts NCCL"),
}


def version_tuple(text: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0): the numeric release parts."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def triton_version() -> str | None:
    """The installed Triton's version, read from its metadata (nothing is imported); None where it is missing."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def triton_usable() -> bool:
    """Whether the installed Triton is one the kernels ran on (TRITON_MINIMUM or later)."""
    found = triton_version()
    return found is not None and version_tuple(found) >= version_tuple(TRITON_MINIMUM)


def _find(*paths: str):
    """The first of `paths` (torch.a.b) this torch has, or None."""
    for path in paths:
        obj = torch
        for part in path.split(".")[1:]:
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    return None


def has(path: str) -> bool:
    """Whether this torch has `path`, one of NEWER's names."""
    if path not in NEWER:
        raise KeyError(f"{path} is not one of compat.NEWER's names")
    return _find(path) is not None


def empty_host_cache() -> None:
    """Give cached pinned host memory back to the system (torch keeps freed pinned blocks for reuse). Nothing to give
    before CUDA is initialised (a CPU build's accelerator call would raise)."""
    release = _find("torch.accelerator.empty_host_cache", "torch._C._host_emptyCache")
    if release is not None and torch.cuda.is_initialized():
        release()


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, b, offs=offs): callers ask `has("torch._grouped_mm")` first."""
    return torch._grouped_mm(a, b, offs=offs)


def amx_tile_supported() -> bool:
    """Whether this CPU has AMX tiles (torch's own probe; False on a torch without it)."""
    probe = _find("torch.cpu._is_amx_tile_supported")
    return bool(probe()) if probe is not None else False


def abort_process_group() -> None:
    """Abort the default group's communicators so collectives blocked on a dead peer return."""
    abort = _find("torch.distributed.distributed_c10d._abort_process_group")
    if abort is not None:
        abort()
    else:
        dist.destroy_process_group()
