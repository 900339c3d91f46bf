"""Small configs for tests: the Kimi-Linear twin's structure at toy sizes, varied by overrides, and the K3 twin's
packaging at toy sizes."""

import copy
import json
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "k3dist" / "configs"
TWIN = CONFIGS / "Kimi-K3-0.40B-config.json"
K3_TWIN = CONFIGS / "Kimi-K3-twin-0.4B-config.json"


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


def small_k3(**text) -> dict:
    """The K3 twin's packaging at toy sizes: 6 layers (MLA at 3 and 6, 1-based), blocks of 2, 4 experts; `text`
    overrides text_config's fields."""
    out = json.loads(K3_TWIN.read_text())
    t = out["text_config"]
    t.update(vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2)
    t.update(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    t.update(intermediate_size=96, num_experts=4, num_experts_per_token=2, num_shared_experts=1)
    t.update(moe_intermediate_size=32, routed_expert_hidden_size=64, attn_res_block_size=2)
    t["linear_attn_config"] |= {"num_heads": 2, "head_dim": 16, "full_attn_layers": [3, 6], "kda_layers": [1, 2, 4, 5]}
    out |= {"bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 511}
    t.update(text)
    return out
