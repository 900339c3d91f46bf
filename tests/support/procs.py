"""Every process of a CLI run, found through a marker in its environment: the launcher, torch elastic's agent, the
ranks and their helpers (resource tracker) all inherit it, so /proc tells which of them are still alive."""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from tests.support.cli_run import ROOT


def marked(marker: str) -> set[int]:
    """Live processes whose environment carries `marker` ("NAME=value"), this one excepted."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    pids.add(int(entry.name))
            except OSError:  # gone meanwhile, or not ours
                pass
    return pids


def reap(marker: str, grace_s: float = 5.0) -> set[int]:
    """The processes of a finished run still alive after `grace_s` (a helper such as the resource tracker notices
    its parent's exit asynchronously); each is killed, so a failing test never leaves one behind."""
    deadline = time.monotonic() + grace_s
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


class Watched:
    """A command line started in a session of its own (as a shell starts a foreground job), its output read as it
    comes and its processes watched through a marker, so a test can signal it mid-run and prove none outlives it."""

    NAME = "K3DIST_WATCH_MARKER"

    def __init__(self, args: list[str], torchrun: list[str] | None = None):
        self.marker = f"{self.NAME}={uuid.uuid4().hex}"
        cmd = [sys.executable, *(["-m", "torch.distributed.run", *torchrun] if torchrun else []), "launch.py", *args]
        env = os.environ | {"PYTHONUNBUFFERED": "1", self.NAME: self.marker.split("=", 1)[1]}
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.seen: set[int] = set()
        self.signalled_at: float | None = None
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._read), threading.Thread(target=self._watch)]
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            self.seen |= marked(self.marker)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, needle: str, count: int = 1, timeout: float = 90) -> None:
        """Until `needle` has appeared in `count` lines of output; fails (after killing the run) if it never does."""
        deadline = time.monotonic() + timeout
        while sum(needle in line for line in self.lines) < count:
            if self._done.is_set() or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"never saw {needle!r} x{count}:\n{self.text}")
            time.sleep(0.05)

    def signal(self, sig: int, group: bool) -> None:
        """`sig` to the process started (`kill -INT pid`) or to its whole process group (a terminal's Ctrl-C)."""
        self.signalled_at = time.monotonic()
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def finish(self, timeout: float = 60) -> tuple[int, float, set[int]]:
        """(exit code, seconds from the signal to the exit, processes left after it); kills the run on a timeout."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        took = time.monotonic() - (self.signalled_at or time.monotonic())
        for t in self._threads:
            t.join()
        return rc, took, reap(self.marker)

    def kill(self) -> None:
        for pid in marked(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
