"""What rank 0 writes, and failures nobody foresaw: a target that cannot be written is refused on every rank before
any byte is loaded, nothing half-written is left, and an unexpected exception anywhere is one `error:` line (never a
traceback, never silence), at world 1 and on spawned ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3dist.twin.checkpoint import write_checkpoint
from tests.support.cli_run import ROOT, error_lines
from tests.support.configs import small_config
from tests.support.tiers import slow_but


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(small_config(), tmp_path_factory.mktemp("outputs") / "m", seed=4)


def launch(tmp: Path, *overrides: str) -> tuple[int, str]:
    args = [sys.executable, "launch.py", *overrides, f"hydra.run.dir={tmp / 'run'}", "generate.max_new_tokens=3"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stderr + proc.stdout


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if "tmp" in p.name or "probe" in p.name)


def test_a_directory_in_results_place_is_refused_before_the_load(ckpt, tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    rc, text = launch(tmp_path, f"model.path={ckpt}", f"out={target}", "dist.nproc=2")
    lines = error_lines(text)
    assert rc == 1 and len(lines) == 2 and lines[0] == lines[1], text
    assert f"out {target}: is a directory" in lines[0] and "rank 0" in lines[0], text
    assert "k3_weight_plan" not in text and "Traceback" not in text  # refused before any planning or reading
    assert leftovers(tmp_path) == [] and list(target.iterdir()) == []


def test_a_file_in_a_parents_place_and_a_directory_for_outputs_are_refused(ckpt, tmp_path):
    blocker = tmp_path / "plain-file"
    blocker.write_text("x")
    rc, text = launch(tmp_path, f"model.path={ckpt}", f"out={blocker / 'sub' / 'result.json'}")
    lines = error_lines(text)
    assert rc == 1 and len(lines) == 1 and lines[0].endswith(f"{blocker} is not a directory"), text
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"ids": [1, 2, 3]}) + "\n")
    outputs = tmp_path / "outputs-dir"
    outputs.mkdir()
    rc, text = launch(
        tmp_path,
        f"model.path={ckpt}",
        f"out={tmp_path / 'r.json'}",
        f"generate.prompts={requests}",
        f"generate.outputs={outputs}",
    )
    lines = error_lines(text)
    assert rc == 1 and len(lines) == 1 and f"generate.outputs {outputs}: is a directory" in lines[0], text
    assert not (tmp_path / "r.json").exists() and leftovers(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only directory")
def test_a_read_only_directory_is_refused(ckpt, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        rc, text = launch(tmp_path, f"model.path={ckpt}", f"out={locked / 'result.json'}")
    finally:
        locked.chmod(0o755)
    lines = error_lines(text)
    assert rc == 1 and len(lines) == 1 and f"cannot write in {locked}" in lines[0], text


@pytest.mark.parametrize("nproc", slow_but([1, 2], keep=[2]))
def test_an_unexpected_exception_is_one_line_naming_rank_and_place(ckpt, tmp_path, nproc):
    out = tmp_path / "result.json"
    rc, text = launch(
        tmp_path, f"model.path={ckpt}", f"out={out}", f"dist.nproc={nproc}", "fault.rank=0", "fault.raise_in=result"
    )
    lines = error_lines(text)
    assert rc == 1 and len(lines) == 1, text  # rank 1 (if any) had finished: only rank 0 speaks
    assert lines[0].startswith("error: rank 0: unexpected RuntimeError: injected failure in result"), text
    assert "at fault_injection.py:" in lines[0] and "Traceback" not in text
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "override, words",
    slow_but(
        [
            ("dist.timeout_s=inf", "dist.timeout_s"),
            ("dist.collective_timeout_s=nan", "dist.collective_timeout_s"),
            ("generate.temperature=inf", "generate.temperature"),
            ("generate.top_p=0", "generate.top_p"),
        ],
        keep=[("dist.collective_timeout_s=nan", "dist.collective_timeout_s"), ("generate.top_p=0", "generate.top_p")],
    ),
)
def test_non_finite_and_out_of_range_numbers_are_refused(ckpt, tmp_path, override, words):
    rc, text = launch(tmp_path, f"model.path={ckpt}", override, "dist.nproc=2")
    lines = error_lines(text)
    assert rc == 1 and len(lines) == 1 and words in lines[0] and "finite number" in lines[0], text
    assert "Traceback" not in text


def test_nan_weights_end_the_run_with_a_line_not_garbage(ckpt, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(ckpt).iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    for shard in broken.glob("*.safetensors"):
        tensors = load_file(shard)
        if "model.norm.weight" in tensors:
            tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
            save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "result.json"
    rc, text = launch(tmp_path, f"model.path={broken}", f"out={out}")
    lines = error_lines(text)
    assert rc == 1 and len(lines) == 1 and "logit nan at generated token 0" in lines[0], text
    assert not out.exists()


def test_outputs_in_a_folder_not_yet_there_are_written(ckpt, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"ids": [1, 2, 3]}) + "\n" + json.dumps({"ids": [4, 5]}) + "\n")
    outputs = tmp_path / "new" / "deeper" / "out.jsonl"
    rc, text = launch(tmp_path, f"model.path={ckpt}", f"generate.prompts={requests}", f"generate.outputs={outputs}")
    assert rc == 0, text
    assert [json.loads(line)["prompt_tokens"] for line in outputs.read_text().splitlines()] == [3, 2]


@pytest.mark.slow  # inductor compiles the step: the slow tier's "compiled engine"
def test_compiled_step_samples_eagerly_on_the_cpu(ckpt, tmp_path):
    """decode.compile=on compiles greedy decoding only on the CPU (inductor's code for the sampler's integer hash
    hangs or aborts): a sampled request runs the same step eagerly and draws what the eager run draws."""
    args = (f"model.path={ckpt}", "generate.temperature=0.8")
    rc, text = launch(tmp_path / "c", *args, "decode.compile=on")
    assert rc == 0, text
    rc, eager_text = launch(tmp_path / "e", *args, "decode.compile=off")
    assert rc == 0, eager_text
    compiled, eager = (json.loads((tmp_path / d / "run" / "result.json").read_text()) for d in ("c", "e"))
    assert compiled["decode_compile"] == "compile" and compiled["tokens"] == eager["tokens"]
