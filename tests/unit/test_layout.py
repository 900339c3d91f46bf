"""The layout holds: packages import only those below them (no import runs back up), and no source file of the
project is over 400 lines."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORDER = [
    "base",
    "kernels",
    "config",
    "checks",
    "settings",
    "text",
    "weights",
    "model",
    "engine",
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


def test_no_source_file_is_over_400_lines():
    sources = [
        *ROOT.glob("k3dist/**/*.py"),
        *ROOT.glob("kernels/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        ROOT / "launch.py",
    ]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
