"""The resident hybrid cache: one statement of its shapes for the plan and the allocation, no reallocation and no
host<->device traffic per decode step, slots reset alone, and a prefix snapshot that restores a prefix exactly."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3dist.config import load_config
from k3dist.engine.snapshots import SnapshotStore
from k3dist.memory.terms import cache_nbytes
from k3dist.model.cache import HybridCache, cache_shapes
from tests.support.configs import TWIN, small_config
from tests.support.models import random_model

CPU = torch.device("cpu")


class CacheTraffic(TorchDispatchMode):
    """Records every op that touches a cache tensor's storage."""

    def __init__(self, cache: HybridCache):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in cache.tensors.values()}
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.ptrs
            for a in (*args, *kwargs.values())
        ):
            self.ops.append(func.__name__)
        return func(*args, **kwargs)


def test_twin_layers_hold_the_right_state():
    cfg = load_config(TWIN)
    cache = HybridCache(cfg, 2, batch=3, cap=64, dtype=torch.bfloat16, device=CPU)
    assert sorted(k for k in cache.tensors if k.startswith("conv.")) == [f"conv.{i}" for i in (0, 1, 2, 4, 5, 6)]
    assert sorted(k for k in cache.tensors if k.startswith("latent.")) == ["latent.3", "latent.7"]
    assert cache.layer("conv", 0).shape == (3, 3, 3, 512) and cache.layer("conv", 0).dtype == torch.bfloat16
    assert cache.layer("state", 0).shape == (3, 4, 128, 128) and cache.layer("state", 0).dtype == torch.float32
    assert cache.layer("latent", 3).shape == (3, 64, 160)
    assert cache.positions.shape == (3,) and cache.positions.dtype == torch.int64
    assert cache.nbytes == cache_nbytes(cache_shapes(cfg, 2, 3, 64, torch.bfloat16))  # what the plan counts


def test_decode_steps_stay_resident():
    cfg, model, cache = random_model(small_config(), batch=2, cap=32)
    with torch.inference_mode():
        model.prefill(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), torch.arange(2), 0)
    cache.positions.fill_(4)
    before = [(t.data_ptr(), t.shape) for t in cache.tensors.values()]
    traffic = CacheTraffic(cache)
    with traffic, torch.inference_mode():
        for step in range(4):
            model.decode(torch.tensor([13 + step, 20 + step]), cache.positions.clamp(max=31))
            cache.positions.add_(1)
    assert [(t.data_ptr(), t.shape) for t in cache.tensors.values()] == before
    assert traffic.ops, "the decode step must read and write the cache"
    crossing = {"_to_copy", "_local_scalar_dense", "clone", "_copy_from", "to", "cpu"}
    assert not set(traffic.ops) & {f"{c}.default" for c in crossing}, set(traffic.ops)
    assert cache.positions.tolist() == [8, 8]


def test_a_slot_resets_alone():
    cfg, model, cache = random_model(small_config(), batch=2, cap=16)
    with torch.inference_mode():
        model.prefill(torch.tensor([[5, 6, 7], [9, 10, 11]]), torch.arange(2), 0)
    cache.positions.fill_(3)
    kept = {n: t[0].clone() for n, t in cache.tensors.items()}
    cache.reset_slot(1)
    for name, t in cache.tensors.items():
        assert torch.equal(t[0], kept[name]), name
        assert not t[1].any(), name
    assert any(kept[n].any() for n in kept if n.startswith("state."))


def test_snapshot_restores_a_prefix_exactly(monkeypatch):
    """A prefix snapshot of one slot (engine/snapshots.py), demoted to the host and restored into an emptied slot
    with host-to-device writes only, gives the same decode as the slot it was taken from. One thread: with more, the
    thread governor (base/threads.py) may drop a loaded host to one between the two decodes, and a GEMM's sums change
    order with the thread count."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the governor's ceiling: it never changes the count
    cfg, model, cache = random_model(small_config(), batch=1, cap=32)
    prefix, rest = torch.tensor([[3, 1, 4, 1, 5, 9, 2]]), [6, 5, 3, 5]

    def decode():
        out = []
        with torch.inference_mode():
            for t in rest:
                out.append(model.decode(torch.tensor([t]), cache.positions.clone()))
                cache.positions.add_(1)
        return out

    with torch.inference_mode():
        model.prefill(prefix, torch.arange(1), 0)
    cache.positions.fill_(7)
    store = SnapshotStore(cache)
    store.save(0, 0, 7, torch.zeros(cfg.vocab_size))
    store.demote(0)  # on the host
    expected = decode()
    cache.reset_slot(0)
    traffic = CacheTraffic(cache)
    with traffic:
        length, _ = store.restore(0, 0)
    assert length == 7 and cache.positions.tolist() == [7]
    assert set(traffic.ops) <= {"copy_.default", "slice.Tensor", "select.int", "fill_.Scalar"}, traffic.ops
    got = decode()
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    assert cache.positions.tolist() == [11]
