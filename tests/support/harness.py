"""Drive k3dist's real pipeline on spawned ranks for tests: load a checkpoint, then prefill and decode."""

import torch
from k3dist.kernels.backend import select
from k3dist.kernels.linear import packable
from safetensors.torch import save_file

from k3dist.base import dist
from k3dist.base.dtypes import BY_NAME
from k3dist.config import load_config, validate_topology
from k3dist.engine.cache import HybridCache, cache_nbytes, cache_shapes
from k3dist.engine.sampling import SamplingMode
from k3dist.engine.step import DecodeStep
from k3dist.model.build import build_model
from k3dist.model.tp import TPComm
from k3dist.weights.inventory import scan
from k3dist.weights.loader import load_weights


def bind(
    model_dir: str,
    dtype: str,
    batch: int,
    cap: int,
    router: str = "unbiased",
    backend: str = "auto",
    pack: bool = False,
):
    """Init the rank, load its shard of the checkpoint, bind the model to an empty cache. With `pack`, weights are
    packed where the job would pack them (bf16 on a CPU with oneDNN bf16), dense experts included."""
    rt = dist.init("gloo", "cpu", 120)
    torch.set_num_threads(1)
    cfg = load_config(model_dir)
    validate_topology(cfg, rt.world)
    inv = scan(model_dir, cfg)
    dt = BY_NAME[dtype].torch
    store = load_weights(inv, rt, dt, cache_nbytes(cache_shapes(cfg, rt.world, batch, cap, dt)), 0)
    cache = HybridCache(cfg, rt.world, batch, cap, dt, rt.device)
    comm = TPComm(rt.world, rt.rank, cfg.vocab_size)
    pack = pack and packable(dt, rt.device)
    model = build_model(cfg, store.tensors, comm, cache, select(backend, rt.device), router, pack)
    return rt, cfg, model, cache


def dense_layers(model) -> int:
    """How many MoE layers hold their experts dense (kernels/moe.py)."""
    return sum(getattr(layer.mlp, "dense", None) is not None for layer in model.layers)


def teacher_forced(
    model_dir: str,
    dtype: str,
    prompt: list,
    forced: list | None,
    out: str,
    steps: int = 16,
    router: str = "unbiased",
    capture: str = "eager",
    pack: bool = False,
):
    """Prefill logits for every prompt position, then one decode step per forced token (or, with `forced` None,
    per greedy token of its own) through the real static step; rank 0 saves logits, tokens and how many MoE layers
    ran dense experts."""
    B, T = len(prompt), len(prompt[0])
    rt, cfg, model, cache = bind(model_dir, dtype, B, T + steps + 1, router, pack=pack)
    dense = dense_layers(model)
    step = DecodeStep(model, cache, steps, SamplingMode(False, False), capture)
    step.warm_up()
    rows = torch.arange(B)
    with torch.inference_mode():
        prefill = model.comm.gather_logits(model.prefill(torch.tensor(prompt), rows, 0, all_logits=True))
        cache.positions.fill_(T)
    logits, tokens = [prefill[:, -1]], []
    for t in range(steps):
        tokens.append(logits[-1].argmax(-1) if forced is None else torch.tensor(forced)[:, t])
        if t < steps - 1:
            step.tokens.copy_(tokens[-1])
            with torch.inference_mode():
                at = cache.positions.clone()
                local = model.decode(step.tokens, at)
                cache.positions.add_(1)
            logits.append(model.comm.gather_logits(local))
    if rt.rank == 0:
        save_file(
            {
                "prefill": prefill.float().contiguous(),
                "steps": torch.stack(logits, 1).float().contiguous(),
                "tokens": torch.stack(tokens, 1).contiguous(),
                "dense_layers": torch.tensor(dense),
            },
            out,
        )
    dist.shutdown()
    return rt.rank


def generate(
    model_dir: str,
    prompts: list[dict],
    batch: int,
    dtype: str = "float32",
    capture: str = "eager",
    sync_every: int = 8,
    prefill_chunk: int = 512,
    cap: int | None = None,
    eos: tuple[int, ...] = (),
) -> list[dict]:
    """Run the real engine on every rank over `prompts` (Prompt fields as dicts); each rank returns its completions."""
    from k3dist.engine.engine import Engine, Prompt

    ready = [Prompt(**({"id": f"r{i}"} | p | {"ids": tuple(p["ids"])})) for i, p in enumerate(prompts)]
    longest = max(len(p.ids) + p.max_new_tokens for p in ready)
    rt, cfg, model, cache = bind(model_dir, dtype, batch, cap or longest)
    mode = SamplingMode(
        sample=any(p.temperature > 0 for p in ready),
        filtered=any(p.temperature > 0 and (p.top_p < 1 or p.top_k > 0) for p in ready),
    )
    step = DecodeStep(model, cache, max(p.max_new_tokens for p in ready), mode, capture)
    step.warm_up()
    engine = Engine(step, prefill_chunk, sync_every, eos)
    out = engine.run(ready)
    dist.shutdown()
    return [{"tokens": c.tokens, "finish_reason": c.finish_reason, "top": c.top_logits} for c in out]
