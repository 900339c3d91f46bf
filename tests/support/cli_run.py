"""Run the real command line (`python launch.py ...` or torchrun) in a subprocess and read its result.json."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(tmp: Path, *overrides: str, torchrun: list[str] | None = None, timeout: float = 240):
    """Returns (exit code, stderr, result dict or None). The Hydra run dir and result.json live under `tmp`."""
    out = tmp / "result.json"
    args = [*overrides, f"hydra.run.dir={tmp / 'run'}", f"out={out}"]
    cmd = (
        [sys.executable, "-m", "torch.distributed.run", *torchrun, "launch.py", *args]
        if torchrun
        else [sys.executable, "launch.py", *args]
    )
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"}
    )
    result = json.loads(out.read_text()) if out.exists() and proc.returncode == 0 else None
    return proc.returncode, proc.stderr + proc.stdout, result


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]
