"""Routed experts without host syncs: gathered expert weights for decode, sorted groups for prefill (the dense
GEMM-pair holder of every expert is the model's: k3dist/model/experts.py).

Weights are stacked per rank: w13 [E, 2I, D] (w1 = gate rows first, then w3 = up) and w2 [E, D, I], I = this rank's
slice of the expert size; each a tensor in the compute dtype, or MXFP4 bytes (`mxfp4.PackedExperts`), which the
paths widen an expert at a time (decode: the chosen ones; grouped: one per group, through grouped_mm's loop).
`act` is the gated activation as a value (activation.py: SiLU for Kimi-Linear, SiTU for K3), chosen once from the
config. Every path returns the per-token sum of weighted expert outputs in fp32, equal to a loop over experts
(`experts_loop`, the oracle).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from k3dist.base import compat

from .activation import SILU, Activation
from .mxfp4 import PackedExperts

Experts = Tensor | PackedExperts


def experts_gathered(
    x: Tensor, ids: Tensor, weights: Tensor, w13: Experts, w2: Experts, act: Activation = SILU
) -> Tensor:
    """Few tokens (decode): gather each token's chosen experts' weights and run them as batched GEMVs.

    x: [N, D]; ids, weights: [N, k]. Static shapes, no host sync. Returns [N, D] fp32.
    """
    N, k = ids.shape
    flat = ids.reshape(-1)
    rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [N*k, D, 1]: token n for each of its k experts
    gate, up = torch.bmm(w13.index_select(0, flat), rows).squeeze(-1).chunk(2, dim=-1)  # [N*k, I] each
    y = torch.bmm(w2.index_select(0, flat), act(gate, up).unsqueeze(-1)).view(N, k, -1)  # [N, k, D]
    return (y.float() * weights.unsqueeze(-1)).sum(1)


def grouped_mm(x: Tensor, w: Experts, offsets: Tensor) -> Tensor:
    """Rows of x grouped by expert (group e ends at offsets[e]) times w[e]^T: x [M, D], w [E, O, D] -> [M, O].

    A loop over the groups, for a torch without the grouped GEMM (compat.NEWER) or a dtype or device its kernel
    refuses. It reads the offsets on the host (one sync per call on CUDA), in fp32 on the CPU: oneDNN compiles and
    keeps a kernel for every new bf16 GEMM shape (about 0.7 MiB each, milliseconds to build), and group sizes change
    with every chunk, so bf16 here would make memory grow through a long run. fp32 products of bf16 values, summed in
    fp32, are what a bf16 GEMM computes too; the result is rounded once to x's dtype. Rows past the last group are
    left as they are.
    """
    compute = torch.float32 if x.device.type == "cpu" else x.dtype
    out, start = x.new_zeros(x.shape[0], w.shape[1]), 0
    for e, stop in enumerate(offsets.tolist()):
        if stop > start:
            out[start:stop] = (x[start:stop].to(compute) @ w[e].to(compute).T).to(x.dtype)
        start = stop
    return out


def _grouped(x: Tensor, w: Experts, offsets: Tensor) -> Tensor:
    """torch's grouped GEMM where it takes these operands (one kernel, offsets read on the device), else the loop
    (packed experts always: it widens one expert at a time)."""
    if isinstance(w, Tensor) and _grouped_mm_usable(x, w.shape[1], w.shape[2]):
        try:
            return compat.grouped_mm(x, w.transpose(1, 2), offsets.to(torch.int32))
        except RuntimeError:  # an alignment or architecture this build's kernel refuses (CUDA before sm90)
            pass
    return grouped_mm(x, w, offsets)


PAD_ROWS = 32  # CPU prefill pads each expert's rows to a multiple of this (see experts_grouped)


def experts_grouped(
    x: Tensor, ids: Tensor, weights: Tensor, w13: Experts, w2: Experts, act: Activation = SILU
) -> Tensor:
    """Many tokens (prefill): sort the (token, choice) pairs by expert, one grouped GEMM per projection.

    x: [N, D]; ids, weights: [N, k]. Returns [N, D] fp32. Nothing is read on the host where torch has the grouped
    GEMM: the rows' buffer has a size fixed by N, k and the expert count, and the group ends stay on the device. On
    a CPU each expert's rows are padded with zero rows to a multiple of PAD_ROWS: oneDNN builds and keeps one kernel
    per GEMM shape, and padding bounds the shapes to N k / PAD_ROWS per weight, so the cache stops growing with the
    prompts' lengths (docs/memory.md), and the grouped GEMM stays faster than the fp32 loop (BENCHMARKS.md,
    "Measurements behind the code"). Rows past the last group are never read back.
    """
    N, k = ids.shape
    E = w13.shape[0]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    grouped = isinstance(w13, Tensor) and _grouped_mm_usable(x, w13.shape[-1], w2.shape[-1])
    pad = PAD_ROWS if x.device.type == "cpu" and grouped else 1
    counts = _group_counts(flat, E)
    padded = (counts + pad - 1) // pad * pad
    ends = padded.cumsum(0)
    rows, dest = x[token], None
    if pad > 1:  # each pair's row in the padded groups; the buffer holds the most the padding can take
        expert = flat[order]
        dest = (ends - padded)[expert] + torch.arange(len(flat), device=x.device) - (counts.cumsum(0) - counts)[expert]
        rows = x.new_zeros(padded_rows(N, k, E, pad), x.shape[1]).index_copy_(0, dest, rows)
    gate, up = _grouped(rows, w13, ends).chunk(2, dim=-1)
    y = _grouped(act(gate, up), w2, ends)  # [rows, D]
    y = y if dest is None else y[dest]  # [N*k, D], in sorted order
    out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, y.float() * weights.reshape(-1)[order, None])


def padded_rows(tokens: int, top_k: int, experts: int, pad: int = PAD_ROWS) -> int:
    """The most rows experts_grouped sorts `tokens` tokens into when each expert's group is padded to `pad` rows (the
    memory plan counts them)."""
    pairs = tokens * top_k
    return pairs + min(experts, pairs) * (pad - 1)


def _grouped_mm_usable(x: Tensor, *sizes: int) -> bool:
    """torch._grouped_mm is in this torch, for this device and dtype, and rows of these sizes meet its 16-byte stride
    rule."""
    aligned = all(n * x.element_size() % 16 == 0 for n in sizes)
    return aligned and compat.has("torch._grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


def experts_sorted(
    x: Tensor, ids: Tensor, weights: Tensor, w13: Experts, w2: Experts, act: Activation = SILU
) -> Tensor:
    """Decode with more (token, expert) pairs than experts: sort them by expert and run torch._grouped_mm, which takes
    the group ends as a device tensor (no host sync), so each chosen expert's weights are read once instead of once
    per token that chose it. Falls back to `experts_gathered` where the build has no grouped GEMM for this dtype;
    packed experts take `experts_grouped`'s loop, which widens each chosen expert once."""
    if not isinstance(w13, Tensor):
        return experts_grouped(x, ids, weights, w13, w2, act)
    if (
        not _grouped_mm_usable(x, w13.shape[-1], w2.shape[-1]) or torch.compiler.is_compiling()
    ):  # its compile-time rule wants bf16 only
        return experts_gathered(x, ids, weights, w13, w2, act)
    N, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    ends = _group_ends(flat, w13.shape[0]).to(torch.int32)
    gate, up = compat.grouped_mm(x[token], w13.transpose(1, 2), ends).chunk(2, dim=-1)
    y = compat.grouped_mm(act(gate, up), w2.transpose(1, 2), ends)
    out = torch.zeros(N, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, y.float() * weights.reshape(-1)[order, None])


def _group_counts(flat: Tensor, experts: int) -> Tensor:
    """How many pairs chose each expert, with a static shape (bincount would size its output from the data: a host
    sync on CUDA)."""
    return torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def _group_ends(flat: Tensor, experts: int) -> Tensor:
    """Where each expert's group ends in the sorted pairs."""
    return _group_counts(flat, experts).cumsum(0)


def experts_loop(x: Tensor, ids: Tensor, weights: Tensor, w13: Experts, w2: Experts, act: Activation = SILU) -> Tensor:
    """The oracle: one gated MLP per expert over the tokens that chose it (host syncs; tests only)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token, choice = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(act(gate, up), w2[e])
        out.index_add_(0, token, y.float() * weights[token, choice, None])
    return out
