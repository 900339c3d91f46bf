"""Drive k3dist's real pipeline on spawned ranks for tests: load a checkpoint, then prefill and decode."""

import torch
from safetensors.torch import save_file

from k3dist.base import dist
from k3dist.base.dtypes import BY_NAME
from k3dist.config import load_config, validate_topology
from k3dist.engine.decode_step import DecodeStep
from k3dist.engine.sampling import GREEDY, SamplingMode
from k3dist.kernels.backend import select
from k3dist.memory.terms import cache_nbytes
from k3dist.model.build import build_model, choices
from k3dist.model.cache import HybridCache, cache_shapes
from k3dist.model.linear import packable
from k3dist.model.tp import TPComm
from k3dist.weights.inventory import scan
from k3dist.weights.loader import load_weights
from k3dist.weights.memory import MemoryTerms


def bind(
    model_dir: str,
    dtype: str,
    batch: int,
    cap: int,
    router: str = "unbiased",
    backend: str = "auto",
    pack: bool = False,
):
    """Init the rank, load its shard of the checkpoint, bind the model to an empty cache. With `pack`, weights are
    packed where the job would pack them (bf16 on a CPU with oneDNN bf16), dense experts included."""
    rt = dist.init("gloo", "cpu", 120)
    torch.set_num_threads(1)
    cfg = load_config(model_dir)
    validate_topology(cfg, rt.world)
    inv = scan(model_dir, cfg)
    dt = BY_NAME[dtype].torch
    store = load_weights(inv, rt, dt, MemoryTerms(cache=cache_nbytes(cache_shapes(cfg, rt.world, batch, cap, dt))))
    cache = HybridCache(cfg, rt.world, batch, cap, dt, rt.device)
    comm = TPComm(rt.world, rt.rank, cfg.vocab_size)
    pack = pack and packable(dt, rt.device)
    kernels = select(backend, rt.device)
    planned = choices(cfg, dt, rt.device, batch=batch, pack=pack, cpu_ops=kernels.name == "cpu")
    model = build_model(cfg, store.tensors, comm, cache, kernels, router_weights=router, pack=pack, **vars(planned))
    return rt, cfg, model, cache


def dense_layers(model) -> int:
    """How many MoE layers hold their experts dense (model/experts.py)."""
    return sum(getattr(layer.mlp, "dense", None) is not None for layer in model.layers)


def teacher_forced(
    model_dir: str,
    dtype: str,
    prompt: list,
    forced: list | None,
    out: str,
    steps: int = 16,
    router: str = "unbiased",
    capture: str = "eager",
    pack: bool = False,
    backend: str = "auto",
    chunk: int | None = None,
):
    """Prefill logits for every prompt position (in pieces of `chunk` tokens, each continuing the cache; None: one
    piece), then one decode step per forced token (or, with `forced` None, per greedy token of its own) through the
    real static step; rank 0 saves logits, tokens and how many MoE layers ran dense experts."""
    B, T = len(prompt), len(prompt[0])
    rt, cfg, model, cache = bind(model_dir, dtype, B, T + steps + 1, router, backend, pack)
    dense = dense_layers(model)
    step = DecodeStep(model, cache, (GREEDY,), capture)
    step.warm_up()
    rows = torch.arange(B)
    with torch.inference_mode():
        ids, pieces = torch.tensor(prompt), range(0, T, chunk or T)
        prefill = torch.cat(
            [model.comm.gather_logits(model.prefill(ids[:, a : a + (chunk or T)], rows, a, True)) for a in pieces], 1
        )
        cache.positions.fill_(T)
    logits, tokens = [prefill[:, -1]], []
    for t in range(steps):
        tokens.append(logits[-1].argmax(-1) if forced is None else torch.tensor(forced)[:, t])
        if t < steps - 1:
            step.tokens.copy_(tokens[-1])
            with torch.inference_mode():
                at = cache.positions.clone()
                local = model.decode(step.tokens, at)
                cache.positions.add_(1)
            logits.append(model.comm.gather_logits(local))
    if rt.rank == 0:
        save_file(
            {
                "prefill": prefill.float().contiguous(),
                "steps": torch.stack(logits, 1).float().contiguous(),
                "tokens": torch.stack(tokens, 1).contiguous(),
                "dense_layers": torch.tensor(dense),
            },
            out,
        )
    dist.shutdown()
    return rt.rank


def as_prompt(fields: dict):
    """A Prompt from a dict of its fields, SamplingParams' among them (temperature, seed, ...), ids as a list."""
    from dataclasses import fields as fields_of

    from k3dist.engine.sampling import SamplingParams
    from k3dist.engine.sequences import Prompt

    names = {f.name for f in fields_of(SamplingParams)}
    sampling = SamplingParams(**{k: v for k, v in fields.items() if k in names})
    own = {k: v for k, v in fields.items() if k not in names} | {"ids": tuple(fields["ids"])}
    return Prompt(**own, sampling=sampling)


def local_engine(step, prefill_chunk: int = 8, sync_every: int = 8, eos=(), rt=None, check_tokens: bool = False):
    """The engine the job builds, over `step`: a runner and the control channel of `rt` (None: a world of one)."""
    from k3dist.engine.control import Channel
    from k3dist.engine.engine import Engine
    from k3dist.engine.runner import Runner

    return Engine(Runner(step, prefill_chunk), Channel(rt, check_tokens), sync_every=sync_every, eos_ids=eos)


def run_all(engine, prompts) -> list:
    """The offline loop over `prompts` (rank 0); completions in input order."""
    from k3dist.offline.run import run_offline

    return run_offline(engine, prompts, lambda event: None)


def generate(
    model_dir: str,
    prompts: list[dict],
    batch: int,
    dtype: str = "float32",
    capture: str = "eager",
    sync_every: int = 8,
    prefill_chunk: int = 512,
    cap: int | None = None,
    eos: tuple[int, ...] = (),
) -> list[dict] | None:
    """Run the real engine over `prompts` (Prompt fields as dicts): rank 0 drives it and returns its completions,
    every other rank follows its windows (with dist.check_tokens on: every window, each rank's generated ids are
    compared with rank 0's) and returns None."""
    from k3dist.engine.engine import follow

    ready = [as_prompt({"id": f"r{i}"} | p) for i, p in enumerate(prompts)]
    longest = max(len(p.ids) + p.max_new_tokens for p in ready)
    rt, cfg, model, cache = bind(model_dir, dtype, batch, cap or longest)
    step = DecodeStep(model, cache, (SamplingMode.covering(p.mode for p in ready),), capture)
    step.warm_up()
    engine = local_engine(step, prefill_chunk, sync_every, eos, rt, check_tokens=True)
    out = None
    if rt.rank == 0:
        out = [
            {"tokens": c.tokens, "finish_reason": c.finish_reason, "top": c.top_logits} for c in run_all(engine, ready)
        ]
    else:
        follow(engine.runner, engine.channel)
    dist.shutdown()
    return out


def prefix_turns(
    model_dir: str,
    turns: list[list[dict]],
    batch: int,
    prefill_chunk: int = 8,
    every: int = 16,
    dtype: str = "float32",
    cap: int = 256,
    pool: tuple[int, int] = (2**30, 0),
    together: bool = False,
) -> tuple[list[dict], list[dict]] | None:
    """Turns of requests through the real engine twice, on the same ranks and weights: with prefix snapshots (a
    pool of (device, host) bytes), then without, from an emptied cache. Each turn runs to its end before the next
    is added; a request {"after": i, "then": [ids]} continues request i of the previous turn: its prompt, its
    completion, then `then` (a chat's next turn). With `together`, a window's prefill budget has no bound, so every
    free slot is admitted in one window. Rank 0 returns (with reuse, without): per turn the completions and the prefix
    statistics so far; other ranks follow and return None."""
    from k3dist.engine.engine import follow
    from k3dist.engine.prefix import PrefixIndex
    from k3dist.engine.runner import Runner
    from k3dist.engine.snapshots import SnapshotStore, snapshot_bytes
    from k3dist.model.cache import cache_shapes

    rt, cfg, model, cache = bind(model_dir, dtype, batch, cap)
    step = DecodeStep(model, cache, (SamplingMode(True, True),))
    shapes, vocab = cache_shapes(cfg, rt.world, 1, 1, model.dtype), -(-cfg.vocab_size // rt.world)
    size = lambda n: snapshot_bytes(shapes, n, vocab, model.dtype.itemsize)  # noqa: E731
    runs = []
    for reuse in (True, False):
        step.reset()
        engine = local_engine(step, prefill_chunk, 4, (), rt, check_tokens=True)
        if together:
            engine.admission.budget = 2**30
        if reuse:
            engine.runner = Runner(step, prefill_chunk, snapshots=SnapshotStore(cache))
            engine.prefix = PrefixIndex(*pool, every, size)
        if rt.rank == 0:
            runs.append(_turns(engine, turns))
            engine.shutdown()
        else:
            follow(engine.runner, engine.channel)
    dist.shutdown()
    return tuple(runs) if rt.rank == 0 else None


def _turns(engine, turns: list[list[dict]]) -> list[dict]:
    out, previous = [], []
    for t, turn in enumerate(turns):
        prompts = []
        for i, r in enumerate(turn):
            if "after" in r:
                before, done = previous[r["after"]]
                r = {k: v for k, v in r.items() if k not in ("after", "then")} | {
                    "ids": list(before.ids) + done.tokens + r["then"]
                }
            prompts.append(as_prompt({"id": f"t{t}r{i}", "max_new_tokens": 6} | r))
            engine.add(prompts[-1])
        done = {}
        while engine.busy:
            for event in engine.run_window():
                if event.finished:
                    done[event.id] = event.completion
        previous = [(p, done[p.id]) for p in prompts]
        stats = engine.prefix.report() if engine.prefix else None
        out.append({"completions": [{"tokens": c.tokens, "top": c.top_logits} for _, c in previous], "prefix": stats})
    return out
