"""One rank's job: config -> topology -> inventory -> plan/preflight/agree -> upload -> bind -> generate.

`run_rank` is what every rank runs, whoever started it (launch.py in-process, its spawned ranks, torchrun).
"""

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from . import dist
from .cache import DeviceHybridCache
from .config import ModelConfig, load_config, validate_topology
from .engine import Sampler, generate
from .errors import K3Error
from .model.tp import TPComm
from .model.transformer import K3Model
from .settings import Settings, parse
from .summary import print_summary
from .weights.inventory import inside, scan
from .weights.loader import load_weights
from .weights.memory import cache_bytes, detect_free, peak_bytes
from .weights.schema import expected_tensors
from .weights.twin import ensure_twin
from .weights.whatif import plan_world

log = logging.getLogger("k3dist")


def setup_logging(rank: int) -> None:
    """Rank 0 logs events at INFO; other ranks stay quiet unless something goes wrong."""
    logger = logging.getLogger("k3dist")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


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


def model_config(s: Settings) -> ModelConfig:
    if s.model_path is None:
        return load_config(s.config_file)
    model_dir = Path(s.model_path)
    if not model_dir.is_dir():
        raise K3Error(f"model.path={s.model_path}: not a directory")
    inside(model_dir, "config.json", "model.path")
    return load_config(model_dir / "config.json")


def prompts(s: Settings, cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    if s.prompt is not None:
        bad = [t for t in s.prompt if t >= cfg.vocab_size]
        if bad:
            raise K3Error(f"generate.prompt has token ids {bad[:5]} >= vocab_size={cfg.vocab_size}")
        return torch.tensor([s.prompt] * s.batch, device=device)
    gen = torch.Generator().manual_seed(s.seed)
    return torch.randint(0, cfg.vocab_size, (s.batch, s.prompt_len), generator=gen).to(device)


def run_rank(job: dict) -> dict | None:
    """Everything one rank does; returns the result on rank 0 (also written to result.json)."""
    s = parse(job)
    rt = dist.init(s.backend, s.device, s.timeout_s)
    setup_logging(rt.rank)
    if rt.device.type == "cpu":  # ranks sharing a host split its cores instead of oversubscribing them
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // rt.local_world))
    result = plan_only(s, rt) if s.mode == "plan" else load_and_generate(s, rt)
    if rt.is_main:
        result["peak_bytes"] = peak_bytes(rt.device)  # rank 0's peak (RSS on CPU, allocation on CUDA)
        write_result(result, s.out)
        print_summary(result)
    dist.shutdown()  # only on success: tearing down a group whose peer failed can block; exiting frees it all
    return result if rt.is_main else None


def plan_only(s: Settings, rt: dist.Runtime) -> dict:
    """run.mode=plan: every rank of `dist.world_size` planned here, from the checkpoint headers or the config."""
    cfg = model_config(s)
    world = s.plan_world or rt.world
    validate_topology(cfg, world)
    inv = scan(s.model_path, cfg) if s.model_path else None
    dtype = s.compute_dtype(cfg.dtype)
    free = s.free if s.free is not None else detect_free(rt.device, rt.local_world)
    plans = plan_world(cfg, inv, world, dtype, cache_bytes(cfg, s.batch, s.cap, world, dtype), s.reserve, free)
    refused = [p.refusal() for p in plans if not p.fits]
    shapes = [e.shape for e in inv.entries.values()] if inv else list(expected_tensors(cfg).values())
    return base_result(s, rt, cfg, world) | {
        "mode": "plan",
        "plan": [p.as_dict() for p in plans],
        "verdict": "refused" if refused else "admitted",
        "refusals": refused,
        "params": sum(math.prod(shape) for shape in shapes),
        "tensors": len(shapes),
    }


def base_result(s: Settings, rt: dist.Runtime, cfg: ModelConfig, world: int) -> dict:
    return {
        "world_size": world,
        "backend": rt.backend,
        "device": rt.device.type,
        "dtype": str(s.compute_dtype(cfg.dtype)).removeprefix("torch."),
    }


def load_and_generate(s: Settings, rt: dist.Runtime) -> dict:
    cfg = staged("config", rt, lambda: model_config(s))
    staged("topology", rt, lambda: validate_topology(cfg, rt.world))
    dtype = s.compute_dtype(cfg.dtype)
    tokens = prompts(s, cfg, rt.device)
    if s.mode == "generate" and tokens.shape[1] + s.max_new_tokens > s.cap:
        raise K3Error(
            f"prompt of {tokens.shape[1]} tokens + generate.max_new_tokens={s.max_new_tokens} exceeds "
            f"cache.cap={s.cap} (raise cache.cap to at least {tokens.shape[1] + s.max_new_tokens})"
        )
    model_dir = s.model_path or str(ensure_twin(s.config_file, s.twin_seed, cfg.dtype))
    inv = staged("inventory", rt, lambda: scan(model_dir, cfg))
    cache = cache_bytes(cfg, s.batch, s.cap, rt.world, dtype)
    store = load_weights(inv, rt, dtype, cache, s.reserve, s.free, s.faults)
    result = base_result(s, rt, cfg, rt.world) | {
        "mode": s.mode,
        "model_dir": str(model_dir),
        "plan": store.all_memory,
        "load_seconds": store.load_seconds,
    }
    if s.mode == "load":
        return result
    model = K3Model(cfg, store.tensors, TPComm(rt.world, rt.rank, cfg.vocab_size), s.router_weights)
    kv = DeviceHybridCache(cfg, rt.world, s.batch, s.cap, dtype, rt.device)
    sampler = Sampler(s.temperature, s.top_p, s.seed, rt.device)
    gen = generate(model, kv, tokens, s.max_new_tokens, sampler, cfg.eos_token_id)
    return result | {
        "prompt": tokens.tolist(),
        "tokens": gen.tokens,
        "top_logits": gen.top_logits,
        "prefill_seconds": gen.prefill_seconds,
        "decode_tokens_per_second": gen.decode_tokens_per_second,
        "step_ms": gen.step_ms(),
    }


def write_result(result: dict, out: str | None) -> None:
    path = Path(out or "result.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def exit_with_error(exc: K3Error) -> NoReturn:
    """Print the one `error:` line and exit 1; after an agreed failure, wait (bounded) until every rank printed.

    `os._exit` skips interpreter teardown: destroying process groups whose peers may be gone can block or abort.
    """
    ErrorHandler().record_exception(exc)  # torch elastic's error file: torchrun's root cause, a sweep's record
    sys.stderr.flush()
    os.write(2, (exc.line + "\n").encode())  # one write: ranks sharing a terminal never interleave lines
    rt = dist.current()
    if exc.agreed and rt is not None and rt.world > 1:
        dist.settle(rt)
    sys.stdout.flush()
    os._exit(1)


@record
def rank_entry(job: dict) -> None:
    """Entry point of a rank spawned by launch.py."""
    try:
        run_rank(job)
    except K3Error as exc:
        exit_with_error(exc)
