"""The torch names k3dist's code reaches, read from its source (k3dist/, kernels/, launch.py) without running it.

Every `torch.a.b` chain, `F.x` / `dist.x` through their import aliases, and `from torch.a import b`, per module; a
chain stops where a call or a subscript begins (`torch.cuda.current_stream().wait_stream` is
`torch.cuda.current_stream`). k3dist's own ops (`torch.ops.k3dist.*`) are left out. k3dist/base/compat.py is the
one module allowed to name an API newer than the declared minimum: its names are listed apart.

    python -m tests.support.torch_api            # every name, and whether this torch resolves it (exit 1 if not)
    python -m tests.support.torch_api --write    # on the minimum torch: record the names it resolves

Run that in an environment with the declared minimum torch (pyproject's `torch>=`) to check the names still exist
there; tests/unit/test_torch_compat.py holds the names against the list verified that way (torch_api_min.txt).
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "k3dist" / "base" / "compat.py"
VERIFIED = Path(__file__).with_name("torch_api_min.txt")
OWN_OPS = ("torch.ops.k3dist",)


def sources() -> list[Path]:
    return sorted([*(ROOT / "k3dist").rglob("*.py"), *(ROOT / "kernels").glob("*.py"), ROOT / "launch.py"])


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch path it stands for (`import torch.distributed as dist`, `from torch import Tensor`)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def names_in(path: Path) -> set[str]:
    """The torch paths one module reaches (its imports included), each chain at its longest."""
    tree = ast.parse(path.read_text())
    aliases = _aliases(tree)
    inner = set()  # attributes that are the `.value` of a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    found = set(aliases.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if chain and chain[0] in aliases:
                found.add(".".join([aliases[chain[0]], *chain[1:]]))
    return {n for n in found if not n.startswith(OWN_OPS)}


def used(skip_compat: bool = True) -> dict[str, set[str]]:
    """torch path -> the files (relative) that reach it."""
    out: dict[str, set[str]] = {}
    for path in sources():
        if skip_compat and path == COMPAT:
            continue
        for name in names_in(path):
            out.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return out


def resolves(name: str) -> bool:
    """Whether this torch has `name` (a module, or an attribute along it; torch.ops namespaces resolve lazily)."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except (AttributeError, RuntimeError):
            return False
        return True
    return False


def verified() -> set[str]:
    return {line.strip() for line in VERIFIED.read_text().splitlines() if line.strip() and not line.startswith("#")}


def main() -> int:
    import torch

    names = sorted(used())
    missing = [n for n in names if not resolves(n)]
    for n in names:
        print(("MISSING " if n in missing else "ok      ") + n)
    print(f"torch {torch.__version__}: {len(names) - len(missing)} of {len(names)} names resolve (compat.py aside)")
    if "--write" in sys.argv[1:] and not missing:
        head = (
            f"# torch names k3dist reaches outside k3dist/base/compat.py, each resolved on torch {torch.__version__}\n"
        )
        VERIFIED.write_text(head + "".join(n + "\n" for n in names))
        print(f"wrote {VERIFIED.relative_to(ROOT)}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
