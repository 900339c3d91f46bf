"""llama.cpp as a CPU peer: an existing build run on a GGUF of the same twin (benchmarks/README.md says how to build
it and convert the twin). Nothing of llama.cpp lives here: the benchmarks take paths, and without them
they skip this peer and say so.

    --llama-bench PATH          llama-bench (prefill); llama-batched-bench is looked for beside it
    --llama-batched-bench PATH  decode, batch 1 and 8 (`S_TG`)
    --gguf FILE                 the bf16 GGUF of the twin;  --gguf-q8 FILE  its Q8_0 quantisation

Decode runs `llama-batched-bench -t T -c 4096 -npp P -ntg N -npl B...` (tok/s = S_TG, batch 8 aggregate), prefill
`llama-bench -t T -p L... -n 0 -r R` (time to first token = L / its tok/s), decode at a depth
`llama-bench -t T -p 0 -n N -d L -r R` (N tokens after L in the cache), all with k3dist's thread count. Where one
prefill takes many minutes (128k tokens), `llama-batched-bench -npp L -ntg N -npl 1` gives both from one prefill
(`T_PP`, `S_TG`): the same batch sizes and attention settings as llama-bench's, so the same figures.
"""

import json
import re
import subprocess
from pathlib import Path

import common


def add_args(ap) -> None:
    ap.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench binary (prefill peer)")
    ap.add_argument("--llama-batched-bench", type=Path, help="llama-batched-bench (decode peer; default: beside it)")
    ap.add_argument("--gguf", type=Path, help="the twin as a bf16 GGUF for llama.cpp")
    ap.add_argument("--gguf-q8", type=Path, help="the twin as a Q8_0 GGUF (beside k3dist's model.quant=int8)")
    ap.add_argument("--llama-extra", default="", help="extra llama.cpp arguments (e.g. -nr where AMX faults)")


def batched_bench(args) -> Path | None:
    if args.llama_batched_bench:
        return args.llama_batched_bench
    if args.llama_bench:
        return args.llama_bench.with_name("llama-batched-bench")
    return None


def missing(args, tool: Path | None, gguf: Path | None = None) -> str | None:
    """Why this peer cannot run (None when it can)."""
    gguf = gguf or args.gguf
    if tool is None or gguf is None:
        return "no llama.cpp paths given (--llama-bench PATH --gguf FILE)"
    for path in (tool, gguf):
        if not Path(path).is_file():
            return f"{path} does not exist"
    return None


def peer_note(args, ran: bool, tool: Path | None, how: str) -> str:
    """The table's note on the llama.cpp peer: its commit and `how` it ran, or why it was skipped."""
    if ran:
        return f"llama.cpp commit {build_commit(args)}: {how}"
    return f"llama.cpp peer skipped: {missing(args, tool)}."


def _run(cmd: list[str], timeout: float) -> str:
    proc = common.run_group([str(c) for c in cmd], timeout)
    return proc.stdout


def build_commit(args) -> str:
    """llama.cpp's commit, as llama-batched-bench --version prints it ("... (build 0, commit 34af94cd9)")."""
    tool = batched_bench(args)
    if tool is None or not Path(tool).is_file():
        return "-"
    try:
        out = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    found = re.search(r"commit ([0-9a-f]+)", out.stdout + out.stderr)
    return found[1] if found else "?"


def decode(args, gguf: Path, batches: list[int], threads: int, prompt: int, new: int) -> dict:
    """{"runs": {batch: tok/s}} or {"runs": {}, "error"/"skipped": why}."""
    tool = batched_bench(args)
    if why := missing(args, tool, gguf):
        return {"runs": {}, "skipped": why}
    cmd = [tool, "-m", gguf, "-t", threads, "-c", 4096, "-npp", prompt, "-ntg", new]
    cmd += ["-npl", ",".join(map(str, batches)), "--output-format", "jsonl", *args.llama_extra.split()]
    try:
        lines = [json.loads(x) for x in _run(cmd, args.timeout).splitlines() if x.startswith("{")]
    except Exception as exc:  # noqa: BLE001 - k3dist's side still reports
        return {"runs": {}, "error": common.short_error(exc)}
    return {"runs": {str(x["pl"]): x["speed_tg"] for x in lines}}


def prefill(args, lengths: list[int], threads: int, repeats: int) -> dict:
    """{"ttft": {length: seconds}, "tok_s": {...}} from llama-bench, or {"skipped"/"error": why}."""
    if why := missing(args, args.llama_bench):
        return {"ttft": {}, "skipped": why}
    cmd = [args.llama_bench, "-m", args.gguf, "-t", threads, "-p", ",".join(map(str, lengths)), "-n", 0]
    cmd += ["-r", repeats, "-o", "json", *args.llama_extra.split()]
    try:
        rows = json.loads(_run(cmd, args.timeout * len(lengths)))
    except Exception as exc:  # noqa: BLE001
        return {"ttft": {}, "error": common.short_error(exc)}
    rate = {str(r["n_prompt"]): r["avg_ts"] for r in rows if r["n_gen"] == 0}
    return {"ttft": {n: int(n) / ts for n, ts in rate.items()}, "tok_s": rate}


def depth_decode(args, depth: int, new: int, threads: int, repeats: int) -> dict:
    """{"tok_s": decode tok/s of `new` tokens after `depth` tokens in the cache} from llama-bench, or {"skipped"/
    "error": why}. llama-bench fills the depth untimed before each repetition, so this costs a prefill of `depth`."""
    if why := missing(args, args.llama_bench):
        return {"skipped": why}
    cmd = [args.llama_bench, "-m", args.gguf, "-t", threads, "-p", 0, "-n", new, "-d", depth, "-r", repeats]
    cmd += ["-o", "json", *args.llama_extra.split()]
    try:
        rows = json.loads(_run(cmd, args.timeout))
    except Exception as exc:  # noqa: BLE001
        return {"error": common.short_error(exc)}
    return {"tok_s": next(r["avg_ts"] for r in rows if r["n_gen"] == new)}


def prompt_then_decode(args, length: int, new: int, threads: int) -> dict:
    """{"ttft": seconds, "tok_s": decode tok/s of `new` tokens after it} from one llama-batched-bench run (one prefill
    of `length`, where prefill() and depth_decode() take two), or {"skipped"/"error": why}."""
    tool = batched_bench(args)
    if why := missing(args, tool):
        return {"skipped": why}
    cmd = [tool, "-m", args.gguf, "-t", threads, "-c", length + new, "-npp", length, "-ntg", new, "-npl", 1]
    cmd += ["--output-format", "jsonl", *args.llama_extra.split()]
    try:
        row = next(json.loads(x) for x in _run(cmd, args.timeout).splitlines() if x.startswith("{"))
    except Exception as exc:  # noqa: BLE001
        return {"error": common.short_error(exc)}
    return {"ttft": row["t_pp"], "tok_s": row["speed_tg"]}
