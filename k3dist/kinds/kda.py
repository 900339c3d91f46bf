"""The KDA mixer kind (Kimi Delta Attention, linear): its tensors, TP rules, cache entries and prefill bytes.

Per slot it keeps the last K-1 inputs of its three short convs and the recurrent state S[h, k, v] (fp32), whatever
the sequence's length.
"""

import torch

from ..kernels.kda import CHUNK
from .spec import COLUMN, HEADS, REPLICATED, ROW, CacheEntry, LayerKind, Placement

A_LOG_SLOTS = 128  # K3 stores A_log as [128] whatever its head count; the first num_heads entries are real
FUSED_IN = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")  # all read the normed input
K3_FUSED_IN = ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_proj")  # K3: its full-rank gate, no g_a


def _tensors(cfg) -> dict:
    D, H, d, P, K = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_dim, cfg.conv_kernel
    shapes = {
        "q_proj.weight": (P, D),
        "k_proj.weight": (P, D),
        "v_proj.weight": (P, D),
        "q_conv1d.weight": (P, 1, K),
        "k_conv1d.weight": (P, 1, K),
        "v_conv1d.weight": (P, 1, K),
        "A_log": (1, 1, H, 1),
        "f_a_proj.weight": (d, D),
        "f_b_proj.weight": (P, d),
        "dt_bias": (P,),
        "b_proj.weight": (H, D),
        "g_a_proj.weight": (d, D),
        "g_b_proj.weight": (P, d),
        "o_norm.weight": (d,),
        "o_proj.weight": (D, P),
    }
    return {"self_attn." + k: s for k, s in shapes.items()}


def _k3_tensors(cfg) -> dict:
    D, H, d, K = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel
    P = H * d
    out = {f"{n}_proj.weight": (P, D) for n in "qkv"}
    out |= {f"{n}_conv1d.weight": (P, 1, K) for n in "qkv"}
    out |= {"f_a_proj.weight": (d, D), "f_b_proj.weight": (P, d), "b_proj.weight": (H, D)}
    out |= {"A_log": (max(A_LOG_SLOTS, H),), "dt_bias": (P,), "g_proj.weight": (P, D)}
    out |= {"o_norm.weight": (d,), "o_proj.weight": (D, P)}
    return {"self_attn." + k: s for k, s in out.items()}


def _placements(cfg, layer: str) -> dict:
    a = layer + "self_attn."
    fused = K3_FUSED_IN if cfg.gate_lower_bound != 0.0 else FUSED_IN  # K3 (model/kda.py tells them apart so too)
    out = {f"{a}{n}.weight": Placement(a + "in_proj.weight", part=i) for i, n in enumerate(fused)}
    out |= {f"{a}{n}_conv1d.weight": Placement(a + "conv1d.weight", slot=i) for i, n in enumerate("qkv")}
    out |= {f"{a}{n}_b_proj.weight": Placement(a + "fg_b_proj.weight", slot=i) for i, n in enumerate("fg")}
    return out


def _activation(cfg, world: int, *, tokens: int, seqs: int, longest: int, s: int, cpu: bool, dense: bool) -> int:
    """Projections, conv windows, fp32 q/k/v/g, the chunked delta rule's [C, C, d] decay tensor."""
    D, H, d = cfg.hidden_size, cfg.kda_heads // world, cfg.kda_head_dim
    P = H * d
    proj = tokens * (3 * P + 2 * d + H) * s + 2 * tokens * P * s  # in_proj output; f_b and g_b outputs
    conv = 3 * (seqs * P * (tokens // seqs + cfg.conv_kernel) * 4 * 2)  # fp32 window + output per q/k/v
    fp32 = 8 * tokens * P * 4  # q, k, v, g in fp32, head-major copies, the output
    chunk = seqs * H * CHUNK * (CHUNK * d * 4 * 2 + CHUNK * 4 * 4 + 2 * d * 4)  # decay (+exp), kk/qk
    return proj + conv + fp32 + chunk + tokens * D * 4 * 2


KDA = LayerKind(
    name="kda",
    role="mixer",
    layer_type="linear_attention",
    layer_list="kda_layers",
    sizes=(
        ("linear_attn_config.num_heads", "kda_heads"),
        ("linear_attn_config.head_dim", "kda_head_dim"),
        ("linear_attn_config.short_conv_kernel_size", "conv_kernel"),
    ),
    splits=(("KDA heads (linear_attn_config.num_heads)", "kda_heads"),),
    tensors=_tensors,
    k3_tensors=_k3_tensors,
    placements=_placements,
    policy=(
        (r"\.self_attn\.A_log$", HEADS),  # K3's [128], padded past the heads: replicated (tp_plan.axis_of)
        (r"\.self_attn\.(f_a_proj|g_a_proj)\.weight$", REPLICATED),
        (r"\.self_attn\.[qkv]_proj\.weight$", COLUMN),  # by head
        (r"\.self_attn\.[qkv]_conv1d\.weight$", COLUMN),
        (r"\.self_attn\.(f_b_proj|g_b_proj|b_proj)\.weight$", COLUMN),
        (r"\.self_attn\.g_proj\.weight$", COLUMN),  # K3's full-rank output gate [P, D], by head (MLA's too)
        (r"\.self_attn\.dt_bias$", COLUMN),
        (r"\.self_attn\.o_proj\.weight$", ROW),
    ),
    cache=(  # the last K-1 q, k, v inputs; key-major S[h, k, v]
        CacheEntry("conv", lambda cfg, w, b, cap: (b, cfg.conv_kernel - 1, 3, cfg.kda_dim // w), None, grows=False),
        CacheEntry(
            "state",
            lambda cfg, w, b, cap: (b, cfg.kda_heads // w, cfg.kda_head_dim, cfg.kda_head_dim),
            torch.float32,
            grows=False,
        ),
    ),
    activation=_activation,
    widest_input=lambda cfg, world: cfg.kda_dim // world,
    quantized=r"\.self_attn\.(in_proj|fg_b_proj|o_proj)\.weight$",
)
