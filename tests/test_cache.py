"""The resident hybrid cache: right layers, no reallocation and no host<->device traffic per decode step,
and a host snapshot that restores a prefix exactly."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3dist.cache import DeviceHybridCache
from k3dist.config import load_config, parse_config
from k3dist.errors import K3Error
from k3dist.model.tp import TPComm
from k3dist.model.transformer import K3Model
from k3dist.weights.schema import expected_tensors
from k3dist.weights.tp_plan import plan_rank, store_shapes
from k3dist.weights.twin import init_tensor

from .configs import TWIN, small_config


def random_model(raw: dict, dtype=torch.float32):
    """A world-1 model bound to freshly drawn weights laid out as the loader's store lays them out."""
    cfg = parse_config(raw)
    gen = torch.Generator().manual_seed(0)
    plans = plan_rank([(n, n, None, s, "F32") for n, s in expected_tensors(cfg).items()], 1, 0, dtype)
    store = {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in store_shapes(plans).items()}
    for p in plans:
        value = init_tensor(p.name, p.full_shape, gen).to(p.dtype)
        (store[p.dest] if p.slot is None else store[p.dest][p.slot]).copy_(value)
    return cfg, K3Model(cfg, store, TPComm(1, 0, cfg.vocab_size))


class CacheTraffic(TorchDispatchMode):
    """Records every op that touches a cache tensor's storage, and whether the cache was an input or output."""

    def __init__(self, cache: DeviceHybridCache):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in cache.tensors()}
        self.ops: list[tuple[str, str]] = []

    def _is_cache(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in self.ptrs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if any(self._is_cache(a) for a in (*args, *kwargs.values())):
            self.ops.append((name, "in"))
        out = func(*args, **kwargs)
        return out


def test_twin_layers_hold_the_right_state():
    cfg = load_config(TWIN)
    cache = DeviceHybridCache(cfg, 2, batch=3, cap=64, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert sorted(cache.conv) == sorted(cache.state) == [0, 1, 2, 4, 5, 6]
    assert sorted(cache.latent) == [3, 7]
    assert cache.conv[0].shape == (3, 3, 512, 3) and cache.conv[0].dtype == torch.bfloat16
    assert cache.state[0].shape == (3, 4, 128, 128) and cache.state[0].dtype == torch.float32
    assert cache.latent[3].shape == (3, 64, 160)
    from k3dist.weights.memory import cache_bytes

    assert cache.nbytes == cache_bytes(cfg, 3, 64, 2, torch.bfloat16)


def test_decode_steps_stay_resident():
    cfg, model = random_model(small_config())
    cache = DeviceHybridCache(cfg, 1, batch=2, cap=32, dtype=torch.float32, device=torch.device("cpu"))
    model.forward(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), cache)
    before = [(t.data_ptr(), t.shape) for t in cache.tensors()]
    traffic = CacheTraffic(cache)
    with traffic:
        for step in range(4):
            model.forward(torch.tensor([[13 + step], [20 + step]]), cache)
    assert [(t.data_ptr(), t.shape) for t in cache.tensors()] == before
    names = {n for n, _ in traffic.ops}
    assert traffic.ops, "the decode step must read and write the cache"
    crossing = {"_to_copy", "_local_scalar_dense", "clone", "_copy_from", "to", "cpu"}
    assert not names & {f"{c}.default" for c in crossing}, names
    assert cache.length == 8


def test_cap_refuses_instead_of_reallocating():
    cfg, model = random_model(small_config())
    cache = DeviceHybridCache(cfg, 1, batch=1, cap=5, dtype=torch.float32, device=torch.device("cpu"))
    model.forward(torch.tensor([[1, 2, 3, 4]]), cache)
    model.forward(torch.tensor([[5]]), cache)
    with pytest.raises(K3Error, match="cache.cap=5"):
        model.forward(torch.tensor([[6]]), cache)


def test_snapshot_restores_a_prefix_exactly():
    cfg, model = random_model(small_config())
    prefix, rest = torch.tensor([[3, 1, 4, 1, 5, 9, 2]]), torch.tensor([[6, 5, 3, 5]])
    cpu = torch.device("cpu")
    first = DeviceHybridCache(cfg, 1, 1, 32, torch.float32, cpu)
    model.forward(prefix, first)
    snap = first.to_host()
    # recompute the prefix from scratch, then decode the rest
    again = DeviceHybridCache(cfg, 1, 1, 32, torch.float32, cpu)
    model.forward(prefix, again)
    expected = [model.forward(rest[:, i : i + 1], again) for i in range(rest.shape[1])]
    # rebuild from the host snapshot: only host-to-device writes, then the same decode
    probe = DeviceHybridCache(cfg, 1, 1, 32, torch.float32, cpu)
    traffic = CacheTraffic(probe)
    with traffic:
        probe.load_host(snap)
    assert {n for n, _ in traffic.ops} <= {"copy_.default", "slice.Tensor", "select.int"}, traffic.ops
    restored = DeviceHybridCache.from_host(snap, cfg, 1, torch.float32, cpu)
    got = [model.forward(rest[:, i : i + 1], restored) for i in range(rest.shape[1])]
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    assert restored.length == again.length == 11
