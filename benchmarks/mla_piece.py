"""Where a short prefill piece after a long past should attend in the absorbed form (model/mla.py, ABSORBED_ROWS).

    python benchmarks/mla_piece.py                          # pieces of 1-512 tokens after 4,096 and 32,768 rows
    python benchmarks/mla_piece.py --depths 4058 --tokens 35 --repeats 9       # one chat turn's rest

A chat turn's rest (the last answer and the new question) is a piece of tens of tokens after thousands of restored
rows. The expanded form reads every past row through kv_b whatever the piece's length; the absorbed form (the decode
op, one query a token) costs per token. This times one MLA layer of the bf16 twin (bound as a world-1 run binds it,
the CPU ops built) both ways, interleaved, on random rows: the cost does not depend on their values. The ratio is
expanded / absorbed, so above 1 the absorbed form is faster; ABSORBED_ROWS sits about where it crosses 1.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import decode_depth  # noqa: E402  (bind: the twin as a run binds it)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 48, 64, 128, 512])
    ap.add_argument("--repeats", type=int, default=5, help="timed pairs per point (median of each form)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out-md", type=Path, default=common.RESULTS / "mla-piece.md")
    args = ap.parse_args()

    import torch

    from k3dist.model import mla

    torch.set_num_threads(args.threads)
    m = common.machine(str(args.threads))
    model, _, _ = decode_depth.bind(1, max(args.depths) + max(args.tokens), "auto", "auto")
    layer = next(layer.mixer for layer in model.layers if isinstance(layer.mixer, mla.MLA))
    absorbed_rows, slots, rows = mla.ABSORBED_ROWS, torch.tensor([0]), []
    g = torch.Generator().manual_seed(0)

    def timed(depth: int, x, limit: int) -> float:
        mla.ABSORBED_ROWS = limit  # 0: every piece takes the expanded form
        start = time.perf_counter()
        layer.prefill(x, slots, depth)
        return (time.perf_counter() - start) * 1e3

    with torch.inference_mode():
        for depth in args.depths:
            layer.latent[:, :depth] = torch.randn(1, depth, layer.latent.shape[-1], generator=g).to(layer.latent.dtype)
            for T in args.tokens:
                x = torch.randn(1, T, model.cfg.hidden_size, generator=g).to(model.dtype)
                times = {0: [], T: []}
                for _ in range(args.repeats + 1):  # the first pair warms up
                    for limit in times:
                        times[limit].append(timed(depth, x, limit))
                expanded, absorbed = (statistics.median(t[1:]) for t in times.values())
                row = [str(depth), str(T), f"{expanded:.2f}", f"{absorbed:.2f}", f"{expanded / absorbed:.2f}"]
                rows.append(row)
                print("  " + " | ".join(row), flush=True)
    mla.ABSORBED_ROWS = absorbed_rows
    table = common.md_table(["past rows", "piece tokens", "expanded ms", "absorbed ms", "expanded / absorbed"], rows)
    text = f"## One MLA layer's prefill piece after a past, bf16 twin\n\n{common.header(m)}\n\n{table}\n"
    text += f"\n- model/mla.py takes the absorbed form for pieces of at most ABSORBED_ROWS = {absorbed_rows} tokens.\n"
    print("\n" + text)
    args.out_md.parent.mkdir(parents=True, exist_ok=True)
    args.out_md.write_text(text)
    print(f"wrote {args.out_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
