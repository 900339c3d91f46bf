"""The one way to assemble the engine, as model/build.py is the model's: on every rank the decode step, the runner and
the channel the window records travel by; on rank 0 the engine over them, with what it reads of the checkpoint's
text (eos ids, stop strings) and the prefix index. Both take the run plan's decisions (run/plan.py) and make none."""

from typing import Protocol

import torch

from ..base import dist
from ..config import ModelConfig
from ..model.cache import HybridCache, cache_shapes
from ..model.decoder import K3Model
from ..settings import Settings
from .control import Channel
from .decode_step import DecodeStep
from .engine import Engine
from .prefix import PrefixIndex
from .runner import Runner
from .sampling import SamplingMode
from .snapshots import SnapshotStore, snapshot_bytes
from .watch import MemoryWatch


class EnginePlan(Protocol):
    """What the assembly reads of the run plan (run/plan.py's RunPlan)."""

    world: int
    dtype: torch.dtype
    modes: tuple[SamplingMode, ...]
    kind: str
    width: int
    reuse: bool

    @property
    def serving(self) -> bool: ...


def build_runner(plan: EnginePlan, s: Settings, rt: dist.Runtime, model: K3Model, cache: HybridCache):
    """Every rank's decode step (not yet warmed up), its runner, and the channel of window records: (runner,
    channel)."""
    step = DecodeStep(model, cache, plan.modes, plan.kind, width=plan.width)
    snapshots = SnapshotStore(cache) if plan.reuse else None
    runner = Runner(step, s.generate.prefill_chunk, s.fault, rt.rank, snapshots)
    return runner, Channel(rt, s.dist.check_tokens)


def build_engine(
    plan: EnginePlan, s: Settings, cfg: ModelConfig, runner: Runner, channel: Channel, *, tokenizer, admitted
) -> Engine:
    """Rank 0's engine over `runner`: `tokenizer` (None: ids only) gives the eos ids and the text of every request;
    `admitted`: every rank's planned bytes, which a server's memory watch holds its ranks to."""
    return Engine(
        runner,
        channel,
        sync_every=s.decode.sync_every,
        eos_ids=eos_ids(cfg, tokenizer),
        make_assembler=text_assembler(tokenizer),
        prefix=prefix_index(s, cfg, plan.world, plan.dtype) if plan.reuse else None,
        watch=MemoryWatch(admitted) if plan.serving else None,
    )


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


def prefix_index(s: Settings, cfg: ModelConfig, world: int, dtype: torch.dtype) -> PrefixIndex:
    """Rank 0's index of snapshots, sized by what one snapshot of L tokens takes on a rank."""
    shapes = cache_shapes(cfg, world, 1, 1, dtype)
    vocab = -(-cfg.vocab_size // world)
    host = s.prefix.host_bytes
    return PrefixIndex(s.prefix.bytes, host, s.prefix.every, lambda n: snapshot_bytes(shapes, n, vocab, dtype.itemsize))
