"""Decode and time to first token at the real Kimi-Linear-48B-A3B shape, with no checkpoint (issue 38).

    python benchmarks/decode_48b.py --json 48b.json                      # CUDA: the real shape, bf16, about 96 GB
    python benchmarks/decode_48b.py --device cpu --batches 1 2 --steps 4 --prompt-len 64     # a rehearsal

The model is k3dist/configs/Kimi-Linear-48B-A3B-config.json (`--shape kimi_linear_48b`), world 1, with seeded
random weights (`--weights random`, the only kind) drawn straight into the weight store on the device, laid out as
the loader lays a checkpoint out (weights/tp_plan.py), and bound by build_model as a run binds it; nothing is read
from disk and nothing passes through host memory. On the CPU the same layer pattern runs at a shrunken width
(SHRUNK), so the script itself is tested (tests/unit/test_gpu_check.py).

Per batch (1, 8, 64): a cache of that many slots, every slot `--context` tokens deep (the latent rows' values do not
change what a step reads), the static decode step captured as a CUDA graph (eager on the CPU), `--steps` steps
timed: tok/s and ms a step. Bytes a step reads: roofline.decode_read_bytes at the mean position, with the routed
experts a batch touches under uniform routing (E (1 - (1 - k/E)^B)); over the HBM rate measured by a large copy_
(read + written bytes), that is the step's share of the memory's limit. TTFT: one prompt of `--prompt-len` seeded
ids through the runner's prefill (chunks of `--chunk`), to its first token, after one unmeasured prefill (kernel
compilation, library handles).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/ is the script dir; common puts the repo root on sys.path)
import roofline  # noqa: E402

SHAPES = {"kimi_linear_48b": "Kimi-Linear-48B-A3B-config.json"}
SHRUNK = {  # the CPU's width: the 48B layer pattern (27 layers, KDA and MLA interleaved, one dense), toy sizes
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size": 2048,
}


def config(shape: str, device: str):
    from k3dist.config import parse_config

    raw = json.loads((common.ROOT / "k3dist" / "configs" / SHAPES[shape]).read_text())
    if device == "cpu":
        raw |= SHRUNK
        raw["linear_attn_config"] = raw["linear_attn_config"] | {"num_heads": 4, "head_dim": 16}
    return parse_config(raw)


def device_weights(cfg, dtype, device, seed: int) -> dict:
    """The weight store of a world-1 rank, every tensor drawn in place on `device` from one seeded generator."""
    import torch

    from k3dist.twin.checkpoint import fill_tensor
    from k3dist.weights.tp_plan import plan_rank, store_shapes
    from k3dist.weights.whatif import config_entries

    plans = plan_rank(cfg, config_entries(cfg), 1, 0, dtype)
    store = {k: torch.empty(shape, dtype=dt, device=device) for k, (shape, dt) in store_shapes(plans).items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in plans:
        target = store[p.dest] if p.slot is None else store[p.dest][p.slot]
        if p.row is not None:
            target = target[p.row : p.row + p.local_shape[0]]
        fill_tensor(target, p.name, gen)
    return store


def decode_point(cfg, weights, args, batch: int) -> dict:
    """A cache of `batch` slots `args.context` deep, the step captured (CUDA) or eager, `args.steps` steps timed."""
    import torch

    from k3dist.engine.decode_step import DecodeStep, capture_kind
    from k3dist.kernels.backend import select
    from k3dist.model.build import build_model, choices
    from k3dist.model.cache import HybridCache
    from k3dist.model.tp import TPComm

    dev = torch.device(args.device)
    dtype = weights["model.embed_tokens.weight"].dtype
    cache = HybridCache(cfg, 1, batch, args.context + args.steps + 8, dtype, dev)
    kernels = select(args.backend, dev)
    planned = choices(cfg, dtype, dev, batch=batch, pack=False, cpu_ops=kernels.name == "cpu")
    model = build_model(cfg, weights, TPComm(1, 0, cfg.vocab_size), cache, kernels, **vars(planned))
    kind = capture_kind("auto", dev)
    step = DecodeStep(model, cache, kind=kind)
    step.warm_up()
    cache.positions.fill_(args.context)
    step()  # the first replay (or eager step) outside the timing
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    E, k = cfg.num_experts, cfg.top_k
    touched = E * (1 - (1 - k / E) ** batch)
    read = roofline.decode_read_bytes(cfg, 1, 2, args.context + args.steps / 2, batch=batch, experts=touched)
    del step, model, cache
    return {"batch": batch, "kind": kind, "step_ms": seconds * 1e3, "tok_s": batch / seconds, "read": read}


def ttft(cfg, weights, args) -> dict:
    """Seconds from a prompt of args.prompt_len seeded ids to its first token, through the runner's prefill."""
    import torch

    from k3dist.engine.control import Admit
    from k3dist.engine.decode_step import DecodeStep
    from k3dist.engine.runner import Runner
    from k3dist.kernels.backend import select
    from k3dist.model.build import build_model, choices
    from k3dist.model.cache import HybridCache
    from k3dist.model.tp import TPComm
    from k3dist.offline.prompts import seeded_ids

    dev = torch.device(args.device)
    dtype = weights["model.embed_tokens.weight"].dtype
    cache = HybridCache(cfg, 1, 1, args.prompt_len + 8, dtype, dev)
    kernels = select(args.backend, dev)
    planned = choices(cfg, dtype, dev, batch=1, pack=False, cpu_ops=kernels.name == "cpu")
    model = build_model(cfg, weights, TPComm(1, 0, cfg.vocab_size), cache, kernels, **vars(planned))
    runner = Runner(DecodeStep(model, cache), prefill_chunk=args.chunk)
    ids = tuple(seeded_ids(1, args.prompt_len, cfg.vocab_size, 0)[0])
    times = []
    for _ in range(2):  # the first compiles kernels and makes library handles: not a request's time
        runner.admit((Admit(0, ids),))  # the runner syncs the device before and after a prefill
        times.append(runner.timings.prefill_seconds - sum(times))
    token = int(runner.decode_step.out_tokens[0, 0])
    return {"prompt_len": args.prompt_len, "chunk": args.chunk, "ttft_s": times[1], "first_s": times[0], "token": token}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="kimi_linear_48b")
    ap.add_argument("--weights", choices=["random"], default="random", help="seeded random weights on the device")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the shrunken width (SHRUNK)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    ap.add_argument("--context", type=int, default=2048, help="tokens each slot holds when the steps start")
    ap.add_argument("--prompt-len", type=int, default=2048, help="the TTFT prompt's tokens")
    ap.add_argument("--chunk", type=int, default=512, help="generate.prefill_chunk of the TTFT prefill")
    ap.add_argument("--backend", default="auto", help="kernels.backend")
    ap.add_argument("--seed", type=int, default=0)
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / f"decode-48b-{args.device}.md"
    if common.no_device(args):
        return 2
    import torch

    started = time.perf_counter()
    m = common.machine(str(torch.get_num_threads()), args.device)
    cfg = config(args.shape, args.device)
    dtype = torch.bfloat16
    with torch.inference_mode():
        weights = device_weights(cfg, dtype, args.device, args.seed)
    held = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"  {args.shape} ({'real' if args.device == 'cuda' else 'shrunken'}): {held / 1e9:.2f} GB of weights "
          f"drawn on {args.device} in {time.perf_counter() - started:.1f} s", flush=True)  # fmt: skip
    hbm = roofline.copy_bandwidth(nbytes=2**30 if args.device == "cuda" else 64 * 2**20, device=args.device)
    points = []
    for b in args.batches:
        points.append(decode_point(cfg, weights, args, b))
        p = points[-1]
        p["GBps"] = p["read"]["total"] * p["tok_s"] / b / 1e9
        p["of_hbm"] = p["GBps"] / hbm
        print(f"  batch {b}: {p['tok_s']:.1f} tok/s, {p['step_ms']:.3f} ms a step, {p['GBps']:.0f} GB/s "
              f"({100 * p['of_hbm']:.0f}% of the copy rate)", flush=True)  # fmt: skip
    first = ttft(cfg, weights, args)
    print(f"  TTFT {args.prompt_len} tokens: {first['ttft_s'] * 1e3:.1f} ms (first run {first['first_s']:.2f} s)")
    head = ["batch", "step", "tok/s", "ms a step", "GB a step", "GB/s", "% of the copy rate"]
    rows = [
        [str(p["batch"]), p["kind"], f"{p['tok_s']:.1f}", f"{p['step_ms']:.3f}", f"{p['read']['total'] / 1e9:.3f}",
         f"{p['GBps']:.0f}", f"{100 * p['of_hbm']:.0f}%"]
        for p in points
    ]  # fmt: skip
    notes = [
        f"{args.shape}, seeded random bf16 weights ({held / 1e9:.1f} GB{'' if args.device == 'cuda' else ', shrunken'})"
        f", world 1, {args.steps} steps per batch from {args.context} tokens deep; copy rate {hbm:.0f} GB/s",
        f"TTFT of {args.prompt_len} tokens (chunks of {args.chunk}): {first['ttft_s'] * 1e3:.1f} ms "
        f"(the unmeasured first prefill: {first['first_s']:.2f} s)",
    ]
    data = {"shape": args.shape, "device": args.device, "weights_bytes": held, "copy_GBps": hbm, "points": points}
    common.publish(args, "48B-shape decode", [common.md_table(head, rows)], notes, m, data | {"ttft": first}, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
