"""One rank's job: settings -> process group -> config -> prompts -> inventory -> plan/agree -> upload -> model ->
front (run/fronts.py) -> result.json.

`run_rank` is what every rank runs, whoever started it (launch.py in-process, its spawned ranks, torchrun). Every
stage that can fail on one rank before the upload ends in an agreement (`staged`); a failure after the load (prefill,
decode) is published to the peers, which may be waiting inside a collective (`after_load`).
"""

import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from ..base import allocator, dist, signals, threads
from ..base.errors import K3Error
from ..base.failures import exit_with_error, staged, unexpected
from ..base.outfiles import atomic_write
from ..base.paths import inside
from ..config import ModelConfig, load_config, validate_topology
from ..memory.traffic import tp_traffic
from ..offline.output import check_targets
from ..offline.prompts import TextTools, build_prompts
from ..offline.summary import print_summary
from ..serve.server import listen
from ..settings import Settings, parse
from ..twin.checkpoint import ensure_twin
from ..weights.inventory import scan
from ..weights.loader import load_weights
from ..weights.memory import detect_free, mark_base, peak_bytes
from ..weights.schema import parameter_count
from ..weights.whatif import plan_all_ranks
from .fronts import FrontInputs, run_front
from .plan import RunPlan, plan_run

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


def model_config(s: Settings) -> ModelConfig:
    if s.model.path is None:
        return load_config(s.model.config_file)
    model_dir = Path(s.model.path)
    if not model_dir.is_dir():
        why = "not a directory" if model_dir.exists() else "does not exist"
        raise K3Error(f"model.path={s.model.path}: {why}")
    inside(model_dir, "config.json", "model.path")
    return load_config(model_dir / "config.json")


def run_rank(job: dict) -> dict | None:
    """Everything one rank does; returns the result on rank 0 (also written to result.json)."""
    mark_base()  # the bare process, before anything of the run: what `admitted` does not count
    s = parse(job)
    rt = dist.init(s.dist.backend, s.dist.device, s.dist.timeout_s, s.dist.collective_timeout_s)
    setup_logging(rt.rank)
    staged("outputs", rt, lambda: check_targets(s) if rt.is_main else None)  # not after a whole generation
    if rt.device.type == "cpu":  # ranks sharing a host split its cores instead of oversubscribing them
        torch.set_num_threads(len(threads.pin_rank(rt.local_rank, rt.local_world)) or 1)
        allocator.limit_heap()
    result = plan_only(s, rt) if s.run.mode == "plan" else load_and_generate(s, rt)
    memory = dist.exchange(measured_memory(rt.device, result.pop("runtime_measured", None)), rt)
    if rt.is_main:
        result["peak_bytes"] = memory[0]["peak_bytes"]  # rank 0's peak (RSS on CPU, allocation on CUDA)
        result["memory"] = memory  # every rank's measured peaks, beside the plan's figures
        s.fault.after_load(rt.rank, "result")  # tests: a failure outside every agreed stage
        write_result(result, s.out)
        print_summary(result)
    dist.shutdown()  # only on success: tearing down a group whose peer failed can block; exiting frees it all
    return result if rt.is_main else None


def measured_memory(device: torch.device, runtime: dict | None) -> dict:
    """What this rank really used: its lifetime peak, and the peak of generation above what it held before."""
    out = {"peak_bytes": peak_bytes(device)}
    if device.type == "cuda":
        out["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
    return out | (runtime or {})


def plan_only(s: Settings, rt: dist.Runtime) -> dict:
    """run.mode=plan: every rank of `dist.world_size` planned here, from the checkpoint headers or the config, for the
    run `run.plan_for` names: the same run plan (run/plan.py) and so the same figures as that run's; with the
    tightest rank's headroom (negative: how far short) and what the TP group's collectives move per token."""
    started = time.perf_counter()
    cfg = model_config(s)
    world = s.dist.world_size or rt.world
    validate_topology(cfg, world)
    inv = scan(s.model.path, cfg) if s.model.path else None
    plan = plan_run(s, cfg, world, rt.device)
    free = s.memory.free if s.memory.free is not None else detect_free(rt.device, rt.local_world)
    plans = plan_all_ranks(cfg, inv, world, plan.dtype, free, plan.terms)
    refused = [p.refusal() for p in plans if not p.fits]
    tightest = min(plans, key=lambda p: p.free - p.admitted)
    return base_result(s, rt, cfg, world) | {
        "mode": "plan",
        "plan_for": plan.run,
        "plan": [p.as_dict() for p in plans],
        "runtime": plan.runtimes[0].as_dict(),
        "verdict": "refused" if refused else "admitted",
        "refusals": refused,
        "headroom": tightest.free - tightest.admitted,
        "tightest_rank": tightest.rank,
        "tp_traffic": tp_traffic(cfg, world, plan.dtype.itemsize).as_dict(),
        "params": parameter_count(cfg),  # the inventory holds the same shapes (scan checks each)
        "tensors": plans[0].tensors,  # every rank plans every tensor
        "plan_seconds": time.perf_counter() - started,
    }


def base_result(s: Settings, rt: dist.Runtime, cfg: ModelConfig, world: int) -> dict:
    return {
        "world_size": world,
        "backend": rt.backend,
        "device": rt.device.type,
        "dtype": str(s.model.compute_dtype(cfg.dtype)).removeprefix("torch."),
    }


def _text_tools(s: Settings, model_dir: Path) -> TextTools | None:
    """Tokenizer and template when the run involves text (text prompts, a prompts file, stops) or the dir has one."""
    g = s.generate
    files = ("tiktoken.model", "tokenizer.json")
    if (
        isinstance(g.prompt, str)
        or g.prompts is not None
        or g.stop
        or g.chat
        or any((model_dir / f).is_file() for f in files)
    ):
        return TextTools(model_dir, cap=s.cache.cap)
    return None


def serving_text(model_dir: Path, cap: int) -> TextTools:
    text = TextTools(model_dir, cap=cap)
    if text.tokenizer is None:
        raise K3Error(
            f"run.mode=serve needs the checkpoint's tokenizer, and {model_dir} has none (tiktoken.model or "
            "tokenizer.json)"
        )
    return text


def load_and_generate(s: Settings, rt: dist.Runtime) -> dict:
    cfg = staged("config", rt, lambda: model_config(s))
    staged("topology", rt, lambda: validate_topology(cfg, rt.world))
    model_dir = Path(s.model.path or ensure_twin(s.model.config_file, s.model.seed, cfg.dtype))
    plan = plan_run(s, cfg, rt.world, rt.device, ranks=(rt.rank,))  # every rank alike, before anything is loaded
    inputs = front_inputs(s, rt, cfg, plan, model_dir)
    inv = staged("inventory", rt, lambda: scan(model_dir, cfg))
    terms = plan.terms[rt.rank]
    store = load_weights(
        inv, rt, plan.dtype, terms, free=s.memory.free, faults=s.fault, drop_page_cache=s.memory.drop_page_cache
    )
    result = base_result(s, rt, cfg, rt.world) | {
        "mode": plan.run,
        "model_dir": str(model_dir),
        "plan": store.all_memory,
        "runtime": plan.runtimes[rt.rank].as_dict(),
        "load_seconds": store.load_seconds,
    }
    if plan.run == "load":
        return result
    inputs = replace(inputs, admitted=[p["admitted"] for p in store.all_memory])
    return result | run_front(s, rt, cfg, store.tensors, plan, inputs)


def front_inputs(s: Settings, rt: dist.Runtime, cfg: ModelConfig, plan: RunPlan, model_dir: Path) -> FrontInputs:
    """The stages of rank 0's front before the load: an offline run's tokenizer and prompts; a server's tokenizer and
    socket, on rank 0 only (a taken port is refused before the load)."""
    if plan.run == "generate":
        text = staged("tokenizer", rt, lambda: _text_tools(s, model_dir))
        prompts = staged("prompts", rt, lambda: build_prompts(s, cfg, text))
        return FrontInputs(model_dir=model_dir, text=text, prompts=prompts)
    if plan.serving:
        text = staged("tokenizer", rt, lambda: serving_text(model_dir, s.cache.cap) if rt.is_main else None)
        sockets = staged("serve", rt, lambda: listen(s.serve) if rt.is_main else None)
        return FrontInputs(model_dir=model_dir, text=text, sockets=sockets)
    return FrontInputs(model_dir=model_dir)


def write_result(result: dict, out: str | None) -> None:
    atomic_write(Path(out or "result.json"), json.dumps(result, indent=1))


@record
def rank_entry(job: dict) -> None:
    """Entry point of a rank spawned by launch.py (which prints the line if a signal ends the run)."""
    signals.as_rank(announce=False)
    run_or_exit(job)


def run_or_exit(job: dict) -> dict | None:
    """run_rank, ending the process with one `error:` line on any failure: a user error as it is, anything else
    (a bug, an I/O fault outside the agreed stages) named with its type, message and place."""
    try:
        return run_rank(job)
    except K3Error as exc:
        exit_with_error(exc)
    except Exception as exc:  # noqa: BLE001 - a rank never ends with a bare traceback or, spawned, in silence
        exit_with_error(unexpected(exc))
