"""Kimi K3's MXFP4 experts stay packed in memory: generating with the 0.4B K3 twin as its config packages it (MXFP4
routed experts) peaks within the plan's `admitted`, and below the same twin with its experts dequantized to bf16 by
at least 90% of the expert bytes the packing saves (docs/memory.md's peak: the rank's resident set less the library
code it mapped, less a bare interpreter's)."""

import json
import math
import subprocess
import sys

import pytest
import torch

from k3dist.config import load_config
from k3dist.twin.checkpoint import ensure_twin
from k3dist.weights.schema import checkpoint_entries, is_routed_expert
from tests.support.cli_run import run_cli
from tests.support.configs import CONFIGS

TWIN = CONFIGS / "Kimi-K3-twin-0.4B-config.json"


def expert_bytes(model_dir) -> int:
    entries = checkpoint_entries(load_config(model_dir), torch.bfloat16)
    return sum(math.prod(s) * d.itemsize for name, (s, d) in entries.items() if is_routed_expert(name))


@pytest.mark.slow
def test_mxfp4_experts_stay_packed_in_memory(k3_cache, tmp_path):
    code = "import torch, re; print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]) * 1024)"
    bare = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    runs, experts = {}, {}
    for variant in ("mxfp4", "dequantized"):
        model = ensure_twin(TWIN, root=k3_cache, variant=variant)
        experts[variant] = expert_bytes(model)
        args = (f"model.path={model}", "generate.prompt=null", "generate.prompt_len=64", "generate.max_new_tokens=8")
        rc, text, runs[variant] = run_cli(tmp_path / variant, *args, timeout=400)
        assert rc == 0, text
    saved = experts["dequantized"] - experts["mxfp4"]
    assert saved > 0.7 * experts["dequantized"]  # 4.25 bits a weight against 16
    peak = {v: r["memory"][0]["peak_bytes"] - bare for v, r in runs.items()}
    report = json.dumps({"peak": peak, "experts": experts, "admitted": runs["mxfp4"]["plan"][0]["admitted"]})
    assert peak["mxfp4"] <= runs["mxfp4"]["plan"][0]["admitted"], report
    assert peak["dequantized"] - peak["mxfp4"] >= 0.9 * saved, report
