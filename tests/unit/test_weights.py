"""The weight pipeline's contracts: the TP plan table, the plan figures of the real 48B config, topology validation,
the twin writer's layout (and transformers loading it), dense-MLP key aliases (copy_shard: test_copy_shard.py).

Every checkpoint here is a real safetensors file in a tmp dir; multi-rank checks run real gloo ranks.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3dist.base.errors import K3Error
from k3dist.config import load_config, parse_config, validate_topology
from k3dist.twin.checkpoint import write_checkpoint
from k3dist.weights.inventory import INDEX, scan
from k3dist.weights.schema import expected_tensors
from k3dist.weights.tp_plan import (
    copy_shard,
    plan_rank,
    plan_tensor,
    store_shapes,
)
from k3dist.weights.whatif import config_entries, plan_all_ranks
from tests.support.configs import small_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "k3dist" / "configs"
TWIN_CONFIG = CONFIGS / "Kimi-K3-0.40B-config.json"
REAL_CONFIG = CONFIGS / "Kimi-Linear-48B-A3B-config.json"


# ---------------------------------------------------------------------------------------------- the TP plan table


def _design_table(cfg) -> dict[str, str]:
    """The TP plan table (docs/model.md), restated name by name for a config: canonical name -> axis name."""
    out = {"model.embed_tokens.weight": "vocab", "lm_head.weight": "vocab", "model.norm.weight": "replicated"}
    kda = {
        **dict.fromkeys(["q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d"], "column"),
        **dict.fromkeys(["f_b_proj", "g_b_proj", "b_proj"], "column"),
        **dict.fromkeys(["f_a_proj", "g_a_proj", "o_norm"], "replicated"),
        "o_proj": "row",
    }
    mla = {"q_proj": "column", "kv_b_proj": "column", "kv_a_proj_with_mqa": "replicated"}
    mla |= {"kv_a_layernorm": "replicated", "o_proj": "row"}
    for spec in cfg.layers:
        p = f"model.layers.{spec.index}."
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = "replicated"
        a = p + "self_attn."
        out |= {f"{a}{k}.weight": v for k, v in (kda if spec.mixer == "kda" else mla).items()}
        if spec.mixer == "kda":
            out |= {a + "A_log": "heads", a + "dt_bias": "column"}
        if spec.mlp == "dense":
            out |= {p + "mlp.gate_proj.weight": "column", p + "mlp.up_proj.weight": "column"}
            out[p + "mlp.down_proj.weight"] = "row"
            continue
        m = p + "block_sparse_moe."
        out |= {m + "gate.weight": "replicated", m + "gate.e_score_correction_bias": "replicated"}
        for e in range(cfg.num_experts):
            out |= {f"{m}experts.{e}.w1.weight": "column", f"{m}experts.{e}.w3.weight": "column"}
            out[f"{m}experts.{e}.w2.weight"] = "row"
        for k, v in (("gate_proj", "column"), ("up_proj", "column"), ("down_proj", "row")):
            out[f"{m}shared_experts.{k}.weight"] = v
    return out


def test_tp_plan_table_on_the_twin_at_world_2():
    cfg = load_config(TWIN_CONFIG)
    table = _design_table(cfg)
    schema = expected_tensors(cfg)
    assert set(table) == set(schema)  # the restated table covers every tensor of the twin, nothing more
    inputs = config_entries(cfg)
    ranks = [plan_rank(cfg, inputs, 2, r, torch.bfloat16) for r in range(2)]
    dims = {"vocab": 0, "column": 0, "row": 1, "heads": 2, "replicated": None}
    for i, (name, shape) in enumerate(schema.items()):
        plans = [ranks[r][i] for r in range(2)]
        assert all(p.name == name and p.full_shape == shape for p in plans)
        want = table[name]
        assert [p.axis.name for p in plans] == [want, want], name
        assert plans[0].axis.dim == dims[want], name
        total = sum(p.numel for p in plans)
        if want == "replicated":
            assert [p.local_shape for p in plans] == [shape, shape]
        else:
            d = dims[want]
            assert [p.local_shape[d] for p in plans] == [shape[d] // 2] * 2, name
            assert (plans[0].start, plans[0].stop, plans[1].start, plans[1].stop) == (
                0,
                shape[d] // 2,
                shape[d] // 2,
                shape[d],
            )
            assert total == math.prod(shape), name
    # spot-check the shapes the model relies on (P = 8 heads x 128; MLA 8 heads; experts 16 x 64)
    by = {p.name: p for p in ranks[1]}
    L1, L4 = "model.layers.1.self_attn.", "model.layers.3.self_attn."  # KDA layer 2, MLA layer 4 (1-based)
    assert by[L1 + "q_proj.weight"].local_shape == (512, 1024)
    assert by[L1 + "q_conv1d.weight"].local_shape == (512, 1, 4)
    assert by[L1 + "A_log"].local_shape == (1, 1, 4, 1) and by[L1 + "A_log"].dtype == torch.float32
    assert by[L1 + "dt_bias"].local_shape == (512,) and by[L1 + "dt_bias"].dtype == torch.float32
    assert by[L1 + "b_proj.weight"].local_shape == (4, 1024)
    assert by[L1 + "o_proj.weight"].local_shape == (1024, 512)
    assert by[L4 + "q_proj.weight"].local_shape == (4 * 96, 1024)
    assert by[L4 + "kv_b_proj.weight"].local_shape == (4 * 128, 128)
    assert by[L4 + "kv_a_proj_with_mqa.weight"].local_shape == (160, 1024)
    assert by["lm_head.weight"].local_shape == by["model.embed_tokens.weight"].local_shape == (81920, 1024)
    router = by["model.layers.1.block_sparse_moe.gate.weight"]
    assert router.local_shape == (16, 1024) and router.dtype == torch.float32
    # the store: fused and stacked destinations, each slice at its rows (schema.placements)
    shapes = store_shapes(ranks[1])
    assert shapes["model.layers.1.block_sparse_moe.experts.w13"] == ((16, 64, 1024), torch.bfloat16)
    assert shapes["model.layers.1.block_sparse_moe.experts.w2"] == ((16, 1024, 32), torch.bfloat16)
    assert shapes[L1 + "in_proj.weight"] == ((3 * 512 + 2 * 128 + 4, 1024), torch.bfloat16)
    assert shapes[L1 + "conv1d.weight"] == ((3, 512, 1, 4), torch.bfloat16)
    assert shapes[L1 + "fg_b_proj.weight"] == ((2, 512, 128), torch.bfloat16)
    assert shapes[L4 + "q_kv_a_proj.weight"] == ((4 * 96 + 160, 1024), torch.bfloat16)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == ((1024, 1024), torch.bfloat16)
    rows = {n: (by[L1 + n].row, by[L1 + n].local_shape[0]) for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
    rows |= {
        n: (by[L1 + n].row, by[L1 + n].local_shape[0]) for n in ("f_a_proj.weight", "g_a_proj.weight", "b_proj.weight")
    }
    assert list(rows.values()) == [(0, 512), (512, 512), (1024, 512), (1536, 128), (1664, 128), (1792, 4)]
    w3 = by["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    assert (w3.dest, w3.slot, w3.row) == ("model.layers.1.block_sparse_moe.experts.w13", 5, 32)
    assert sum(p.local_bytes for p in ranks[1]) == sum(math.prod(s) * d.itemsize for s, d in shapes.values())


# ---------------------------------------------------------------------------------------------- the real 48B config


def test_plan_figures_of_the_real_48b_config():
    cfg = load_config(REAL_CONFIG)
    inputs = config_entries(cfg)
    one = plan_rank(cfg, inputs, 1, 0, torch.bfloat16)
    assert len(one) == 20_493
    assert sum(p.numel for p in one) == 49_122_681_728
    (w1,) = plan_all_ranks(cfg, None, 1, torch.bfloat16, 2**62)
    assert w1.tensors == 20_493 and w1.source_bytes == 2 * 49_122_681_728
    assert w1.replicated_bytes > 0 and w1.fits
    for world in (2, 8):  # (4 shows nothing that 2 and 8 do not)
        plans = plan_all_ranks(cfg, None, world, torch.bfloat16, 2**62)
        assert [p.rank for p in plans] == list(range(world))
        assert {p.replicated_bytes for p in plans} == {w1.replicated_bytes}
        assert sum(p.local_bytes for p in plans) == w1.local_bytes + (world - 1) * w1.replicated_bytes
        assert sum(p.source_bytes for p in plans) == w1.source_bytes + (world - 1) * sum(
            p.source_bytes for p in one if p.axis.dim is None
        )
        assert all(p.tensors == 20_493 for p in plans)


# ---------------------------------------------------------------------------------------------- topology


def test_validate_topology_on_the_twin():
    cfg = load_config(TWIN_CONFIG)
    for world in (1, 2, 4, 8):
        validate_topology(cfg, world)
    with pytest.raises(K3Error) as err:
        validate_topology(cfg, 3)
    msg = str(err.value)
    assert str(TWIN_CONFIG) in msg and "world size 3" in msg
    assert "num_heads)=8" in msg and "num_attention_heads)=8" in msg and "moe_intermediate_size)=64" in msg
    assert "[1, 2, 4, 8]" in msg
    with pytest.raises(K3Error, match=r"world size 16 .*=8"):
        validate_topology(cfg, 16)
    with pytest.raises(K3Error, match="must be >= 1"):
        validate_topology(cfg, 0)


def test_validate_topology_on_the_real_config():
    cfg = load_config(REAL_CONFIG)
    for world in (1, 2, 4, 8, 16, 32):
        validate_topology(cfg, world)
    with pytest.raises(K3Error, match=r"world size 6 does not divide .*=32"):
        validate_topology(cfg, 6)


# ---------------------------------------------------------------------------------------------- the twin checkpoint


def test_twin_writer_layout(twin_dir):
    cfg = load_config(twin_dir)
    index = json.loads((twin_dir / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == sorted(p.name for p in twin_dir.glob("*.safetensors"))
    assert all(f.startswith("model-") and f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    schema = expected_tensors(cfg)
    assert set(index["weight_map"]) == set(schema)
    names, total = {}, 0
    for f in files:
        with safe_open(twin_dir / f, framework="pt") as h:
            for key in h.keys():
                s = h.get_slice(key)
                names[key] = (tuple(s.get_shape()), s.get_dtype())
                total += math.prod(s.get_shape()) * 2
                assert index["weight_map"][key] == f
    assert {k: v[0] for k, v in names.items()} == schema
    assert {v[1] for v in names.values()} == {"BF16"}
    assert index["metadata"]["total_size"] == total
    # original Hugging Face names
    assert "model.layers.1.self_attn.q_conv1d.weight" in names
    assert "model.layers.1.block_sparse_moe.experts.15.w1.weight" in names
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(k.startswith("model.layers.0.block_sparse_moe.") for k in names)
    with safe_open(twin_dir / index["weight_map"]["model.layers.1.self_attn.A_log"], framework="pt") as h:
        a_log = h.get_tensor("model.layers.1.self_attn.A_log").float()
    bf16_ulp = 2.0**-6  # spacing of bf16 values in [2, 4)
    assert a_log.min() >= math.log(1.0) and a_log.max() <= math.log(16.0) + bf16_ulp
    assert a_log.max() - a_log.min() > 0.5  # drawn, not constant
    for key in [k for k in names if k.endswith("norm.weight")]:
        with safe_open(twin_dir / index["weight_map"][key], framework="pt") as h:
            assert torch.equal(h.get_tensor(key), torch.ones(names[key][0], dtype=torch.bfloat16)), key
    inv = scan(twin_dir, cfg)
    assert list(inv.entries) == list(schema) and inv.files == tuple(files)


def test_transformers_loads_the_twin_without_key_problems(twin_dir):
    from transformers import KimiLinearForCausalLM

    model, info = KimiLinearForCausalLM.from_pretrained(twin_dir, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info.get("error_msgs"), info
    index = json.loads((twin_dir / INDEX).read_text())["weight_map"]
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight"):
        with safe_open(twin_dir / index[key], framework="pt") as h:
            assert torch.equal(model.state_dict()[key], h.get_tensor(key)), key


# ---------------------------------------------------------------------------------------------- key aliases


def test_inventory_maps_save_pretrained_dense_mlp_names(tmp_path):
    raw = small_config()
    d = write_checkpoint(raw, tmp_path / "m", seed=3, shard_bytes=200_000)
    index = json.loads((d / INDEX).read_text())
    renames = {
        f"model.layers.0.mlp.{p}.weight": f"model.layers.0.block_sparse_moe.{p}.weight"
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    originals = {}
    for file in sorted({index["weight_map"][k] for k in renames}):
        with safe_open(d / file, framework="pt") as h:
            tensors = {k: h.get_tensor(k).clone() for k in h.keys()}
        originals |= {k: v for k, v in tensors.items() if k in renames}
        save_file({renames.get(k, k): v for k, v in tensors.items()}, str(d / file), metadata={"format": "pt"})
    index["weight_map"] = {renames.get(k, k): v for k, v in index["weight_map"].items()}
    (d / INDEX).write_text(json.dumps(index))
    cfg = parse_config(raw)
    inv = scan(d, cfg)
    assert list(inv.entries) == list(expected_tensors(cfg))
    for canon, saved in renames.items():
        entry = inv.entries[canon]
        assert entry.name == canon and entry.key == saved
        plan = plan_tensor(entry, 2, 1, torch.bfloat16)
        with safe_open(d / entry.file, framework="pt") as h:
            piece = copy_shard(h, plan)
        full = originals[canon]
        assert torch.equal(piece, full.narrow(plan.axis.dim, plan.start, plan.stop - plan.start))
    # both spellings at once is one tensor twice
    with safe_open(d / index["weight_map"][renames["model.layers.0.mlp.up_proj.weight"]], framework="pt") as h:
        extra = {"model.layers.0.mlp.up_proj.weight": h.get_tensor("model.layers.0.block_sparse_moe.up_proj.weight")}
    save_file(extra, str(d / "model-extra.safetensors"))
    (d / INDEX).unlink()
    with pytest.raises(
        K3Error, match=r"model-extra.safetensors: tensor model.layers.0.mlp.up_proj.weight is duplicated"
    ):
        scan(d, cfg)


def test_write_checkpoint_is_deterministic_per_seed(tmp_path):
    raw = small_config()
    a = write_checkpoint(raw, tmp_path / "a", seed=1, shard_bytes=200_000)
    b = write_checkpoint(raw, tmp_path / "b", seed=1, shard_bytes=200_000)
    c = write_checkpoint(raw, tmp_path / "c", seed=2, shard_bytes=200_000)
    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(files) >= 3
    same = [(a / f).read_bytes() == (b / f).read_bytes() for f in files]
    differ = [(a / f).read_bytes() != (c / f).read_bytes() for f in files]
    assert all(same) and all(differ)
    cfg = parse_config(raw)
    assert scan(a, cfg).fingerprint == scan(b, cfg).fingerprint  # header-only: c has the same headers too
