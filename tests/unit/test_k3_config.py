"""A Kimi K3 config.json reads into typed fields: its variant decided once from its fields, the nested text_config,
the 1-based layer lists with the extra final MLA layer; a field k3dist does not implement is refused, naming it and
its value; a world size that would cut an MXFP4 group is refused with the numbers; a K3 checkpoint's vision tower is
skipped by name, never planned or read."""

import copy
import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from k3dist.base.errors import K3Error
from k3dist.config import KIMI_K3, KIMI_LINEAR, load_config, parse_config, validate_topology
from k3dist.kinds.registry import MIXERS, MLPS
from k3dist.twin.checkpoint import write_checkpoint
from k3dist.twin.k3_checkpoint import VISION_STUBS
from k3dist.weights.inventory import layout, scan
from k3dist.weights.reads import read_bytes
from k3dist.weights.schema import expected_tensors, parameter_count
from k3dist.weights.tp_plan import plan_rank
from tests.support.configs import CONFIGS, small_k3

REAL, TWIN = CONFIGS / "Kimi-K3-2.8T-A50B-config.json", CONFIGS / "Kimi-K3-twin-0.4B-config.json"
KDA, MLA = MIXERS.values()
DENSE, MOE = MLPS.values()


def raw(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_real_k3_config_reads_into_typed_fields():
    cfg = load_config(REAL)
    assert cfg.variant == KIMI_K3 and cfg.source == str(REAL)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.rms_norm_eps, cfg.dtype) == (
        163840,
        7168,
        93,
        1e-5,
        "bfloat16",
    )
    assert (cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel, cfg.gate_lower_bound) == (96, 128, 4, -5.0)
    assert (cfg.mla_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (96, 1536, 512)
    assert (cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim) == (128, 64, 128)
    assert (cfg.intermediate_size, cfg.num_experts, cfg.top_k, cfg.expert_size) == (33792, 896, 16, 3072)
    assert (cfg.num_shared_experts, cfg.shared_size, cfg.latent_size) == (2, 6144, 3584)
    assert (cfg.attn_res_block_size, cfg.situ_beta, cfg.situ_linear_beta, cfg.mxfp4_experts) == (12, 4.0, 25.0, True)
    assert (cfg.renormalize, cfg.routed_scaling_factor, cfg.num_expert_group, cfg.topk_group) == (True, 1.0, 1, 1)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (163584, 163586, 163839)
    # 1-based lists, every 4th layer MLA plus the extra final one: 0-based 3, 7, ..., 91 and 92
    assert [s.index for s in cfg.layers if s.mixer == MLA.name] == [*range(3, 92, 4), 92]
    assert cfg.count(mixer=KDA.name) == 69 and cfg.count(mixer=MLA.name) == 24
    assert cfg.layers[0].mlp == DENSE.name and cfg.count(mlp=MOE.name) == 92
    assert round(parameter_count(cfg) / 1e12, 2) == 2.78  # the experts counted as weights, not packed bytes
    names = expected_tensors(cfg)  # canonical: without language_model.
    assert "lm_head.weight" in names and "model.layers.1.block_sparse_moe.experts.0.w2.weight_packed" in names


def test_the_variant_is_decided_once_and_kimi_k3_is_not_read_as_kimi_linear():
    linear = parse_config(raw(CONFIGS / "Kimi-Linear-48B-A3B-config.json"))
    assert linear.variant == KIMI_LINEAR and linear.q_lora_rank == 0 and not linear.mxfp4_experts
    flat = raw(TWIN)["text_config"]  # flattened: its attention residuals say K3
    assert parse_config(flat).variant == KIMI_K3
    # a top-level kimi_k3 without text_config is read as K3 and stops at K3's own field, not at Kimi-Linear's
    bare = {k: v for k, v in raw(REAL).items() if k != "text_config"}
    with pytest.raises(K3Error, match="linear_attn_config must be an object"):
        parse_config(bare, "m/config.json")
    # a Kimi-Linear config that says kimi_k3's field set is no longer accepted under Kimi-Linear's model types
    with pytest.raises(K3Error, match="model_type='llama' is not one of \\['kimi_linear'\\]"):
        parse_config(raw(CONFIGS / "Kimi-Linear-48B-A3B-config.json") | {"model_type": "llama"})


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.update(num_nextn_predict_layers=2), "num_nextn_predict_layers=2: MTP layers are not supported"),
        (lambda t: t.update(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (
            lambda t: t["quantization_config"].update(format="nvfp4-pack-quantized"),
            "quantization_config quant_method='compressed-tensors' format='nvfp4-pack-quantized' is not supported",
        ),
        (
            lambda t: t["quantization_config"].update(quant_method="fp8"),
            "quant_method='fp8' format='mxfp4-pack-quantized' is not supported",
        ),
        (lambda t: t.update(moe_router_activation_func="softmax"), "moe_router_activation_func='softmax'"),
    ],
)
def test_a_field_k3dist_does_not_implement_is_refused_naming_it(change, message):
    bad = copy.deepcopy(raw(REAL))
    change(bad["text_config"])
    with pytest.raises(K3Error) as refused:
        parse_config(bad, "m/config.json")
    line = str(refused.value)
    assert line.startswith("m/config.json: text_config: ") and message in line and "\n" not in line


def test_a_world_that_would_cut_an_mxfp4_group_is_refused_with_the_numbers():
    twin = load_config(TWIN)  # 8 heads, experts of 128 columns: 4 groups of 32
    for world in (1, 2, 4):
        validate_topology(twin, world)
    with pytest.raises(K3Error) as refused:
        validate_topology(twin, 8)
    assert str(refused.value) == (
        f"{TWIN}: world size 8 splits the MXFP4 experts' moe_intermediate_size=128 into 16 columns per rank, which "
        "cuts their groups of 32 (4 groups do not split into 8); world sizes that fit: [1, 2, 4]"
    )
    dequantized = raw(TWIN)
    del dequantized["text_config"]["quantization_config"]
    validate_topology(parse_config(dequantized), 8)  # bf16 experts have no groups to cut
    real = load_config(REAL)
    for world in (1, 2, 4, 8, 16, 32):
        validate_topology(real, world)
    with pytest.raises(K3Error, match="world size 5 does not divide .*world sizes that fit: \\[1, 2, 4, 8, 16, 32\\]"):
        validate_topology(real, 5)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_vision_tower_is_skipped_by_name_and_never_read(tmp_path):
    config = small_k3()
    model = write_checkpoint(config, tmp_path / "k3", seed=3, tokenizer=False)  # carries the two vision stubs
    cfg = load_config(model)
    logger, lines = logging.getLogger("k3dist"), Lines()
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not .level =: it clears the loggers' cached isEnabledFor answers
    try:
        inv = scan(model, cfg)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    said = [line for line in lines.lines if "vision" in line]
    assert said == [
        f"{model}: skipping 2 vision-tower tensors (vision_tower., mm_projector.): k3dist serves the text model"
    ]
    keys = {e.key for e in inv.entries.values()}
    assert not keys & set(VISION_STUBS) and "language_model.lm_head.weight" in keys
    assert set(inv.entries) == set(expected_tensors(cfg))
    plans = plan_rank(cfg, inv.entries.values(), 1, 0, torch.float32)
    assert not [p for p in plans if p.key.startswith(("vision_tower.", "mm_projector."))]
    # the stubs' bytes lie outside every planned read, and the reads count only the text model's bytes
    (file,) = inv.files
    fd = os.open(model / file, os.O_RDONLY)
    try:
        spans = {key: (offset, offset + math.prod(shape) * 2) for key, (_, shape, offset) in layout(fd).items()}
    finally:
        os.close(fd)
    stubs = [spans[key] for key in VISION_STUBS]
    reads = [(p.offset, p.offset + p.source_bytes) for p in plans]
    assert not [r for r in reads for s in stubs if r[0] < s[1] and s[0] < r[1]]
    assert sum(p.source_bytes for p in plans) + sum(e - b for b, e in stubs) == inv.file_bytes - header(model / file)
    assert read_bytes(plans) > 0


def header(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")
