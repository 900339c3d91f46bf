"""Models bound to freshly drawn weights in one process (world of one), laid out exactly as the loader lays them out:
for tests that need the model's math but not checkpoint files or ranks."""

import torch

from k3dist.config import parse_config
from k3dist.kernels.backend import select
from k3dist.model.build import build_model, choices
from k3dist.model.cache import HybridCache
from k3dist.model.tp import TPComm
from k3dist.twin.checkpoint import init_tensor
from k3dist.weights.tp_plan import plan_rank, store_shapes
from k3dist.weights.whatif import config_entries


def random_weights(cfg, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    plans = plan_rank(cfg, config_entries(cfg), 1, 0, dtype)
    store = {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in store_shapes(plans).items()}
    for p in plans:
        value = init_tensor(p.name, p.full_shape, gen).to(p.dtype)
        target = store[p.dest] if p.slot is None else store[p.dest][p.slot]
        if p.row is not None:
            target = target[p.row : p.row + p.local_shape[0]]
        target.copy_(value.view(target.shape))
    return store


def random_model(
    raw: dict,
    batch: int = 1,
    cap: int = 32,
    dtype=torch.float32,
    seed: int = 0,
    backend="torch",
    device="cpu",
    comm: TPComm | None = None,
):
    """(config, model, cache) for a raw config dict, weights seeded by `seed` (drawn on the host, then moved), on
    `device`; `comm` defaults to a world of one."""
    cfg = parse_config(raw)
    dev = torch.device(device)
    cache = HybridCache(cfg, 1, batch, cap, dtype, dev)
    weights = {k: v.to(dev) for k, v in random_weights(cfg, dtype, seed).items()}
    kernels = select(backend, dev)
    planned = choices(cfg, dtype, dev, batch=batch, pack=False, cpu_ops=kernels.name == "cpu")
    model = build_model(cfg, weights, comm or TPComm(1, 0, cfg.vocab_size), cache, kernels, **vars(planned))
    return cfg, model, cache
