"""A real k3dist server for tests: `python launch.py run.mode=serve ...` (or under torchrun) in a session of its own,
on 127.0.0.1 and a free port, ready once it prints its serving line; every process it started is tracked, so a test
can signal or kill one rank and prove none outlives the server."""

import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai

from tests.support.procs import Watched

READY = re.compile(r"k3dist: serving '([^']+)' at (http://(?:[\d.]+|\[[\da-f:]+\]):\d+/v1) .*rank pids ([\d ]+)\)")


class Server(Watched):
    def __init__(
        self, tmp: Path, *overrides: str, torchrun: list[str] | None = None, env: dict | None = None, port: int = 0
    ):
        """`port`: 0 for a free one; a given one restarts a server where a router expects it."""
        args = ["run.mode=serve", f"serve.port={port}", f"hydra.run.dir={tmp / 'run'}", *overrides]
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            super().__init__(args, torchrun=torchrun)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.model, self.url, self.pids = self._ready()

    def _ready(self, timeout: float = 180) -> tuple[str, str, list[int]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if m := READY.search(line):
                    return m.group(1), m.group(2), [int(p) for p in m.group(3).split()]
            if self._done.is_set():
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"the server never said it was serving:\n{self.text}")

    @property
    def base(self) -> str:
        return self.url.removesuffix("/v1")

    def client(self, key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120, **kwargs)

    def async_client(self, key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples without labels (name -> value)."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return {n: float(v) for n, v in re.findall(r"^(k3dist_\w+) (\S+)$", text, re.M)}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM, group=False)
        rc, _, _ = self.finish(timeout=60)
        return rc
