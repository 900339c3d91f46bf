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
    store = load_weights(cfg, inv, rt, dt, cache_bytes(cfg, batch, cap, rt.world, dt), 0)
    model = K3Model(cfg, store.tensors, TPComm(rt.world, rt.rank, cfg.vocab_size), router)
    return rt, cfg, store, model, DeviceHybridCache(cfg, rt.world, batch, cap, dt, rt.device)


def teacher_forced(model_dir: str, dtype: str, prompt: list, forced: list, out: str, router: str = "unbiased"):
    """Prefill logits for every prompt position, then one decode step per forced token; rank 0 saves them."""
    rt, cfg, store, model, cache = bind(model_dir, dtype, len(prompt), len(prompt[0]) + len(forced[0]) + 1, router)
    prefill = model.forward(torch.tensor(prompt), cache, all_logits=True)
    steps = [prefill[:, -1]]
    for t in range(len(forced[0]) - 1):
        steps.append(model.forward(torch.tensor(forced)[:, t : t + 1], cache))
    if rt.rank == 0:
        save_file({"prefill": prefill.float().contiguous(), "steps": torch.stack(steps, 1).float().contiguous()}, out)
    dist.shutdown()
    return rt.rank
