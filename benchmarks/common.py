"""What both benchmarks share: the commit measured, Markdown tables, and publishing the result."""

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "?"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def publish(text: str, out_md: Path, started: float) -> None:
    """Print the result table and its notes, and write them to `out_md`."""
    print(f"\n{text}\n(benchmark took {time.perf_counter() - started:.0f} s)")
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(text)
    print(f"wrote {out_md}")
