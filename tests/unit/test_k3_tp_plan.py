"""Kimi K3's TP plan (docs/model.md, "Kimi K3's TP plan"): heads split as today, the attention-residual vectors
and K3's padded A_log replicated, the latent MoE's down projection split by latent row, its norm replicated, its up
projection split by latent column, and the MXFP4 experts split as their weights with every group of 32 on one rank;
at world 1, 2, 4 and 8 on the real 2.78T shape, and every tensor of the K3 twin."""

import math

import pytest
import torch

from k3dist.config import load_config, validate_topology
from k3dist.kinds.spec import COLUMN, REPLICATED, ROW, VOCAB
from k3dist.weights.tp_plan import plan_rank, store_shapes
from k3dist.weights.whatif import config_entries
from tests.support.configs import CONFIGS

REAL, TWIN = CONFIGS / "Kimi-K3-2.8T-A50B-config.json", CONFIGS / "Kimi-K3-twin-0.4B-config.json"
L = "model.layers."
MOE = L + "1.block_sparse_moe."
# canonical name -> (axis, the dim it splits: checked against the shard sizes)
EXPECTED = {
    "model.embed_tokens.weight": VOCAB,
    "lm_head.weight": VOCAB,
    "model.output_attn_res_proj.weight": REPLICATED,
    "model.output_attn_res_norm.weight": REPLICATED,
    L + "0.self_attention_res_proj.weight": REPLICATED,
    L + "0.mlp_res_proj.weight": REPLICATED,
    L + "0.self_attention_res_norm.weight": REPLICATED,
    L + "0.self_attn.q_proj.weight": COLUMN,
    L + "0.self_attn.q_conv1d.weight": COLUMN,
    L + "0.self_attn.f_a_proj.weight": REPLICATED,
    L + "0.self_attn.f_b_proj.weight": COLUMN,
    L + "0.self_attn.b_proj.weight": COLUMN,
    L + "0.self_attn.A_log": REPLICATED,  # [128], padded past the 96 heads
    L + "0.self_attn.dt_bias": COLUMN,
    L + "0.self_attn.g_proj.weight": COLUMN,  # full-rank gate, by head
    L + "0.self_attn.o_norm.weight": REPLICATED,
    L + "0.self_attn.o_proj.weight": ROW,
    L + "0.mlp.gate_proj.weight": COLUMN,
    L + "0.mlp.down_proj.weight": ROW,
    L + "3.self_attn.q_a_proj.weight": REPLICATED,
    L + "3.self_attn.q_a_layernorm.weight": REPLICATED,
    L + "3.self_attn.q_b_proj.weight": COLUMN,
    L + "3.self_attn.kv_a_proj_with_mqa.weight": REPLICATED,
    L + "3.self_attn.kv_b_proj.weight": COLUMN,
    L + "3.self_attn.g_proj.weight": COLUMN,
    L + "3.self_attn.o_proj.weight": ROW,
    MOE + "gate.weight": REPLICATED,
    MOE + "gate.e_score_correction_bias": REPLICATED,
    MOE + "routed_expert_down_proj.weight": COLUMN,
    MOE + "routed_expert_norm.weight": REPLICATED,
    MOE + "routed_expert_up_proj.weight": ROW,
    MOE + "shared_experts.gate_proj.weight": COLUMN,
    MOE + "shared_experts.down_proj.weight": ROW,
    MOE + "experts.0.w1.weight_packed": COLUMN,
    MOE + "experts.0.w3.weight_scale": COLUMN,
    MOE + "experts.895.w2.weight_packed": ROW,
    MOE + "experts.895.w2.weight_scale": ROW,
}


def plans_by_rank(cfg, entries, world):
    return [{p.name: p for p in plan_rank(cfg, entries, world, r, torch.bfloat16)} for r in range(world)]


def check_split(name, ranks, world):
    """The ranks' pieces tile the tensor's split dim in rank order, each of an equal share where world divides it."""
    pieces = [r[name] for r in ranks]
    axis = pieces[0].axis
    full = pieces[0].full_shape
    if axis.dim is None:
        assert all(p.local_shape == full for p in pieces), name
        return
    n = full[axis.dim]
    assert [(p.start, p.stop) for p in pieces] == [(i * n // world, (i + 1) * n // world) for i in range(world)], name
    assert sum(math.prod(p.local_shape) for p in pieces) == math.prod(full), name


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_the_k3_tensors_at_the_real_shape(world):
    cfg = load_config(REAL)
    validate_topology(cfg, world)
    entries = [e for e in config_entries(cfg) if e.name in EXPECTED]  # one layer of each kind, two experts
    assert len(entries) == len(EXPECTED)
    ranks = plans_by_rank(cfg, entries, world)
    for name, axis in EXPECTED.items():
        assert ranks[0][name].axis == axis, name
        check_split(name, ranks, world)
    for r in ranks:
        a_log = r[L + "0.self_attn.A_log"]
        assert a_log.local_shape == (128,) and a_log.dtype == torch.float32
        assert r[L + "0.self_attn.q_proj.weight"].local_shape == (12288 // world, 7168)  # 96 heads of 128
        assert r[MOE + "routed_expert_up_proj.weight"].local_shape == (7168, 3584 // world)
        assert r[MOE + "routed_expert_down_proj.weight"].local_shape == (3584 // world, 7168)
        packed, scale = r[MOE + "experts.895.w2.weight_packed"], r[MOE + "experts.895.w2.weight_scale"]
        # the down projection's 3072 inputs: whole groups of 32 on each rank, codes and scales alike
        assert packed.dtype == scale.dtype == torch.uint8
        assert packed.local_shape == (3584, 1536 // world) and scale.local_shape == (3584, 96 // world)
        assert packed.start * 2 == scale.start * 32 and packed.stop * 2 == scale.stop * 32
        assert r[MOE + "experts.0.w1.weight_packed"].local_shape == (3072 // world, 1792)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_tensor_of_the_k3_twin(world):
    cfg = load_config(TWIN)
    validate_topology(cfg, world)
    entries = config_entries(cfg)
    ranks = plans_by_rank(cfg, entries, world)
    for e in entries:
        check_split(e.name, ranks, world)
    shapes = store_shapes(list(ranks[0].values()))
    x = "model.layers.1.block_sparse_moe.experts."
    assert shapes[x + "w13_packed"] == ((64, 2 * 128 // world, 256), torch.uint8)  # 64 experts, w1 and w3 fused
    assert shapes[x + "w2_scale"] == ((64, 512, 4 // world), torch.uint8)
    # the projections of one input fused, each rank's rows part after part (model/kda.py, mla.py, latent_moe.py read
    # them in this order): KDA's q, k, v, f_a, b and full-rank gate; MLA's latent, q-LoRA down and output gate; the
    # latent MoE's down projection and the shared experts' gate and up
    P, d, H, r, dr, q, dv = 8 * 128 // world, 128, 8 // world, 512, 64, 384, 8 * 128 // world
    kda, mla, moe = "model.layers.1.self_attn.", "model.layers.3.self_attn.", "model.layers.1.block_sparse_moe."
    assert shapes[kda + "in_proj.weight"] == ((3 * P + d + H + P, 1024), torch.bfloat16)
    assert shapes[mla + "q_kv_a_proj.weight"] == ((r + dr + q + dv, 1024), torch.bfloat16)
    assert shapes[moe + "in_proj.weight"] == ((512 // world + 2 * 256 // world, 1024), torch.bfloat16)
    by = ranks[0]
    rows = [by[kda + n + ".weight"].row for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_proj")]
    assert rows == [0, P, 2 * P, 3 * P, 3 * P + d, 3 * P + d + H]
    rows = [by[mla + n + ".weight"].row for n in ("kv_a_proj_with_mqa", "q_a_proj", "g_proj")]
    assert rows == [0, r + dr, r + dr + q]
    rows = [
        by[moe + n + ".weight"].row
        for n in ("routed_expert_down_proj", "shared_experts.gate_proj", "shared_experts.up_proj")
    ]
    assert rows == [0, 512 // world, 512 // world + 256 // world]
    local = sum(p.local_bytes for r in ranks for p in r.values())
    replicated = sum(p.local_bytes for p in ranks[0].values() if p.axis == REPLICATED)
    full = sum(math.prod(e.shape) * p.dtype.itemsize for e, p in zip(entries, ranks[0].values(), strict=True))
    assert local == full + (world - 1) * replicated  # shards add up to one copy, plus the replicated ones per rank
