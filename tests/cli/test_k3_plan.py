"""Kimi K3 from the command line: the what-if plan of the real 2.78T config (`model=kimi_k3`) at world 8, refused on
141 GiB a rank with its numbers and admitted on 400 GiB, and at world 16 with a verdict its numbers bear out; the K3
twin's; a world that would cut an MXFP4 group refused with one `error:` line before anything is read or written;
a K3 checkpoint planned from its headers, its vision tower skipped with one log line, then loaded and run (its MXFP4
experts kept packed) without reading the vision tower."""

import math

import pytest
import torch

from k3dist.base.units import fmt_bytes
from k3dist.config import load_config
from k3dist.twin.checkpoint import write_checkpoint
from k3dist.weights.schema import checkpoint_entries, expected_tensors, parameter_count
from tests.support.cli_run import error_lines, run_cli
from tests.support.configs import CONFIGS, small_k3

REAL, TWIN = CONFIGS / "Kimi-K3-2.8T-A50B-config.json", CONFIGS / "Kimi-K3-twin-0.4B-config.json"


def mxfp4_bytes(config) -> int:
    """The routed experts' packed codes and scales, as stored (uint8)."""
    entries = checkpoint_entries(load_config(config), torch.bfloat16)
    return sum(math.prod(shape) for name, (shape, dtype) in entries.items() if dtype == torch.uint8)


def check_plan(result, text, world, params, tensors, mxfp4):
    assert result["mode"] == "plan" and result["world_size"] == world and result["verdict"] == "admitted", text
    assert result["params"] == params  # the experts counted as weights, not as their packed bytes
    assert result["tensors"] == tensors
    plans = result["plan"]
    assert [p["rank"] for p in plans] == list(range(world))
    for p in plans:  # every rank holds its share of the packed experts, and the cache of its heads per slot
        assert p["local_bytes"] > mxfp4 // world and p["cache_bytes"] > 0
    assert len({p["local_bytes"] for p in plans}) == 1  # every split is even
    assert "verdict: admitted" in text and "Traceback" not in text


def test_what_if_plan_of_the_k3_twin(tmp_path):
    rc, text, result = run_cli(
        tmp_path, f"model.config_file={TWIN}", "run.mode=plan", "dist.world_size=4", "memory.free=8GiB", timeout=120
    )
    assert rc == 0, text
    check_plan(result, text, 4, 403_821_952, 6_590, mxfp4_bytes(TWIN))


@pytest.mark.slow  # the default tier plans the real K3 at 141 GiB (below); this adds the admitted verdict's checks
def test_what_if_plan_of_the_real_k3_at_world_8(tmp_path):
    rc, text, result = run_cli(
        tmp_path, "model=kimi_k3", "run.mode=plan", "dist.world_size=8", "memory.free=400GiB", timeout=600
    )
    assert rc == 0, text
    check_plan(result, text, 8, parameter_count(load_config(REAL)), 497_052, mxfp4_bytes(REAL))


def real_k3_plan(tmp_path, world: int) -> tuple[str, dict]:
    """The real K3 planned for `world` ranks of 141 GiB (an H200's)."""
    args = ("model=kimi_k3", "run.mode=plan", f"dist.world_size={world}", "memory.free=141GiB")
    rc, text, result = run_cli(tmp_path, *args, timeout=300)
    assert rc == 0 and "Traceback" not in text, text
    plans = result["plan"]
    assert [p["rank"] for p in plans] == list(range(world)) and {p["free"] for p in plans} == {141 * 2**30}
    assert result["verdict"] == ("admitted" if all(p["admitted"] <= p["free"] for p in plans) else "refused")
    assert all(p["fits"] == (p["admitted"] <= p["free"]) for p in plans)
    assert result["headroom"] == min(p["free"] - p["admitted"] for p in plans)
    traffic = result["tp_traffic"]
    assert traffic["world"] == world and traffic["routed_experts"] == 896 and traffic["ring_bytes"] > 0
    assert f"parallelism: one pure TP group of {world} ranks" in text and "no expert parallelism" in text
    assert f"{traffic['all_reduce_bytes']:,} bytes" in text and f"{traffic['ring_bytes']:,} bytes of ring" in text
    return text, result


def test_the_real_k3_at_world_8_is_refused_on_141_gib(tmp_path):
    """Each rank's MXFP4 experts alone pass an H200: every rank's refusal gives its admitted, free and shortfall."""
    text, result = real_k3_plan(tmp_path, 8)
    assert result["verdict"] == "refused" and result["tp_traffic"]["nodes"] == 1
    plans = result["plan"]
    assert all(p["admitted"] > p["free"] and not p["fits"] for p in plans)
    assert len(result["refusals"]) == 8 and "verdict: refused" in text
    for p, line in zip(plans, result["refusals"], strict=True):
        short = fmt_bytes(p["admitted"] - p["free"])
        assert f"rank {p['rank']} needs admitted {fmt_bytes(p['admitted'])} > free 141.0 GiB" in line, line
        assert line.endswith(f"short by {short})") and line in text
    assert f"short by {fmt_bytes(-result['headroom'])} (rank" in text


def test_the_real_k3_at_world_16_answers_with_its_margin(tmp_path):
    """Across two nodes: the verdict is what the numbers say, and the verdict line gives the margin either way."""
    text, result = real_k3_plan(tmp_path, 16)
    assert result["tp_traffic"]["nodes"] == 2 and "across 2 nodes of 8 GPUs" in text
    room = fmt_bytes(abs(result["headroom"]))
    said = f"fits with {room} to spare" if result["verdict"] == "admitted" else f"short by {room}"
    assert f"verdict: {result['verdict']} (" in text and said in text


def test_k3_refusals_are_one_line(tmp_path):
    rc, text, _ = run_cli(tmp_path / "w8", f"model.config_file={TWIN}", "run.mode=plan", "dist.world_size=8")
    lines = error_lines(text)
    assert rc != 0 and len(lines) == 1 and "Traceback" not in text, text
    assert "world size 8 splits the MXFP4 experts' moe_intermediate_size=128 into 16 columns per rank" in lines[0]
    assert "world sizes that fit: [1, 2, 4]" in lines[0]


def test_a_k3_checkpoint_plans_from_its_headers_without_its_vision_tower(tmp_path):
    model = write_checkpoint(small_k3(), tmp_path / "k3", seed=2, tokenizer=False)  # with two vision stubs
    rc, text, result = run_cli(tmp_path / "plan", f"model.path={model}", "run.mode=plan", "memory.free=1GiB")
    assert rc == 0, text
    assert text.count("vision-tower") == 1 and f"{model}: skipping 2 vision-tower tensors" in text
    assert result["verdict"] == "admitted" and result["tensors"] == len(expected_tensors(load_config(model)))
    rc, text, loaded = run_cli(tmp_path / "load", f"model.path={model}", "run.mode=load")
    assert rc == 0 and loaded["plan"][0]["read_bytes"] == result["plan"][0]["read_bytes"], text
    assert loaded["plan"][0]["local_bytes"] == result["plan"][0]["local_bytes"]  # MXFP4 experts as their bytes
    args = ("generate.prompt=[1, 2, 3]", "generate.max_new_tokens=4")
    rc, text, ran = run_cli(tmp_path / "gen", f"model.path={model}", *args)
    assert rc == 0 and "seq 0 (4 tokens, length)" in text and text.count("vision-tower") == 1, text


@pytest.mark.slow
def test_k3_runs_compiled_and_int8(tmp_path):
    """The K3 parts on the compiled decode step (decode.compile=on) and under model.quant=int8 (K3's q-LoRA and output
    gates among the int8 projections), at world 1 and 2: the compiled step gives the eager step's greedy tokens and
    top logits (fp32, within 1e-5); int8 gives the same tokens at both world sizes."""
    model = write_checkpoint(small_k3(moe_intermediate_size=64), tmp_path / "k3", seed=2, tokenizer=False)
    args = (f"model.path={model}", "generate.prompt=[1, 2, 3]", "generate.max_new_tokens=6", "model.dtype=float32")
    runs = {}
    for name, extra in {
        "eager": (),
        "compiled": ("decode.compile=on",),
        "int8": ("model.quant=int8",),
        "int8-w2": ("model.quant=int8", "dist.nproc=2"),
    }.items():
        rc, text, runs[name] = run_cli(tmp_path / name, *args, *extra)
        assert rc == 0, text
    assert runs["compiled"]["decode_compile"] == "compile" and runs["int8"]["quant"] == "int8"
    assert runs["compiled"]["tokens"] == runs["eager"]["tokens"]
    for a, b in zip(runs["compiled"]["top_logits"][0], runs["eager"]["top_logits"][0], strict=True):
        assert [i for i, _ in a] == [i for i, _ in b] and max(
            abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)
        ) <= 1e-5
    assert runs["int8"]["tokens"] == runs["int8-w2"]["tokens"]
