"""Decode-kernel benchmark (GPU only): k3dist's Triton kernels beside a peer, on Kimi-Linear-48B-A3B shapes per rank.

    python benchmarks/kda_kernel.py --json kernels.json              # tp 1 and 8, batch 1, 8, 64
    python benchmarks/kda_kernel.py --tp 8 --batches 1 --json k.json # a quick look

KDA (32 / tp heads of d = 128, conv width 4, bf16, fp32 state):
- ours: `kda_triton.kda_decode_fused`, one kernel: conv-state update, causal conv + SiLU of q, k, v, l2norm, forget
  gate (softplus, A_log, dt_bias), sigmoid(beta), delta rule on the fp32 state, output read, gated RMSNorm.
- fla: `fla.ops.kda.fused_recurrent_kda`, the recurrent part only: it gets post-conv q, k, v, the log decay g and
  sigmoid(beta) precomputed, l2-normalises q and k in the kernel (`use_qk_l2norm_in_kernel=True`) and returns the
  un-normed output and the final state. The conv, gate and norm it leaves out are more launches in a real step.
- torch: the reference `kda_fused.kda_decode_fused` (about 30 small ops), the oracle both are checked against.
MLA (absorbed decode, 32 / tp heads, r = 512, dr = 64, bf16, every sequence at full length L):
- ours: `mla_triton.mla_decode` (split-L flash decoding + a combine kernel); torch: `mla.mla_decode`.

`--device cpu` rehearses the script (gpu_check.sh's dry run): the same code at toy shapes, the Triton kernels under
Triton's interpreter, timed eagerly; its figures mean nothing.

Timing: every implementation is captured in a CUDA graph (what the runtime replays) as a chain of calls that rotates
over enough copies of its inputs to overflow the 50 MB L2, so states and caches come from HBM as in a real step;
the graph is replayed and µs/call = elapsed / calls. An implementation that cannot be captured is timed eagerly
(marked). GB/s counts the KDA state read + written, or the MLA latent rows read. Writes the table to stdout and,
with --json, everything to that file. On a machine without CUDA it prints a note and exits 0.
"""

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import header, machine, md_table  # noqa: E402  (benchmarks/ is on sys.path as the script dir)

DEVICE = "cuda"
L2_BYTES = 50 * 2**20  # H200
KDA_HEADS, KDA_D, KDA_K = 32, 128, 4
MLA_HEADS, MLA_R, MLA_DR = 32, 512, 64


def n_copies(bytes_per_call: int) -> int:
    """Input copies whose rotation reads about twice the L2 (at most 256)."""
    return max(1, min(256, math.ceil(2 * L2_BYTES / max(bytes_per_call, 1))))


def toy_shapes() -> None:
    """The shapes of a CPU rehearsal (the interpreter runs every program in Python)."""
    global KDA_HEADS, KDA_D, MLA_HEADS, MLA_R, MLA_DR
    KDA_HEADS, KDA_D, MLA_HEADS, MLA_R, MLA_DR = 4, 16, 4, 32, 16


def bench(calls: list, target_s: float = 0.05) -> tuple[float, str]:
    """µs per call and how it was timed ("graph" or "eager"); calls: zero-argument callables, one per input copy."""
    copies = len(calls)
    if DEVICE == "cpu":
        start = time.perf_counter()
        for fn in calls[:2]:
            fn()
        return (time.perf_counter() - start) * 1e6 / min(2, copies), "eager"
    for fn in calls[:2]:  # compile and warm up
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    calls[0]()
    end.record()
    torch.cuda.synchronize()
    once_s = max(start.elapsed_time(end) / 1e3, 1e-6)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            calls[0]()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        graph.replay()
        torch.cuda.synchronize()
        replays = max(2, min(200, int(target_s / (once_s * copies))))
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        del graph
        return start.elapsed_time(end) * 1e3 / (replays * copies), "graph"
    except Exception as err:  # noqa: BLE001  (a peer that cannot be captured is still timed)
        print(f"  (CUDA graph capture failed: {type(err).__name__}: {err}; timing eagerly)")
        torch.cuda.synchronize()
        n = max(3, min(200, int(target_s / once_s)))
        start.record()
        for i in range(n):
            calls[i % copies]()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / n, "eager"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# ---------------------------------------------------------------- KDA


def kda_args(B: int, H: int, seed: int) -> list:
    """Arguments of kda_decode_fused (qkv, g_raw, beta_raw, gate, conv_state, state, layer), bf16 activations and an
    fp32 state, on the GPU."""
    from k3dist.kernels.kda_fused import KDALayer

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    P, d, K, bf = H * KDA_D, KDA_D, KDA_K, torch.bfloat16

    def randn(*shape, dtype=bf, s=1.0):
        return (s * torch.randn(*shape, generator=gen, device=DEVICE)).to(dtype)

    dt = torch.empty(P, device=DEVICE).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    qkv, conv_state, conv_w = randn(B, 3, P), randn(B, K - 1, 3, P), randn(3, P, K, s=0.5)
    g_raw, beta_raw, gate = randn(B, P, s=3.0), randn(B, H), randn(B, P)
    A_log = torch.empty(H, device=DEVICE).uniform_(1.0, 16.0, generator=gen).log()
    layer = KDALayer(conv_w, A_log, dt + torch.log(-torch.expm1(-dt)), randn(d, s=0.1) + 1.0, 1e-5)
    return [qkv, g_raw, beta_raw, gate, conv_state, randn(B, H, d, d, dtype=torch.float32, s=0.1), layer]


def fla_args(args: list) -> list:
    """What fla's recurrent kernel takes for the same step: post-conv q, k, v, log decay g, sigmoid(beta), state."""
    from k3dist.kernels.conv import causal_conv_step
    from k3dist.kernels.kda import kda_gate

    qkv, g_raw, beta_raw, _, conv_state, state, layer = args
    conv_w, A_log, dt_bias = layer.conv_w, layer.A_log, layer.dt_bias
    B, _, P = qkv.shape
    H = beta_raw.shape[-1]
    cs = conv_state.clone()
    q, k, v = (causal_conv_step(qkv[:, i], conv_w[i], cs[:, :, i]).view(B, 1, H, KDA_D) for i in range(3))
    g = kda_gate(g_raw.view(B, 1, H, KDA_D), A_log, dt_bias, layer.lower)
    return [q, k, v, g, beta_raw.float().sigmoid().view(B, 1, H), state.clone()]


def run_kda(tps: list[int], batches: list[int]) -> list[dict]:
    from k3dist.kernels.kda_fused import kda_decode_fused as torch_kda
    from k3dist.kernels.kda_triton import kda_decode_fused as triton_kda

    try:
        from fla.ops.kda import fused_recurrent_kda
    except ImportError:
        fused_recurrent_kda = None
        print("fla not installed: timing k3dist's kernel and the torch reference only")
    rows = []
    for tp in tps:
        H = KDA_HEADS // tp
        for B in batches:
            state_bytes = B * H * KDA_D * KDA_D * 4
            moved = 2 * state_bytes  # the state is read once and written once
            sets = [kda_args(B, H, seed) for seed in range(n_copies(moved))]
            check = [a.clone() if isinstance(a, torch.Tensor) else a for a in sets[0]]
            want = torch_kda(*[a.clone() if isinstance(a, torch.Tensor) else a for a in sets[0]])
            err = rel_err(triton_kda(*check), want)
            row = {"tp": tp, "heads": H, "batch": B, "state_MiB": state_bytes / 2**20, "ours_rel_err": err}
            row["ours_us"], row["ours_mode"] = bench([lambda a=a: triton_kda(*a) for a in sets])
            row["torch_us"], row["torch_mode"] = bench([lambda a=a: torch_kda(*a) for a in sets])
            if fused_recurrent_kda is not None:
                fsets = [fla_args(s) for s in sets]

                def fla_call(q, k, v, g, beta, h0):
                    return lambda: fused_recurrent_kda(
                        q=q,
                        k=k,
                        v=v,
                        g=g,
                        beta=beta,
                        initial_state=h0,
                        output_final_state=True,
                        use_qk_l2norm_in_kernel=True,
                    )

                try:
                    with torch.inference_mode():
                        row["fla_us"], row["fla_mode"] = bench([fla_call(*f) for f in fsets])
                except Exception as err:  # noqa: BLE001  (fla's API moves between versions: report, go on)
                    row["fla_error"] = f"{type(err).__name__}: {err}"[:300]
                    print(f"  fla failed at tp {tp} batch {B}: {row['fla_error']}")
                del fsets
            other = f"fla {row.get('fla_us', float('nan')):.1f} µs"
            rows.append(_done(row, moved, f"kda tp {tp} batch {B}", other))
            del sets
    return rows


def _done(row: dict, moved: int, what: str, other: str) -> dict:
    """Our bandwidth from the bytes one call moves, a progress line, and the point's memory handed back."""
    row["ours_GBps"] = moved / row["ours_us"] / 1e3
    print(f"{what}: ours {row['ours_us']:.1f} µs, {other}")
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------- MLA


def run_mla(tps: list[int], batches: list[int], lengths: list[int]) -> list[dict]:
    from k3dist.kernels.mla import mla_decode as torch_mla
    from k3dist.kernels.mla_triton import mla_decode as triton_mla

    rows = []
    scale = (128 + MLA_DR) ** -0.5  # qk_nope_head_dim 128 + qk_rope_head_dim 64
    for tp in tps:
        H = MLA_HEADS // tp
        for L in lengths:
            for B in batches:
                read = B * L * (MLA_R + MLA_DR) * 2
                n = n_copies(read)
                gen = torch.Generator(device=DEVICE).manual_seed(0)
                sets = [
                    (
                        torch.randn(B, H, MLA_R, generator=gen, device=DEVICE).bfloat16(),
                        torch.randn(B, H, MLA_DR, generator=gen, device=DEVICE).bfloat16(),
                        torch.randn(B, L, MLA_R + MLA_DR, generator=gen, device=DEVICE).bfloat16(),
                        torch.full((B,), L, device=DEVICE),
                    )
                    for _ in range(n)
                ]
                err = rel_err(triton_mla(*sets[0], scale), torch_mla(*sets[0], scale))
                row = {"tp": tp, "heads": H, "batch": B, "L": L, "cache_MiB": read / 2**20, "ours_rel_err": err}
                row["ours_us"], row["ours_mode"] = bench([lambda a=a: triton_mla(*a, scale) for a in sets])
                row["torch_us"], row["torch_mode"] = bench([lambda a=a: torch_mla(*a, scale) for a in sets])
                rows.append(_done(row, read, f"mla tp {tp} L {L} batch {B}", f"torch {row['torch_us']:.1f} µs"))
                del sets
    return rows


def tables(kda: list[dict], mla: list[dict]) -> str:
    def us(row, key):
        mode = row.get(key + "_mode")
        return "" if key + "_us" not in row else f"{row[key + '_us']:.1f}" + ("" if mode == "graph" else " (eager)")

    head = ["tp", "heads", "batch", "state MiB", "ours µs", "fla µs", "torch µs", "ours GB/s", "fla / ours"]
    head += ["torch / ours", "ours err"]
    body = [
        [
            str(r["tp"]),
            str(r["heads"]),
            str(r["batch"]),
            f"{r['state_MiB']:.1f}",
            us(r, "ours"),
            us(r, "fla") or ("n/a" if "fla_error" not in r else "failed"),
            us(r, "torch"),
            f"{r['ours_GBps']:.0f}",
            f"{r['fla_us'] / r['ours_us']:.2f}" if "fla_us" in r else "",
            f"{r['torch_us'] / r['ours_us']:.1f}",
            f"{r['ours_rel_err']:.1e}",
        ]
        for r in kda
    ]
    out = "KDA decode step (ours: whole fused step; fla: recurrent part only; torch: reference)\n\n"
    out += md_table(head, body)
    head = ["tp", "heads", "batch", "L", "cache MiB", "ours µs", "torch µs", "ours GB/s", "torch / ours", "ours err"]
    body = [
        [
            str(r["tp"]),
            str(r["heads"]),
            str(r["batch"]),
            str(r["L"]),
            f"{r['cache_MiB']:.0f}",
            us(r, "ours"),
            us(r, "torch"),
            f"{r['ours_GBps']:.0f}",
            f"{r['torch_us'] / r['ours_us']:.1f}",
            f"{r['ours_rel_err']:.1e}",
        ]
        for r in mla
    ]
    out += f"\n\nMLA absorbed decode, r = {MLA_R}, dr = {MLA_DR}, full-length caches (ours vs the torch reference)\n\n"
    return out + md_table(head, body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 8], help="tensor-parallel degrees (heads = 32 / tp)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768], help="MLA cache lengths")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a rehearsal at toy shapes")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined
        toy_shapes()
    elif not torch.cuda.is_available():
        print("benchmarks/kda_kernel.py needs a CUDA GPU: nothing to time on this machine")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"skipped": "no CUDA device"}))
        return 0
    import triton

    started = time.perf_counter()
    try:
        from importlib.metadata import version

        fla_version = version("flash-linear-attention")
    except Exception:  # noqa: BLE001
        fla_version = None
    env = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton's interpreter, toy shapes)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": fla_version or "not installed",
        "python": platform.python_version(),
    }
    m = machine("-", DEVICE)
    print(header(m))
    print(" | ".join(f"{k} {v}" for k, v in env.items()))
    torch.backends.cuda.matmul.allow_tf32 = False
    kda = run_kda(args.tp, args.batches)
    mla = run_mla(args.tp, args.batches, args.lengths)
    print("\n" + tables(kda, mla))
    elapsed = time.perf_counter() - started
    print(f"\n(benchmark took {elapsed:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**env, "machine": m, "seconds": elapsed, "kda": kda, "mla": mla}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
