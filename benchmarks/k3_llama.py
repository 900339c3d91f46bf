"""The K3 twin in k3dist against llama.cpp on the same CPU and the same MXFP4 weights: decode at batch 1 and 8, time
to first token at 512 and 2,048 tokens, in interleaved pairs.

    python benchmarks/k3_llama.py --llama-bench PATH --gguf twin-mxfp4.gguf            # three repeats
    python benchmarks/k3_llama.py --llama-bench PATH --gguf twin-mxfp4.gguf --repeats 1 --lengths 512   # a quick look

The GGUF is the K3 twin (Kimi-K3-twin-0.4B-config.json, seed 0) converted by llama.cpp's own converter
(`python benchmarks/k3_convert.py TREE TWIN_DIR --outfile twin-mxfp4.gguf --outtype bf16`): its routed experts
repacked to ggml's MXFP4, every other weight bf16, as k3dist runs the twin (MXFP4 experts kept packed, bf16, world 1,
decode.compile=auto; the decode points again with decode.compile=on, `--compiled`). benchmarks/README.md says how to
build llama.cpp.

Each repeat runs every point on both sides, k3dist then llama.cpp, so a shared host's drift falls on both alike.
Figures are medians over the repeats; ratios are medians of the pairs, k3dist over llama.cpp (tok/s over tok/s;
for the time to first token, llama.cpp's seconds over k3dist's), so above 1 is k3dist ahead. Decode: result.json's
tok/s on a --prompt-len-token prompt against llama-batched-bench's S_TG (same prompt length, same new tokens); time
to first token: result.json's prefill_seconds of one prompt (generate.prefill_chunk at its default) against
llama-bench's prompt processing (-p L -n 0): L over its tok/s. Both run with this machine's cores as threads.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import llama  # noqa: E402

CONFIG = common.ROOT / "k3dist" / "configs" / "Kimi-K3-twin-0.4B-config.json"


def k3_point(args, twin: Path, batch: int, prompt_len: int, new: int, out: Path, compiled: bool = False) -> dict:
    overrides = [
        f"model.path={twin}",
        "model.dtype=bfloat16",
        "generate.prompt=null",
        f"generate.prompt_len={prompt_len}",
        f"generate.batch={batch}",
        f"generate.max_new_tokens={new}",
        f"cache.cap={max(prompt_len + new, 4096)}",
        *(["decode.compile=on"] if compiled else []),
    ]
    return common.k3dist_point(
        f"batch {batch} prompt {prompt_len}" + (" (decode.compile=on)" if compiled else ""),
        overrides,
        out,
        args.timeout,
        lambda r: f"{r['decode_tokens_per_second']:.1f} tok/s, prefill {r['prefill_seconds']:.3f} s",
    )


def llama_point(args, kind: str, value: int, threads: int) -> float | None:
    """llama.cpp's figure for one point: decode tok/s at batch `value`, or the time to first token of `value`
    tokens; None (and a line saying why) when it did not run."""
    if kind == "decode":
        got = llama.decode(args, args.gguf, [value], threads, args.prompt_len, args.max_new_tokens)
        figure = got["runs"].get(str(value))
    else:
        got = llama.prefill(args, [value], threads, 1)
        figure = got["ttft"].get(str(value))
    why = got.get("error") or got.get("skipped")
    print(f"  llama.cpp {kind} {value}: " + (why or (f"{figure:.1f} tok/s" if kind == "decode" else f"{figure:.3f} s")))
    return figure


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048], help="prompt tokens for the TTFT points")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt tokens before decode")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--compiled",
        type=int,
        nargs="*",
        default=[1, 8],
        help="batches also decoded with decode.compile=on (torch.compile's step; its warm-up is not a decode time)",
    )
    llama.add_args(ap)
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / "k3-llama.md"
    from k3dist.twin.checkpoint import ensure_twin

    started = time.perf_counter()
    threads = len(os.sched_getaffinity(0))
    m = common.machine(f"{threads} a side (k3dist one rank, llama.cpp -t {threads})")
    print(common.header(m), flush=True)
    twin = ensure_twin(CONFIG, 0, "bfloat16", variant="mxfp4")
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-llama-"))
    points = [("decode", b) for b in args.batches] + [("compiled", b) for b in args.compiled]
    points += [("ttft", n) for n in args.lengths]
    mine: dict[tuple, list] = {p: [] for p in points}
    peer: dict[tuple, list] = {p: [] for p in points}
    for r in range(args.repeats):
        for kind, value in points:
            if kind in ("decode", "compiled"):
                out = tmp / f"{r}-{kind}{value}.json"
                run = k3_point(args, twin, value, args.prompt_len, args.max_new_tokens, out, kind == "compiled")
                mine[kind, value].append(run.get("decode_tokens_per_second"))
            else:
                run = k3_point(args, twin, 1, value, 1, tmp / f"{r}-t{value}.json")
                mine[kind, value].append(run.get("prefill_seconds"))
            peer[kind, value].append(llama_point(args, "ttft" if kind == "ttft" else "decode", value, threads))

    def cell(values: list, unit: str) -> str:
        got = [v for v in values if v is not None]
        return f"{statistics.median(got):.{1 if unit == 'tok/s' else 3}f} {unit}" if got else "-"

    rows = []
    for kind, value in points:
        unit = "s" if kind == "ttft" else "tok/s"
        a, b = mine[kind, value], peer[kind, value]
        pairs = [(y / x if kind == "ttft" else x / y) for x, y in zip(a, b, strict=True) if x and y]
        ratio = f"{statistics.median(pairs):.2f} ({' '.join(f'{p:.2f}' for p in pairs)})" if pairs else "-"
        label = {"decode": f"decode b{value}", "compiled": f"decode b{value}, decode.compile=on"}.get(kind)
        label = label or f"TTFT {value}"
        rows.append([label, cell(a, unit), cell(b, unit), ratio])
    notes = [
        "ratio: k3dist over llama.cpp (for TTFT, llama.cpp's seconds over k3dist's), the median of the pairs "
        "(each repeat's in brackets); above 1: k3dist ahead",
        "decode rows: the eager step (decode.compile=auto on a CPU), and where named the torch.compile'd step a user "
        "asks for with decode.compile=on (its one-time compile is warm-up, outside the decode time); each k3dist run "
        "has its own llama.cpp run beside it",
        f"the twin: {CONFIG.name} seed 0, MXFP4 routed experts, bf16 elsewhere; the GGUF: {Path(args.gguf).name}",
        llama.peer_note(args, any(v for vs in peer.values() for v in vs), args.llama_bench, "-t " + str(threads)),
    ]
    table = common.md_table(["point", "k3dist", "llama.cpp", "k3dist / llama.cpp"], rows)
    data = {
        "k3dist": {f"{k}{v}": x for (k, v), x in mine.items()},
        "llama": {f"{k}{v}": x for (k, v), x in peer.items()},
    }
    common.publish(args, "The K3 twin against llama.cpp, MXFP4 experts", [table], notes, m, data, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
