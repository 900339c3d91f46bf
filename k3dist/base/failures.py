"""Failing the same way on every rank: agreed stages before the load, published failures after it, one `error:` line
and a non-zero exit always.

Before the upload every stage that can fail on one rank ends in an agreement (`staged`). After the load a failure
cannot wait for an agreement (a peer may be blocked inside a collective with the failing rank): it is published in
the rendezvous store, and a peer whose collective fails, or whose watcher sees it first, prints that line instead of
its own (`after_load`, `end_with_peer_failure`); every rank then waits (bounded) until all have printed.
"""

import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from . import dist, store
from .errors import K3Error


def staged(stage: str, rt: dist.Runtime, fn):
    """Run a local step on every rank and agree on its outcome, so one rank's error stops all of them."""
    error, value = None, None
    try:
        value = fn()
    except K3Error as exc:
        error = str(exc) if str(exc).startswith("rank ") else f"rank {rt.rank}: {exc}"
    except Exception as exc:  # a bug or I/O fault on this rank: peers must hear of it now, not at their timeout
        error = f"rank {rt.rank}: {stage} failed: {type(exc).__name__}: {exc}"
    dist.agree(stage, error, rt)
    return value


def after_load(stage, rt: dist.Runtime, fn):
    """Run prefill/decode work; a failure on any rank ends every rank with that rank's line.

    `stage` is a name, or a function that names the stage the work is in when it fails (the engine's prefill or
    decode).

    The failing rank publishes its error before it exits; a peer blocked in a collective with it sees that
    collective fail (its peer left, or NCCL was aborted) and prints the published line instead of its own.
    """
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - every failure after the load must reach the peers
        stage = stage() if callable(stage) else stage
        own = str(exc) if isinstance(exc, K3Error) else f"{stage} failed: {type(exc).__name__}: {exc}"
        own = own if own.startswith("rank ") else f"rank {rt.rank}: {own}"
        if isinstance(exc, torch.OutOfMemoryError):
            own = f"rank {rt.rank}: out of device memory in {stage} (raise memory.reserve or lower generate.batch)"
        if rt.world == 1:
            raise K3Error(own) from None
        own_fault = _own_fault(exc)
        peer = store.published_failure(wait_s=0.0 if own_fault else 5.0)
        if peer is None:
            store.publish_failure(own)
        # an own fault's peers are alive, stuck in a collective with this rank: its exit waits for their lines
        raise K3Error(peer or own, peers_alive=own_fault and peer is None) from None


def _own_fault(exc: Exception) -> bool:
    """Errors a rank makes itself, as opposed to a collective failing because a peer went away."""
    return not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError) or "injected" in str(exc)


_EXITING = threading.Lock()  # a rank's main thread and its peer-failure watcher may both end it: one line only


def exit_with_error(exc: K3Error) -> NoReturn:
    """Print the one `error:` line and exit 1; after an agreed or a published failure, wait (bounded) until every
    rank printed.

    `os._exit` skips interpreter teardown: destroying process groups whose peers may be gone can block or abort.
    """
    if not _EXITING.acquire(blocking=False):
        while True:  # the other thread prints and exits the process
            time.sleep(1)
    ErrorHandler().record_exception(exc)  # torch elastic's error file: torchrun's root cause, a sweep's record
    sys.stderr.flush()
    os.write(2, (exc.line + "\n").encode())  # one write: ranks sharing a terminal never interleave lines
    rt = dist.current()
    if exc.agreed and rt is not None and rt.world > 1:
        dist.settle(rt)
    elif rt is not None and rt.world > 1:
        store.printed_after_failure(rt, wait=exc.peers_alive)
    sys.stdout.flush()
    os._exit(1)


def end_with_peer_failure(message: str) -> NoReturn:
    """A peer published its failure (the watcher thread of store.abort_on_peer_failure): end this rank with that line,
    after the other live ranks printed theirs."""
    exit_with_error(K3Error(message, peers_alive=True))


def unexpected(exc: Exception) -> K3Error:
    """An exception nobody turned into a K3Error, as one line; K3DIST_TRACEBACK=1 also prints its traceback."""
    if os.environ.get("K3DIST_TRACEBACK"):
        traceback.print_exception(exc)
    rt = dist.current()
    rank = rt.rank if rt is not None else os.environ.get("RANK", "0")
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    name = type(exc).__name__
    return K3Error(f"rank {rank}: unexpected {name}: {exc}{where} (K3DIST_TRACEBACK=1 shows the traceback)")
