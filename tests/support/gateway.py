"""The SGLang Model Gateway (`smg`, the test extra) in front of k3dist servers, as its users start it: the `smg`
executable beside this interpreter, `smg launch --worker-urls ...` on 127.0.0.1 with free ports for its HTTP and its
Prometheus listeners (the latter defaults to 0.0.0.0:29000), in a session of its own, its log in a file. Used by
tests/serve/test_gateway.py and benchmarks/replicas.py."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SMG = Path(sys.executable).parent / "smg"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# short health checks, so a killed replica is marked down (and a restarted one up) within seconds; workers that are
# not up yet when the gateway starts asked again every second (its default: 30 s); on SIGTERM, 1 s for requests in
# flight (its default: 180 s, and 5 s to exit when idle)
QUICK = (
    "--health-check-interval-secs", "1", "--health-check-timeout-secs", "1",
    "--health-failure-threshold", "1", "--health-success-threshold", "1",
    "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "1",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """`smg launch` pointed at `workers` (base URLs) with `policy` and `extra` flags; ready once its /readiness counts
    every worker healthy."""

    def __init__(self, workers: list[str], log: Path, policy: str = "round_robin", extra: tuple = QUICK):
        if not SMG.exists():
            raise FileNotFoundError(f"{SMG}: the SGLang Model Gateway is in the test extra (pip install 'smg')")
        self.port, self.prometheus = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus)]
        cmd += ["--worker-urls", *workers, "--policy", policy, *extra]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ | {"NO_COLOR": "1"}
            )
        self.workers = list(workers)

    def ready(self, timeout: float = 60) -> float:
        """Seconds until /readiness reports every worker healthy; fails with the log's tail past `timeout`."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"smg exited {self.proc.returncode}:\n{self.text[-3000:]}")
            try:
                r = httpx.get(f"{self.base}/readiness", timeout=2)
                if r.status_code == 200 and r.json().get("healthy_workers") == len(self.workers):
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"smg not ready with {len(self.workers)} workers in {timeout} s:\n{self.text[-3000:]}")

    def status(self) -> dict[str, dict]:
        """The gateway's view of each worker (GET /workers), by URL."""
        return {w["url"]: w for w in httpx.get(f"{self.base}/workers", timeout=10).json()["workers"]}

    def wait_health(self, url: str, healthy: bool, timeout: float) -> float:
        """Seconds until the gateway's health check has marked `url` healthy (or not); fails past `timeout`."""
        start = time.monotonic()
        while self.status()[url]["is_healthy"] != healthy:
            if time.monotonic() - start > timeout:
                raise AssertionError(f"{url} not is_healthy={healthy} after {timeout:.1f} s: {self.status()[url]}")
            time.sleep(0.05)
        return time.monotonic() - start

    def wait_loads(self, timeout: float = 30) -> float:
        """Seconds until the gateway holds a load snapshot of every worker (it polls each every
        --load-monitor-interval, 10 s by default): until then it scores a worker that has none otherwise, and a burst
        of requests lands unevenly."""
        start = time.monotonic()
        while not all("engine_load" in w for w in self.status().values()):
            if time.monotonic() - start > timeout:
                raise AssertionError(f"no load snapshot of every worker after {timeout} s: {self.status()}")
            time.sleep(0.2)
        return time.monotonic() - start

    @property
    def text(self) -> str:
        return ANSI.sub("", self.log.read_text(errors="replace"))

    def warnings(self) -> list[str]:
        """Its WARN and ERROR lines, less the one it logs on every start without an API key (SECURITY POSTURE)."""
        lines = [line for line in self.text.splitlines() if re.search(r"\b(WARN|ERROR)\b", line)]
        return [line for line in lines if "smg::posture" not in line]

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM (it drains, then exits: several seconds), SIGKILL past `timeout`."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
