"""How far model.quant=int8 is from bf16 on the twin: top-1 agreement over greedy steps, and the KL of the logits.

    python benchmarks/quant_accuracy.py                       # 256 greedy steps after a 64-token seeded prompt
    python benchmarks/quant_accuracy.py --steps 32 --prompts 1  # a quick look

One process, world 1, the real loader and build_model (packed bf16 weights, the CPU ops where they build). bf16
decodes greedily; int8 is teacher-forced on bf16's tokens, so every step compares the two models on the same prefix.
Figures: the share of steps where int8's argmax is bf16's token (top-1 agreement), the mean and largest
KL(p_bf16 || p_int8) over steps, the mean |logit difference| over the logits' spread, and, free-running, how many
tokens int8's own greedy run shares with bf16's before the first divergence. The same figures for fp32 against bf16
give the scale: how far bf16's own rounding already moves this model.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def build(cfg, twin, quant: str, cap: int, dtype_name: str = "bfloat16"):
    import torch

    from k3dist.base import dist
    from k3dist.kernels.backend import select
    from k3dist.memory.terms import cache_nbytes
    from k3dist.model.build import build_model, choices
    from k3dist.model.cache import HybridCache, cache_shapes
    from k3dist.model.linear import packable
    from k3dist.model.tp import TPComm
    from k3dist.weights.inventory import scan
    from k3dist.weights.loader import load_weights
    from k3dist.weights.memory import MemoryTerms

    rt = dist.current() or dist.init("gloo", "cpu", 120)
    dtype = getattr(torch, dtype_name)
    store = load_weights(
        scan(twin, cfg), rt, dtype, MemoryTerms(cache=cache_nbytes(cache_shapes(cfg, 1, 1, cap, dtype)))
    )
    cache = HybridCache(cfg, 1, 1, cap, dtype, rt.device)
    comm = TPComm(1, 0, cfg.vocab_size)
    pack = packable(dtype, rt.device)
    kernels = select("auto", rt.device)
    planned = choices(cfg, dtype, rt.device, batch=1, pack=pack, cpu_ops=kernels.name == "cpu")
    model = build_model(cfg, store.tensors, comm, cache, kernels, pack=pack, quant=quant, **vars(planned))
    return model, cache


def run(model, cache, prompt: list[int], steps: int, forced: list[int] | None):
    """Greedy (or teacher-forced on `forced`) decode after the prompt: (tokens, fp32 logits per step [steps, V])."""
    import torch

    with torch.inference_mode():
        cache.reset()
        logits = model.prefill(torch.tensor([prompt]), torch.tensor([0]), 0)
        cache.positions.fill_(len(prompt))
        tokens, out = [], []
        for t in range(steps):
            out.append(logits[0].float())
            tokens.append(int(out[-1].argmax()) if forced is None else forced[t])
            at = cache.positions.clone()
            logits = model.decode(torch.tensor([tokens[-1]]), at)
            cache.positions.add_(1)
    return tokens, torch.stack(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2, help="seeded prompts (seeds 0, 1, ...)")
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / "quant_accuracy.md"

    import torch

    from k3dist.config import load_config
    from k3dist.offline.prompts import seeded_ids

    started = time.perf_counter()
    m = common.machine(f"{torch.get_num_threads()} (one process)")
    twin, cfg = common.twin_dir(), load_config(common.CONFIG)
    cap = args.prompt_len + args.steps + 1
    models = {"int8": build(cfg, twin, "int8", cap), "fp32": build(cfg, twin, "none", cap, "float32")}
    bf16 = build(cfg, twin, "none", cap)
    rows, data = [], []
    for seed in range(args.prompts):
        prompt = seeded_ids(1, args.prompt_len, cfg.vocab_size, seed)[0]
        tokens, ref = run(*bf16, prompt, args.steps, None)
        logp = ref.log_softmax(-1)
        for name, model in models.items():
            _, forced = run(*model, prompt, args.steps, tokens)
            own, _ = run(*model, prompt, args.steps, None)
            agree = (forced.argmax(-1) == torch.tensor(tokens)).float().mean().item()
            logq = forced.log_softmax(-1)
            kl = (logp.exp() * (logp - logq)).sum(-1)
            rel = ((forced - ref).abs().mean(-1) / ref.std(-1)).mean().item()
            same = next((i for i, (a, b) in enumerate(zip(tokens, own, strict=True)) if a != b), args.steps)
            row = {"model": name, "seed": seed, "top1": agree, "kl_mean": kl.mean().item(), "kl_max": kl.max().item()}
            row |= {"mean_abs_logit_diff_over_std": rel, "free_running_same": same}
            data.append(row)
            rows.append(
                [
                    name,
                    str(seed),
                    f"{100 * agree:.1f}% ({round(agree * args.steps)}/{args.steps})",
                    f"{row['kl_mean']:.2e}",
                    f"{row['kl_max']:.2e}",
                    f"{rel:.3f}",
                    f"{same}/{args.steps}",
                ]
            )
            print(f"  {name} prompt seed {seed}: " + " | ".join(rows[-1][2:]), flush=True)
    head = ["model vs bf16", "prompt seed", "top-1 agreement (teacher-forced)", "KL mean", "KL max"]
    head += ["mean |dlogit| / std(logit)", "free-running tokens equal"]
    summary = {
        name: {k: statistics.median(r[k] for r in data if r["model"] == name) for k in ("top1", "kl_mean", "kl_max")}
        for name in models
    }
    notes = [
        f"twin `{twin.name}` (random weights: near-ties are common, so this is a hard case for agreement); "
        f"prompts: {args.prompt_len} seeded random ids each, {args.steps} greedy steps of bf16, int8 teacher-forced "
        "on bf16's tokens (and once free-running).",
        "int8: weights/quant_plan.py's projections and the LM head as int8 with per-output-channel scales, bf16 "
        "activations (kernels/quant.py); everything else as in bf16. KL(p_bf16 || p_int8) in nats per step.",
    ]
    data = {"args": vars(args), "rows": data, "summary": summary}
    title = "int8 vs bf16 accuracy (model.quant=int8)"
    common.publish(args, title, [common.md_table(head, rows)], notes, m, data, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
