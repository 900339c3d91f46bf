"""Small Kimi-Linear configs for tests: the twin's structure at toy sizes, varied by overrides."""

import copy
import json
from pathlib import Path

TWIN = Path(__file__).resolve().parents[2] / "k3dist" / "configs" / "Kimi-K3-0.40B-config.json"


def twin_config() -> dict:
    return json.loads(TWIN.read_text())


def small_config(**overrides) -> dict:
    """A 4-layer full-coverage config (dense + KDA/MoE + MLA/MoE), a few MB in bf16."""
    raw = twin_config()
    raw.update(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=96,
        linear_attn_config={
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        num_shared_experts=1,
        first_k_dense_replace=1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    for key, value in overrides.items():
        if key == "linear_attn_config":
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return copy.deepcopy(raw)
