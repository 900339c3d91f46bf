"""Decode's memory roofline: the bytes one decode step must read on a rank, counted from the config, and the
bandwidths this machine gives torch's own bf16 matrix-vector product and a plain copy.

A batch-1 decode step is a chain of matrix-vector products, so its floor is (bytes it must read) / (bandwidth a GEMV
reaches here). The GEMV bandwidth, not the DRAM datasheet, is the fair ceiling for a runtime built on torch's kernels;
the copy bandwidth is shown beside it as the DRAM roofline.
"""

import statistics
import time

import torch
import torch.nn.functional as F

from k3dist.config import ModelConfig
from k3dist.weights.tp_plan import shard_range


def local_size(size: int, world: int, rank: int) -> int:
    """Rows of a `size`-row tensor split over `world` ranks that `rank` holds (the TP plan's ceil split)."""
    start, stop = shard_range(size, world, rank)
    return stop - start


def decode_read_bytes(
    cfg: ModelConfig, world: int, itemsize: int, position: float, batch: int = 1, experts: int | None = None, rank=0
) -> dict[str, float]:
    """Bytes one decode step reads on `rank` of `world` with weights of `itemsize` bytes: weights, cache, total.

    Weights, once per step whatever the batch: the LM head's vocab slice [V/world, D] and the final norm; per layer
    its two norms; KDA: the fused input projection (q, k, v and b by head, the replicated f_a and g_a), the three
    short-conv filters, f_b and g_b, o_norm, the fp32 A_log and dt_bias, o_proj's slice; MLA: the fused q + kv_a
    projection, kv_a_layernorm, kv_b_proj and o_proj slices; dense MLP: gate_up and down slices; MoE: the fp32 router
    weight and bias, the w13 + w2 slices of `experts` routed experts (default top_k, i.e. batch 1), the shared
    expert's slices. Per sequence: one embedding row, and the cache read: each KDA layer's conv window and fp32
    recurrent state, each MLA layer's latent rows 0..position.
    Not counted: writes (states, the new latent row), activations, collectives, the gathered logits.
    With experts = num_experts and the whole embedding slice instead of one row this is the rank's local_bytes
    (`resident_weight_bytes`, checked against the plan).
    """
    s, D = itemsize, cfg.hidden_size
    loc = lambda size: local_size(size, world, rank)  # noqa: E731
    experts = cfg.top_k if experts is None else experts
    weights = local_size(cfg.vocab_size, world, rank) * D * s + D * s  # LM head slice, final norm
    cache = batch * D * s  # embedding rows
    for spec in cfg.layers:
        weights += 2 * D * s
        if spec.mixer == "kda":
            H, d, P, K = loc(cfg.kda_heads), cfg.kda_head_dim, loc(cfg.kda_dim), cfg.conv_kernel
            weights += (3 * P + 2 * d + H) * D * s + 3 * P * K * s + 2 * P * d * s + d * s + (H + P) * 4
            weights += D * P * s
            cache += batch * (3 * P * (K - 1) * s + H * d * d * 4)
        else:
            r, dr = cfg.kv_lora_rank, cfg.qk_rope_dim
            q_rows = loc(cfg.mla_heads * cfg.qk_head_dim)
            weights += (q_rows + r + dr) * D * s + r * s
            weights += loc(cfg.mla_heads * (cfg.qk_nope_dim + cfg.v_head_dim)) * r * s
            weights += D * loc(cfg.mla_heads * cfg.v_head_dim) * s
            cache += batch * (position + 1) * (r + dr) * s
        if spec.mlp == "dense":
            weights += 3 * loc(cfg.intermediate_size) * D * s
        else:
            weights += cfg.num_experts * (D + 1) * 4 + experts * 3 * loc(cfg.expert_size) * D * s
            if cfg.num_shared_experts:
                weights += 3 * loc(cfg.shared_size) * D * s
    return {"weights": weights, "cache": cache, "total": weights + cache}


def resident_weight_bytes(cfg: ModelConfig, world: int, itemsize: int, rank: int = 0) -> int:
    """Every weight byte the rank holds, by the same count: all experts, the whole embedding slice."""
    step = decode_read_bytes(cfg, world, itemsize, position=0, batch=0, experts=cfg.num_experts, rank=rank)
    return int(step["weights"]) + local_size(cfg.vocab_size, world, rank) * cfg.hidden_size * itemsize


def plan_mismatches(cfg: ModelConfig, world: int, dtype: torch.dtype, plan: list[dict] | None = None) -> list[str]:
    """Ranks where the count above differs from the plan's local_bytes: the what-if plan from the config, and
    `plan` (a result.json's, from the checkpoint headers) when given. Empty when the count is right."""
    from k3dist.weights.whatif import plan_all_ranks

    plans = {"config plan": [p.as_dict() for p in plan_all_ranks(cfg, None, world, dtype, 0)]}
    if plan:
        plans["run's plan"] = plan
    out = []
    for name, ranks in plans.items():
        for p in ranks:
            counted = resident_weight_bytes(cfg, world, dtype.itemsize, p["rank"])
            if counted != p["local_bytes"]:
                out.append(
                    f"world {world} rank {p['rank']}: counted {counted} != {name} local_bytes {p['local_bytes']}"
                )
    return out


def _median_seconds(fn, device: str, repeats: int, inner: int) -> float:
    for _ in range(2):  # warm-up: first-call costs, pages of the buffers
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def gemv_bandwidth(rows: int, cols: int, device: str = "cpu", repeats: int = 7) -> float:
    """GB/s of torch's bf16 `F.linear(x[1, cols], W[rows, cols])`: W's bytes / the median call (warm-up excluded)."""
    w = torch.randn(rows, cols, device=device).to(torch.bfloat16)
    x = torch.randn(1, cols, device=device).to(torch.bfloat16)
    with torch.inference_mode():
        seconds = _median_seconds(lambda: F.linear(x, w), device, repeats, 20 if device == "cuda" else 1)
    return w.numel() * w.element_size() / seconds / 1e9


def packed_gemv_bandwidth(rows: int, cols: int, repeats: int = 7) -> float | None:
    """GB/s of the same GEMV on a oneDNN-prepacked weight (what k3dist's CPU decode uses where oneDNN has bf16
    kernels, k3dist/model/linear.py); None where packing is not available."""
    from k3dist.model.linear import Linear, packable

    if not packable(torch.bfloat16, torch.device("cpu")):
        return None
    w = Linear(torch.randn(rows, cols).to(torch.bfloat16), pack=True)
    x = torch.randn(1, cols).to(torch.bfloat16)
    with torch.inference_mode():
        seconds = _median_seconds(lambda: w(x), "cpu", repeats, 1)
    return rows * cols * 2 / seconds / 1e9


def copy_bandwidth(nbytes: int = 256 * 2**20, device: str = "cpu", repeats: int = 7) -> float:
    """GB/s of a large `copy_` (bytes read + bytes written): the DRAM (or HBM) roofline."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), device, repeats, 10 if device == "cuda" else 1)
    return 2 * nbytes / seconds / 1e9
