"""What a router asks of a worker beside the OpenAI routes: SGLang's worker-info routes, as the SGLang Model Gateway
(`smg`) reads them when it registers a worker and while it routes (docs/serving.md: Behind a router).

- `GET /server_info` and `GET /model_info` (and their older names `/get_server_info`, `/get_model_info`, which the
  gateway forwards verbatim from its own routes of those names): the model, where it was loaded from, the tensor-
  parallel world, the slots and their length, k3dist's version. A 2xx on `/server_info` is how the gateway tells
  an SGLang-protocol worker from a plain OpenAI one; `/version` is not served, as a 2xx there means vLLM to it.
- `GET /v1/loads` (and `GET /loads?model=`, the gateway's own schema, which it asks first): one load snapshot in
  SGLang's `WorkerLoadResponse` schema, made by the engine loop's thread after every window (`Load.of`), so the HTTP
  side reads a finished value and never the engine. Every number is one k3dist has; a field it has no value for
  (SGLang's `utilization`) is left out, and the gateway reads a missing field as 0.
"""

from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import FastAPI, Request

from ..base.files import optional_file, read_json_object
from .errors import APIError

RATE_S = 10.0  # gen_throughput: over the last this many seconds of decode steps


def k3dist_version() -> str:
    try:
        return f"k3dist {version('k3dist')}"
    except PackageNotFoundError:  # a checkout run without `pip install -e .`
        return "k3dist (not installed)"


@dataclass(frozen=True)
class WorkerInfo:
    """The server's fixed facts, as SGLang's /server_info and /model_info name them."""

    model_path: str  # the checkpoint dir (its tokenizer is in it too)
    served_name: str
    world: int  # ranks of the tensor-parallel group
    cap: int  # cache.cap: tokens per sequence
    slots: int  # generate.batch
    model_type: str | None
    architectures: tuple[str, ...] | None

    @classmethod
    def of(cls, model_dir: Path, served_name: str, *, world: int, cap: int, slots: int) -> "WorkerInfo":
        """The facts, `model_type` and `architectures` read from the checkpoint's config.json (already checked by the
        load; one missing or of another type is left out)."""
        found = optional_file(model_dir, "config.json", "the model's config")
        raw = read_json_object(found) if found else {}
        kind = raw.get("model_type") if isinstance(raw.get("model_type"), str) else None
        arch = raw.get("architectures")
        arch = tuple(arch) if isinstance(arch, list) and all(isinstance(a, str) for a in arch) else None
        return cls(str(model_dir), served_name, world, cap, slots, kind, arch)

    def server_info(self) -> dict:
        """SGLang's /server_info fields that k3dist has: one data-parallel rank, no pipeline, no disaggregation (SGLang
        writes that as the string "null"); `max_total_tokens` is what the slots' MLA cache holds."""
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_name,
            "tokenizer_path": self.model_path,
            "tp_size": self.world,
            "dp_size": 1,
            "pp_size": 1,
            "context_length": self.cap,
            "max_total_tokens": self.slots * self.cap,
            "max_running_requests": self.slots,
            "is_embedding": False,
            "disaggregation_mode": "null",
            "version": k3dist_version(),
        }

    def model_info(self) -> dict:
        """Text in, text out: no image or audio understanding is served (K3's vision tower is not loaded)."""
        info = {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
        if self.model_type is not None:
            info["model_type"] = self.model_type
        if self.architectures is not None:
            info["architectures"] = list(self.architectures)
        return info


class DecodeRate:
    """SGLang's gen_throughput: tokens the decode steps produced per second spent in them, over the latest windows
    that make up `span_s` seconds of decoding; the last figure stands while the server idles, 0 before its first
    decode step. A rate over wall time would fall towards 0 on an idle replica, and a router that divides queued
    work by it (smg's expected wait) would then send every request to the replica that has not reported one."""

    def __init__(self, span_s: float = RATE_S):
        self.span_s, self.samples = span_s, deque()  # (tokens, seconds) per window that decoded
        self.tokens, self.seconds = 0, 0.0  # the sums over `samples`
        self.seen = (0, 0.0)  # the engine's running totals at the last update

    def update(self, tokens_total: int, seconds_total: float) -> None:
        """The engine's running totals (Timings.decode_tokens, decode_seconds) after a window."""
        tokens, seconds = tokens_total - self.seen[0], seconds_total - self.seen[1]
        self.seen = (tokens_total, seconds_total)
        if seconds <= 0:
            return
        self.samples.append((tokens, seconds))
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        while self.seconds - self.samples[0][1] >= self.span_s:
            old_tokens, old_seconds = self.samples.popleft()
            self.tokens, self.seconds = self.tokens - old_tokens, self.seconds - old_seconds

    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass(frozen=True)
class Load:
    """One load snapshot. `used_tokens`: the prompt and generated tokens of the requests in the slots (the partly
    prefilled prompt's prefilled part); `pending_tokens`: prompt tokens still to prefill, the waiting prompts whole
    (k3dist looks a prompt's snapshot up when it admits it, so a waiting prompt's reuse is not known yet: an upper
    bound); `reused`: the share of admitted prompt tokens restored from prefix snapshots."""

    running: int = 0
    waiting: int = 0
    used_tokens: int = 0
    pending_tokens: int = 0
    slots: int = 0
    cap: int = 0
    gen_rate: float = 0.0
    reused: float = 0.0

    @classmethod
    def of(cls, engine, queued: int, gen_rate: float, prompt_tokens: int) -> "Load":
        """From the engine, on its own thread (the engine loop's); `queued`: requests submitted, not yet handed to
        the engine."""
        filling = engine.admission.filling
        used = sum(len(s.prompt.ids) + len(s.out.tokens) for s in engine.live.values())
        used += filling.at if filling is not None and filling.prompt is not None else 0
        running = len(engine.live) + (filling is not None and filling.prompt is not None)
        reused = engine.prefix.stats.tokens_reused if engine.prefix is not None else 0
        return cls(
            running=running,
            waiting=len(engine.waiting) + queued,
            used_tokens=used,
            pending_tokens=engine.admission.pending_tokens,
            slots=engine.cache.batch,
            cap=engine.cache.cap,
            gen_rate=gen_rate,
            reused=reused / prompt_tokens if prompt_tokens else 0.0,
        )

    def sglang(self) -> dict:
        """SGLang's /v1/loads entry for data-parallel rank 0 (the only one)."""
        capacity = self.slots * self.cap
        return {
            "dp_rank": 0,
            "num_running_reqs": self.running,
            "num_waiting_reqs": self.waiting,
            "num_waiting_uncached_tokens": self.pending_tokens,
            "num_total_reqs": self.running + self.waiting,
            "num_used_tokens": self.used_tokens,
            "num_total_tokens": self.used_tokens + self.pending_tokens,
            "max_total_num_tokens": capacity,
            "token_usage": round(self.used_tokens / capacity, 4) if capacity else 0.0,
            "gen_throughput": round(self.gen_rate, 2),
            "cache_hit_rate": round(self.reused, 4),
            "max_running_requests": self.slots,
        }


def loads_body(load: Load) -> dict:
    stamp = datetime.now(timezone.utc).isoformat()  # noqa: UP017 - datetime.UTC is 3.11+, the floor is 3.10
    return {"timestamp": stamp, "version": k3dist_version(), "dp_rank_count": 1, "loads": [load.sglang()]}


def add_worker_routes(app: FastAPI, front, info: WorkerInfo) -> None:
    """The routes above; `front.loop.load` is the engine loop's latest snapshot."""

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return info.server_info()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return info.model_info()

    @app.get("/v1/loads")
    async def loads():
        return loads_body(front.loop.load)

    @app.get("/loads")
    async def loads_of_model(request: Request):
        model = request.query_params.get("model")
        if model is not None and model != front.model_name:
            message = f"model {model!r} is not served here (this server serves {front.model_name!r})"
            raise APIError(404, message, "model", "model_not_found")
        return loads_body(front.loop.load)
