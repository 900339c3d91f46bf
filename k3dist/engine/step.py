"""The decode step: one static function of device tensors, captured once and replayed per token.

`DecodeStep.step` reads each slot's next input token and position, runs the model, chooses the next tokens
(sampling.py), writes them and their top-5 logits into per-slot output buffers at each slot's output index, and
advances tokens, positions and indices: all in place, every shape fixed by (batch, cache.cap, max_new_tokens), no host
read anywhere. `decode.compile` decides how it runs: eagerly, as one CUDA graph (NCCL all-reduces inside) or through
`torch.compile(fullgraph=True)`. The host reads the buffers every `decode.sync_every` steps (engine.py).
"""

import time

import torch
from torch import Tensor

from ..base.errors import K3Error
from ..model.decoder import K3Model
from .cache import HybridCache
from .sampling import SamplingMode, choose_tokens

TOP = 5  # top logits kept per generated token (result.json's top_logits)


def capture_kind(setting: str, device: torch.device, sample: bool = False) -> str:
    """decode.compile -> how the step runs: 'graph' (CUDA graph), 'compile' (torch.compile) or 'eager'.

    auto is the CUDA graph on CUDA and eager on CPU, where benchmarks/decode.py measured torch.compile's step no
    faster than eager for the default run and its one-time compile costs tens of seconds (README.md). A compiled
    CPU step that samples is refused: torch inductor's CPU code for the sampler's integer hash hangs or aborts.
    """
    if setting == "off":
        return "eager"
    if device.type == "cuda":
        return "graph"
    if setting == "on" and sample:
        raise K3Error(
            "decode.compile=on with sampling (temperature > 0) is refused on the CPU: torch inductor's CPU code for "
            "the sampler's integer hash hangs or aborts; use decode.compile=auto (eager) or greedy decoding"
        )
    return "compile" if setting == "on" else "eager"


class DecodeStep:
    def __init__(
        self,
        model: K3Model,
        cache: HybridCache,
        max_new_tokens: int,
        mode: SamplingMode,
        kind: str = "eager",
    ):
        self.model, self.cache, self.mode, self.kind = model, cache, mode, kind
        B, N, dev = cache.batch, max(max_new_tokens, 1), cache.positions.device
        self.batch, self.max_new = B, N
        self.top = min(TOP, model.cfg.vocab_size)
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        self.slots = torch.arange(B, device=dev)
        self.tokens = zeros(B)  # each slot's next input token
        self.gen = zeros(B)  # index in its output of the token each slot produces next
        self.out_tokens = zeros(B, N)
        self.top_ids = zeros(B, N, self.top)
        self.top_values = zeros(B, N, self.top, dtype=torch.float32)
        self.temperature = zeros(B, dtype=torch.float32)
        self.top_p = torch.ones(B, dtype=torch.float32, device=dev)
        self.top_k = zeros(B)
        self.seed = zeros(B)
        self._run = self.step
        self._graph = None
        self.warmup_seconds = 0.0
        self.rows: int | None = None  # eager only: cache rows MLA attends to (engine.py sets it per window)

    def buffers(self) -> list[Tensor]:
        return [self.tokens, self.gen, self.out_tokens, self.top_ids, self.top_values]

    def emit(self, local_logits: Tensor, rows: Tensor) -> None:
        """Choose the next token of slots `rows` from this rank's logits [n, V_local]; record it at each slot's output
        index with its top logits; make it the slot's next input."""
        comm = self.model.comm
        values, ids = comm.gather_topk(local_logits, self.top)
        if self.mode.sample:
            logits = comm.gather_logits(local_logits.float())
            args = (self.temperature, self.top_p, self.top_k, self.seed, self.gen)
            token = choose_tokens(logits, *(a[rows] for a in args), self.mode)
        else:
            token = ids[:, 0]
        at = self.gen[rows].clamp(max=self.max_new - 1)  # a finished slot may step on until the host looks
        self.out_tokens.index_put_((rows, at), token)
        self.top_ids.index_put_((rows, at), ids)
        self.top_values.index_put_((rows, at), values)
        self.tokens.index_put_((rows,), token)
        self.gen.index_put_((rows,), self.gen[rows] + 1)

    def step(self) -> None:
        """The static step over every slot."""
        positions = self.cache.positions
        at = positions.clamp(max=self.cache.cap - 1)
        self.emit(self.model.decode(self.tokens, at, self.rows), self.slots)
        positions.add_(1)

    def warm_up(self) -> None:
        """Compile or capture once, on the empty cache, before any request; then empty everything again.

        The time goes to `warmup_seconds`, never into prefill or step times.
        """
        if self.kind == "eager":
            return
        start = time.perf_counter()
        with torch.inference_mode():
            if self.kind == "compile":
                self._run = torch.compile(self.step, fullgraph=True, dynamic=False)
                for _ in range(2):
                    self._run()
            elif self.kind == "graph":
                self._capture()
            else:
                raise K3Error(f"unknown decode capture {self.kind!r}")
        self.reset()
        self.warmup_seconds = time.perf_counter() - start

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: allocator, cuBLAS workspaces and NCCL buffers exist before the capture
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self.step()
        self._run = self._graph.replay

    def reset(self) -> None:
        self.cache.reset()
        for t in self.buffers():
            t.zero_()

    def __call__(self) -> None:
        with torch.inference_mode():
            self._run()
