"""The command line as users run it: defaults, every way of starting agrees, what-if planning, refusals."""

import json
import subprocess
import sys

import pytest

from tests.support.cli_run import ROOT, error_lines, run_cli

FIELDS = {
    "world_size",
    "backend",
    "device",
    "dtype",
    "plan",
    "load_seconds",
    "tokens",
    "top_logits",
    "prefill_seconds",
    "decode_tokens_per_second",
    "step_ms",
    "text",
    "finish_reason",
    "warmup_seconds",
}
PLAN_FIELDS = {
    "source_bytes",
    "local_bytes",
    "replicated_bytes",
    "staging_peak",
    "derived_bytes",
    "cache_bytes",
    "runtime_bytes",
    "reserve",
    "admitted",
    "free",
}


def test_default_run_writes_twin_and_generates_32_tokens(k3_cache, tmp_path):
    rc, text, result = run_cli(tmp_path)
    assert rc == 0, text
    assert FIELDS <= set(result) and PLAN_FIELDS <= set(result["plan"][0])
    assert result["world_size"] == 1 and result["dtype"] == "bfloat16" and result["device"] == "cpu"
    assert [len(t) for t in result["tokens"]] == [32]
    assert len(result["top_logits"][0]) == 32 and len(result["top_logits"][0][0]) == 5
    assert result["peak_bytes"] > result["plan"][0]["local_bytes"]  # CPU: rank 0's RSS holds its weights
    assert result["decode_tokens_per_second"] > 0 and result["step_ms"]["p90"] >= result["step_ms"]["p50"] > 0
    assert list(k3_cache.glob("Kimi-K3-0.40B-config-*/model.safetensors.index.json"))


@pytest.fixture(scope="module")
def fp32_runs(k3_cache, tmp_path_factory):
    """The twin in fp32 started every way: launch.py in-process, launch.py spawning 2 ranks, torchrun with 2 ranks,
    and two torchrun agents as two nodes."""
    runs = {}
    for name, extra, torchrun in [
        ("nproc1", ["dist.nproc=1"], None),
        ("nproc2", ["dist.nproc=2"], None),
        ("torchrun2", [], ["--nproc_per_node=2"]),
    ]:
        tmp = tmp_path_factory.mktemp(name)
        rc, text, result = run_cli(tmp, "model.dtype=float32", *extra, torchrun=torchrun)
        assert rc == 0, text
        runs[name] = (tmp, result)
    runs["two_nodes"] = two_agents(tmp_path_factory.mktemp("two_nodes"))
    return runs


def two_agents(tmp):
    """Two nodes on one machine: two torchrun agents meeting at a c10d rendezvous, one rank each."""
    from k3dist.base.dist import free_port

    out = tmp / "result.json"
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
        "launch.py",
        "model.dtype=float32",
        f"hydra.run.dir={tmp / 'run'}",
        f"out={out}",
    ]
    agents = [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)
    ]
    logs = [a.communicate(timeout=240)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)
    return tmp, json.loads(out.read_text())


def test_every_way_of_starting_gives_the_same_tokens_and_plans(fp32_runs):
    tokens = {name: r["tokens"] for name, (_, r) in fp32_runs.items()}
    assert len(tokens["nproc1"][0]) == 32
    assert tokens["nproc1"] == tokens["nproc2"] == tokens["torchrun2"] == tokens["two_nodes"]
    # plans agree byte for byte, except free memory, which each start detects for itself
    plans = {
        name: [{k: v for k, v in p.items() if k not in ("free", "fits")} for p in r["plan"]]
        for name, (_, r) in fp32_runs.items()
    }
    assert plans["nproc2"] == plans["torchrun2"] == plans["two_nodes"] and len(plans["nproc2"]) == 2
    assert all(r["world_size"] == 2 for name, (_, r) in fp32_runs.items() if name != "nproc1")


def test_only_rank0_owns_a_run_dir(fp32_runs):
    tmp, _ = fp32_runs["torchrun2"]
    assert (tmp / "run" / ".hydra" / "config.yaml").exists()
    assert not (ROOT / ".hydra").exists() and not (ROOT / "launch.log").exists()


def test_cap_too_small_is_refused_up_front(k3_cache, tmp_path):
    rc, text, _ = run_cli(tmp_path, "cache.cap=20", "generate.prompt_len=16", "generate.max_new_tokens=8")
    assert rc != 0 and error_lines(text) == [
        "error: prompts failed on 1 of 1 ranks: rank 0: request seq-0: prompt of 16 tokens + max_new_tokens=8 exceeds "
        "cache.cap=20 (raise cache.cap to at least 24)"
    ]
    assert "k3_weight_plan" not in text


def test_bad_override_is_one_error_line(tmp_path):
    rc, text, _ = run_cli(tmp_path, "memory.reserve=lots")
    assert rc != 0 and error_lines(text) == [
        "error: memory.reserve='lots' is not a byte size (use an int or e.g. 512MiB, 2GiB, 1GB)"
    ]
    for override, says in [
        ("dist.nproc=two", "dist.nproc='two' must be an integer >= 1"),
        ("memroy.reserve=1GiB", "Could not override 'memroy.reserve'"),
        ("model=nope", "Could not find 'model/nope'"),
    ]:
        rc, text, _ = run_cli(tmp_path, override)
        lines = error_lines(text)
        assert rc != 0 and len(lines) == 1 and says in lines[0] and "Traceback" not in text, text


def test_what_if_plan_of_the_real_48b_model(tmp_path):
    rc, text, result = run_cli(
        tmp_path, "model=kimi_linear_48b", "run.mode=plan", "dist.world_size=8", "memory.free=80GiB", timeout=60
    )
    assert rc == 0, text
    assert result["params"] == 49_122_681_728 and result["tensors"] == 20_493
    plans = result["plan"]
    assert [p["rank"] for p in plans] == list(range(8)) and all(p["free"] == 80 * 2**30 for p in plans)
    assert result["verdict"] == "admitted"
    local = sum(p["local_bytes"] for p in plans)
    # shards add up to one full copy (bf16, 2 more bytes per fp32-kept element) plus 7 more replicated copies
    assert local == 2 * 49_122_681_728 + 2 * FP32_KEPT + 7 * plans[0]["replicated_bytes"]
    assert "verdict: admitted" in text


# Elements kept in fp32 whatever the compute dtype: A_log and dt_bias (20 KDA layers), router weight and bias (26).
FP32_KEPT = 20 * (32 + 4096) + 26 * (256 * 2304 + 256)


def test_help_and_cfg_show_the_config():
    out = subprocess.run(
        [sys.executable, "launch.py", "--cfg", "job"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "reserve:" in out.stdout and "cap:" in out.stdout and "nproc:" in out.stdout
    out = subprocess.run([sys.executable, "launch.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "model: kimi_k3, kimi_linear_48b, twin_0_40b" in out.stdout


@pytest.mark.slow  # the 48B what-if from its config stays in the default run
def test_what_if_plan_from_a_sparse_checkpoint_equals_the_config_plan(tmp_path):
    sparse = tmp_path / "sparse48b"
    done = subprocess.run(
        [sys.executable, "-m", "k3dist.twin.sparse", str(sparse)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    files = list(sparse.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in files) > 98e9  # the real layout's apparent size...
    assert sum(f.stat().st_blocks * 512 for f in files) < 64 * 2**20  # ...with the data left as holes
    plans = {}
    for name, extra in [("config", []), ("sparse", [f"model.path={sparse}"])]:
        rc, text, result = run_cli(
            tmp_path / name,
            "model=kimi_linear_48b",
            "run.mode=plan",
            "dist.world_size=4",
            "memory.free=80GiB",
            *extra,
            timeout=90,
        )
        assert rc == 0, text
        plans[name] = result
    # equal but for the reads: from the config alone every tensor is assumed to start on a page; the real headers
    # pack tensors back to back, so neighbours share pages and read chunks end elsewhere (the staging ring's size)
    layout = ("read_bytes", "staging_peak", "admitted")
    exact = {n: [{k: v for k, v in p.items() if k not in layout} for p in r["plan"]] for n, r in plans.items()}
    assert exact["sparse"] == exact["config"]
    for sparse, config in zip(plans["sparse"]["plan"], plans["config"]["plan"], strict=True):
        assert sparse["source_bytes"] <= sparse["read_bytes"]
        assert all(abs(sparse[k] / config[k] - 1) < 0.01 for k in layout), (sparse, config)
    assert plans["sparse"]["params"] == 49_122_681_728 and plans["sparse"]["tensors"] == 20_493


def test_a_prefix_pool_that_does_not_fit_is_refused_up_front(k3_cache, tmp_path):
    rc, text, _ = run_cli(tmp_path, "prefix.enabled=on", "prefix.bytes=1TiB", "generate.max_new_tokens=2")
    lines = error_lines(text)
    assert rc != 0 and len(lines) == 1 and "preflight failed" in lines[0] and "prefix 1.0 TiB" in lines[0], text
    assert "lower memory.reserve, cache.cap or prefix.bytes" in lines[0], text  # the advice names the pool too
    assert "k3_weight_shard_loaded" not in text
