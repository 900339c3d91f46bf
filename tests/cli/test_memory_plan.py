"""The plan covers the real peak: on the CPU, a rank's peak (its resident set less the library code it mapped after
its bare process: docs/memory.md) minus a bare interpreter's (torch imported) stays at or below its `admitted`, at
batch 1 and 4, prompts of 16, 2048 and 8192 tokens, world 1 and 2; and `runtime_bytes` stays within 2x of the memory
generation really added (result.json's measured `memory`), less the GEMM caches' allowance for the upper bound."""

import json
import subprocess
import sys

import pytest

from k3dist.memory.runtime import HOST_ALLOWANCE
from k3dist.twin.checkpoint import write_checkpoint
from tests.support.cli_run import run_cli
from tests.support.configs import small_config
from tests.support.tiers import slow_but

# Big enough that activations, not interpreter noise, decide the figures; small enough to prefill 4 x 8192 quickly.
MEMORY_CONFIG = small_config(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1024,
    linear_attn_config={"head_dim": 64, "num_heads": 4},
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    num_experts=8,
    moe_intermediate_size=256,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(MEMORY_CONFIG, tmp_path_factory.mktemp("mem") / "m", seed=1, tokenizer=False)


@pytest.fixture(scope="module")
def bare_rss() -> int:
    # VmHWM, as the ranks report it: ru_maxrss would carry this test runner's size across the fork and exec
    code = "import torch, re; print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]) * 1024)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


POINTS = [(prompt, batch, world) for prompt in (16, 2048, 8192) for batch in (1, 4) for world in (1, 2)]


@pytest.mark.parametrize("prompt, batch, world", slow_but(POINTS, keep=[(2048, 4, 2), (8192, 1, 1)]))
def test_peak_stays_within_the_plan(model_dir, bare_rss, tmp_path, world, batch, prompt):
    rc, text, result = run_cli(
        tmp_path,
        f"model.path={model_dir}",
        "generate.prompt=null",
        f"generate.prompt_len={prompt}",
        f"generate.batch={batch}",
        "generate.max_new_tokens=4",
        f"cache.cap={prompt + 8}",
        f"dist.nproc={world}",
        timeout=400,
    )
    assert rc == 0, text
    assert len(result["memory"]) == len(result["plan"]) == world
    for plan, used in zip(result["plan"], result["memory"], strict=True):
        report = json.dumps({"plan": plan, "used": used, "bare": bare_rss})
        assert used["peak_bytes"] - bare_rss <= plan["admitted"], report
        runtime, measured = plan["runtime_bytes"], used["runtime_peak_bytes"]
        # the GEMM primitive caches' cap and the host libraries' first-use allocations are allowances, not estimates:
        # on a CPU whose oneDNN has no bf16 kernels (AVX2), or with plain weights (linear.packs), little fills them,
        # and at 16 tokens they are most of the term
        allowance = result["runtime"]["kernels"] + HOST_ALLOWANCE
        assert measured / 2 <= runtime and runtime - allowance <= 2 * measured, report


@pytest.mark.parametrize("world", slow_but([1, 2], keep=[2]))
def test_int8_peak_stays_within_the_plan(model_dir, bare_rss, tmp_path, world):
    """model.quant=int8 binds one int8 copy at a time (derived_bytes) and then holds bound_bytes < local_bytes."""
    rc, text, result = run_cli(
        tmp_path,
        f"model.path={model_dir}",
        "model.dtype=bfloat16",
        "model.quant=int8",
        "generate.prompt=null",
        "generate.max_new_tokens=4",
        f"dist.nproc={world}",
        timeout=400,
    )
    assert rc == 0, text
    assert result["quant"] == "int8"
    for plan, used in zip(result["plan"], result["memory"], strict=True):
        report = json.dumps({"plan": plan, "used": used, "bare": bare_rss})
        assert used["peak_bytes"] - bare_rss <= plan["admitted"], report
        assert 0 < plan["bound_bytes"] < plan["local_bytes"] and plan["derived_bytes"] > 0, report
