"""The rendezvous store's protocol: what ranks tell each other outside the process groups (dist.py), which still
works after a collective failed or a peer died. A published failure (the first one wins) and how many ranks printed
its line; a follower's ask for a drain; counters; and the daemon threads that watch for those keys, stopped by
dist.shutdown before the group goes.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from . import compat

if TYPE_CHECKING:
    from .dist import Runtime


def count(key: str) -> int:
    """Add one to counter `key` in the rendezvous store, which every rank of the job reaches; returns the count."""
    return rendezvous().add(key, 1)


def rendezvous():
    """The job's rendezvous store (torch.distributed's default), which every rank reaches."""
    return dist.distributed_c10d._get_default_store()


FAILURE = "k3dist/failure"
_watchers: list = []  # (stop event, thread) of the store watchers below, stopped by stop_watchers
PRINTED = "k3dist/failure-printed"  # how many ranks printed their line after a published failure
_published: list[str] = []  # what this rank published, if it did


def publish_failure(message: str) -> None:
    """Leave this rank's failure in the rendezvous store (the first one wins), for peers stuck in a collective."""
    try:
        rendezvous().compare_set(FAILURE, "", message)
        _published.append(message)
    except Exception:  # noqa: BLE001 - the store's host may be gone; the peers then name the lost rank instead
        pass


def printed_after_failure(rt: Runtime, wait: bool, wait_s: float = 5.0) -> None:
    """After a published failure: count this rank's line as printed and, with `wait` (the peers are alive: the
    failure was a rank's own), wait (bounded) until every rank's is. The launcher stops every rank as soon as one
    exits, so a rank that exited at once could cut a live peer off before its line."""
    try:
        store = rendezvous()
        if not store.check([FAILURE]):
            return
        store.add(PRINTED, 1)
        if not wait:
            return
        deadline = time.monotonic() + wait_s
        while store.add(PRINTED, 0) < rt.world and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - store gone: the job is ending anyway
        pass


def published_failure(wait_s: float = 5.0) -> str | None:
    """The failure a peer published, waiting up to `wait_s` for it to arrive; None if none did."""
    deadline = time.monotonic() + wait_s
    try:
        store = rendezvous()
        while not store.check([FAILURE]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return store.get(FAILURE).decode()
    except Exception:  # noqa: BLE001 - store unreachable
        return None


DRAIN = "k3dist/drain"


def ask_drain(signum: int) -> None:
    """A server's follower signalled alone: ask rank 0 to drain as if it had the signal (the first ask wins)."""
    try:
        rendezvous().compare_set(DRAIN, "", str(signum))
    except Exception:  # noqa: BLE001 - the store's host is gone: the job is ending anyway
        pass


def _watch_store(key: str, act, name: str, interval_s: float) -> None:
    """A daemon thread polling the store every `interval_s` for `key`; once it is set and `act(value)` returns true,
    the thread ends. Stopped by `shutdown` before the group goes (see there)."""
    stop = threading.Event()

    def watch():
        store = rendezvous()
        while not stop.wait(interval_s):
            try:
                if store.check([key]) and act(store.get(key).decode()):
                    return
            except Exception:  # noqa: BLE001 - store gone: the job is ending anyway
                return

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    _watchers.append((stop, thread))


def on_drain_asked(callback, interval_s: float = 0.5) -> None:
    """Rank 0 of a server: a daemon thread calls `callback(signum)` once a follower asks for a drain (ask_drain), so a
    signal that reached one follower only drains the whole server instead of ending it under its requests."""
    _watch_store(DRAIN, lambda signum: callback(int(signum)) or True, "k3dist-drain", interval_s)


def abort_on_peer_failure(rt: Runtime, end=None, interval_s: float = 0.1) -> None:
    """A daemon thread that acts as soon as a peer publishes a failure. NCCL: abort this rank's communicators, so a
    collective waiting on that peer returns with an error instead of waiting for the watchdog. gloo, given `end`:
    call `end(message)`, which ends this rank with the peer's line (a gloo collective fails only once the failing
    rank is gone, and by then the launcher may stop this rank before it prints)."""
    if rt.world == 1 or (rt.backend != "nccl" and end is None):
        return

    def act(message: str) -> bool:
        if _published:  # this rank's own failure: it prints its line itself
            return False
        if rt.backend == "nccl":
            compat.abort_process_group()
        else:
            end(message)
        return True

    _watch_store(FAILURE, act, "k3dist-peer-failure", interval_s)


def stop_watchers() -> None:
    """Stop the watcher threads. A daemon thread still inside a store call when the interpreter finalizes is unwound
    through C++ frames: "terminate called without an active exception", SIGABRT."""
    for stop, thread in _watchers:
        stop.set()
        thread.join(timeout=5.0)
    _watchers.clear()
