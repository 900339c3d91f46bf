"""The run plan: every decision a run makes before its load, made once, from the settings, the model config, the
world and the device alone.

The memory preflight, the loader, the generation and the what-if plan (`run.mode=plan`, for the run named by
`run.plan_for`) all read one `RunPlan`; none of them decides again. So the what-if answers, rank by rank, with the
`admitted` and the terms of the run those settings start. Nothing here looks at the prompts themselves: a run plans
for any prompt its settings admit (up to `cache.cap` less `generate.max_new_tokens`; a server or a prompts file, up
to `cache.cap`, in any sampling mode; a load, none).
"""

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..engine.decode_step import TOP, WIDEST, capture_kind
from ..engine.sampling import ALL_MODES, SamplingMode
from ..kernels.backend import Kernels, expected, select
from ..memory.runtime import RuntimeMemory, runtime_memory
from ..memory.terms import bind_bytes, cache_nbytes, int8_terms, prefix_pool_bytes
from ..model.build import choices
from ..model.cache import cache_shapes
from ..model.linear import packs
from ..offline.prompts import cli_sampling
from ..settings import Settings
from ..weights.memory import MemoryTerms, default_reserve


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    run: str  # generate, serve or load
    world: int
    dtype: torch.dtype  # the compute dtype
    modes: tuple[SamplingMode, ...]  # sampling modes the step is built for (a CUDA graph each)
    longest: int  # the longest prompt planned for
    kind: str  # how the decode step runs: eager, graph or compile
    kernels: Kernels | None  # the kernels selected, once (None in a what-if, which builds none)
    width: int  # the step's log-probability width: WIDEST for a server (any request may ask), else TOP
    pack: bool  # weights packed for oneDNN at bind time
    widen: bool  # prefill GEMMs widened to fp32 (a CPU without units for the compute dtype)
    dense: bool  # MoE experts held as one dense GEMM pair (model/experts.py)
    reuse: bool  # prefix snapshots on
    runtimes: dict[int, RuntimeMemory]  # by rank, for the ranks planned (rank 0 of a server also serves HTTP)
    terms: dict[int, MemoryTerms]  # by rank, for the ranks planned

    @property
    def serving(self) -> bool:
        return self.run == "serve"


def plan_run(
    s: Settings, cfg: ModelConfig, world: int, device: torch.device, ranks: tuple[int, ...] | None = None
) -> RunPlan:
    """The decisions for the run `s` starts (or, for `run.mode=plan`, the run `run.plan_for` names) on `world` ranks
    of `device`'s kind; memory terms for `ranks` (None: every rank, as the what-if wants; a rank of the run asks for
    its own only)."""
    ranks = tuple(range(world)) if ranks is None else ranks
    run = s.run.runs
    g, serving, prompts_file = s.generate, run == "serve", s.generate.prompts is not None
    dtype = s.model.compute_dtype(cfg.dtype)
    modes, longest = (cli_sampling(g).mode,), max(1, s.cache.cap - g.max_new_tokens)
    if serving or prompts_file:  # any request: a server's, or a file's own sampling fields
        modes, longest = ALL_MODES, s.cache.cap
    elif run == "load":  # no prompt is ever run
        longest = 1
    kind = capture_kind(s.decode.compile, device)  # every rank alike, before anything is loaded
    # the kernels the run selects (a what-if asks which it would, without building them)
    kernels = None if s.run.mode == "plan" else select(s.kernels.backend, device)
    backend = expected(s.kernels.backend, device) if kernels is None else kernels.name
    cpu_ops = backend == "cpu"  # the CPU ops: the decode-rows op and the one-op MoE block
    width = WIDEST if serving else TOP
    pack = run != "load" and kind == "eager" and packs(dtype, device, g.batch, rows_op=cpu_ops)
    bound = choices(cfg, dtype, device, batch=g.batch, pack=pack, cpu_ops=cpu_ops)
    widen, dense = run != "load" and bound.widen, bound.dense
    reuse = run != "load" and s.prefix.on(run, prompts_file)
    cache = cache_nbytes(cache_shapes(cfg, world, g.batch, s.cache.cap, dtype))
    host = s.prefix.host_bytes if device.type == "cpu" else 0
    pool = prefix_pool_bytes(s.prefix.bytes, host) if reuse else 0  # the snapshots, and rank 0's remembered ids
    reserve = s.memory.reserve if s.memory.reserve is not None else default_reserve(device)
    sample = any(m.sample for m in modes)
    by_role = {}  # the runtime of a rank that serves HTTP (rank 0 of a server) and of every other rank
    for serves_http in {serving and rank == 0 for rank in ranks}:
        by_role[serves_http] = runtime_memory(
            cfg,
            world,
            batch=g.batch,
            longest_prompt=longest,
            prefill_chunk=g.prefill_chunk,
            out_len=s.cache.cap,
            sample=sample,
            itemsize=dtype.itemsize,
            device_type=device.type,
            dense_experts=dense,
            widen=widen,
            graphs=len(modes),
            top=width,
            scoring=serving,
            serves_http=serves_http,
            stored=s.serve.store_bytes if serves_http and s.serve.store_responses else 0,  # the Responses API's store
        )
    runtimes, terms = {}, {}
    for rank in ranks:
        runtimes[rank] = by_role[serving and rank == 0]
        saved, int8 = int8_terms(cfg, world, rank, dtype) if s.model.quant == "int8" else (0, 0)
        derived = bind_bytes(cfg, world, dtype, pack, dense, s.model.quant == "int8", int8)
        runtime = runtimes[rank].total
        terms[rank] = MemoryTerms(
            cache=cache, runtime=runtime, derived=derived, prefix=pool, saved=saved, reserve=reserve
        )
    return RunPlan(
        run=run,
        world=world,
        dtype=dtype,
        modes=modes,
        longest=longest,
        kind=kind,
        kernels=kernels,
        width=width,
        pack=pack,
        widen=widen,
        dense=dense,
        reuse=reuse,
        runtimes=runtimes,
        terms=terms,
    )
