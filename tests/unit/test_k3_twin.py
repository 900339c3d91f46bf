"""The K3 layout (weights/schema.k3_tensors, the one list of K3 tensors) against the real K3 checkpoint's, the variant
decided from a config's fields, and the K3 twin writer: both variants hold exactly the listed tensors and the same
values (MXFP4 experts dequantize to the dequantized twin's bits)."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3dist.base.errors import K3Error
from k3dist.config import KIMI_K3, KIMI_LINEAR, model_variant, read_k3
from k3dist.text.tokenizer import load_tokenizer
from k3dist.twin.checkpoint import ensure_twin, write_checkpoint
from k3dist.twin.k3_checkpoint import VISION_STUBS
from k3dist.weights.mxfp4 import dequantize
from k3dist.weights.schema import checkpoint_tensors, is_routed_expert, k3_logical_tensors, k3_tensors
from tests.support.configs import small_k3

CONFIGS = Path(__file__).resolve().parents[2] / "k3dist" / "configs"
REAL, TWIN, TWIN12 = (CONFIGS / f"Kimi-K3-{n}-config.json" for n in ("2.8T-A50B", "twin-0.4B", "twin-0.4B-block12"))
U8, F32, BF16 = torch.uint8, torch.float32, torch.bfloat16


def raw(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_real_k3_layout():
    cfg = read_k3(raw(REAL))
    assert [s.index for s in cfg.layers if s.mixer == "mla"] == [*range(3, 92, 4), 92]
    assert [s.mlp for s in cfg.layers].count("dense") == 1 and cfg.layers[0].mlp == "dense"
    t = k3_tensors(cfg)
    p = "language_model.model.layers."
    expect = {
        "language_model.lm_head.weight": ((163840, 7168), BF16),
        "language_model.model.output_attn_res_proj.weight": ((1, 7168), BF16),
        p + "0.self_attention_res_proj.weight": ((1, 7168), BF16),
        p + "0.mlp_res_norm.weight": ((7168,), BF16),
        p + "0.self_attn.q_conv1d.weight": ((12288, 1, 4), F32),
        p + "0.self_attn.A_log": ((128,), F32),
        p + "0.self_attn.dt_bias": ((12288,), F32),
        p + "0.self_attn.g_proj.weight": ((12288, 7168), BF16),
        p + "0.self_attn.o_norm.weight": ((128,), F32),
        p + "0.mlp.gate_proj.weight": ((33792, 7168), BF16),
        p + "3.self_attn.q_b_proj.weight": ((18432, 1536), BF16),
        p + "3.self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), BF16),
        p + "3.self_attn.kv_b_proj.weight": ((24576, 512), BF16),
        p + "92.self_attn.g_proj.weight": ((12288, 7168), BF16),
        p + "1.block_sparse_moe.gate.weight": ((896, 7168), BF16),
        p + "1.block_sparse_moe.gate.e_score_correction_bias": ((896,), F32),
        p + "1.block_sparse_moe.routed_expert_down_proj.weight": ((3584, 7168), BF16),
        p + "1.block_sparse_moe.shared_experts.down_proj.weight": ((7168, 6144), BF16),
        p + "1.block_sparse_moe.experts.895.w1.weight_packed": ((3072, 1792), U8),
        p + "1.block_sparse_moe.experts.895.w3.weight_scale": ((3072, 112), U8),
        p + "92.block_sparse_moe.experts.0.w2.weight_packed": ((3584, 1536), U8),
        p + "92.block_sparse_moe.experts.0.w2.weight_scale": ((3584, 96), U8),
    }
    assert {k: t[k] for k in expect} == expect
    assert not any(k.endswith("experts.0.w1.weight") for k in t) and p + "3.self_attn.A_log" not in t
    logical = k3_logical_tensors(cfg)
    params = sum(math.prod(s) for s, _ in logical.values())
    experts = sum(math.prod(s) for k, (s, _) in logical.items() if is_routed_expert(k))
    assert round(params / 1e12, 2) == 2.78 and round((params - experts) / 1e9) == 57  # 2.78T; ~57B not experts
    assert round(sum(math.prod(s) * d.itemsize for s, d in t.values()) / 1e12, 2) == 1.56  # MXFP4: 1.56 TB


def test_the_variant_is_decided_from_the_fields():
    assert model_variant(raw(REAL)) == model_variant(raw(TWIN)) == KIMI_K3
    flat = raw(TWIN)["text_config"]  # flattened K3: its block attention residuals still say K3
    assert model_variant(flat) == KIMI_K3 and read_k3(flat).attn_res_block_size == 5
    assert model_variant(raw(CONFIGS / "Kimi-Linear-48B-A3B-config.json")) == KIMI_LINEAR
    assert model_variant(raw(CONFIGS / "Kimi-K3-0.40B-config.json")) == KIMI_LINEAR
    linear = checkpoint_tensors(raw(CONFIGS / "Kimi-K3-0.40B-config.json"), BF16)
    assert linear["lm_head.weight"] == ((163840, 1024), BF16)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.update(hidden_act="silu"), "hidden_act='silu'"),
        (lambda t: t.update(num_nextn_predict_layers=1), "MTP"),
        (lambda t: t["linear_attn_config"].update(use_full_rank_gate=False), "use_full_rank_gate=False"),
        (lambda t: t.pop("mla_use_output_gate"), "mla_use_output_gate=None"),
        (lambda t: t["quantization_config"].update(format="nvfp4-pack-quantized"), "format='nvfp4-pack-quantized'"),
        (lambda t: t["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=16), "16"),
        (lambda t: t["linear_attn_config"].update(gate_lower_bound=5.0), "gate_lower_bound=5.0"),
        (lambda t: t.pop("routed_expert_hidden_size"), "routed_expert_hidden_size is missing"),
    ],
)
def test_a_k3_field_the_layout_cannot_hold_is_refused(change, message):
    bad = raw(TWIN)
    change(bad["text_config"])
    with pytest.raises(K3Error, match="text_config: .*" + message.replace("(", r"\(")):
        read_k3(bad, "m/config.json")


def headers(model_dir: Path) -> dict[str, tuple]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out |= {k: st.get_tensor(k) for k in st.keys()}
    return out


CODES = {U8: "U8", F32: "F32", BF16: "BF16"}


def check_variants(packed: Path, plain: Path) -> None:
    """Both variants hold exactly k3_tensors' list (plus the vision stubs) and the same values."""
    cfg_a, cfg_b = (json.loads((d / "config.json").read_text()) for d in (packed, plain))
    assert "quantization_config" in cfg_a["text_config"] and "quantization_config" not in cfg_b["text_config"]
    for d, cfg in ((packed, cfg_a), (plain, cfg_b)):
        listed = {k: (s, CODES[dt]) for k, (s, dt) in k3_tensors(read_k3(cfg), BF16).items()}
        held = headers(d)
        stubs = {n: held.pop(n) for n in VISION_STUBS}  # the vision tower's stand-ins, beside the text model
        assert held == listed and all(dt == "BF16" for _, dt in stubs.values())
    a, b = tensors(packed), tensors(plain)
    heads = read_k3(cfg_a).kda_heads
    for name, value in b.items():
        if is_routed_expert(name):
            base = name.removesuffix("weight")
            widened = dequantize(a[base + "weight_packed"], a[base + "weight_scale"])
            assert torch.equal(widened.view(torch.int32), value.float().view(torch.int32)), name
        else:
            assert torch.equal(a[name], value), name
        if name.endswith("A_log"):
            assert (value[heads:] == 0).all() and (value[:heads] != 0).all()


def test_both_variants_hold_the_same_values(tmp_path):
    config = small_k3()
    packed = write_checkpoint(config, tmp_path / "a", seed=5, variant="mxfp4", shard_bytes=100_000)
    plain = write_checkpoint(config, tmp_path / "b", seed=5, variant="dequantized", shard_bytes=100_000)
    assert len(list(packed.glob("*.safetensors"))) > 1  # several shards of mixed dtypes
    check_variants(packed, plain)
    assert load_tokenizer(plain).vocab_size == 512
    default = write_checkpoint(config, tmp_path / "c", seed=5, tokenizer=False)  # the config's own: MXFP4
    assert headers(default) == headers(packed) and not (default / "tiktoken.model").exists()
    other = tensors(write_checkpoint(config, tmp_path / "d", seed=6, variant="dequantized", tokenizer=False))
    assert not torch.equal(other["language_model.lm_head.weight"], tensors(plain)["language_model.lm_head.weight"])
    with pytest.raises(ValueError, match="only a K3 config has variants"):
        write_checkpoint(raw(CONFIGS / "Kimi-K3-0.40B-config.json"), tmp_path / "e", variant="mxfp4")
    with pytest.raises(ValueError, match="must nest the text model"):
        write_checkpoint(config["text_config"], tmp_path / "g")
    unquantized = copy.deepcopy(config)
    del unquantized["text_config"]["quantization_config"]
    with pytest.raises(ValueError, match="needs the config's quantization_config"):
        write_checkpoint(unquantized, tmp_path / "f", variant="mxfp4")


def test_ensure_twin_keys_k3_twins_by_variant(tmp_path):
    config = tmp_path / "k3.json"
    config.write_text(json.dumps(small_k3()))
    a = ensure_twin(config, seed=1, root=tmp_path / "cache")
    b = ensure_twin(config, seed=1, root=tmp_path / "cache", variant="dequantized")
    assert a.name.startswith("k3-seed1-bfloat16-mxfp4-") and b.name.startswith("k3-seed1-bfloat16-dequantized-")
    assert ensure_twin(config, seed=1, root=tmp_path / "cache", variant="mxfp4") == a


@pytest.mark.slow
@pytest.mark.parametrize("config", [TWIN, TWIN12], ids=["block5", "block12"])
def test_the_k3_twin_at_full_size(config, k3_cache):
    """The ~0.4B K3 twin: both variants as the small one, at K3's head sizes (about 2 minutes on 2 cores)."""
    cfg = read_k3(raw(config))
    assert sum(math.prod(s) for s, _ in k3_logical_tensors(cfg).values()) == 403_821_952
    packed = ensure_twin(config, root=k3_cache, variant="mxfp4")
    plain = ensure_twin(config, root=k3_cache, variant="dequantized")
    check_variants(packed, plain)
    assert load_tokenizer(plain).vocab_size == 32768
