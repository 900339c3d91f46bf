"""Typed job settings from the composed Hydra config: one dataclass per config group, the config's own key names.

Each field declares its key once (checks.key): its default (conf/<group>/*.yaml says the same), its check and its
meaning (README's configuration table says the same); tests/unit/test_settings.py keeps the three in agreement.
The job crosses process boundaries as a plain dict (spawned ranks); `parse` checks every value a user can override,
turns a bad one into one `error:` line naming the key, and resolves the null defaults that depend only on settings.
"""

import importlib.util
import os
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path

import torch

from .base.dtypes import COMPUTE, compute_dtype
from .base.errors import K3Error
from .base.fault_injection import Faults
from .base.units import parse_bytes
from .checks import Choice, Flag, Int, Number, OrNull, Size, Text, key, read_group

CONFIGS = Path(__file__).parent / "configs"
MODES = ("generate", "load", "plan", "serve")
PLANNED = ("generate", "serve", "load")  # the runs run.mode=plan can plan for
# decode.sync_every when null: a server looks at the tokens after every step, so each token is streamed as it comes;
# an offline run looks less often, as each look waits for the device (docs/serving.md has the trade measured)
SYNC_SERVE, SYNC_BATCH = 1, 8
SNAPSHOT_CHUNKS = 4  # prefix.every when null, in prefill chunks


def _config_file(value, job) -> Path:
    """A config.json by name in k3dist/configs/ or by path; it must exist only when model.path is null."""
    config_file = Path(str(value or ""))
    if (job.get("model") or {}).get("path") is None:
        if not config_file.is_absolute():
            config_file = CONFIGS / config_file
        if not config_file.is_file():
            raise ValueError(f"names no config ({config_file})")
    return config_file


def _prompt(value, job) -> str | list[int] | None:
    if value is None or (isinstance(value, str) and value):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if min(value) >= 0:
            return list(value)
    raise ValueError("must be text or a non-empty list of token ids")


def _stop(value, job) -> tuple[str, ...]:
    if value is None:
        return ()
    stop = [value] if isinstance(value, str) else value
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError("must be a string or a list of non-empty strings")
    return tuple(stop)


def _host(value, job) -> str:
    if not Text()(value):
        raise ValueError("must be an address to listen on, such as 127.0.0.1 or 0.0.0.0")
    return value


def _port(value, job) -> int:
    if Int(0)(value) > 65535:
        raise ValueError("must be a TCP port (0-65535; 0 picks a free one)")
    return value


def _every(value, job) -> int | None:
    every, chunk = OrNull(Int(1))(value), (job.get("generate") or {}).get("prefill_chunk")
    if every is not None and isinstance(chunk, int) and chunk > 0 and every % chunk:
        raise ValueError(f"must be a multiple of generate.prefill_chunk={chunk}, so snapshots fall on chunk ends")
    return every


def _kv_events(value, job) -> str | None:
    """A ZMQ endpoint, with prefix reuse on and the events extra there (serve/kv_events.py publishes on it)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://")):
        raise ValueError(
            "must be null or a ZMQ endpoint: tcp://*:5557 (bound), tcp://HOST:PORT (connected), ipc://PATH"
        )
    if (job.get("prefix") or {}).get("enabled") in ("off", False):
        raise ValueError("publishes prefix snapshots, and prefix.enabled is off")
    missing = [m for m in ("zmq", "msgspec") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"needs the events extra (pip install 'k3dist[events]'): no {', '.join(missing)}")
    return value


ON_OFF = Choice("auto", "on", "off")


@dataclass(frozen=True)
class ModelSettings:
    name: str = key(
        "twin_0_40b", Text(), "the `model=` option: `twin_0_40b`, `kimi_linear_48b` or `kimi_k3` (conf/model/)"
    )
    config_file: Path = key(
        CONFIGS / "Kimi-K3-0.40B-config.json",
        _config_file,
        "the model's config.json when `model.path` is null (the twin's, or a what-if's); names are in k3dist/configs/",
    )
    path: str | None = key(
        None,
        Text(cast=True),
        "HF checkpoint dir (config.json, *.safetensors, optional index, tokenizer files); null: the twin, written "
        "once to `$K3DIST_CACHE` from its seed",
    )
    dtype: str = key(
        "auto", Choice("auto", *COMPUTE), "compute dtype: `auto` (the checkpoint's), `bfloat16`, `float16`, `float32`"
    )
    seed: int = key(0, Int(0), "seed of the twin's random weights")
    router_weights: str = key(
        "unbiased",
        Choice("unbiased", "biased"),
        "`unbiased` (vLLM, transformers 5.x) or `biased` (original HF remote code)",
    )
    quant: str = key(
        "none",
        Choice("none", "int8"),
        "`int8`: weight-only int8 projections and LM head, per-output-channel scales, bf16 activations, made at "
        "bind time (weights/quant_plan.py, docs/model.md)",
    )

    def compute_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        return compute_dtype(checkpoint_dtype if self.dtype == "auto" else self.dtype).torch


@dataclass(frozen=True)
class DistSettings:
    nproc: int = key(1, Int(1), "ranks launch.py starts on this machine when not under torchrun")
    world_size: int | None = key(
        None, OrNull(Int(1)), "`run.mode=plan`: the world to plan for, in one process (null: the running world)"
    )
    timeout_s: float = key(
        120.0, Number(1.0), "how long a rank waits on its peers in an agreement before it names the missing ranks"
    )
    collective_timeout_s: float = key(
        600.0, Number(1.0), "how long a prefill or decode collective may wait (a first compile or capture can be slow)"
    )
    backend: str = key("auto", Choice("auto", "gloo", "nccl"), "`auto` (nccl on CUDA, gloo on CPU), `gloo`, `nccl`")
    device: str = key(
        "auto",
        Choice("auto", "cpu", "cuda"),
        "`auto`, `cpu`, `cuda` (one rank per GPU: `cuda:LOCAL_RANK`, or `cuda:0` when one is visible)",
    )
    check_tokens: bool = key(
        False, Flag(), "debug: after every window the ranks compare their generated ids; a mismatch ends the run"
    )


@dataclass(frozen=True)
class MemorySettings:
    reserve: int | None = key(
        None,
        Size(),
        "headroom per rank (`512MiB`, `2GiB`); null: the device's, resolved by the run plan (run/plan.py): 64 MiB "
        "on CPU, 2 GiB + 3% of the device on CUDA",
    )
    free: int | None = key(None, Size(), "override the detected free memory per rank (what-if planning)")
    drop_page_cache: str = key(
        "auto",
        ON_OFF,
        "`auto`: drop a file's cached pages once every rank of the machine has read it (CUDA only); `on`; `off`",
    )


@dataclass(frozen=True)
class CacheSettings:
    """The resident hybrid cache; only the MLA latent grows with `cap` (KDA state is fixed-size)."""

    cap: int = key(4096, Int(1), "MLA latent cache capacity, tokens per sequence (preallocated)")


@dataclass(frozen=True)
class GenerateSettings:
    prompt: str | list[int] | None = key(
        "Tell me about the lighthouse at the end of the pier.",
        _prompt,
        "text or token ids for every slot; null: 16 seeded random ids",
    )
    prompt_len: int | None = key(None, OrNull(Int(1)), "N: N seeded random ids instead of `prompt` (benchmarks)")
    prompts: str | None = key(
        None, Text(), "a JSONL file of requests, one a line: `prompt`, `messages` or `ids`, and sampling fields"
    )
    outputs: str | None = key(None, Text(), "where outputs.jsonl goes (null: next to result.json)")
    chat: bool = key(False, Flag(), "render the checkpoint's chat template around the prompt")
    system: str | None = key(None, Text(), "the system message of a `chat` prompt")
    batch: int = key(1, Int(1), "slots decoded together")
    max_new_tokens: int = key(32, Int(0), "token budget per request")
    stop: tuple[str, ...] = key(
        (), _stop, "a string or a list of strings that end a sequence (cut from the text); eos ids are the checkpoint's"
    )
    temperature: float = key(0.0, Number(), "0: greedy")
    top_p: float = key(
        1.0,
        Number(0.0, 1.0, open_low=True),
        "nucleus cut: sample among the likeliest tokens up to this probability mass (1.0: no cut)",
    )
    top_k: int = key(0, Int(0), "0: no top-k cut")
    seed: int = key(
        0, Int(0), "sampling seed: slot i (or request i of a file) draws with seed + i, alike on every rank"
    )
    stream: str = key("auto", ON_OFF, "print text as it comes: `auto` (when stdout is a terminal), `on`, `off`")
    prefill_chunk: int = key(
        512,
        Int(1),
        "prompt tokens per prefill forward, and per window: a longer prompt is prefilled over several windows, "
        "between the decode steps of the running requests",
    )


@dataclass(frozen=True)
class DecodeSettings:
    compile: str = key(
        "auto", ON_OFF, "`auto`: CUDA graph on CUDA, eager on CPU; `on`: CUDA graph / `torch.compile`; `off`"
    )
    sync_every: int = key(
        None,
        OrNull(Int(1)),
        "decode steps between the host's looks at the tokens (stops, refills, streams); null, resolved by parse: "
        "1 for `run.mode=serve` (each token streamed as it comes), 8 otherwise",
    )


@dataclass(frozen=True)
class KernelSettings:
    backend: str = key(
        "auto",
        Choice("auto", "torch", "cpu", "triton"),
        "`auto` (Triton on CUDA when it imports; the C++ CPU ops on a CPU when they build; else torch), `torch`, "
        "`cpu`, `triton`",
    )


@dataclass(frozen=True)
class RunSettings:
    """What the job does: generate, stop after the weights (load), or only plan every rank (plan)."""

    mode: str = key(
        "generate",
        Choice(*MODES),
        "`generate`, `load` (stop after the weights), `plan` (inventory, plan and verdict, no upload), `serve` (HTTP)",
    )
    plan_for: str = key(
        "generate",
        Choice(*PLANNED),
        "`run.mode=plan`: the run it plans (`generate`, `serve` or `load`); every rank's `admitted` and terms are "
        "that run's own",
    )

    @property
    def runs(self) -> str:
        """The run these settings start, or, under `run.mode=plan`, the one they plan: what every default that
        depends on the run (sync_every here, the run plan's decisions) is resolved for."""
        return self.plan_for if self.mode == "plan" else self.mode


@dataclass(frozen=True)
class ServeSettings:
    """run.mode=serve: the HTTP front on rank 0 (k3dist/serve/, docs/serving.md)."""

    host: str = key("127.0.0.1", _host, "address to listen on (`0.0.0.0`: every interface)")
    port: int = key(8000, _port, "TCP port; 0 picks a free one (the ready line names it)")
    api_key: str | None = key(
        None,
        Text(),
        "when set, every /v1 route wants `Authorization: Bearer <key>`; null, resolved by parse: `K3DIST_API_KEY` "
        "from the environment, else no key",
    )
    model_name: str | None = key(
        None, Text(), "the name /v1/models lists and requests must use; null: the checkpoint dir's name"
    )
    max_waiting: int = key(256, Int(0), "requests queued beyond the slots; more get 503 with Retry-After")
    max_body: int = key(4 * 2**20, Size(null=0), "largest request body; more gets 413")
    drain_s: float = key(10.0, Number(), "on SIGTERM / Ctrl-C: how long in-flight requests may still run")
    unknown_fields: str = key(
        "refuse",
        Choice("refuse", "ignore"),
        "a request field no route declares: `refuse` (a 400 naming it, as OpenAI's API), `ignore` (dropped, its name "
        "logged once: a gateway that adds fields of its own)",
    )
    store_responses: int = key(
        1024,
        Int(0),
        "the Responses API's stored responses (`store`, `previous_response_id`) kept on rank 0, the oldest evicted "
        "first; 0: none is (`store: true` is refused)",
    )
    store_bytes: int = key(
        64 * 2**20,
        Size(null=0),
        "the bytes stored responses may hold (each its JSON and 512 bytes), the oldest evicted first; counted in rank "
        "0's memory plan (runtime `stored`)",
    )
    kv_events: str | None = key(
        None,
        _kv_events,
        "a ZMQ endpoint where rank 0 publishes KV-cache events in vLLM's schema, blocks of `prefix.every` tokens "
        "(docs/serving.md); null: none",
    )


@dataclass(frozen=True)
class PrefixSettings:
    """Exact prefix reuse (engine/prefix.py, docs/prefix.md): snapshots of one sequence's hybrid state, keyed by its
    token ids."""

    enabled: str = key(
        "auto", ON_OFF, "docs/prefix.md: `auto` (on for `run.mode=serve` and `generate.prompts` files), `on`, `off`"
    )
    bytes: int = key(2**30, Size(null=0), "the device pool of snapshots, LRU by bytes (in the plan as `prefix_bytes`)")
    host_bytes: int = key(
        0, Size(null=0), "snapshots evicted from the pool are kept in (pinned) host memory up to this"
    )
    every: int = key(
        None,
        _every,
        "prompt tokens between snapshots of a long prompt, a multiple of `generate.prefill_chunk`; null, resolved by "
        "parse: 4 prefill chunks (snapshots are also taken where prompts branch)",
    )

    def on(self, mode: str, prompts_file: bool) -> bool:
        return self.enabled == "on" or (self.enabled == "auto" and (mode == "serve" or prompts_file))


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
    out: str | None  # result.json's path (launch.py fills in the run dir's)
    fault: Faults  # tests only (base/fault_injection.py)


GROUPS = {f.name: f.type for f in fields(Settings) if is_dataclass(f.type) and f.type is not Faults}


def parse(job: dict) -> Settings:
    """Check every value a user can override (a bad one is an `error:` line naming the key), then resolve the null
    defaults that depend only on settings."""
    groups = {name: read_group(cls, job, name) for name, cls in GROUPS.items()}
    return _resolved(Settings(**groups, out=job.get("out"), fault=_faults(job.get("fault"))))


def _resolved(s: Settings) -> Settings:
    """Null defaults resolved once, here; memory.reserve depends on the device and the run plan resolves it."""
    sync = s.decode.sync_every or (SYNC_SERVE if s.run.runs == "serve" else SYNC_BATCH)
    every = s.prefix.every or SNAPSHOT_CHUNKS * s.generate.prefill_chunk
    api_key = s.serve.api_key or os.environ.get("K3DIST_API_KEY") or None
    return replace(
        s,
        decode=replace(s.decode, sync_every=sync),
        prefix=replace(s.prefix, every=every),
        serve=replace(s.serve, api_key=api_key, model_name=s.serve.model_name or None),
    )


def _faults(values: dict | None) -> Faults:
    """fault.* (tests only): known faults only; free and free_drop are byte sizes."""
    fault = dict(values or {})
    known = {f.name for f in fields(Faults)}
    if set(fault) - known:
        raise K3Error(f"fault.{sorted(set(fault) - known)[0]} is not a fault (known: {sorted(known)})")
    for name in ("free", "free_drop"):
        if fault.get(name) is not None:
            fault[name] = parse_bytes(fault[name], f"fault.{name}")
    return Faults(**fault)
