"""How often k3dist and llama.cpp choose the same greedy token on the K3 twin's MXFP4 weights: information, not a
test. The two cannot match closely (llama.cpp's CPU path rounds the activations to Q8_0 before the MXFP4 experts,
and a random twin turns small differences into different choices), so this reports shares over many prompts.

    python benchmarks/k3_agreement.py --gguf twin-mxfp4.gguf [--prompts 32 --length 64 --steps 16]

llama-cpp-python must import (its 0.3.36 sdist, built or pointed at a build with LLAMA_CPP_LIB_PATH); the GGUF is
the MXFP4 twin as `k3_llama.py` takes it. For each of --prompts seeded random prompts of --length tokens, both run
the prompt with logits at every position and then --steps greedy tokens of their own: k3dist in bf16 at world 1 (the
twin as its config packages it, MXFP4 experts kept packed), llama.cpp with an f16 K/V cache. Reported: the share of
prompt positions whose greedy choice (teacher-forced: both saw the same prompt) agrees, the share of prompts whose
first generated token agrees, and the mean number of generated tokens before the first difference; beside it the
same between k3dist's bf16 and fp32 runs of the same weights, which says how far rounding alone moves this twin.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CONFIG = common.ROOT / "k3dist" / "configs" / "Kimi-K3-twin-0.4B-config.json"


def k3dist_side(twin: Path, dtype: str, prompts: list[list[int]], steps: int, out: Path):
    """(argmax at every prompt position [P, L], the greedy tokens [P, steps]) from one world-1 run of every prompt."""
    from tests.support.harness import teacher_forced
    from tests.support.ranks import expect_ok, run_ranks

    expect_ok(run_ranks(teacher_forced, 1, str(twin), dtype, prompts, None, str(out), steps))
    got = load_file(out)
    return got["prefill"].argmax(-1).numpy(), got["tokens"].numpy()


def llama_side(gguf: Path, prompts: list[list[int]], steps: int, threads: int) -> tuple[np.ndarray, np.ndarray]:
    import llama_cpp

    positions, generated = [], []
    for ids in prompts:
        llm = llama_cpp.Llama(
            str(gguf), n_ctx=len(ids) + steps + 1, n_batch=len(ids), n_threads=threads, n_threads_batch=threads,
            logits_all=True, flash_attn=False, verbose=False,
        )  # fmt: skip
        llm.eval(ids)
        positions.append(np.array(llm.scores[: len(ids)], dtype=np.float32).argmax(-1))
        tokens, last = [], positions[-1][-1]
        for _ in range(steps):
            tokens.append(int(last))
            llm.eval([tokens[-1]])
            last = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        generated.append(tokens)
        del llm
    return np.stack(positions), np.array(generated)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True, help="the MXFP4 twin converted by llama.cpp's converter")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / "k3-agreement.md"
    from k3dist.config import load_config
    from k3dist.offline.prompts import seeded_ids
    from k3dist.twin.checkpoint import ensure_twin

    started = time.perf_counter()
    threads = len(os.sched_getaffinity(0))
    m = common.machine(f"{threads} a side")
    twin = ensure_twin(CONFIG, 0, "bfloat16", variant="mxfp4")
    vocab = load_config(twin).vocab_size
    prompts = seeded_ids(args.prompts, args.length, vocab, args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-agree-"))
    mine = k3dist_side(twin, "bfloat16", prompts, args.steps, tmp / "bf16.safetensors")
    fp32 = k3dist_side(twin, "float32", prompts, args.steps, tmp / "fp32.safetensors")
    peer = llama_side(args.gguf, prompts, args.steps, threads)

    def agreement(a, b) -> list[str]:
        (a_pos, a_gen), (b_pos, b_gen) = a, b
        runs = [int(np.argmin(np.append(x == y, False))) for x, y in zip(a_gen, b_gen, strict=True)]
        same, first = (a_pos == b_pos).mean(), (a_gen[:, 0] == b_gen[:, 0]).mean()
        return [f"{same:.3f}", f"{first:.3f}", f"{statistics.mean(runs):.1f} of {args.steps}"]

    rows = [
        ["k3dist bf16 / llama.cpp MXFP4 GGUF", *agreement(mine, peer)],
        ["k3dist bf16 / k3dist fp32 (the same weights)", *agreement(mine, fp32)],
        ["k3dist fp32 / llama.cpp MXFP4 GGUF", *agreement(fp32, peer)],
    ]
    head = ["pair", "positions, same greedy choice", "prompts, same first token", "tokens before a difference"]
    table = common.md_table(head, rows)
    runs = rows
    notes = [
        f"{args.prompts} seeded prompts (seed {args.seed}) of {args.length} tokens; k3dist bf16 world 1, MXFP4 "
        f"experts packed; llama.cpp on {args.gguf.name} (MXFP4 experts, bf16 elsewhere, Q8_0 activations into the "
        "experts), f16 K/V cache",
        "information only: the exactness check of MXFP4 is k3dist's packed path against its own dequantized run",
    ]
    data = {"rows": runs}
    common.publish(args, "Greedy agreement with llama.cpp on the MXFP4 twin", [table], notes, m, data, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
