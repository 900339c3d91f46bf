"""The K3 twin beside the Kimi-Linear twin: decode and prefill through k3dist on the same CPU, interleaved.

    python benchmarks/k3_twin.py                         # decode batch 1 and 8, prefill 512, three interleaved repeats
    python benchmarks/k3_twin.py --repeats 1 --max-new-tokens 16 --prefill-len 128       # a quick look

Three models, each one `python launch.py` per point, bf16, world 1, `decode.compile=auto`: the Kimi-Linear twin
(0.40B), the K3 twin as its config packages it (0.40B, MXFP4 routed experts kept packed) and the same K3 twin with
its experts dequantized to bf16. Each repeat runs every model at a point before the next point, so a shared host's
drift falls on all of them alike; figures are medians over the repeats, and the K3 / Kimi-Linear ratios are medians
of the ratios paired within a repeat. Decode: result.json's decode tok/s on a seeded prompt of --prompt-len tokens;
prefill: its `prefill_seconds` for one --prefill-len prompt, `generate.prefill_chunk` 512.

What differs per token: the K3 twin has 17 layers (12 KDA, 5 MLA) where the Kimi-Linear twin has (see their
configs), block attention residuals, a latent MoE of 64 experts (top 16) in a 512-wide latent with SiTU-GLU, and a
32768-token vocabulary; the read bytes of each model's step are its plan's local bytes (printed).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CONFIGS = common.ROOT / "k3dist" / "configs"
MODELS = {  # name -> (config, K3 variant or None)
    "Kimi-Linear twin": ("Kimi-K3-0.40B-config.json", None),
    "K3 twin, MXFP4 experts": ("Kimi-K3-twin-0.4B-config.json", "mxfp4"),
    "K3 twin, bf16 experts": ("Kimi-K3-twin-0.4B-config.json", "dequantized"),
}


def model_dir(config: str, variant: str | None) -> Path:
    from k3dist.twin.checkpoint import ensure_twin

    return ensure_twin(CONFIGS / config, 0, "bfloat16", variant=variant)


def point(args, path: Path, batch: int, prompt_len: int, new: int, out: Path) -> dict:
    overrides = [
        f"model.path={path}",
        "model.dtype=bfloat16",
        "generate.prompt=null",
        f"generate.prompt_len={prompt_len}",
        f"generate.batch={batch}",
        f"generate.max_new_tokens={new}",
        "generate.prefill_chunk=512",
    ]
    return common.k3dist_point(
        f"{path.name} batch {batch} prompt {prompt_len}",
        overrides,
        out,
        args.timeout,
        lambda r: f"{r['decode_tokens_per_second']:.1f} tok/s, prefill {r['prefill_seconds']:.3f} s",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / "k3-twin.md"
    started = time.perf_counter()
    m = common.machine("2 threads a rank (world 1)")
    print(common.header(m), flush=True)
    dirs = {name: model_dir(*spec) for name, spec in MODELS.items()}
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-k3twin-"))
    points = [(f"decode b{b}", b, args.prompt_len, args.max_new_tokens) for b in args.batches]
    points.append((f"prefill {args.prefill_len}", 1, args.prefill_len, 1))
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.repeats):
        for label, b, n, new in points:
            for name, path in dirs.items():
                out = tmp / f"{r}-{label.replace(' ', '')}-{abs(hash(name))}.json"
                runs.setdefault((label, name), []).append(point(args, path, b, n, new, out))

    def figure(label: str, run: dict) -> float | None:
        if "error" in run:
            return None
        return run["decode_tokens_per_second"] if label.startswith("decode") else run["prefill_seconds"]

    base = next(iter(MODELS))
    head = ["point", *MODELS, *(f"{n} / {base}" for n in list(MODELS)[1:])]
    rows = []
    for label, *_ in points:
        values = {n: [figure(label, x) for x in runs[label, n]] for n in MODELS}
        cells = [label]
        for n in MODELS:
            got = [v for v in values[n] if v is not None]
            unit = "tok/s" if label.startswith("decode") else "s"
            cells.append(f"{statistics.median(got):.{1 if unit == 'tok/s' else 3}f} {unit}" if got else "failed")
        for n in list(MODELS)[1:]:
            pairs = [
                a / c if label.startswith("decode") else c / a
                for a, c in zip(values[n], values[base], strict=True)
                if a and c
            ]
            cells.append(f"{statistics.median(pairs):.2f} ({' '.join(f'{p:.2f}' for p in pairs)})" if pairs else "")
        rows.append(cells)
    local = {n: runs[points[0][0], n][-1].get("plan", [{}])[0].get("local_bytes") for n in MODELS}
    notes = [
        "ratios: speed relative to the Kimi-Linear twin (tok/s over tok/s; for prefill, its seconds over these), "
        "medians of the per-repeat pairs (the pairs in brackets)",
        "each model's local bytes (what a decode step reads at most, weights): "
        + ", ".join(f"{n} {b / 2**20:.0f} MiB" for n, b in local.items() if b),
    ]
    data = {"runs": {f"{k[0]} | {k[1]}": v for k, v in runs.items()}}
    common.publish(
        args, "The K3 twin beside the Kimi-Linear twin", [common.md_table(head, rows)], notes, m, data, started
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
