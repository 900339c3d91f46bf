"""Drive k3dist's real pipeline on spawned ranks for tests: load a checkpoint, then run teacher-forced steps."""

import torch
from safetensors.torch import save_file

from k3dist import dist
from k3dist.cache import DeviceHybridCache
from k3dist.config import load_config, validate_topology
from k3dist.model.tp import TPComm
from k3dist.model.transformer import K3Model
from k3dist.weights.inventory import scan
from k3dist.weights.loader import load_weights
from k3dist.weights.memory import cache_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def bind(model_dir: str, dtype: str, batch: int, cap: int, router: str = "unbiased"):
    """Init the rank, load its shard of the checkpoint, bind the model and an empty cache."""
    rt = dist.init("gloo", "cpu", 120)
    torch.set_num_threads(1)
    cfg = load_config(model_dir)
    validate_topology(cfg, rt.world)
    inv = scan(model_dir, cfg)
    dt = DTYPES[dtype]
    store = load_weights(inv, rt, dt, cache_bytes(cfg, batch, cap, rt.world, dt), 0)
    model = K3Model(cfg, store.tensors, TPComm(rt.world, rt.rank, cfg.vocab_size), router)
    return rt, cfg, store, model, DeviceHybridCache(cfg, rt.world, batch, cap, dt, rt.device)


def teacher_forced(
    model_dir: str, dtype: str, prompt: list, forced: list | None, out: str, steps: int = 16, router: str = "unbiased"
):
    """Prefill logits for every prompt position, then one decode step per forced token (or, with `forced` None,
    per greedy token of its own); rank 0 saves logits and tokens."""
    rt, cfg, store, model, cache = bind(model_dir, dtype, len(prompt), len(prompt[0]) + steps + 1, router)
    prefill = model.forward(torch.tensor(prompt), cache, all_logits=True)
    logits, tokens = [prefill[:, -1]], []
    for t in range(steps):
        tokens.append(logits[-1].argmax(-1) if forced is None else torch.tensor(forced)[:, t])
        if t < steps - 1:
            logits.append(model.forward(tokens[-1][:, None], cache))
    if rt.rank == 0:
        save_file(
            {
                "prefill": prefill.float().contiguous(),
                "steps": torch.stack(logits, 1).float().contiguous(),
                "tokens": torch.stack(tokens, 1).contiguous(),
            },
            out,
        )
    dist.shutdown()
    return rt.rank


def sample(model_dir: str, prompt: list, max_new: int, temperature: float, top_p: float, seed: int, eos=None):
    """Generate on every rank with the real engine; each rank returns the tokens it sampled."""
    from k3dist.engine import Sampler, generate

    rt, cfg, store, model, cache = bind(model_dir, "float32", len(prompt), len(prompt[0]) + max_new)
    gen = generate(model, cache, torch.tensor(prompt), max_new, Sampler(temperature, top_p, seed, rt.device), eos)
    dist.shutdown()
    return gen.tokens
