"""The decode step: one static function of device tensors, captured once per sampling mode and replayed per token.

`DecodeStep.step` reads each slot's next input token and position, runs the model, chooses the next tokens
(sampling.py), writes them, their top logits (5, or a window's wider k) and the log-sum-exp of all logits (for
log-probabilities) into per-slot output buffers at each slot's output index, and advances tokens, positions and
indices: all in place, every shape fixed by (batch, cache.cap), no host read anywhere. `decode.compile` decides how
it runs: eagerly, as one CUDA graph per mode (NCCL all-reduces inside) or through `torch.compile(fullgraph=True)`.
The host reads the buffers every `decode.sync_every` steps (engine.py).
"""

import time
from functools import partial

import torch
from torch import Tensor

from ..base.errors import K3Error
from ..model.cache import HybridCache
from ..model.decoder import K3Model
from .logits import PENALTIES, LogitProcessors
from .sampling import ALL_MODES, GREEDY, SamplingMode, SamplingParams, choose_tokens, slot_seed

TOP = 5  # top logits kept per generated token (result.json's top_logits, top_logprobs)
WIDEST = 20  # the most a request may ask for (OpenAI's and vLLM's limit); a server's output buffers are this wide


def capture_kind(setting: str, device: torch.device) -> str:
    """decode.compile -> how the step runs: 'graph' (CUDA graph), 'compile' (torch.compile) or 'eager'.

    auto is the CUDA graph on CUDA and eager on CPU, where torch.compile's step is no faster than eager for the
    default run (benchmarks/decode.py) and its one-time compile is long (README.md). A compiled
    CPU step compiles greedy decoding only: torch inductor's CPU code for the sampler's integer hash hangs or aborts,
    so windows that sample run the same step eagerly.
    """
    if setting == "off":
        return "eager"
    if device.type == "cuda":
        return "graph"
    return "compile" if setting == "on" else "eager"


class DecodeStep:
    def __init__(self, model: K3Model, cache: HybridCache, modes=(GREEDY,), kind: str = "eager", width: int = TOP):
        """`modes`: the sampling modes windows may ask for; a CUDA graph is captured for each at warm-up, and a window
        runs the least captured mode covering its own. `width`: top logits the output buffers hold per token (TOP, or
        WIDEST for a server); a window gathers only the `top` it needs (TOP unless a live slot asks for more), except
        a CUDA graph, which was captured with the whole width."""
        self.model, self.cache, self.kind = model, cache, kind
        self.modes = tuple(sorted(set(modes)))
        B, N, dev = cache.batch, cache.cap, cache.positions.device
        self.batch, self.out_len = B, N  # outputs fit a whole cache row: any budget cache.cap admits
        self.width = min(max(width, TOP), model.cfg.vocab_size)
        self.top = min(TOP, self.width)  # the k of this window's gather (engine.py sets it per window)
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        self.slots = torch.arange(B, device=dev)
        self.tokens = zeros(B)  # each slot's next input token
        self.gen = zeros(B)  # index in its output of the token each slot produces next
        self.out_tokens = zeros(B, N)
        self.top_ids = zeros(B, N, self.width)
        self.top_values = zeros(B, N, self.width, dtype=torch.float32)
        self.out_lse = zeros(B, N, dtype=torch.float32)  # log-sum-exp of all logits: logprob = logit - lse
        self.out_logit = zeros(B, N, dtype=torch.float32)  # the chosen token's logit
        self.temperature = zeros(B, dtype=torch.float32)
        self.top_p = torch.ones(B, dtype=torch.float32, device=dev)
        self.top_k = zeros(B)
        self.seed = zeros(B)
        self.processors = LogitProcessors(B, model.comm.vocab_start, model.comm.vocab_stop, dev)
        self._runs = {mode: partial(self.step, mode) for mode in ALL_MODES}  # eager: any mode as it is
        self._graphs: list = []
        self.warmup_seconds = 0.0
        self.rows: int | None = None  # eager only: cache rows MLA attends to (engine.py sets it per window)
        self.active: int | None = None  # eager only: step the first `active` slots, past which none is live

    def use_top(self, k: int) -> None:
        """The k the next steps and emits gather (a window's); a captured graph keeps its own (the whole width)."""
        if self.kind != "graph" or not self._graphs:
            self.top = min(max(k, TOP), self.width)

    def load(self, slot: int, sampling: SamplingParams, prompt: tuple[int, ...]) -> None:
        """A request's sampling into its slot's tensors (host-to-device writes, outside any step): the one place a
        SamplingParams field reaches the device. Any integer fits: a top_k past the vocabulary cuts nothing, a seed
        is its low 64 bits."""
        self.temperature[slot], self.top_p[slot] = sampling.temperature, sampling.top_p
        self.top_k[slot] = min(sampling.top_k, self.model.cfg.vocab_size)
        self.seed[slot] = slot_seed(sampling.seed)
        self.processors.load(slot, sampling, prompt)

    def buffers(self) -> list[Tensor]:
        return [self.tokens, self.gen, self.out_tokens, self.top_ids, self.top_values, self.out_lse, self.out_logit]

    def emit(self, local_logits: Tensor, rows: Tensor, mode: SamplingMode, first: int | None = None) -> None:
        """Choose the next token of slots `rows` from this rank's logits [n, V_local] (`first`: they are the first n
        slots); record it at each slot's output index with its top logits and the log-sum-exp; make it the slot's
        next input."""
        comm = self.model.comm
        if mode.process:  # masks, logit_bias, min_tokens and perhaps penalties (logits.py)
            local_logits = self.processors.apply(local_logits, rows, self.gen[rows], mode.process, first)
        values, ids, lse = comm.gather_topk(local_logits, self.top, self.model.kernels.topk_lse)
        if mode.sample:
            logits = comm.gather_logits(local_logits.float())
            args = (self.temperature, self.top_p, self.top_k, self.seed, self.gen)
            token = choose_tokens(logits, *(a[rows] for a in args), mode)
            chosen = logits.gather(1, token[:, None]).squeeze(1)
        else:
            token, chosen = ids[:, 0], values[:, 0]
        at = self.gen[rows].clamp(max=self.out_len - 1)  # a finished slot may step on until the host looks
        k = ids.shape[-1]  # columns past k keep older values: the host reads at most the k its window gathered
        self.out_tokens.index_put_((rows, at), token)
        if mode.process >= PENALTIES:
            self.processors.count(rows, token)
        self.top_ids[..., :k].index_put_((rows, at), ids)
        self.top_values[..., :k].index_put_((rows, at), values)
        self.out_lse.index_put_((rows, at), lse)
        self.out_logit.index_put_((rows, at), chosen)
        self.tokens.index_put_((rows,), token)
        self.gen.index_put_((rows,), self.gen[rows] + 1)

    def step(self, mode: SamplingMode = GREEDY) -> None:
        """The static step over every slot (an eager step over the first `active` ones: a server at low
        concurrency then steps the rows it uses, not all of its slots)."""
        n = self.active or self.batch
        positions = self.cache.positions[:n]
        at = positions.clamp(max=self.cache.cap - 1)
        self.emit(self.model.decode(self.tokens[:n], at, self.rows), self.slots[:n], mode, n)
        positions.add_(1)

    def warm_up(self) -> None:
        """Compile or capture once per mode, on the empty cache, before any request; then empty everything again.

        The time goes to `warmup_seconds`, never into prefill or step times.
        """
        if self.kind == "eager":
            return
        start = time.perf_counter()
        with torch.inference_mode():
            if self.kind == "compile":  # greedy only: sampling windows run eagerly (see capture_kind)
                compiled = torch.compile(partial(self.step, GREEDY), fullgraph=True, dynamic=False)
                for _ in range(2):
                    compiled()
                self._runs[GREEDY] = compiled
            elif self.kind == "graph":
                self._warm_prefill()
                pool = torch.cuda.graph_pool_handle()  # the modes' graphs replay one at a time: one pool
                graphs = {mode: self._capture(mode, pool) for mode in self.modes}
                covering = {m: [c for c in self.modes if c.covers(m)] for m in ALL_MODES}
                self._runs = {m: graphs[min(cs)] for m, cs in covering.items() if cs}
            else:
                raise K3Error(f"unknown decode capture {self.kind!r}")
        self.reset()
        self.warmup_seconds = time.perf_counter() - start

    def _warm_prefill(self) -> None:
        """A two-token prefill into slot 0 (emptied again with the rest): the prefill's libraries (cuBLAS, the KDA
        chunked form's triangular solve, the attention kernels) make their handles and load their code here, once,
        not inside the first request's time to first token. Every rank runs it, so its collectives pair up."""
        self.model.prefill(torch.zeros(1, 2, dtype=torch.int64, device=self.slots.device), self.slots[:1], 0)

    def _capture(self, mode: SamplingMode, pool):
        self.top = self.width  # a graph replays its captured k whatever a window asks: the whole width
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: allocator, cuBLAS workspaces and NCCL buffers exist before the capture
                self.step(mode)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.step(mode)
        self._graphs.append(graph)
        return graph.replay

    def reset(self) -> None:
        self.cache.reset()
        for t in self.buffers():
            t.zero_()
        self.processors.reset()

    def __call__(self, mode: SamplingMode = GREEDY) -> None:
        """One step in `mode` (a graph runs the least captured mode that covers it; a compiled step was traced with
        TOP, so a wider window runs eagerly)."""
        with torch.inference_mode():
            if self.kind == "compile" and self.top != TOP:
                return self.step(mode)
            self._runs[mode]()
