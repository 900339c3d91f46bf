"""After the load, on every rank: bind the model to its cache, build the step, the runner and the engine, then run the
offline front (prompts in, result.json out) or the server. Rank 0 drives the engine; every other rank follows its
window records until the shutdown one."""

import gc
import os
import sys
import threading
from functools import partial

from ..base import dist, signals
from ..base.failures import after_load, end_with_peer_failure
from ..config import ModelConfig
from ..engine.control import Channel
from ..engine.decode_step import TOP, WIDEST, DecodeStep
from ..engine.engine import Engine, follow
from ..engine.prefix import PrefixIndex
from ..engine.runner import Runner
from ..engine.snapshots import SnapshotStore, snapshot_bytes
from ..engine.watch import MemoryWatch
from ..kernels.backend import select
from ..model.build import build_model
from ..model.cache import HybridCache, cache_shapes
from ..model.tp import TPComm
from ..offline.output import Output
from ..offline.run import run_offline
from ..settings import Settings
from ..weights.memory import start_peak_window, window_peak
from .plan import RunPlan


def eos_ids(cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    return tokenizer.eos_ids if tokenizer else tuple(t for t in (cfg.eos_token_id,) if t is not None)


def text_assembler(tokenizer):
    """Prompt -> its TextAssembler (stop strings, streaming-safe text), or None without a tokenizer."""
    if tokenizer is None:
        return None
    from ..text.stream import TextAssembler

    def assembler(prompt):
        special = tokenizer.marked_special
        skip = (*tokenizer.eos_ids, *special) if prompt.skip_special else tokenizer.eos_ids
        return TextAssembler(tokenizer, prompt.stop, skip, special if prompt.spaced_special else ())

    return assembler


def prefix_index(s: Settings, cfg: ModelConfig, world: int, dtype) -> PrefixIndex:
    """Rank 0's index of snapshots, sized by what one snapshot of L tokens takes on a rank."""
    shapes = cache_shapes(cfg, world, 1, 1, dtype)
    vocab = -(-cfg.vocab_size // world)
    host = s.prefix.host_bytes
    return PrefixIndex(s.prefix.bytes, host, s.prefix.every, lambda n: snapshot_bytes(shapes, n, vocab, dtype.itemsize))


def _drain_from_follower(limit_s: float, signum: int) -> None:
    """A follower's signal: rank 0 drains the server as if it had the signal too (it may not have); if its stop
    never comes, this rank ends itself `limit_s` later."""
    dist.ask_drain(signum)
    threading.Timer(limit_s, signals.end, (signum,)).start()


def generate(
    s: Settings,
    rt: dist.Runtime,
    cfg,
    weights,
    plan: RunPlan,
    *,
    text,
    prompts,
    listener,
    model_dir,
    admitted: list[int],
):
    """`plan`: the decisions made before the load (run/plan.py); `text`, `prompts`: rank 0's (the tokenizer; the
    offline requests); `listener`: the server's socket; `admitted`: every rank's plan (a server watches its ranks
    against it)."""
    dtype, reuse = plan.dtype, plan.reuse
    cache = HybridCache(cfg, rt.world, s.generate.batch, s.cache.cap, dtype, rt.device)
    comm = TPComm(rt.world, rt.rank, cfg.vocab_size)
    kernels = select(s.kernels.backend, rt.device)
    model = build_model(
        cfg,
        weights,
        comm,
        cache,
        kernels,
        router_weights=s.model.router_weights,
        pack=plan.pack,
        widen=plan.widen,
        dense=plan.dense,
        quant=s.model.quant,
    )
    step = DecodeStep(model, cache, plan.modes, plan.kind, width=WIDEST if plan.serving else TOP)
    runner = Runner(step, s.generate.prefill_chunk, s.fault, rt.rank, SnapshotStore(cache) if reuse else None)
    channel = Channel(rt, s.dist.check_tokens)
    # rank 0 of a server keeps failing its requests itself when a collective fails; every other rank ends at once
    dist.abort_on_peer_failure(rt, None if s.run.mode == "serve" and rt.is_main else end_with_peer_failure)
    held = start_peak_window(rt.device)
    after_load("warm-up", rt, step.warm_up)
    # what exists now (config, tokenizer tables, model objects) lives for the whole run: frozen, the cyclic GC stops
    # walking it in the middle of decode windows (a collection there stalls every stream)
    gc.collect()
    gc.freeze()
    facts = {"warmup_seconds": step.warmup_seconds, "kernels": model.kernels.name, "decode_compile": step.kind}
    facts |= {"packed_weights": plan.pack, "quant": s.model.quant}
    pids = [r["pid"] for r in dist.exchange({"pid": os.getpid()}, rt)] if s.run.mode == "serve" else None
    if not rt.is_main:
        if s.run.mode == "serve":  # a signal here has rank 0 drain the server, which ends this rank too
            signals.defer(partial(_drain_from_follower, s.serve.drain_s + 10))
        code = after_load(lambda: runner.stage, rt, lambda: follow(runner, channel))
        if code:  # the server ended for a signal: rank 0 printed the line and exits with the same code
            sys.stdout.flush()
            os._exit(code)
        peak = window_peak(rt.device) - held
        return facts | {"runtime_measured": {"held_before_generate": held, "runtime_peak_bytes": peak}}
    tokenizer = text.tokenizer if text else None
    prefix = prefix_index(s, cfg, rt.world, dtype) if reuse else None
    watch = MemoryWatch(admitted) if s.run.mode == "serve" else None
    engine = Engine(
        runner,
        channel,
        sync_every=s.decode.sync_every,
        eos_ids=eos_ids(cfg, tokenizer),
        make_assembler=text_assembler(tokenizer),
        prefix=prefix,
        watch=watch,
    )
    if s.run.mode == "serve":
        from ..serve.server import serve

        return facts | serve(s, rt, engine, text=text, cfg=cfg, sock=listener, model_dir=model_dir, pids=pids)
    out = Output(s, rt, prompts)
    completions = after_load(lambda: runner.stage, rt, lambda: run_offline(engine, prompts, out.on_event))
    runtime_peak = window_peak(rt.device) - held
    out.close(completions)
    t = engine.timings
    return (
        facts
        | {
            "prompt": [list(p.ids) for p in prompts],
            "tokens": [c.tokens for c in completions],
            "text": [c.text for c in completions],
            "finish_reason": [c.finish_reason for c in completions],
            "top_logits": [c.top_logits for c in completions],
            "prefill_seconds": t.prefill_seconds,
            "decode_tokens_per_second": t.decode_tokens_per_second,
            "step_ms": t.step_ms(),
            "prefix": prefix.report() if prefix else None,
            "runtime_measured": {"held_before_generate": held, "runtime_peak_bytes": runtime_peak},
        }
        | out.paths()
    )
