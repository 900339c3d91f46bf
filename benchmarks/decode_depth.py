"""Where a batch-1 eager decode step's time goes as the context deepens (docs/decode.md, issue 27).

    python benchmarks/decode_depth.py                              # depths 512 2048 8192 32768, 2 threads
    python benchmarks/decode_depth.py --depths 64 32768 --steps 20 --profile    # plus torch.profiler per op

Why in-process and not through launch.py: the question is what one step costs at depth L, not how long it takes to
reach L. So the bf16 twin is bound once (world 1, the real model, its weights and CPU ops as a run binds them), each
slot's MLA latent rows up to L are filled with random rows (a decode step's cost does not depend on their
values) and the positions set to L; then the engine's eager step runs with the row bound the engine would give it
(engine.py's ROW_BUCKET). Prefilling 32k real tokens first would take a minute a depth and change nothing measured.

Per depth: the step's wall time (median of --steps after --warm steps), and with --profile torch.profiler's self CPU
time per op name over the same steps, so the growth with depth shows up in the op that grows.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/ is the script dir; common puts the repo root on sys.path)

from k3dist.base.threads import configure_openmp  # noqa: E402

configure_openmp()  # as launch.py: before torch loads libgomp


def bind(batch: int, cap: int, backend: str, pack: str):
    """The twin bound as a world-1 CPU run binds it: its model, cache and eager step (`pack`: auto = as the run plan
    decides for this batch, on or off = packed or plain weights where oneDNN has bf16 kernels)."""
    import torch

    from k3dist.base import dist
    from k3dist.config import load_config
    from k3dist.engine.decode_step import DecodeStep
    from k3dist.kernels.backend import select
    from k3dist.memory.terms import cache_nbytes
    from k3dist.model.build import build_model, choices
    from k3dist.model.cache import HybridCache, cache_shapes
    from k3dist.model.linear import packable, packs
    from k3dist.model.tp import TPComm
    from k3dist.weights.inventory import scan
    from k3dist.weights.loader import load_weights
    from k3dist.weights.memory import MemoryTerms

    rt = dist.init("gloo", "cpu", 120)
    model_dir = str(common.twin_dir())
    cfg = load_config(model_dir)
    dt = torch.bfloat16
    terms = MemoryTerms(cache=cache_nbytes(cache_shapes(cfg, 1, batch, cap, dt)))
    store = load_weights(scan(model_dir, cfg), rt, dt, terms)
    cache = HybridCache(cfg, 1, batch, cap, dt, rt.device)
    comm = TPComm(1, 0, cfg.vocab_size)
    kernels = select(backend, rt.device)
    packed = {
        "auto": packs(dt, rt.device, batch, rows_op=kernels.name == "cpu"),
        "on": packable(dt, rt.device),
        "off": False,
    }[pack]
    print(f"  weights {'packed' if packed else 'plain'}", flush=True)
    planned = choices(cfg, dt, rt.device, batch=batch, pack=packed, cpu_ops=kernels.name == "cpu")
    model = build_model(cfg, store.tensors, comm, cache, kernels, pack=packed, **vars(planned))
    return model, cache, DecodeStep(model, cache)


def at_depth(model, cache, step, depth: int, row_bucket: int) -> None:
    """Every slot `depth` tokens deep: random latent rows below it, the positions at it, the engine's row bound."""
    import torch

    g = torch.Generator().manual_seed(depth)
    for layer in model.layers:
        latent = getattr(layer.mixer, "latent", None)  # MLA layers only
        if latent is not None:
            latent[:, :depth] = torch.randn(latent.shape[0], depth, latent.shape[2], generator=g).to(latent.dtype)
    cache.positions.fill_(depth)
    step.gen.zero_()
    step.rows = min(cache.cap, -(-(depth + 64) // row_bucket) * row_bucket)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--backend", default="auto", help="kernels.backend: auto (the CPU ops) or torch")
    ap.add_argument(
        "--pack", choices=["auto", "on", "off"], default="auto", help="packed weights: as a run would, or not"
    )
    ap.add_argument("--profile", action="store_true", help="also torch.profiler's self time per op name")
    ap.add_argument("--top", type=int, default=12, help="ops listed per depth with --profile")
    args = ap.parse_args()

    import torch

    from k3dist.engine.engine import ROW_BUCKET

    torch.set_num_threads(args.threads)
    m = common.machine(str(args.threads))
    model, cache, step = bind(args.batch, max(args.depths) + args.warm + args.steps + 64, args.backend, args.pack)
    print(common.header(m), flush=True)
    rows, profiles = [], {}
    with torch.inference_mode():
        for depth in args.depths:
            at_depth(model, cache, step, depth, ROW_BUCKET)
            for _ in range(args.warm):
                step()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times.append((time.perf_counter() - start) * 1e3)
            p50 = statistics.median(times)
            rows.append([str(depth), f"{p50:.2f}", f"{min(times):.2f}", f"{max(times):.2f}"])
            print(f"  depth {depth}: step p50 {p50:.2f} ms (min {min(times):.2f})", flush=True)
            if args.profile:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(args.steps):
                        step()
                ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
                per_step = [(e.key, e.count // args.steps, e.self_cpu_time_total / args.steps / 1e3) for e in ops]
                profiles[depth] = per_step
    print("\n" + common.md_table(["depth", "step p50 ms", "min", "max"], rows))
    for depth, ops in profiles.items():
        print(f"\ndepth {depth}: self CPU ms per step, by op (torch.profiler, {args.steps} steps)")
        print(common.md_table(["op", "calls/step", "ms/step"], [[k, str(c), f"{t:.3f}"] for k, c, t in ops]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
