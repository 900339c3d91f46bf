"""The CPU decode kernels (kernels/csrc/*.cpp): C++ ops registered as `torch.ops.k3dist.*`, built on first use.

Why: at batch 1 the eager CPU step is bound by its op count, not its bytes. The torch reference runs each KDA layer's
recurrent core as about 100 small ops and each MoE layer as about 40, each a dispatch and an OpenMP region; here each
is one op that reads every byte once (docs/decode.md has the profile). The ops are compiled once per machine and
torch build with torch's own extension builder (a compiler and ninja), into
`$TORCH_EXTENSIONS_DIR` (default ~/.cache/torch_extensions) under a name that hashes the sources, the flags, torch's
version and the CPU's flags; concurrent ranks wait on torch's lock for one build. Where the build fails, `available()`
says why once and the model keeps the torch references (`kernels.backend=cpu` refuses instead).
"""

import functools
import hashlib
import logging
from pathlib import Path

import torch

from .activation import SILU, Activation
from .kda_fused import KDALayer
from .mxfp4 import PackedExperts

log = logging.getLogger("k3dist")

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "kda_decode.cpp",
    "moe_decode.cpp",
    "moe_experts.cpp",
    "moe_route.cpp",
    "int8_mm.cpp",
    "topk_lse.cpp",
    "mla_decode.cpp",
    "linear_rows.cpp",
    "norms.cpp",
    "glu.cpp",
)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]  # no FMA contraction: the reference's roundings


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def _name() -> str:
    h = hashlib.sha256(" ".join(FLAGS + [torch.__version__, _cpu_flags()]).encode())
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    return "k3dist_cpu_" + h.hexdigest()[:16]


def buildable() -> bool:
    """Whether the ops are built here, or look as if they would build (a C++ compiler and ninja on PATH), without
    building them: the what-if plan's question, which must not take a build's minutes."""
    import shutil

    from torch.utils.cpp_extension import _get_build_directory

    name = _name()
    built = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    return built.is_file() or (shutil.which("ninja") is not None and shutil.which("c++") is not None)


@functools.cache
def build_error() -> str | None:
    """Build (or find) and load the ops; None when they loaded, else why not (said once in the log)."""
    try:
        from torch.utils.cpp_extension import load

        load(
            name=_name(),
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=FLAGS,
            extra_include_paths=[str(CSRC)],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: the references still run
        lines = str(exc).strip().splitlines() or [""]
        first_error = next((line.strip() for line in lines if "error:" in line), None)  # the compiler's own words
        why = f"{type(exc).__name__}: {first_error or lines[-1]}"
        log.warning("k3dist: CPU decode kernels unavailable, using the torch references (%s)", why)
        return why
    _register_fakes()
    return None


def _register_fakes() -> None:
    """Shapes for torch.compile (decode.compile=on traces through the ops without running them)."""
    fakes = {
        "kda_decode": _kda_fake,
        "kda_prefill": _kda_prefill_fake,
        "moe_decode": _moe_fake,
        "moe_experts": _moe_fake,
        "moe_route": _moe_route_fake,
        "int8_mm": _int8_fake,
        "topk_lse": _topk_lse_fake,
        "mla_decode": _mla_fake,
        "linear_rows": _linear_rows_fake,
        "rmsnorm": _rmsnorm_fake,
        "res_mix": _res_mix_fake,
        "glu": _glu_fake,
    }
    for name, fake in fakes.items():
        try:
            torch.library.register_fake(f"k3dist::{name}")(fake)
        except RuntimeError:  # already registered in this process
            pass


def _kda_fake(qkv, *_):  # the op's schema: qkv, conv_state, conv_w, g_raw, beta_raw, gate, A_log, dt_bias, ...
    return qkv.new_empty(qkv.shape[0], qkv.shape[2])


def _kda_prefill_fake(qkv, *_):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], qkv.shape[3])


def _moe_fake(x, *_):
    return x.new_empty(x.shape, dtype=torch.float32)


def _moe_route_fake(logits, bias, top_k, renormalize, scale, biased):
    N = logits.shape[0]
    return logits.new_empty(N, top_k, dtype=torch.int64), logits.new_empty(N, top_k)


def _int8_fake(x, q, scales):
    return x.new_empty(x.shape[0], q.shape[0])


def _linear_rows_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def _rmsnorm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=x.dtype if x.dtype == weight.dtype else torch.float32)  # fp32, bf16, fp16 mixed


def _glu_fake(gate_up, act, beta, linear_beta):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _res_mix_fake(candidates, score, eps):
    return candidates[0].new_empty(candidates[0].shape)


def _topk_lse_fake(logits, k):
    B = logits.shape[0]
    f32 = dict(dtype=torch.float32, device=logits.device)
    return torch.empty(B, k, **f32), torch.empty(B, k, dtype=torch.int64, device=logits.device), torch.empty(B, **f32)


def _mla_fake(q, latent, lengths, w_kb, w_vb, scale):
    return q.new_empty(q.shape[0], q.shape[1] * w_vb.shape[1])


def available() -> bool:
    return build_error() is None


def _kda_op(op, inputs: tuple, conv_state, state, layer: KDALayer):
    """The C++ ops take the layer's constants one by one, in their schema's order."""
    (qkv, g_raw, beta_raw, gate), L = inputs, layer
    return op(
        qkv, conv_state, L.conv_w, g_raw, beta_raw, gate, L.A_log, L.dt_bias, L.o_norm, L.eps, L.lower, L.l2_eps, state
    )


def kda_decode(qkv, g_raw, beta_raw, gate, conv_state, state, layer: KDALayer):
    """kernels/kda_fused.py's kda_decode_fused, as one op (same signature, same roundings)."""
    return _kda_op(torch.ops.k3dist.kda_decode, (qkv, g_raw, beta_raw, gate), conv_state, state, layer)


def kda_prefill(qkv, g_raw, beta_raw, gate, conv_state, state, layer: KDALayer):
    """kda_decode over a chunk of T tokens per sequence: qkv [n, T, 3, P], g_raw and gate [n, T, P], beta_raw
    [n, T, H], the states as kda_decode's. Returns [n, T, P]: exactly what decoding the tokens one by one returns."""
    return _kda_op(torch.ops.k3dist.kda_prefill, (qkv, g_raw, beta_raw, gate), conv_state, state, layer)


def moe_decode(
    x,
    logits,
    *,
    bias,
    w13,
    w2,
    shared13,
    shared2,
    top_k: int,
    renormalize: bool,
    scale: float,
    biased: bool,
    act: Activation = SILU,
):
    """A decode MoE block from the router logits [N, E] fp32 on: routing (one group), the chosen experts from the
    stacked w13 [E, 2I, D] / w2 [E, D, I], plus the shared expert (gate_up [2Is, D], down [D, Is], or None), all
    with the activation `act`. Returns [N, D] fp32, as MoE._forward's experts + shared sum before the all-reduce."""
    op = torch.ops.k3dist.moe_decode
    return op(x, logits, bias, w13, w2, shared13, shared2, top_k, renormalize, scale, biased, *_act(act))


def moe_experts(z, ids, weights, w13, w2, *, act: Activation = SILU):
    """The routed experts for any number of tokens (decode rows, prefill): z [N, Z] in the compute dtype (fp32,
    bf16, fp16), ids int64 and weights [N, k] (the router's choice, in top-k order), w13 [E, 2I, Z] (gate rows, then
    up) and w2 [E, Z, I] either dense in z's dtype or MXFP4 (`PackedExperts`, read packed: never widened whole).
    Returns [N, Z] fp32: per token, sum over its choices in order of weight * w2 act(w1 z, w3 z), each projection
    rounded to z's dtype (kernels/moe.py's paths; moe_experts.cpp says how). Packed and dense stacks of the same
    values give the same bits, and a token the same bits whatever tokens came with it."""
    packed = isinstance(w13, PackedExperts)
    if packed != isinstance(w2, PackedExperts):
        raise ValueError("moe_experts: both projections packed (PackedExperts), or neither")
    weight_args = (w13.packed, w13.scale, w2.packed, w2.scale) if packed else (w13, None, w2, None)
    return torch.ops.k3dist.moe_experts(z, ids, weights.float(), *weight_args, *_act(act))


def moe_route(logits, bias, top_k: int, renormalize: bool, scale: float, biased: bool):
    """The sigmoid router's choice from its fp32 logits [N, E] (model/moe.py's `route` after its GEMV, one expert
    group): (expert ids int64 [N, k] in descending order of the biased score, ties to the lower id; their combination
    weights fp32 [N, k])."""
    return torch.ops.k3dist.moe_route(logits, bias, top_k, renormalize, scale, biased)


def _act(act: Activation) -> tuple[int, float, float]:
    return act.code, act.beta, act.linear_beta


# moe_experts.cpp's buffers: phase 1 widens ROWS1 rows (gate and up) of the latent's width, phase 2 ROWS2 rows of the
# expert width, in fp32 at most
ROWS1, ROWS2 = 32, 32


def moe_experts_scratch_bytes(tokens: int, top_k: int, latent: int, width: int, threads: int) -> int:
    """The most moe_experts allocates for `tokens` tokens of `top_k` choices, latent width `latent` (Z), this
    rank's expert width `width` (I), on `threads` threads, its fp32 result included: z in fp32, the pairs' sort,
    the activations [pairs, I] fp32, and per thread the larger phase's buffers (phase 1: its widened rows and the
    outputs of one expert's tokens; phase 2: its widened rows and every pair's outputs for one block of rows). The
    plan counts it beside the packed weight bytes."""
    pairs = tokens * top_k
    shared = tokens * latent * 4 * 2 + pairs * 8 * 2 + pairs * width * 4
    phase1 = ROWS1 * latent * 4 + tokens * (ROWS1 * 4 + 8)
    phase2 = ROWS2 * width * 4 + pairs * ROWS2 * 4 + tokens * 8
    return shared + threads * max(phase1, phase2)


def int8_mm(x, q, scales):
    """x [1, in] times an int8 weight q [out, in] with per-row scales [out]: [1, out] in x's dtype, as torch's
    _weight_int8pack_mm computes it, at the memory bandwidth (batch-1 decode; more rows: torch's op is faster)."""
    return torch.ops.k3dist.int8_mm(x, q, scales)


def linear_rows(x, w):
    """x [M, K] (M <= 16, decode rows) times a contiguous bf16, fp16 or fp32 weight w [N, K]: [M, N] in x's dtype, as
    F.linear computes it, reading the weight once at the memory bandwidth where oneDNN has no units for its dtype."""
    return torch.ops.k3dist.linear_rows(x, w)


def rmsnorm(x, weight, eps: float):
    """kernels/norm.py's rmsnorm as one op: weight * (x * rsqrt(mean(x^2) + eps)) in fp32, the normalised row rounded
    to x's dtype before the weight, the product in the promoted dtype."""
    return torch.ops.k3dist.rmsnorm(x, weight, eps)


def glu(gate_up, act: Activation):
    """kernels/activation.py's glu as one op: act(gate, up) of a gate_up projection's output [..., 2I] (gate rows,
    then up rows), in its dtype."""
    return torch.ops.k3dist.glu(gate_up, *_act(act))


def res_mix(p, bank: tuple, score, eps: float):
    """kernels/norm.py's res_mix as one op (the bank's snapshots and p, all fp32 [..., D]; p itself while the bank is
    empty)."""
    if not bank:
        return p
    return torch.ops.k3dist.res_mix([*bank, p], score, eps)


def topk_lse(logits, k: int):
    """logits [B, V] (any float dtype, rows contiguous) -> (the k largest fp32 [B, k] best first, their ids [B, k],
    the log-sum-exp of each row fp32 [B]), in one pass over each row; among equal values the lower id comes first."""
    return torch.ops.k3dist.topk_lse(logits, k)


def mla_absorbed(q, latent, lengths, w_kb, w_vb, scale: float):
    """MLA's absorbed decode after the cache write: q [B, H, dn + dr], the latent rows [B, L, r + dr], each sequence's
    length [B], kv_b's key and value rows per head (w_kb [H, dn, r], w_vb [H, dv, r]) -> o [B, H * dv], as the torch
    path (model/mla.py) computes it, roundings included."""
    return torch.ops.k3dist.mla_decode(q, latent, lengths, w_kb, w_vb, scale)
