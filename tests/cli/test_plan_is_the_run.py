"""`run.mode=plan` answers for the run it describes: for the same overrides, every rank's `admitted` and every term
of its plan (weights, derived copies, staging, cache, runtime, prefix pool, reserve, what int8 saves) equal what the
run itself plans, at world 2 and 4, with int8, a batch and a cap, a prefix pool, and a server (rank 0's HTTP
side in its runtime), because both read one run plan (k3dist/run/plan.py)."""

import re
import time

import httpx
import pytest

from k3dist.twin.checkpoint import write_checkpoint
from tests.support.cli_run import run_cli
from tests.support.configs import small_config
from tests.support.server import Server
from tests.support.tiers import slow_but

SHORT = ("generate.prompt=null", "generate.prompt_len=8", "generate.max_new_tokens=2", "memory.free=64GiB")
RUNS = {
    "int8-batch-cap-w2": ("model.quant=int8", "generate.batch=3", "cache.cap=300", "dist.nproc=2"),
    "prefix-pool-w4": ("prefix.enabled=on", "prefix.bytes=8MiB", "generate.batch=2", "dist.nproc=4"),
}
ADMITTED = re.compile(r'k3dist_rank_admitted_bytes\{rank="(\d+)"\} (\S+)')
NOT_PLANNED = ("free", "fits")  # memory.free is given to both, and the verdict follows from the rest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """bf16, so that a CPU with bf16 units packs weights at bind time (derived_bytes)."""
    return write_checkpoint(small_config(), tmp_path_factory.mktemp("plan") / "m", seed=4, dtype="bfloat16")


def _what_if(tmp_path, model_dir, overrides, plan_for):
    world = [o.split("=")[1] for o in overrides if o.startswith("dist.nproc=")] or ["1"]
    planned = [o for o in overrides if not o.startswith("dist.nproc=")]
    args = ("run.mode=plan", f"run.plan_for={plan_for}", f"dist.world_size={world[0]}", f"model.path={model_dir}")
    rc, text, result = run_cli(tmp_path / "plan", *args, *planned)
    assert rc == 0, text
    assert result["plan_for"] == plan_for
    return result["plan"]


def _terms(plan: dict) -> dict:
    return {k: v for k, v in plan.items() if k not in NOT_PLANNED}


@pytest.mark.parametrize("name", slow_but(sorted(RUNS), keep=["int8-batch-cap-w2"]))
def test_the_what_if_is_the_generate_run(model_dir, tmp_path, name):
    overrides = (*SHORT, *RUNS[name])
    rc, text, result = run_cli(tmp_path / "run", f"model.path={model_dir}", *overrides)
    assert rc == 0, text
    what_if = _what_if(tmp_path, model_dir, overrides, "generate")
    assert [_terms(p) for p in what_if] == [_terms(p) for p in result["plan"]]
    if "model.quant=int8" in overrides:
        assert all(p["derived_bytes"] > 0 and p["saved_bytes"] > 0 for p in what_if)
    if "prefix.enabled=on" in overrides:
        assert all(p["prefix_bytes"] >= 8 * 2**20 for p in what_if)


def test_the_what_if_is_the_server(model_dir, tmp_path):
    overrides = ("generate.batch=2", "cache.cap=512", "memory.free=64GiB", "dist.nproc=2")
    server = Server(tmp_path / "serve", f"model.path={model_dir}", *overrides)
    try:
        admitted, deadline = {}, time.monotonic() + 30
        while len(admitted) < 2 and time.monotonic() < deadline:  # every rank's, as the memory watch reports them
            text = httpx.get(f"{server.base}/metrics", timeout=10).text
            admitted = {int(r): float(v) for r, v in ADMITTED.findall(text)}
            time.sleep(0.1)
    finally:
        server.stop()
    logged = re.search(r"k3_weight_plan (rank=0 .*)", server.text)[1]
    rank0 = {k: v for k, v in (kv.split("=") for kv in logged.split())}
    what_if = _what_if(tmp_path, model_dir, overrides, "serve")
    assert admitted == {p["rank"]: float(p["admitted"]) for p in what_if}
    logged = {k: v for k, v in rank0.items() if k not in NOT_PLANNED}
    assert {k: str(v) for k, v in _terms(what_if[0]).items()} == logged
    assert what_if[0]["runtime_bytes"] > what_if[1]["runtime_bytes"]  # rank 0 also serves HTTP
    assert _what_if(tmp_path, model_dir, overrides, "generate")[0]["admitted"] != what_if[0]["admitted"]
