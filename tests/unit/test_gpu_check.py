"""The GPU session's scripts, rehearsed on the CPU (issue 38: gpu_check.sh overran its own step limits on an H200, and
its dry run only proved the steps fail fast): the whole gpu_check.sh in its dry run, its limits against the H200's
figures, and the 48B-shape decode benchmark at its shrunken width."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support.cli_run import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
H200_SECONDS = {  # what each step took on the H200 (issue 38), or the estimate from its parts: seconds, one pass
    "nvidia-smi": 2,
    "twin": 30,  # writing the 0.40B twin once (788 MB)
    "pytest-gpu": 45,  # 20 CUDA points: Triton compiles, graph captures at small shapes and the twin's
    "decode": 6 * 12,  # 6 launch.py points of about 12 s each (180 s held 2.3 passes of 6)
    "kda_kernel": 30,  # tp 1: 3 KDA and 6 MLA points, each timed as a graph for 0.05 s per implementation
    "serve": 30,  # a server's start with one graph per sampling mode, 9 requests, the drain
    "load": 10,  # one run of 9.5 s
}


def _steps() -> dict[str, int]:
    """Step name -> its limit in seconds, from the script's `step NAME LIMIT ...` lines."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^step (\S+) (\d+) ", SCRIPT.read_text(), re.M)}


def test_every_step_ends_well_inside_its_limit_and_the_script_in_five_minutes():
    steps, text = _steps(), SCRIPT.read_text()
    assert set(steps) == set(H200_SECONDS)
    assert all(steps[name] >= 1.3 * seconds for name, seconds in H200_SECONDS.items()), steps
    assert 'BUDGET="${GPU_CHECK_BUDGET:-300}"' in text and sum(H200_SECONDS.values()) <= 0.8 * 300
    assert text.count("--repeats 1") == 2  # decode and load: one pass of each batch, one load


def test_the_48b_shape_is_the_real_config_and_fits_one_h200():
    import decode_48b
    import roofline

    cfg = decode_48b.config("kimi_linear_48b", "cuda")
    assert (cfg.hidden_size, cfg.num_experts, len(cfg.layers), cfg.kv_lora_rank) == (2304, 256, 27, 512)
    weights = roofline.resident_weight_bytes(cfg, 1, 2)
    assert 90e9 < weights < 120e9  # bf16, every expert: about 98 GB of an H200's 141 GB


def test_the_48b_benchmark_runs_at_its_shrunken_shape(tmp_path):
    out = tmp_path / "48b.json"
    cmd = [sys.executable, "benchmarks/decode_48b.py", "--device", "cpu", "--batches", "1", "2", "--steps", "2"]
    cmd += ["--context", "16", "--prompt-len", "24", "--chunk", "16", "--backend", "torch", "--json", str(out)]
    cmd += ["--out-md", str(tmp_path / "48b.md")]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [p["batch"] for p in doc["points"]] == [1, 2] and all(p["tok_s"] > 0 for p in doc["points"])
    assert all(p["read"]["total"] > p["read"]["weights"] > 0 for p in doc["points"])
    assert doc["ttft"]["prompt_len"] == 24 and doc["ttft"]["ttft_s"] > 0 and doc["copy_GBps"] > 0


@pytest.mark.slow  # every step of the GPU session on 2 CPU cores: several minutes
def test_the_dry_run_rehearses_every_step_on_the_cpu(tmp_path, twin_dir):
    env = os.environ | {
        "GPU_CHECK_DRY": "1",
        "GPU_CHECK_BUDGET": "1800",
        "OUT": str(tmp_path / "out"),
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",  # python3: this interpreter
    }
    run = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1900)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert run.returncode == 0 and summary["status"] == "passed", run.stdout[-4000:]
    assert [s["step"] for s in summary["steps"]] == list(_steps()) and all(s["rc"] == 0 for s in summary["steps"])
    for name in ("decode", "kda_kernel", "serve", "load"):
        assert "skipped" not in json.loads((tmp_path / "out" / f"{name}.json").read_text()), name
