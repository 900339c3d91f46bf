"""After the load, on every rank: `bind` the model to its cache and build the runner every rank runs (model/build.py,
engine/build.py), then one entry per front: `offline` (rank 0 of an offline run: prompts in, result.json's fields
out), `server` (rank 0 of a server) and `follower` (every other rank: rank 0's window records until the shutdown
one). Every decision comes from the run plan (run/plan.py); none is made here."""

import gc
import os
import sys
import threading
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ..base import dist, signals, store
from ..base.failures import after_load, end_with_peer_failure
from ..config import ModelConfig
from ..engine.build import build_engine, build_runner
from ..engine.control import Channel
from ..engine.engine import follow
from ..engine.runner import Runner
from ..model.build import build_model
from ..model.cache import HybridCache
from ..model.tp import TPComm
from ..offline.output import Output
from ..offline.prompts import TextTools
from ..offline.run import run_offline
from ..serve.server import Sockets
from ..settings import Settings
from ..weights.memory import start_peak_window, window_peak
from .plan import RunPlan


@dataclass(frozen=True, kw_only=True)
class FrontInputs:
    """What rank 0's front took before the load (each an agreed stage of run/job.py): the checkpoint's tokenizer and
    template, the offline prompts, the server's sockets; `model_dir`: the checkpoint's; `admitted`: every rank's
    planned bytes (a server watches its ranks against them)."""

    model_dir: Path
    text: TextTools | None = None
    prompts: list = field(default_factory=list)
    sockets: Sockets | None = None
    admitted: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Bound:
    """What every rank holds once its model is bound and its step warmed up."""

    runner: Runner
    channel: Channel
    held: int  # bytes held before generation: its peak is measured above them
    facts: dict  # result.json's fields about the binding


def bind(s: Settings, rt: dist.Runtime, cfg: ModelConfig, weights, plan: RunPlan) -> Bound:
    """The model over this rank's weights and its cache, the runner, the warm-up; then the cyclic GC frozen."""
    cache = HybridCache(cfg, rt.world, s.generate.batch, s.cache.cap, plan.dtype, rt.device)
    comm = TPComm(rt.world, rt.rank, cfg.vocab_size)
    model = build_model(
        cfg,
        weights,
        comm,
        cache,
        plan.kernels,
        router_weights=s.model.router_weights,
        pack=plan.pack,
        widen=plan.widen,
        dense=plan.dense,
        quant=s.model.quant,
    )
    runner, channel = build_runner(plan, s, rt, model, cache)
    # rank 0 of a server keeps failing its requests itself when a collective fails; every other rank ends at once
    store.abort_on_peer_failure(rt, None if plan.serving and rt.is_main else end_with_peer_failure)
    held = start_peak_window(rt.device)
    step = runner.decode_step
    after_load("warm-up", rt, step.warm_up)
    # what exists now (config, tokenizer tables, model objects) lives for the whole run: frozen, the cyclic GC stops
    # walking it in the middle of decode windows (a collection there stalls every stream)
    gc.collect()
    gc.freeze()
    facts = {"warmup_seconds": step.warmup_seconds, "kernels": model.kernels.name, "decode_compile": step.kind}
    facts |= {"packed_weights": plan.pack, "quant": s.model.quant}
    return Bound(runner=runner, channel=channel, held=held, facts=facts)


def run_front(s: Settings, rt: dist.Runtime, cfg: ModelConfig, weights, plan: RunPlan, inputs: FrontInputs) -> dict:
    """This rank's front after the load; returns result.json's fields from it (the server's and a follower's of a
    server: none, they end the process)."""
    bound = bind(s, rt, cfg, weights, plan)
    if not rt.is_main:
        return follower(s, rt, plan, bound)
    if plan.serving:
        return server(s, rt, cfg, plan, bound, inputs)
    return offline(s, rt, cfg, plan, bound, inputs)


def _measured(rt: dist.Runtime, bound: Bound) -> dict:
    peak = window_peak(rt.device) - bound.held
    return {"runtime_measured": {"held_before_generate": bound.held, "runtime_peak_bytes": peak}}


def follower(s: Settings, rt: dist.Runtime, plan: RunPlan, bound: Bound) -> dict:
    """Every rank but 0: run rank 0's windows until its shutdown record. A server's follower ends the process here
    with the server's code when a signal ended it (rank 0 printed the line)."""
    if plan.serving:
        dist.exchange({"pid": os.getpid()}, rt)  # the ready line names every rank's process
        signals.defer(partial(_drain_from_follower, s.serve.drain_s + 10))  # rank 0 drains, which ends this rank too
    code = after_load(lambda: bound.runner.stage, rt, lambda: follow(bound.runner, bound.channel))
    if code:  # the server ended for a signal: rank 0 printed the line and exits with the same code
        sys.stdout.flush()
        os._exit(code)
    return bound.facts | _measured(rt, bound)


def _drain_from_follower(limit_s: float, signum: int) -> None:
    """A follower's signal: rank 0 drains the server as if it had the signal too (it may not have); if its stop
    never comes, this rank ends itself `limit_s` later."""
    store.ask_drain(signum)
    threading.Timer(limit_s, signals.end, (signum,)).start()


def server(s: Settings, rt: dist.Runtime, cfg: ModelConfig, plan: RunPlan, bound: Bound, inputs: FrontInputs) -> dict:
    """Rank 0 of a server: serve until a signal's drain ends the process (serve/server.py)."""
    from ..serve.server import serve

    pids = [r["pid"] for r in dist.exchange({"pid": os.getpid()}, rt)]
    tokenizer = inputs.text.tokenizer
    engine = build_engine(plan, s, cfg, bound.runner, bound.channel, tokenizer=tokenizer, admitted=inputs.admitted)
    sock, model_dir = inputs.sockets, inputs.model_dir
    return bound.facts | serve(s, rt, engine, text=inputs.text, cfg=cfg, sock=sock, model_dir=model_dir, pids=pids)


def offline(s: Settings, rt: dist.Runtime, cfg: ModelConfig, plan: RunPlan, bound: Bound, inputs: FrontInputs) -> dict:
    """Rank 0 of an offline run: every prompt through the engine, its outputs written; result.json's fields."""
    prompts, tokenizer = inputs.prompts, inputs.text.tokenizer if inputs.text else None
    engine = build_engine(plan, s, cfg, bound.runner, bound.channel, tokenizer=tokenizer, admitted=[])
    out = Output(s, rt, prompts)
    completions = after_load(lambda: bound.runner.stage, rt, lambda: run_offline(engine, prompts, out.on_event))
    measured = _measured(rt, bound)
    out.close(completions)
    t = engine.timings
    return (
        bound.facts
        | {
            "prompt": [list(p.ids) for p in prompts],
            "tokens": [c.tokens for c in completions],
            "text": [c.text for c in completions],
            "finish_reason": [c.finish_reason for c in completions],
            "top_logits": [c.top_logits for c in completions],
            "prefill_seconds": t.prefill_seconds,
            "decode_tokens_per_second": t.decode_tokens_per_second,
            "step_ms": t.step_ms(),
            "prefix": engine.prefix.report() if engine.prefix else None,
        }
        | measured
        | out.paths()
    )
