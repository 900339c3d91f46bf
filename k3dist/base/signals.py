"""Ctrl-C (SIGINT) and SIGTERM: every process of a run ends at once, one `error: interrupted` line, exit 128+signal.

A signal never raises inside whatever the process was doing: an exception thrown from a handler in the middle of an
import or a C++ callback can be swallowed or abort the interpreter. Instead the handler ends the process on the spot
(`end`): finishers (a sweep's summary), the line if this process speaks for the run, `os._exit`. A rank also ends this
way when its main thread is blocked in a gloo collective that never returns to the interpreter: a watcher thread,
woken through the signal wakeup fd, ends it.

While the launcher runs ranks through torch elastic, the agent's own handlers are in place: they forward the signal
to the ranks, wait for them and raise SignalException, which the launcher turns into `Interrupted` to unwind (past
Hydra's sweep loop, which goes on after an Exception) and exit normally.

Whoever ends the run prints the line, once: the launcher for the ranks it started, rank 0 under torchrun, the process
itself when it is a world of one.
"""

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker

SIGNALS = (signal.SIGINT, signal.SIGTERM)
LINE = "error: interrupted"


class Interrupted(BaseException):
    """The ranks were ended for a signal; the launcher unwinds with this. Not an Exception: no `except Exception`
    on the way out (Hydra's, around each point of a sweep) may swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)

    @property
    def code(self) -> int:
        return 128 + self.signum


def interrupt_code(exitcode: int | None) -> int | None:
    """The signal a process's exit code says ended it (130/143 from `end`, -2/-15 from the signal itself)."""
    for sig in SIGNALS:
        if exitcode in (128 + sig, -sig):
            return int(sig)
    return None


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_finishers: list[Callable[[], None]] = []


def on_interrupt(fn: Callable[[], None]) -> None:
    """Run `fn` when an interrupt ends this process, before the line (a sweep's summary of its finished points)."""
    _finishers.append(fn)


def discard(fn: Callable[[], None] | None) -> None:
    if fn in _finishers:
        _finishers.remove(fn)


_ending = threading.Lock()
_announce = True


def report(signum: int) -> bool:
    """Finishers, then the one line if this process speaks for the run; False (nothing done) if already reported."""
    if not _ending.acquire(blocking=False):
        return False
    for fn in list(_finishers):
        try:
            fn()
        except Exception:  # noqa: BLE001 - the process is ending: a failed finisher must not stop that
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - interrupted mid-write (a reentrant flush) or closed: nothing to save
            pass
    if _announce:
        os.write(2, (LINE + "\n").encode())  # one write: ranks sharing a terminal never interleave lines
    return True


def end(signum: int) -> None:
    """Report, then `os._exit(128 + signum)`: no interpreter teardown, which could block on process groups whose
    peers are gone. Only the first caller ends the process; a later one (the main thread's handler racing the
    watcher thread, a second Ctrl-C while the launcher reports) returns."""
    if report(signum):
        os._exit(128 + signum)


_deferred: Callable[[int], None] | None = None
_first: float | None = None
REPEAT_S = 2.0  # a repeat of a deferred signal sooner than this is the same stop (torchrun forwards the terminal's)


def defer(callback: Callable[[int], None]) -> None:
    """From now on the first signal calls `callback(signum)` instead of ending this rank (a server drains first); a
    later one, more than REPEAT_S after it, ends the rank at once as usual."""
    global _deferred
    _deferred = callback


def _dispatch(signum: int) -> None:
    global _first
    if _deferred is None:
        end(signum)
    elif _first is None:
        _first = time.monotonic()
        _deferred(signum)
    elif time.monotonic() - _first > REPEAT_S:
        end(signum)


def _handle(signum, frame) -> None:
    if _deferred is None or not _watching:  # a deferred signal is the watcher thread's to dispatch (once)
        _dispatch(signum)


def as_launcher(announce: bool) -> None:
    """A signal ends this process when its main thread next runs Python (it has no ranks of its own running: while
    it does, torch elastic's handlers are in place). `announce`: whether this process prints the line."""
    global _announce
    _announce = announce
    if _main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _handle)


def _watch(fd: int) -> None:
    while True:
        for byte in os.read(fd, 64):
            if byte in SIGNALS:
                _dispatch(byte)


_watching = False


def as_rank(announce: bool) -> None:
    """A signal ends this rank at once, whatever its main thread is blocked in (idempotent).

    The C-level handler writes the signal number to the wakeup fd from whichever thread the kernel picked; the
    watcher thread reads it and ends the process even while the main thread never returns to the interpreter.
    Signals held since the process started (`held_for_children`) arrive once unblocked here.
    """
    global _watching
    as_launcher(announce)
    if not _main_thread():
        return
    _no_named_semaphores()
    if not _watching:
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=_watch, args=(read,), name="k3dist-signals", daemon=True).start()
        _watching = True
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def _no_named_semaphores() -> None:
    """`os._exit` skips the finalizers that unlink multiprocessing's named semaphores, and the resource tracker
    then warns about each one after the line. The one a rank makes is tqdm's write lock, a multiprocessing lock for
    processes that inherit it; each spawned rank makes its own and shares it with no one, so a thread lock does."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


_receiver: threading.Thread | None = None


@contextmanager
def held_for_children() -> Iterator[None]:
    """Processes started inside start with SIGINT and SIGTERM blocked, until they install their handlers.

    A signal mask survives exec, so a Ctrl-C that reaches a rank while its interpreter starts waits for the rank's
    handler instead of printing a KeyboardInterrupt traceback from the middle of an import. The main thread blocks
    the signals meanwhile; an idle thread started first does not, so the kernel delivers them to the launcher there
    and Python still runs the handler in the main thread. multiprocessing's resource tracker is started first: the
    first spawn starts it and unblocks both signals in the calling thread on its way.
    """
    global _receiver
    if not _main_thread():
        yield
        return
    resource_tracker.ensure_running()
    if _receiver is None:
        _receiver = threading.Thread(target=threading.Event().wait, name="k3dist-signal-receiver", daemon=True)
        _receiver.start()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
