"""Typed job settings from the composed Hydra config: one dataclass per config group, the config's own key names.

The job crosses process boundaries as a plain dict (spawned ranks); `parse` checks every value a user can override
and turns a bad one into one `error:` line naming the key.
"""

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from .base.dtypes import COMPUTE, compute_dtype
from .base.errors import K3Error
from .base.fault_injection import Faults
from .base.units import parse_bytes

CONFIGS = Path(__file__).parent / "configs"
MODES = ("generate", "load", "plan", "serve")
PLANNED = ("generate", "serve", "load")  # the runs run.mode=plan can plan for
# decode steps between the host's looks: a server streams each token as it comes (benchmarks/serve.py: inter-token
# latency p50 266 -> 33 ms at concurrency 1, 3% less throughput at 16); an offline run looks less often
SYNC_SERVE, SYNC_BATCH = 1, 8


@dataclass(frozen=True)
class ModelSettings:
    config_file: Path  # the twin's (or what-if) config.json when `path` is null
    path: str | None
    dtype: str  # auto or a compute dtype
    seed: int  # seed of the twin's random weights
    router_weights: str
    quant: str = "none"  # none or int8: weight-only int8 projections, made at bind time (weights/quant_plan.py)

    def compute_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        return compute_dtype(checkpoint_dtype if self.dtype == "auto" else self.dtype).torch


@dataclass(frozen=True)
class DistSettings:
    nproc: int
    world_size: int | None  # run.mode=plan: the world to plan for
    timeout_s: float  # agreements
    collective_timeout_s: float  # collectives of prefill and decode (a first capture can be slow)
    backend: str
    device: str
    check_tokens: bool  # debug: after every window, ranks compare their generated ids (engine/control.py)


@dataclass(frozen=True)
class MemorySettings:
    reserve: int | None  # None: the device's default (memory.py)
    free: int | None
    drop_page_cache: str  # auto (CUDA only), on, off: weights/pagecache.py


@dataclass(frozen=True)
class CacheSettings:
    """The resident hybrid cache; only the MLA latent grows with `cap` (KDA state is fixed-size)."""

    cap: int  # tokens per sequence


@dataclass(frozen=True)
class GenerateSettings:
    prompt: str | list[int] | None
    prompt_len: int | None  # set: seeded random ids of this length instead of `prompt`
    prompts: str | None  # a JSONL file of requests
    outputs: str | None
    chat: bool
    system: str | None
    batch: int
    max_new_tokens: int
    stop: tuple[str, ...]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stream: str
    prefill_chunk: int


@dataclass(frozen=True)
class DecodeSettings:
    compile: str
    sync_every: int  # null in the config: SYNC_SERVE for a server (every token streamed as it comes), else SYNC_BATCH


@dataclass(frozen=True)
class KernelSettings:
    backend: str


@dataclass(frozen=True)
class ServeSettings:
    """run.mode=serve: the HTTP front on rank 0 (k3dist/serve/)."""

    host: str
    port: int
    api_key: str | None  # or the environment's K3DIST_API_KEY; None: no key asked
    model_name: str | None  # None: the checkpoint dir's name
    max_waiting: int  # requests queued beyond the slots before new ones get 503
    max_body: int  # bytes of a request body
    drain_s: float  # on SIGTERM / Ctrl-C: how long in-flight requests may still run


@dataclass(frozen=True)
class PrefixSettings:
    """Exact prefix reuse (engine/prefix.py): snapshots of one sequence's hybrid state, keyed by its token ids."""

    enabled: str  # auto (on for run.mode=serve and prompts files), on, off
    bytes: int  # the device pool (the plan's prefix_bytes)
    host_bytes: int  # snapshots evicted from it are kept in (pinned) host memory up to this
    every: int | None  # prompt tokens between snapshots; None: 4 x generate.prefill_chunk

    def on(self, mode: str, prompts_file: bool) -> bool:
        return self.enabled == "on" or (self.enabled == "auto" and (mode == "serve" or prompts_file))


@dataclass(frozen=True)
class RunSettings:
    """What the job does: generate, stop after the weights (load), or only plan every rank (plan)."""

    mode: str
    plan_for: str = "generate"  # run.mode=plan: the run planned for (generate, serve or load)


@dataclass(frozen=True)
class Settings:
    model: ModelSettings
    dist: DistSettings
    memory: MemorySettings
    cache: CacheSettings
    generate: GenerateSettings
    decode: DecodeSettings
    kernels: KernelSettings
    run: RunSettings
    serve: ServeSettings
    prefix: PrefixSettings
    out: str | None
    fault: Faults


class _Section:
    """Reads one config group, naming `group.key` in every refusal."""

    def __init__(self, job: dict, group: str):
        self.values, self.group = job.get(group) or {}, group

    def fail(self, key: str, why: str):
        raise K3Error(f"{self.group}.{key}={self.values.get(key)!r} {why}")

    def integer(self, key: str, low: int = 0, optional: bool = False):
        value = self.values.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            self.fail(key, f"must be an integer >= {low}")
        return value

    def number(self, key: str, low: float = 0.0, high: float | None = None, open_low: bool = False) -> float:
        """A finite number in [low, high] ((low, high] with open_low): NaN and infinity are refused too."""
        value = self.values.get(key)
        bad = not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
        if bad or value < low or (open_low and value == low) or (high is not None and value > high):
            bounds = f"{'(' if open_low else '['}{low}, {high if high is not None else 'inf)'}"
            self.fail(key, f"must be a finite number in {bounds}{']' if high is not None else ''}")
        return float(value)

    def choice(self, key: str, choices) -> str:
        value = self.values.get(key)
        if isinstance(value, bool) and "on" in choices:  # YAML reads a bare on/off as a boolean
            value = "on" if value else "off"
        if value not in choices:
            self.fail(key, f"must be one of {list(choices)}")
        return value

    def flag(self, key: str) -> bool:
        value = self.values.get(key)
        if not isinstance(value, bool):
            self.fail(key, "must be true or false")
        return value

    def text(self, key: str) -> str | None:
        value = self.values.get(key)
        if value is not None and not isinstance(value, str):
            self.fail(key, "must be a string")
        return value

    def size(self, key: str) -> int | None:
        value = self.values.get(key)
        return None if value is None else parse_bytes(value, f"{self.group}.{key}")


def _prompt(gen: _Section):
    prompt = gen.values.get("prompt")
    if prompt is None or (isinstance(prompt, str) and prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if min(prompt) >= 0:
            return list(prompt)
    gen.fail("prompt", "must be text or a non-empty list of token ids")


def _stop(gen: _Section) -> tuple[str, ...]:
    stop = gen.values.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        gen.fail("stop", "must be a string or a list of non-empty strings")
    return tuple(stop)


def _model(sec: _Section) -> ModelSettings:
    config_file = Path(str(sec.values.get("config_file") or ""))
    if sec.values.get("path") is None:
        if not config_file.is_absolute():
            config_file = CONFIGS / config_file
        if not config_file.is_file():
            sec.fail("config_file", f"names no config ({config_file})")
    path = sec.values.get("path")
    return ModelSettings(
        config_file=config_file,
        path=None if path is None else str(path),
        dtype=sec.choice("dtype", ("auto", *COMPUTE)),
        seed=sec.integer("seed"),
        router_weights=sec.choice("router_weights", ("unbiased", "biased")),
        quant=sec.choice("quant", ("none", "int8")) if "quant" in sec.values else "none",
    )


def _serve(sec: _Section) -> ServeSettings:
    port = sec.integer("port")
    if port > 65535:
        sec.fail("port", "must be a TCP port (0-65535; 0 picks a free one)")
    host = sec.text("host")
    if not host:
        sec.fail("host", "must be an address to listen on, such as 127.0.0.1 or 0.0.0.0")
    return ServeSettings(
        host=host,
        port=port,
        api_key=sec.text("api_key") or os.environ.get("K3DIST_API_KEY") or None,
        model_name=sec.text("model_name") or None,
        max_waiting=sec.integer("max_waiting"),
        max_body=sec.size("max_body") or 0,
        drain_s=sec.number("drain_s"),
    )


def _prefix(sec: _Section, chunk) -> PrefixSettings:
    every = sec.integer("every", 1, optional=True)
    if every is not None and isinstance(chunk, int) and chunk > 0 and every % chunk:
        sec.fail("every", f"must be a multiple of generate.prefill_chunk={chunk}, so snapshots fall on chunk ends")
    return PrefixSettings(
        enabled=sec.choice("enabled", ("auto", "on", "off")),
        bytes=sec.size("bytes") or 0,
        host_bytes=sec.size("host_bytes") or 0,
        every=every,
    )


def parse(job: dict) -> Settings:
    """Check every value a user can override; a bad one is an `error:` line naming the key."""
    groups = ("model", "dist", "memory", "cache", "generate", "decode", "kernels", "run", "serve", "prefix")
    model, dist, mem, cache, gen, dec, ker, run, serve, prefix = (_Section(job, g) for g in groups)
    fault = dict(job.get("fault") or {})
    known = {f.name for f in fields(Faults)}
    if set(fault) - known:
        raise K3Error(f"fault.{sorted(set(fault) - known)[0]} is not a fault (known: {sorted(known)})")
    for key in ("free", "free_drop"):
        if fault.get(key) is not None:
            fault[key] = parse_bytes(fault[key], f"fault.{key}")
    return Settings(
        model=_model(model),
        dist=DistSettings(
            nproc=dist.integer("nproc", 1),
            world_size=dist.integer("world_size", 1, optional=True),
            timeout_s=dist.number("timeout_s", 1.0),
            collective_timeout_s=dist.number("collective_timeout_s", 1.0),
            backend=dist.choice("backend", ("auto", "gloo", "nccl")),
            device=dist.choice("device", ("auto", "cpu", "cuda")),
            check_tokens=dist.flag("check_tokens"),
        ),
        memory=MemorySettings(
            reserve=mem.size("reserve"),
            free=mem.size("free"),
            drop_page_cache=mem.choice("drop_page_cache", ("auto", "on", "off")),
        ),
        cache=CacheSettings(cap=cache.integer("cap", 1)),
        generate=GenerateSettings(
            prompt=_prompt(gen),
            prompt_len=gen.integer("prompt_len", 1, optional=True),
            prompts=gen.text("prompts"),
            outputs=gen.text("outputs"),
            chat=gen.flag("chat"),
            system=gen.text("system"),
            batch=gen.integer("batch", 1),
            max_new_tokens=gen.integer("max_new_tokens", 0),
            stop=_stop(gen),
            temperature=gen.number("temperature"),
            top_p=gen.number("top_p", 0.0, 1.0, open_low=True),  # as a request's own top_p (text/prompt_file.py)
            top_k=gen.integer("top_k"),
            seed=gen.integer("seed"),
            stream=gen.choice("stream", ("auto", "on", "off")),
            prefill_chunk=gen.integer("prefill_chunk", 1),
        ),
        decode=DecodeSettings(
            compile=dec.choice("compile", ("auto", "on", "off")),
            sync_every=dec.integer("sync_every", 1, optional=True)
            or (SYNC_SERVE if run.values.get("mode") == "serve" else SYNC_BATCH),
        ),
        kernels=KernelSettings(backend=ker.choice("backend", ("auto", "torch", "cpu", "triton"))),
        run=RunSettings(mode=run.choice("mode", MODES), plan_for=run.choice("plan_for", PLANNED)),
        serve=_serve(serve),
        prefix=_prefix(prefix, gen.values.get("prefill_chunk")),
        out=job.get("out"),
        fault=Faults(**fault),
    )
