"""runtime_bytes: the memory a rank needs beyond weights and cache while it generates, computed from shapes.

Terms (each an upper bound of what is alive at once, in bytes):
- prefill: the activations of one chunk of `prefill_chunk` tokens for every slot at once (one slot at a time on the
  CPU, as the engine prefills there), the largest of the layer
  kinds (KDA: projections, conv windows, fp32 q/k/v/g, the chunked delta rule's [C, C, d] decay tensor; MLA: the
  latent rows expanded through kv_b_proj back to the start of the longest prompt, attention scores; MoE: tokens
  sorted by expert, their gate/up and down outputs, or with dense experts every expert's) plus the fp32 residual
  stream around it;
- logits: the last-token logits of a chunk and of a step, gathered to the whole vocabulary when sampling, with the
  sampler's sort and noise buffers;
- outputs: the per-slot token and top-k buffers the host reads (5 wide, a server's 20), and the logit processors'
  per-slot buffers (settings, output counts, prompt tokens and grammar masks over the rank's vocabulary shard:
  logits.py), with rank 0's bitmask;
- scoring (a server): one block of logits of prompt positions being scored, the gathers of its top-k, and the
  scored positions of the prompts a window admits (engine/prompt_logprobs.py);
- guard: one slot's KDA state, set aside while a prompt prefilled over several windows sits out the decode steps;
- cuda: the CUDA graph pool (one step's activations again) and a fixed workspace for cuBLAS and NCCL;
- cpu: an allowance for what the libraries allocate on first use during generation (pools, code paged in) plus
  a measured growth per prompt token of the batch (allocator fragmentation over long prefills);
- kernels (cpu): the GEMM primitives the libraries keep, one per (row count, weight shape) the run has met, at most
  the caches' cap (base/allocator.py): a server meets every row count, so the cap is what it holds; and the MLA
  decode op's buffers (kernels/csrc/mla_decode.cpp keeps them between steps): every slot's scores per head over its
  rows, up to cache.cap, and the partial contexts of its pieces;
- front: rank 0 of a server, the HTTP side (FastAPI, uvicorn, pydantic, their threads and the requests in flight);
- stored: rank 0 of a server, the Responses API's stored responses: their bound, serve.store_bytes (each entry's
  JSON and its bookkeeping are counted against it: serve/response_store.py).
"""

from dataclasses import asdict, dataclass

from ..base.allocator import PRIMITIVE_BYTES, cached_primitives
from ..config import ModelConfig
from ..kernels.moe import PAD_ROWS, padded_rows
from ..model.linear import WIDE_BLOCK
from ..model.mla import KEY_BLOCK
from .decode_step import TOP, WIDEST
from .logits import processor_bytes
from .prompt_logprobs import SCORE_ROWS
from .runner import prefills_together

MiB = 2**20
CUDA_WORKSPACE = 256 * MiB  # cuBLAS workspaces (a few per stream) and NCCL's channel buffers, rounded up
HOST_ALLOWANCE = 4 * MiB  # what CPU libraries allocate on first use during generation (see docs/memory.md)
HOST_PER_PROMPT_TOKEN = 512  # and what the allocator keeps growing by over long prefills, per prompt token of the batch
FRONT = 32 * MiB  # a server's HTTP side on rank 0: 18 MiB of its libraries measured, their threads and requests
KDA_CHUNK = 16  # kernels/kda.py's chunk length
MLA_PIECES, MLA_PIECE = 64, 256  # kernels/csrc/mla_decode.cpp: the most pieces a sequence is cut into, their least rows


@dataclass(frozen=True)
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
    (on the CPU MLA expands at most one key block of them at a time); with `widen`, one projection's fp32 input and
    weight block beside it (model/linear.py)."""
    D = cfg.hidden_size
    residual = 3 * tokens * D * 4 + tokens * D * s  # h, h + mixer(x), the mixer's fp32 output; the normed input
    kinds = [0]
    if cfg.count(mixer="kda"):
        H, d = cfg.kda_heads // world, cfg.kda_head_dim
        P = H * d
        proj = tokens * (3 * P + 2 * d + H) * s + 2 * tokens * P * s  # in_proj output; f_b and g_b outputs
        conv = 3 * (seqs * P * (tokens // seqs + cfg.conv_kernel) * 4 * 2)  # fp32 window + output per q/k/v
        fp32 = 8 * tokens * P * 4  # q, k, v, g in fp32, head-major copies, the output
        chunk = seqs * H * KDA_CHUNK * (KDA_CHUNK * d * 4 * 2 + KDA_CHUNK * 4 * 4 + 2 * d * 4)  # decay (+exp), kk/qk
        kinds.append(proj + conv + fp32 + chunk + tokens * D * 4 * 2)
    if cfg.count(mixer="mla"):
        H, r, dr = cfg.mla_heads // world, cfg.kv_lora_rank, cfg.qk_rope_dim
        dqk, dv = cfg.qk_nope_dim + dr, cfg.v_head_dim
        chunk = tokens // seqs
        rows = seqs * (min(longest, KEY_BLOCK + chunk) if cpu else longest)  # expanded keys and values
        proj = tokens * (H * dqk + r + dr) * s * 2
        expanded = rows * ((r + dr) * s + H * (cfg.qk_nope_dim + dv) * s + H * dqk * s)  # rows, kv, keys
        merged = 3 * tokens * H * dqk * 4  # block outputs and the running merge, fp32 (padded to dqk)
        kinds.append(proj + expanded + merged + tokens * H * dv * s * 2 + tokens * D * 4 * 2)
    if cfg.count(mlp="moe"):
        k, E, I_ = cfg.top_k, cfg.num_experts, cfg.expert_size // world
        rows = padded_rows(tokens, k, E, PAD_ROWS if cpu else 1)  # sorted (CPU: padded) x, gate/up, act, down
        routed = rows * (D * s + 3 * I_ * s + D * s) + tokens * k * (D * s + D * 4 + 3 * 8)  # then [N*k] fp32
        if dense:  # every expert: gate/up, act, weighted fp32 act and its rounding; the output
            routed = tokens * (E * I_ * (3 * s + 4 + s) + E * 4 + D * (s + 4))
        router = tokens * E * 4 * 4
        shared = tokens * 3 * cfg.shared_size // world * s
        kinds.append(routed + router + shared + tokens * D * 4 * 2)
    if cfg.count(mlp="dense"):
        kinds.append(tokens * 3 * (cfg.intermediate_size // world) * s + tokens * D * 4 * 2)
    wide = 0
    if widen:  # the widest projection input: its fp32 copy and a fp32 block of weight rows
        ins = (D, cfg.intermediate_size // world, cfg.shared_size // world, cfg.kda_dim // world)
        ins += (cfg.mla_heads // world * cfg.v_head_dim,)
        wide = (tokens + WIDE_BLOCK) * max(ins) * 4
    return residual + max(kinds) + wide


def mla_decode_bytes(cfg: ModelConfig, world: int, batch: int, cap: int) -> int:
    """The CPU MLA decode op's buffers at `batch` slots of `cap` rows: scores [H, rows] fp32 (one block past the end),
    each piece's max and sum per head, partial contexts [H, r] per piece, q_abs and q_pe per (slot, head) in fp32,
    and in bf16 and bf16 pairs for the dot-product and tile kernels."""
    if not cfg.count(mixer="mla"):
        return 0
    H, r, dr = cfg.mla_heads // world, cfg.kv_lora_rank, cfg.qk_rope_dim
    pad = lambda n, lanes=16: -(-n // lanes) * lanes  # noqa: E731  (the widest vector's float lanes; 32 bf16)
    pieces = batch * min(MLA_PIECES, -(-max(cap, 1) // MLA_PIECE))  # a piece holds MLA_PIECE rows or more
    q_bf16 = batch * H * pad(r + dr, 32) * (2 + 2)
    return 4 * (H * (batch * cap + 32) + pieces * H * (2 + pad(r, 32)) + batch * H * pad(r + dr)) + q_bf16


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
    kernels = (
        0
        if device_type == "cuda"
        else cached_primitives() * PRIMITIVE_BYTES + mla_decode_bytes(cfg, world, batch, out_len)
    )
    P, H, d = cfg.kda_dim // world, cfg.kda_heads // world, cfg.kda_head_dim  # one slot's KDA state (cache.py)
    guard = cfg.count(mixer="kda") * ((cfg.conv_kernel - 1) * 3 * P * s + H * d * d * 4)
    return RuntimeMemory(prefill, logits, outputs, device, score, kernels, FRONT if serves_http else 0, guard, stored)
