"""One MoE layer's routed experts on the CPU: MXFP4 kept packed against the dequantized bf16 stack (issue 41).

    python benchmarks/moe_mxfp4.py                      # twin and real widths; decode b1, b8; a 512-token prefill
    python benchmarks/moe_mxfp4.py --shapes twin --repeats 9

Per shape, top-16 routing of random tokens, bf16 compute, SiTU (K3's activation), three ways, interleaved per repeat
(medians of the repeats after a warm-up round):
- packed: `cpu_ops.moe_experts` on the MXFP4 bytes (widened per 32-group inside the op);
- bf16 torch: kernels/moe.py's path for the batch on the dequantized bf16 stack, as model/moe.py picks it for
  decode (gathered where the pairs are fewer than the experts, else sorted) and prefill (grouped);
- bf16 op: `cpu_ops.moe_experts` on that dequantized stack (the same op reading 2 bytes a weight, not 0.53).
The ratio is bf16 torch / packed: above 1 the packed op is faster. Weights are random bytes with realistic scales
(values do not change the cost). `real` keeps K3's latent (3584) and expert width (3072 / --world) but holds
--real-experts of its 896 experts (memory): a decode step reads 16 experts either way; a 512-token prefill then
gives each expert more tokens than K3's 896 would (about 9).
"""

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SHAPES = {"twin": dict(E=64, Z=512, I=128), "real": dict(E=None, Z=3584, I=3072)}  # K3-twin config; K3's config
TOP_K = 16


def stacks(E: int, rows: int, inputs: int, seed: int):
    """A packed stack [E, rows, inputs] of random codes, scales around 2^-5 (weights of about 0.02), and its exact
    bf16 dequantization, built an expert at a time."""
    import torch

    from k3dist.kernels.mxfp4 import PackedExperts
    from k3dist.weights import mxfp4

    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (E, rows, inputs // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(119, 124, (E, rows, inputs // 32), dtype=torch.uint8, generator=g)
    dense = torch.empty(E, rows, inputs, dtype=torch.bfloat16)
    for e in range(E):
        dense[e] = mxfp4.dequantize(packed[e], scale[e], torch.bfloat16)
    return PackedExperts(packed, scale, torch.bfloat16), dense


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["twin", "real"], choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 512])
    ap.add_argument("--real-experts", type=int, default=32, help="experts held at the real widths (K3 has 896)")
    ap.add_argument("--world", type=int, default=1, help="TP size: each rank holds expert width I / world")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    common.add_output_args(ap)
    ap.set_defaults(out_md=common.RESULTS / "moe-mxfp4.md")
    args = ap.parse_args()

    import torch

    from k3dist.kernels import cpu_ops
    from k3dist.kernels.activation import SiTU
    from k3dist.kernels.moe import experts_gathered, experts_grouped, experts_sorted

    if not cpu_ops.available():
        print(f"the CPU ops do not build here ({cpu_ops.build_error()}): nothing to measure")
        return 1
    torch.set_num_threads(args.threads)
    m = common.machine(str(args.threads))
    act, rows, started = SiTU(4.0, 25.0), [], time.perf_counter()
    for name in args.shapes:
        s = SHAPES[name]
        E, Z, I = s["E"] or args.real_experts, s["Z"], s["I"] // args.world
        p13, d13 = stacks(E, 2 * I, Z, seed=1)
        p2, d2 = stacks(E, Z, I, seed=2)
        per_token = {"packed": (p13.nbytes + p2.nbytes) / E * TOP_K, "bf16": (d13.nbytes + d2.nbytes) / E * TOP_K}
        g = torch.Generator().manual_seed(0)
        for N in args.tokens:
            z = torch.randn(N, Z, generator=g).bfloat16()
            ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(N)])
            weights = torch.rand(N, TOP_K, generator=g)
            torch_path = experts_gathered if N * TOP_K < E else experts_sorted if N <= 16 else experts_grouped
            routed = (z, ids, weights)
            ways = {
                "packed": partial(cpu_ops.moe_experts, *routed, p13, p2, act=act),
                "bf16 torch": partial(torch_path, *routed, d13, d2, act),
                "bf16 op": partial(cpu_ops.moe_experts, *routed, d13, d2, act=act),
            }
            times = {w: [] for w in ways}
            with torch.inference_mode():
                for r in range(args.repeats + 1):  # the first round warms up
                    for way, fn in ways.items():
                        t0 = time.perf_counter()
                        fn()
                        if r:
                            times[way].append((time.perf_counter() - t0) * 1e3)
            med = {w: statistics.median(t) for w, t in times.items()}
            row = [name, f"{E}x[{2 * I}+{I}]x{Z}", str(N), *(f"{med[w]:.2f}" for w in ways)]
            row += [f"{med['bf16 torch'] / med['packed']:.2f}", f"{per_token['packed'] / 2**20:.1f}"]
            rows.append(row + [f"{per_token['bf16'] / 2**20:.1f}"])
            print("  " + " | ".join(rows[-1]), flush=True)
        del p13, d13, p2, d2, ways
    head = ["shape", "experts x rows x latent", "tokens", "packed ms", "bf16 torch ms", "bf16 op ms"]
    head += ["bf16 torch / packed", "MiB/token packed", "MiB/token bf16"]
    notes = [
        f"{args.repeats} interleaved repeats, medians; bf16 compute, SiTU, top-{TOP_K}; world {args.world}.",
        "MiB/token: the weight bytes of the 16 experts a token chooses (scales included for packed).",
        "Measured on a CPU shared with other jobs unless the load average above says otherwise: compare ratios.",
    ]
    common.publish(
        args, "Routed experts: MXFP4 packed vs dequantized bf16", [common.md_table(head, rows)], notes, m, {}, started
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
