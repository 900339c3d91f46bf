"""The upload pipeline in one process: the CUDA path (pinned ring, side stream, events guarding slot reuse) driven on
CPU tensors with torch.cuda's pieces replaced, a reader thread's failure, the page-cache policy, CUDA free memory."""

import contextlib
import functools
import gc
import logging
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from k3dist.base.dist import Runtime
from k3dist.base.errors import K3Error
from k3dist.base.fault_injection import Faults
from k3dist.config import load_config
from k3dist.twin.checkpoint import write_checkpoint
from k3dist.weights import loader, memory, pagecache, staging
from k3dist.weights.inventory import scan
from k3dist.weights.pagecache import PageCache
from k3dist.weights.tp_plan import plan_rank
from k3dist.weights.transfer import Transfer
from tests.support.configs import small_config
from tests.support.residency import SUPPORTED, evict, resident, write_synced

CPU_RANK = Runtime(0, 1, 0, 1, torch.device("cpu"), "gloo", None, 30.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = write_checkpoint(small_config(), tmp_path_factory.mktemp("ckpt") / "m", seed=4, shard_bytes=120_000)
    for f in d.glob("*.safetensors"):
        write_synced(f)
    return d


def _check(ckpt: Path, plans, tensors) -> None:
    full = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        full |= load_file(f)
    for p in plans:
        mine = tensors[p.dest] if p.slot is None else tensors[p.dest][p.slot]
        mine = mine if p.row is None else mine[p.row : p.row + p.local_shape[0]]
        expect = full[p.key] if p.axis.dim is None else full[p.key].narrow(p.axis.dim, p.start, p.stop - p.start)
        assert torch.equal(mine, expect.to(p.dtype)), p.name


class _Log:
    """What the fake CUDA pieces saw, in order."""

    def __init__(self):
        self.calls: list[tuple] = []


def _fake_cuda(monkeypatch, log: _Log) -> None:
    """torch.cuda's stream, event and pinned memory, replaced by recorders that do the work on the CPU."""

    class Stream:
        def __init__(self, device=None):
            self.name = "side" if device is not None else "current"

        def wait_stream(self, other):
            log.calls.append(("wait_stream", self.name, other.name))

        def synchronize(self):
            log.calls.append(("stream_sync", self.name))

    class Event:
        count = 0

        def __init__(self):
            self.id, Event.count = Event.count, Event.count + 1
            self.recorded = 0

        def record(self, stream):
            self.recorded += 1
            log.calls.append(("record", self.id, stream.name))

        def synchronize(self):
            log.calls.append(("sync", self.id, self.recorded))

    current = Stream()

    def host_buffer(nbytes, pinned):
        log.calls.append(("buffer", nbytes, pinned))
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, src, non_blocking=False):
        log.calls.append(("copy", threading.current_thread().name, non_blocking))
        return real_copy(self, src, non_blocking=non_blocking)

    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(staging, "host_buffer", host_buffer)
    monkeypatch.setattr(staging, "release_pinned", lambda: log.calls.append(("release_pinned",)))
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    monkeypatch.setattr(loader, "Transfer", functools.partial(Transfer, cuda=True))


@pytest.mark.parametrize("world, rank", [(1, 0), (2, 1), (4, 2)])
def test_cuda_path_on_cpu(monkeypatch, ckpt, world, rank):
    """Everything staged in the (pinned) ring, spans packed by the readers, non-blocking copies on the side stream,
    which waits for the weights' allocation; a slot is refilled only after waiting on the event recorded after its
    copies; the current stream waits for the side stream at the end. The weights are exact."""
    cfg = load_config(ckpt)
    inv = scan(ckpt, cfg)
    plans = plan_rank(cfg, inv.entries.values(), world, rank, torch.bfloat16)
    log = _Log()
    _fake_cuda(monkeypatch, log)
    tensors = loader.upload(inv, plans, CPU_RANK, Faults())
    monkeypatch.undo()
    _check(ckpt, plans, tensors)
    buffers = [c for c in log.calls if c[0] == "buffer"]
    assert buffers and all(pinned for _, _, pinned in buffers)
    copies = [c for c in log.calls if c[0] == "copy"]
    uploads = [c for c in copies if not c[1].startswith("k3dist-read")]  # this thread: to the device
    assert uploads and all(non_blocking for _, _, non_blocking in uploads)
    packed = [c for c in copies if c[1].startswith("k3dist-read")]  # readers: row splits' columns, packed
    assert bool(packed) == (world > 1)
    events: dict[int, int] = {}
    for call in log.calls:
        if call[0] == "record":
            assert call[2] == "side"
            events[call[1]] = events.get(call[1], 0) + 1
        if call[0] == "sync":  # a slot refilled: the event after its last copies was recorded, and is waited on
            assert call[2] == events.get(call[1], 0) >= 1
    syncs = [c for c in log.calls if c[0] == "sync"]
    assert len(syncs) >= sum(events.values()) - len(buffers)  # every reuse waited
    files = len(inv.files)
    assert log.calls.count(("wait_stream", "side", "current")) == files
    assert log.calls.count(("wait_stream", "current", "side")) == 1
    assert ("stream_sync", "side") in log.calls
    assert log.calls[-1] == ("release_pinned",)  # after the last event was waited on


def _floats() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.dtype.is_floating_point)


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-path", "cuda-path"])
def test_a_reader_thread_failure_frees_everything(monkeypatch, caplog, ckpt, cuda):
    """A read failing in a reader thread names the tensor and file, and nothing it or the copies touched stays
    alive (weak references and a census of float tensors)."""
    cfg = load_config(ckpt)
    inv = scan(ckpt, cfg)
    plans = plan_rank(cfg, inv.entries.values(), 2, 0, torch.bfloat16)
    at = next(i for i, p in enumerate(plans) if p.file == inv.files[1] and ".w2." in p.name)
    if cuda:
        _fake_cuda(monkeypatch, _Log())
    before = _floats()
    with caplog.at_level(logging.WARNING, logger="k3dist"), pytest.raises(K3Error) as err:
        loader.upload(inv, plans, CPU_RANK, Faults(rank=0, read_fail_at=at))
    monkeypatch.undo()
    message = str(err.value)
    assert message.startswith(f"upload failed on 1 of 1 ranks: rank 0: upload failed at tensor {plans[at].name} ")
    assert f"{ckpt / inv.files[1]}: OSError: [Errno 5] injected read error" in message
    (cleanup,) = [r.getMessage() for r in caplog.records if "k3_weight_cleanup" in r.getMessage()]
    assert cleanup.startswith("k3_weight_cleanup rank=0 freed=") and cleanup.endswith(" live=0")
    assert int(cleanup.split("freed=")[1].split()[0]) > 0
    assert _floats() == before


@pytest.mark.skipif(not SUPPORTED, reason="needs mincore and posix_fadvise")
@pytest.mark.parametrize("mode, gone", [("on", True), ("auto", False), ("off", False)])
def test_page_cache_policy_on_cpu(ckpt, mode, gone):
    """`on` drops each file once read (a world of one: no counter to wait for); `auto` keeps them on CPU; `off`
    always keeps them."""
    cfg = load_config(ckpt)
    inv = scan(ckpt, cfg)
    plans = plan_rank(cfg, inv.entries.values(), 1, 0, torch.bfloat16)
    for f in inv.files:
        evict(ckpt / f)
    loader.upload(inv, plans, CPU_RANK, Faults(), pages=PageCache(mode, CPU_RANK, "here", 1))
    left = [len(resident(ckpt / f)) for f in inv.files]
    assert all(n == 0 for n in left) if gone else all(n > 0 for n in left), left


def test_auto_drops_on_cuda_only():
    assert pagecache.drops("auto", torch.device("cuda", 0)) and not pagecache.drops("auto", torch.device("cpu"))
    assert pagecache.drops("on", torch.device("cpu")) and not pagecache.drops("off", torch.device("cuda", 0))


def test_cuda_free_memory_counts_what_the_allocator_holds(monkeypatch):
    """Free on CUDA = the driver's free memory + what torch's caching allocator holds unused (ours to reuse)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 * 2**30)
    assert memory.detect_free(torch.device("cuda", 0)) == 11 * 2**30
