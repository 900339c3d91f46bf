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
- outputs: the per-slot token and top-5 buffers the host reads;
- guard: one slot's KDA state, set aside while a prompt prefilled over several windows sits out the decode steps;
- cuda: the CUDA graph pool (one step's activations again) and a fixed workspace for cuBLAS and NCCL;
- cpu: an allowance for what the libraries allocate on first use during generation (oneDNN kernels, pools) plus
  a measured growth per prompt token of the batch (allocator fragmentation over long prefills).
"""

from dataclasses import asdict, dataclass

from ..config import ModelConfig
from ..model.mla import KEY_BLOCK
from .runner import prefills_together

MiB = 2**20
CUDA_WORKSPACE = 256 * MiB  # cuBLAS workspaces (a few per stream) and NCCL's channel buffers, rounded up
HOST_ALLOWANCE = 20 * MiB  # what CPU libraries allocate on first use during generation (see docs/memory.md)
HOST_PER_PROMPT_TOKEN = 512  # and what the allocator keeps growing by over long prefills, per prompt token of the batch
KDA_CHUNK = 16  # kernels/kda.py's chunk length


@dataclass(frozen=True)
class RuntimeMemory:
    prefill: int
    logits: int
    outputs: int
    guard: int
    device: int  # cuda: graph pool + workspace; cpu: host allowance

    @property
    def total(self) -> int:
        return self.prefill + self.logits + self.outputs + self.guard + self.device

    def as_dict(self) -> dict:
        return asdict(self) | {"total": self.total}


def _prefill(
    cfg: ModelConfig, world: int, tokens: int, seqs: int, longest: int, s: int, cpu: bool = True, dense: bool = False
) -> int:
    """Peak bytes of one forward over `tokens` = `seqs` x chunk tokens whose keys reach back `longest` positions
    (on the CPU MLA expands at most one key block of them at a time)."""
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
        routed = tokens * k * (D * s + 3 * I_ * s + D * s + D * 4 + 3 * 8)  # sorted x, gate/up, act, down, fp32
        if dense:  # every expert: gate/up, act, weighted fp32 act and its rounding; the output
            routed = tokens * (E * I_ * (3 * s + 4 + s) + E * 4 + D * (s + 4))
        router = tokens * E * 4 * 4
        shared = tokens * 3 * cfg.shared_size // world * s
        kinds.append(routed + router + shared + tokens * D * 4 * 2)
    if cfg.count(mlp="dense"):
        kinds.append(tokens * 3 * (cfg.intermediate_size // world) * s + tokens * D * 4 * 2)
    return residual + max(kinds)


def runtime_memory(
    cfg: ModelConfig,
    world: int,
    batch: int,
    longest_prompt: int,
    prefill_chunk: int,
    out_len: int,
    sample: bool,
    itemsize: int,
    device_type: str,
    dense_experts: bool = False,
    graphs: int = 1,
) -> RuntimeMemory:
    """`out_len`: tokens each slot's output buffers hold (cache.cap); `graphs`: CUDA graphs captured (one per
    sampling mode the run may need)."""
    V, Vl, s = cfg.vocab_size, -(-cfg.vocab_size // world), itemsize
    together = batch if prefills_together(device_type) else 1
    tokens = together * min(prefill_chunk, longest_prompt)
    prefill = _prefill(cfg, world, tokens, together, longest_prompt, s, device_type == "cpu", dense_experts)
    logits = batch * Vl * (s + 4) * 2  # local logits of a chunk's last tokens and of a step, fp32 copies
    if sample:
        logits += batch * V * (4 * 4 + 8 * 3)  # gathered fp32 logits, scaled, sorted, probs; order, noise bits
    outputs = batch * max(out_len, 1) * (8 + 5 * (8 + 4) + 4 + 4)  # token, top-5 ids and logits, lse, its logit
    if device_type == "cuda":
        step = _prefill(cfg, world, batch, batch, 1, s, cpu=False) + logits  # a graph pool: one step's tensors
        device = graphs * step + CUDA_WORKSPACE
    else:
        device = HOST_ALLOWANCE + HOST_PER_PROMPT_TOKEN * batch * longest_prompt
    P, H, d = cfg.kda_dim // world, cfg.kda_heads // world, cfg.kda_head_dim  # one slot's KDA state (cache.py)
    guard = cfg.count(mixer="kda") * ((cfg.conv_kernel - 1) * 3 * P * s + H * d * d * 4)
    return RuntimeMemory(prefill, logits, outputs, guard, device)
