"""Process groups and agreement: init from torchrun's env, a gloo control group, JSON exchange, one verdict.

Control traffic (plans, fingerprints, statuses) goes over gloo as JSON bytes, never pickled objects. What ranks tell
each other outside the groups (failures, drains, counters) goes through the rendezvous store: store.py.
"""

import itertools
import json
import logging
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import store
from .errors import K3Error

log = logging.getLogger("k3dist")


@dataclass
class Runtime:
    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device
    backend: str
    ctrl: object  # gloo group for control traffic
    timeout_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun gives one rank of a single-node job (for processes started without it)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def init(
    backend: str = "auto", device: str = "auto", timeout_s: float = 120.0, collective_timeout_s: float | None = None
) -> Runtime:
    """Join the job torchrun (or launch.py) described in the environment; a lone process is a world of one.

    Two groups, two timeouts: the model's collectives (prefill, decode) wait up to `collective_timeout_s`, long
    enough for a slow first compile or capture; the gloo control group's agreements give up after `timeout_s`.
    """
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(torchrun_env(0, 1, free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise K3Error(f"dist.device={device!r} must be auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise K3Error(f"rank {rank}: dist.device=cuda but no CUDA device is visible")
    dev, unusable = pick_device(device, rank, local_rank)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise K3Error(f"dist.backend={backend!r} must be auto, gloo or nccl")
    if backend == "nccl" and dev.type != "cuda":
        raise K3Error("dist.backend=nccl needs dist.device=cuda")
    timeout = timedelta(seconds=float(timeout_s))
    collective = timedelta(seconds=float(collective_timeout_s or timeout_s))
    if dev.type == "cuda" and unusable is None:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():  # a rank without a GPU still joins, so that every rank hears why
        kwargs = {"device_id": dev} if backend == "nccl" and unusable is None else {}
        dist.init_process_group(backend, timeout=collective, **kwargs)
    ctrl = dist.new_group(backend="gloo", timeout=timeout) if world > 1 else dist.group.WORLD
    global _current
    _current = Runtime(rank, world, local_rank, local_world, dev, backend, ctrl, float(timeout_s))
    check_devices(_current, unusable)
    return _current


def pick_device(device: str, rank: int, local_rank: int) -> tuple[torch.device, str | None]:
    """One rank per GPU: `cuda:LOCAL_RANK`, or `cuda:0` when the process sees exactly one GPU (each rank given its
    own through CUDA_VISIBLE_DEVICES). Returns the device and, when LOCAL_RANK has none, the refusal to agree on."""
    if device == "cpu":
        return torch.device("cpu"), None
    visible = torch.cuda.device_count()
    if visible == 1:
        return torch.device("cuda", 0), None
    if local_rank < visible:
        return torch.device("cuda", local_rank), None
    where = os.environ.get("CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", 0), (
        f"rank {rank}: LOCAL_RANK={local_rank} has no GPU: this process sees {visible} "
        f"(cuda:0..{visible - 1}, CUDA_VISIBLE_DEVICES={where if where is not None else 'unset'}); "
        "start at most one rank per GPU on each machine"
    )


def node_id() -> str:
    """This machine: hostname and kernel boot id. Ranks with the same id share one page cache and one set of GPUs."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def check_devices(rt: Runtime, unusable: str | None) -> None:
    """Agree right after init that every rank has a device and no two ranks drive the same GPU (UUIDs compared)."""
    uuid = None
    if rt.device.type == "cuda" and unusable is None:
        uuid = str(torch.cuda.get_device_properties(rt.device.index).uuid)
    statuses = agree("devices", unusable, rt, host=socket.gethostname(), device=str(rt.device), uuid=uuid)
    by_uuid: dict[str, list[dict]] = {}
    for st in statuses:
        if st["uuid"] is not None:
            by_uuid.setdefault(st["uuid"], []).append(st)
    shared = [group for group in by_uuid.values() if len(group) > 1]
    if shared:
        what = "; ".join(
            "ranks "
            + ", ".join(f"{st['rank']} ({st['host']} {st['device']})" for st in group)
            + f" share GPU {group[0]['uuid']}"
            for group in shared
        )
        raise K3Error(
            f"devices: {what}; run one rank per GPU (rank i of a machine uses cuda:LOCAL_RANK, or give each rank its "
            "own GPU through CUDA_VISIBLE_DEVICES)",
            agreed=True,
        )


_current: Runtime | None = None


def current() -> Runtime | None:
    """The runtime this process joined, if any (for the exit path)."""
    return _current


def settle(rt: Runtime, seconds: float = 5.0) -> None:
    """Bounded barrier after an agreed failure, so every rank has printed its error before any rank exits."""
    try:
        dist.monitored_barrier(group=rt.ctrl, timeout=timedelta(seconds=min(seconds, rt.timeout_s)))
    except Exception:  # noqa: BLE001 - a peer already gone is fine here: we are exiting anyway
        pass


def shutdown() -> None:
    """Stop the store's watcher threads (store.py), then destroy the group."""
    store.stop_watchers()
    if dist.is_initialized():
        dist.destroy_process_group()


def exchange(obj: dict, rt: Runtime) -> list[dict]:
    """All-gather one JSON object per rank over the control group."""
    if rt.world == 1:
        return [json.loads(json.dumps(obj))]
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(rt.world)]
    dist.all_gather(sizes, torch.tensor([data.numel()]), group=rt.ctrl)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(rt.world)]
    dist.all_gather(out, padded, group=rt.ctrl)
    return [json.loads(o[: int(s.item())].numpy().tobytes()) for o, s in zip(out, sizes, strict=True)]


_agreements = itertools.count(1)  # every rank enters the same agreements in the same order, also across re-inits


def arrive(rt: Runtime) -> str:
    """Mark this rank as arrived at its next agreement in the rendezvous store; returns the agreement's key.

    The store is not the collectives' transport, so after a collective failed it still tells which ranks never
    arrived (killed, crashed or stuck). Under torchrun and launch.py the elastic agent hosts it, so it outlives any
    rank; under a plain env:// start rank 0 hosts it.
    """
    key = f"k3dist/agree/{next(_agreements)}"
    store.rendezvous().set(f"{key}/{rt.rank}", str(rt.rank))
    return key


def missing(key: str | None, rt: Runtime) -> list[int] | None:
    """Ranks that never arrived at agreement `key`; None when the store cannot tell."""
    if key is None:
        return None
    try:
        kv = store.rendezvous()
        return [r for r in range(rt.world) if not kv.check([f"{key}/{r}"])]
    except RuntimeError:  # the store went with its host
        return None


def lost(stage: str, key: str | None, exc: Exception, rt: Runtime) -> K3Error:
    """The error for a collective that failed under us, naming the ranks that never arrived when the store knows."""
    gone = missing(key, rt)
    if gone:
        who = f"lost rank{'s' * (len(gone) > 1)} {', '.join(map(str, gone))}"
        how = "never reached this agreement: killed, crashed or stuck past"
    else:
        who = "lost contact with peer ranks"
        how = "the rendezvous store is unreachable too;" if gone is None else "every rank reached this agreement;"
        how += " waited up to"
    return K3Error(f"rank {rt.rank}: {stage}: {who} ({how} dist.timeout_s={rt.timeout_s:g}; {_cause(exc)})")


def _cause(exc: Exception) -> str:
    """The first sentence of a backend error, without gloo's source location."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return re.sub(r"^\[[^\]]*\] ", "", text).split(". ")[0][:200] or type(exc).__name__


def agree(stage: str, error: str | None, rt: Runtime, **facts) -> list[dict]:
    """Every rank reports its status for `stage`; if any failed, every rank raises the same error naming them.

    If the exchange itself fails (a peer died or hung past dist.timeout_s), every surviving rank raises naming the
    ranks that never arrived.
    """
    key = None
    try:
        if rt.world > 1:
            key = arrive(rt)
        statuses = exchange({"rank": rt.rank, "error": error, **facts}, rt)
    except RuntimeError as exc:  # gloo's DistBackendError and connection errors, the store's DistNetworkError
        raise lost(stage, key, exc, rt) from None
    failed = [s for s in statuses if s["error"]]
    if failed:
        raise K3Error(
            f"{stage} failed on {len(failed)} of {rt.world} ranks: " + "; ".join(s["error"] for s in failed),
            agreed=True,
        )
    return statuses
