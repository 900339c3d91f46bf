"""Context length as a measured axis: time to first token, decode at that depth and peak memory, k3dist vs llama.cpp.

    python benchmarks/context.py --llama-bench ~/llama.cpp/build/bin/llama-bench --gguf twin-bf16.gguf
    python benchmarks/context.py --lengths 2048 8192 32768 131072 --repeats 3          # k3dist alone, 128k too
    python benchmarks/context.py --lengths 2048 --repeats 1 --no-plan                  # a quick look

Why: Kimi-Linear's point is long context (three layers in four keep a fixed-size state), so what a user feels at 2k,
8k, 32k and 128k tokens is the figure to keep honest (issue 27). Per length L and repeat, interleaved:
- k3dist: `python launch.py generate.prompt_len=L generate.max_new_tokens=N cache.cap=L+N+...` at batch 1 (and at
  each --batches value up to --batch-max-length); TTFT = result.json's `prefill_seconds`, decode tok/s at depth L =
  its `decode_tokens_per_second`, peak RSS (`peak_bytes`) beside the plan's `admitted` (the bare interpreter's RSS,
  which `admitted` does not count, taken off: benchmarks/common.py's bare_torch_rss);
- llama.cpp (benchmarks/llama.py; skipped and said so without --llama-bench and --gguf): right after, on the same
  GGUF of the twin and threads, `llama-bench -p L -n 0` (TTFT = L / its prompt tok/s) and `llama-bench -p 0 -n N
  -d L` (decode of N tokens after L); from --peer-one-prefill-from on (128k: each prefill takes minutes) one
  `llama-batched-bench -npp L -ntg N -npl 1` run gives both from one prefill. Its batch-4 decode at depth is not
  run: llama-batched-bench would prefill 4 x L tokens first.
Ratios are paired within a repeat (the two ran back to back) and their median is reported: a shared host's speed
drifts by tens of percent between minutes. --base (512) is the shallow decode every depth is compared with.

It also prints the 48B model at TP 8 with cache.cap=1048576 as a what-if (`run.mode=plan`): memory per rank, and
how many slots fit on an 80 GiB and a 141 GiB device (from the plans at batch 1 and 2: per-slot bytes are linear in
the batch; each answer checked by planning it). Writes benchmarks/results/context.md and context.png (matplotlib, in
the `bench` extra).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/ is the script dir; common puts the repo root on sys.path)
import llama  # noqa: E402

GiB = 1 << 30
DEVICES = {"80 GiB": 80 * GiB, "141 GiB": 141 * GiB}
WHATIF = ["model=kimi_linear_48b", "run.mode=plan", "dist.world_size=8", "cache.cap=1048576"]


def k3_point(args, n: int, b: int, out: Path) -> dict:
    """One launch.py run of the twin at prompt length n, batch b: its result.json, or {"error": ...}."""
    overrides = ["model.dtype=bfloat16", "generate.prompt=null", f"generate.prompt_len={n}", f"generate.batch={b}"]
    overrides += [f"generate.max_new_tokens={args.new_tokens}", f"cache.cap={n + args.new_tokens + 64}"]
    return common.k3dist_point(
        f"{n} tokens batch {b}",
        overrides,
        out,
        args.timeout,
        lambda r: (
            f"TTFT {r['prefill_seconds']:.2f} s, decode {r['decode_tokens_per_second']:.2f} tok/s, peak "
            f"{r['peak_bytes'] / GiB:.2f} GiB, admitted {r['plan'][0]['admitted'] / GiB:.2f} GiB"
        ),
    )


def whatif(args, tmp: Path) -> tuple[str, dict]:
    """The 48B what-if plan: a table of rank 0's figures, and the slots that fit on each device size."""
    plans = {}
    for b in (1, 2):
        r = common.k3dist([*WHATIF, f"generate.batch={b}", f"memory.free={80 * GiB}"], tmp / f"plan-b{b}.json", 600)
        plans[b] = r["plan"][0]
    slot = plans[2]["admitted"] - plans[1]["admitted"]
    fixed = plans[1]["admitted"] - slot
    fits, checked = {}, {}
    for name, free in DEVICES.items():
        fits[name] = max(0, (free - fixed) // slot)
        if fits[name]:  # the answer planned: one more slot must be refused (a plan's verdict, not its exit code)
            over = [*WHATIF, f"generate.batch={fits[name] + 1}", f"memory.free={free}"]
            r = common.k3dist(over, tmp / f"plan-{fits[name] + 1}.json", 600)
            refused = r.get("verdict") == "refused"
            checked[name] = f"{fits[name] + 1} refused" if refused else "one more was admitted too: not linear"
    p = plans[1]
    rows = [
        [key, f"{p[key] / GiB:.2f}"]
        for key in ("local_bytes", "derived_bytes", "staging_peak", "cache_bytes", "runtime_bytes", "reserve")
    ]
    rows += [["admitted (batch 1)", f"{p['admitted'] / GiB:.2f}"], ["per extra slot", f"{slot / GiB:.2f}"]]
    rows += [[f"slots on a {name} device", f"{fits[name]} ({checked.get(name, '-')})"] for name in DEVICES]
    table = "48B what-if, rank 0 of 8 (`" + " ".join(WHATIF) + "`), GiB:\n\n"
    return table + common.md_table(["figure", "value"], rows), {"plans": plans, "slot": slot, "fits": fits}


def median(xs) -> float | None:
    xs = [x for x in xs if x]
    return statistics.median(xs) if xs else None


def paired(a: list, b: list) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=False) if x and y]


def plot(path: Path, lengths: list[int], series: dict[str, dict[str, dict[int, float]]]) -> str | None:
    """TTFT and decode tok/s against context, both engines, log-scaled context; None or why no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, by in series["ttft"].items():
        xs = [n for n in lengths if by.get(n)]
        left.plot(xs, [by[n] for n in xs], marker="o", label=name)
    for name, by in series["decode"].items():
        xs = [n for n in lengths if by.get(n)]
        right.plot(xs, [by[n] for n in xs], marker="o", label=name)
    for ax, title, unit in ((left, "time to first token", "s"), (right, "decode at that depth", "tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    left.set_yscale("log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768], help="context lengths (tokens)")
    ap.add_argument("--base", type=int, default=512, help="the shallow depth decode is compared with")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="k3dist decode batches")
    ap.add_argument("--batch-max-length", type=int, default=8192, help="batches > 1 only up to this length")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens decoded after the prompt")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved k3dist / llama.cpp pairs per length")
    ap.add_argument("--long", type=int, default=32768, help="lengths from here on get --long-repeats")
    ap.add_argument("--long-repeats", type=int, default=1)
    ap.add_argument("--peer-one-prefill-from", type=int, default=131072, help="llama.cpp: one run for both from here")
    ap.add_argument("--no-plan", action="store_true", help="skip the 48B what-if plan")
    ap.add_argument("--png", type=Path, default=common.RESULTS / "context.png")
    llama.add_args(ap)
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / "context.md"

    started = time.perf_counter()
    cores = len(os.sched_getaffinity(0))
    m = common.machine(f"k3dist {cores} (one rank), llama.cpp -t {cores}")
    print(common.header(m), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-context-"))
    tables, notes, data = [], [], {"args": vars(args)}
    if not args.no_plan:
        table, data["whatif"] = whatif(args, tmp)
        print(table, flush=True)
        tables.append(table)
    bare = common.bare_torch_rss()
    peer = not llama.missing(args, args.llama_bench)
    lengths = [args.base, *args.lengths]
    k3: dict[tuple, list[dict]] = {}  # (length, batch) -> one result per repeat
    lt: dict[int, list] = {}  # length -> llama.cpp TTFT per repeat
    ld: dict[int, list] = {}  # length -> llama.cpp decode tok/s per repeat
    for n in lengths:
        for rep in range(args.repeats if n < args.long else args.long_repeats):
            for b in args.batches:
                if b == 1 or n <= args.batch_max_length:
                    k3.setdefault((n, b), []).append(k3_point(args, n, b, tmp / f"n{n}-b{b}-{rep}.json"))
            if peer:
                if n >= args.peer_one_prefill_from:
                    d = llama.prompt_then_decode(args, n, args.new_tokens, cores)
                    t = d.get("ttft")
                else:
                    t = llama.prefill(args, [n], cores, 1)["ttft"].get(str(n))
                    d = llama.depth_decode(args, n, args.new_tokens, cores, 1)
                lt.setdefault(n, []).append(t)
                ld.setdefault(n, []).append(d.get("tok_s"))
                print(f"  llama.cpp {n} tokens: TTFT {t or float('nan'):.2f} s, decode {d}", flush=True)
            common.save_partial(args, k3)

    def runs(n, b, key):
        return [r.get(key) for r in k3.get((n, b), [])]

    base_tok = median(runs(args.base, 1, "decode_tokens_per_second"))
    head = ["context", "batch", "k3dist TTFT s", "llama.cpp TTFT s", "TTFT speedup (paired)", "k3dist decode tok/s"]
    head += ["llama.cpp decode tok/s", "decode ratio (paired)", f"decode / k3dist's at {args.base}"]
    head += ["peak RSS GiB", "peak - bare / admitted"]
    rows, series = [], {"ttft": {}, "decode": {}}
    for (n, b), rs in sorted(k3.items()):
        ok = [r for r in rs if "error" not in r]
        if not ok:
            rows.append([str(n), str(b), rs[0]["error"], *[""] * (len(head) - 3)])
            continue
        ttft, tok = median(runs(n, b, "prefill_seconds")), median(runs(n, b, "decode_tokens_per_second"))
        peak = max(r["peak_bytes"] for r in ok)
        admitted = max(r["plan"][0]["admitted"] for r in ok)
        speedup = paired(lt.get(n, []), runs(n, b, "prefill_seconds")) if b == 1 else []
        ratio = paired(runs(n, b, "decode_tokens_per_second"), ld.get(n, [])) if b == 1 else []
        rows.append(
            [
                str(n),
                str(b),
                f"{ttft:.2f}",
                common.fmt(median(lt.get(n, [])) if b == 1 else None, ".2f", "-"),
                f"{statistics.median(speedup):.2f}x" if speedup else "-",
                f"{tok:.2f}",
                common.fmt(median(ld.get(n, [])) if b == 1 else None, ".2f", "-"),
                f"{statistics.median(ratio):.2f}x" if ratio else "-",
                f"{tok / base_tok:.2f}" if b == 1 and base_tok else "-",
                f"{peak / GiB:.2f}",
                f"{(peak - bare) / admitted:.2f}",
            ]
        )
        series["ttft"].setdefault(f"k3dist batch {b}", {})[n] = ttft if b == 1 else None
        series["decode"].setdefault(f"k3dist batch {b}", {})[n] = tok
        if b == 1 and peer:
            series["ttft"].setdefault("llama.cpp", {})[n] = median(lt.get(n, []))
            series["decode"].setdefault("llama.cpp batch 1", {})[n] = median(ld.get(n, []))
    tables.insert(0, common.md_table(head, rows))
    series["ttft"] = {k: v for k, v in series["ttft"].items() if any(v.values())}
    why = plot(args.png, lengths, series)
    notes.append(f"plot: {args.png.name}" if why is None else f"no plot: {why}")
    reps = f"{args.repeats} pairs per length below {args.long}, {args.long_repeats} from it on"
    notes += [
        f"bf16 twin, seeded random prompts, {args.new_tokens} new tokens, greedy; {reps}; medians, ratios paired "
        "within a repeat (`TTFT speedup` = llama.cpp's TTFT / k3dist's, `decode ratio` = k3dist / llama.cpp).",
        f"k3dist: `python launch.py generate.prompt_len=L generate.batch=B generate.max_new_tokens={args.new_tokens} "
        f"cache.cap=L+{args.new_tokens + 64}` (default prefill_chunk); batches > 1 only up to {args.batch_max_length} "
        "tokens (each prompt is prefilled in turn on a CPU: B x the batch-1 TTFT).",
        f"`peak - bare / admitted`: rank 0's peak RSS less a bare torch interpreter's ({bare / GiB:.2f} GiB), over the "
        "plan's `admitted`; at most 1.00 is the plan holding.",
    ]
    how = (
        f"`llama-bench -m {args.gguf.name} -t {cores} -p L -n 0 -r 1` and `-p 0 -n {args.new_tokens} -d L -r 1` after "
        "each k3dist point; its batch-4 decode at depth is not run (llama-batched-bench would prefill 4 x L tokens)."
    )
    if any(n >= args.peer_one_prefill_from for n in lengths):
        how += (
            f" From {args.peer_one_prefill_from} tokens on, one `llama-batched-bench -t {cores} -c L+{args.new_tokens} "
            f"-npp L -ntg {args.new_tokens} -npl 1` run instead (TTFT = its T_PP, decode = its S_TG: one prefill, "
            "not two)."
        )
    notes.append(llama.peer_note(args, bool(peer), args.llama_bench, how))
    data |= {"k3dist": {f"{n}-{b}": rs for (n, b), rs in k3.items()}, "llama_ttft": lt, "llama_decode": ld}
    data["bare_rss"] = bare
    title = "Context length: TTFT, decode at depth and memory, k3dist vs llama.cpp"
    common.publish(args, title, tables, notes, m, data, started)
    return 1 if any("error" in r for rs in k3.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
