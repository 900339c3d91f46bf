"""runtime_memory: the memory a rank needs beyond weights and cache while it generates, computed from shapes.

Terms (each an upper bound of what is alive at once, in bytes):
- prefill: the activations of one chunk of `prefill_chunk` tokens for every slot at once (one slot at a time on the
  CPU, as the engine prefills there), the largest of the layer
  kinds' (each kind's spec counts its own: kinds/) plus the fp32 residual stream around it;
- logits: the last-token logits of a chunk and of a step, gathered to the whole vocabulary when sampling, with the
  sampler's sort and noise buffers;
- outputs: the per-slot token and top-k buffers the host reads (5 wide, a server's 20), and the logit processors'
  per-slot buffers (settings, output counts, prompt tokens and grammar masks over the rank's vocabulary shard:
  logits.py), with rank 0's bitmask;
- scoring (a server): one block of logits of prompt positions being scored, the gathers of its top-k, and the
  scored positions of the prompts a window admits (engine/prompt_logprobs.py);
- guard: one slot's states that do not grow with its tokens (KDA's: kinds/), set aside while a prompt prefilled
  over several windows sits out the decode steps;
- cuda: the CUDA graph pool (one step's activations again) and a fixed workspace for cuBLAS and NCCL;
- cpu: an allowance for what the libraries allocate on first use during generation (pools, code paged in) plus
  a measured growth per prompt token of the batch (allocator fragmentation over long prefills);
- kernels (cpu): the GEMM primitives the libraries keep, one per (row count, weight shape) the run has met, at most
  the caches' cap (base/allocator.py): a server meets every row count, so the cap is what it holds; and the buffers
  a kind's CPU decode op keeps between steps (MLA's: kinds/mla.py);
- front: rank 0 of a server, the HTTP side (FastAPI, uvicorn, pydantic, their threads and the requests in flight);
- stored: rank 0 of a server, the Responses API's stored responses: their bound, serve.store_bytes (each entry's
  JSON and its bookkeeping are counted against it: serve/response_store.py).
"""

import math
from dataclasses import asdict, dataclass

from ..base.allocator import PRIMITIVE_BYTES, cached_primitives
from ..config import ModelConfig
from ..engine.decode_step import TOP, WIDEST
from ..engine.logits import EDITS
from ..engine.prompt_logprobs import SCORE_ROWS
from ..engine.runner import prefills_together
from ..kinds.registry import KINDS, MIXERS, present
from ..model.linear import WIDE_BLOCK

MiB = 2**20
CUDA_WORKSPACE = 256 * MiB  # cuBLAS workspaces (a few per stream) and NCCL's channel buffers, rounded up
HOST_ALLOWANCE = 4 * MiB  # what CPU libraries allocate on first use during generation (see docs/memory.md)
HOST_PER_PROMPT_TOKEN = 512  # and what the allocator keeps growing by over long prefills, per prompt token of the batch
FRONT = 32 * MiB  # a server's HTTP side on rank 0: 18 MiB of its libraries measured, their threads and requests


@dataclass(frozen=True, kw_only=True)
class RuntimeMemory:
    prefill: int
    logits: int
    outputs: int
    device: int  # cuda: graph pool + workspace; cpu: host allowance
    scoring: int = 0  # prompt log-probabilities (a server)
    kernels: int = 0  # cpu: GEMM primitives the libraries keep
    front: int = 0  # rank 0 of a server: the HTTP side
    guard: int = 0  # one slot's KDA state, kept while its prompt is prefilled over several windows
    stored: int = 0  # rank 0 of a server: the stored responses' bound (serve.store_bytes)

    @property
    def total(self) -> int:
        return sum(v for k, v in asdict(self).items())

    def as_dict(self) -> dict:
        return asdict(self) | {"total": self.total}


def _prefill(
    cfg: ModelConfig,
    world: int,
    *,
    tokens: int,
    seqs: int,
    longest: int,
    s: int,
    cpu: bool = True,
    dense: bool = False,
    widen: bool = False,
) -> int:
    """Peak bytes of one forward over `tokens` = `seqs` x chunk tokens whose keys reach back `longest` positions
    (each present kind's own peak: kinds/); with `widen`, one projection's fp32 input and weight block beside it
    (model/linear.py)."""
    D = cfg.hidden_size
    residual = 3 * tokens * D * 4 + tokens * D * s  # h, h + mixer(x), the mixer's fp32 output; the normed input
    residual += bank_bytes(cfg, tokens)
    shape = dict(tokens=tokens, seqs=seqs, longest=longest, s=s, cpu=cpu, dense=dense)
    kinds = [0, *(kind.activation(cfg, world, **shape) for kind in present(cfg))]
    wide = 0
    if widen:  # the widest projection input: its fp32 copy and a fp32 block of weight rows
        wide = (tokens + WIDE_BLOCK) * max(D, *(kind.widest_input(cfg, world) for kind in KINDS)) * 4
    return residual + max(kinds) + wide


def bank_bytes(cfg: ModelConfig, tokens: int) -> int:
    """K3's block attention residuals (model/residuals.py): a snapshot of the stream per block, fp32, for every token
    of the forward, and at a mixing site every candidate stacked once more (the bank and the stream). 0 without
    them."""
    if not cfg.attn_res_block_size:
        return 0
    blocks = -(-cfg.num_layers // cfg.attn_res_block_size)
    return tokens * cfg.hidden_size * 4 * (2 * blocks + 1)


def processor_bytes(batch: int, vocab_local: int) -> int:
    """Device bytes of the logit processors' buffers (engine/logits.py: LogitProcessors)."""
    per_slot = vocab_local * (4 + 1 + 4) + EDITS * (8 + 4 + 1) + 4 * 4 + 8
    return batch * per_slot + 256 * 8 * 4


def guard_bytes(cfg: ModelConfig, world: int, itemsize: int) -> int:
    """One slot's cache entries that do not grow with its tokens, over every layer (engine/runner.py's guard)."""
    entries = [e for layer in cfg.layers for e in MIXERS[layer.mixer].cache if not e.grows]
    return sum(math.prod(e.shape(cfg, world, 1, 1)) * (e.dtype.itemsize if e.dtype else itemsize) for e in entries)


def runtime_memory(
    cfg: ModelConfig,
    world: int,
    *,
    batch: int,
    longest_prompt: int,
    prefill_chunk: int,
    out_len: int,
    sample: bool,
    itemsize: int,
    device_type: str,
    dense_experts: bool = False,
    widen: bool = False,
    graphs: int = 1,
    top: int = TOP,
    scoring: bool = False,
    serves_http: bool = False,
    stored: int = 0,
) -> RuntimeMemory:
    """`out_len`: tokens each slot's output buffers hold (cache.cap); `graphs`: CUDA graphs captured (one per
    sampling mode the run may need); `top`: the output buffers' top-k width; `scoring`: whether prompts may be
    scored (a server); `serves_http`: this rank serves HTTP (rank 0 of a server); `stored`: the bytes its stored
    responses may hold (rank 0 of a server)."""
    V, Vl, s = cfg.vocab_size, -(-cfg.vocab_size // world), itemsize
    together = batch if prefills_together(device_type) else 1
    tokens = together * min(prefill_chunk, longest_prompt)
    prefill = _prefill(
        cfg,
        world,
        tokens=tokens,
        seqs=together,
        longest=longest_prompt,
        s=s,
        cpu=device_type == "cpu",
        dense=dense_experts,
        widen=widen,
    )
    logits = batch * Vl * (s + 4) * 2  # local logits of a chunk's last tokens and of a step, fp32 copies
    if sample:
        logits += batch * V * (4 * 4 + 8 * 3)  # gathered fp32 logits, scaled, sorted, probs; order, noise bits
    outputs = batch * max(out_len, 1) * (8 + top * (8 + 4) + 4 + 4)  # token, top-k ids and logits, lse, its logit
    score = 0
    if scoring:  # a block's logits (and fp32 widening), its normed states, the gathers; the admissions' scores
        block = SCORE_ROWS * (Vl * (s + 4) + cfg.hidden_size * (4 + s) + 2 * world * (WIDEST + 1) * (4 + 8))
        score = block + together * longest_prompt * (WIDEST * (4 + 8) + 4 + 4)
    outputs += processor_bytes(batch, Vl) + batch * -(-V // 32) * 4  # logit processors; grammar bitmask rows
    if device_type == "cuda":
        step = (
            _prefill(cfg, world, tokens=batch, seqs=batch, longest=1, s=s, cpu=False) + logits
        )  # a graph pool: one step's tensors
        device = graphs * step + CUDA_WORKSPACE
    else:
        device = HOST_ALLOWANCE + HOST_PER_PROMPT_TOKEN * batch * longest_prompt
    kernels = 0
    if device_type != "cuda":  # the GEMM primitives kept, and what each kind's CPU decode op keeps
        ops = sum(kind.decode_op_bytes(cfg, world, batch, out_len) for kind in present(cfg))
        kernels = cached_primitives() * PRIMITIVE_BYTES + ops
    guard = guard_bytes(cfg, world, s)
    return RuntimeMemory(
        prefill=prefill,
        logits=logits,
        outputs=outputs,
        device=device,
        scoring=score,
        kernels=kernels,
        front=FRONT if serves_http else 0,
        guard=guard,
        stored=stored,
    )
