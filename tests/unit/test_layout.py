"""The layout holds: packages import only those below them (no import runs back up), and no source file of the
project is over 400 lines."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORDER = [
    "base",
    "kernels",
    "kinds",
    "config",
    "checks",
    "settings",
    "text",
    "weights",
    "model",
    "engine",
    "memory",
    "offline",
    "serve",
    "twin",
    "run",
]


def _imports(path: Path, parts: list[str]) -> set[str]:
    """The k3dist packages (or top-level modules) a file imports, relative or absolute."""
    out = set()
    for line in path.read_text().splitlines():
        if m := re.match(r"\s*from (\.+)([\w.]*) import", line):
            base = parts[:-1][: len(parts) - 1 - (len(m.group(1)) - 1)]
            target = base + (m.group(2).split(".") if m.group(2) else [])
            out.add(target[1])
        elif m := re.match(r"\s*(?:from|import) k3dist\.(\w+)", line):
            out.add(m.group(1))
    return out


def test_no_import_runs_back_up():
    files = [(p, list(p.relative_to(ROOT).with_suffix("").parts)) for p in (ROOT / "k3dist").rglob("*.py")]
    files += [(p, ["k3dist", "kernels", p.stem]) for p in (ROOT / "kernels").glob("*.py")]
    upward = []
    for path, parts in files:
        own = parts[1]
        for target in _imports(path, parts) - {own}:
            if own in ORDER and target in ORDER and ORDER.index(target) > ORDER.index(own):
                upward.append(f"{path.relative_to(ROOT)} imports k3dist.{target}")
    assert not upward, upward
    assert {parts[1] for _, parts in files} - {"__init__"} <= set(ORDER), "a package missing from ORDER"


def test_kernels_hold_compute_only():
    """kernels/ holds functions and the values they take (dataclasses); no weight holder or policy object."""
    import ast

    holders = []
    for path in (ROOT / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                holders.append(f"{path.name}: {node.name}")
    assert not holders, holders


def test_the_architecture_doc_draws_this_order():
    """docs/architecture.md's layout lists every package, top down: ORDER read from the bottom up."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("```\n", 2)[1]
    drawn = []
    for line in block.splitlines():
        if m := re.match(r"(?:k3dist/)?(\w+)(?:/|\.py)\s", line):
            drawn.append(m.group(1))
    assert drawn[0] == "launch" and drawn[1:] == ORDER[::-1], drawn


def test_the_feature_map_names_test_files_that_exist():
    """docs/architecture.md's "Where each feature is tested" names files under tests/ that exist."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## Where each feature is tested", 1)[1]
    named = set(re.findall(r"\b(\w+/test_\w+\.py)\b", text))
    assert named and not [n for n in sorted(named) if not (ROOT / "tests" / n).is_file()]


def test_no_source_file_is_over_400_lines():
    sources = [
        *ROOT.glob("k3dist/**/*.py"),
        *ROOT.glob("kernels/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        ROOT / "launch.py",
    ]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
