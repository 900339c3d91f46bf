"""The MLP kinds: a dense SwiGLU MLP (`dense`) and the routed mixture of experts with its shared experts (`moe`).

Neither keeps anything in the cache; their prefill bytes are the activations of one chunk.
"""

from ..kernels.moe import PAD_ROWS, padded_rows
from .spec import COLUMN, REPLICATED, ROW, LayerKind, Placement

_GATE_UP = (r"\.(gate_proj|up_proj)\.weight$", COLUMN)  # the dense MLP's and the shared experts'
_DOWN = (r"\.down_proj\.weight$", ROW)


def _gate_up(m: str) -> dict:
    parts = enumerate(("gate_proj", "up_proj"))
    return {f"{m}{n}.weight": Placement(m + "gate_up_proj.weight", part=i) for i, n in parts}


def _dense_tensors(cfg) -> dict:
    D, Id = cfg.hidden_size, cfg.intermediate_size
    return {"mlp.gate_proj.weight": (Id, D), "mlp.up_proj.weight": (Id, D), "mlp.down_proj.weight": (D, Id)}


def _dense_activation(cfg, world: int, *, tokens: int, seqs: int, longest: int, s: int, cpu: bool, dense: bool):
    return tokens * 3 * (cfg.intermediate_size // world) * s + tokens * cfg.hidden_size * 4 * 2


DENSE = LayerKind(
    name="dense",
    role="mlp",
    layer_type="dense",
    sizes=(("intermediate_size", "intermediate_size"),),
    splits=(),
    tensors=_dense_tensors,
    k3_tensors=_dense_tensors,
    placements=lambda cfg, layer: _gate_up(layer + "mlp."),
    policy=(_GATE_UP, _DOWN),
    activation=_dense_activation,
    widest_input=lambda cfg, world: cfg.intermediate_size // world,
    quantized=r"\.mlp\.(gate_up_proj|down_proj)\.weight$",
)


def _moe_tensors(cfg) -> dict:
    D, E, Ie, Is = cfg.hidden_size, cfg.num_experts, cfg.expert_size, cfg.shared_size
    p = "block_sparse_moe."
    out = {p + "gate.weight": (E, D), p + "gate.e_score_correction_bias": (E,)}
    for e in range(E):
        out |= {
            f"{p}experts.{e}.w1.weight": (Ie, D),
            f"{p}experts.{e}.w2.weight": (D, Ie),
            f"{p}experts.{e}.w3.weight": (Ie, D),
        }
    if Is:
        out |= {
            p + "shared_experts.gate_proj.weight": (Is, D),
            p + "shared_experts.up_proj.weight": (Is, D),
            p + "shared_experts.down_proj.weight": (D, Is),
        }
    return out


def _k3_moe_tensors(cfg) -> dict:
    """K3's latent MoE: the routed experts work in a latent of `latent_size`, between a down and an up projection."""
    D, E, Ie, Z = cfg.hidden_size, cfg.num_experts, cfg.expert_size, cfg.latent_size
    Is = Ie * cfg.num_shared_experts  # the shared MLP's width
    p = "block_sparse_moe."
    out = {p + "gate.weight": (E, D), p + "gate.e_score_correction_bias": (E,)}
    out |= {p + "routed_expert_down_proj.weight": (Z, D), p + "routed_expert_norm.weight": (Z,)}
    out[p + "routed_expert_up_proj.weight"] = (D, Z)
    out |= {p + f"shared_experts.{n}_proj.weight": (Is, D) for n in ("gate", "up")}
    out[p + "shared_experts.down_proj.weight"] = (D, Is)
    for e in range(E):
        x = f"{p}experts.{e}."
        out |= {x + "w1.weight": (Ie, Z), x + "w2.weight": (Z, Ie), x + "w3.weight": (Ie, Z)}
    return out


def _moe_placements(cfg, layer: str) -> dict:
    """Experts stacked: w1 and w3 fused per expert into `w13`, w2 into `w2`; K3's MXFP4 experts the same, once for
    the packed codes (`w13_packed`) and once for the scales (`w13_scale`). The shared experts' gate and up in one;
    K3's with the routed experts' down projection before them (`in_proj`: all three read the block's input)."""
    m = layer + "block_sparse_moe."
    if cfg.latent_size:
        fused = ("routed_expert_down_proj", "shared_experts.gate_proj", "shared_experts.up_proj")
        out = {f"{m}{n}.weight": Placement(m + "in_proj.weight", part=i) for i, n in enumerate(fused)}
    else:
        out = _gate_up(m + "shared_experts.")
    x = layer + "block_sparse_moe.experts."
    kept = (("weight_packed", "_packed"), ("weight_scale", "_scale")) if cfg.mxfp4_experts else (("weight", ""),)
    for e in range(cfg.num_experts):
        for part, tail in kept:
            out[f"{x}{e}.w1.{part}"] = Placement(x + "w13" + tail, slot=e, part=0)
            out[f"{x}{e}.w3.{part}"] = Placement(x + "w13" + tail, slot=e, part=1)
            out[f"{x}{e}.w2.{part}"] = Placement(x + "w2" + tail, slot=e)
    return out


def _moe_activation(cfg, world: int, *, tokens: int, seqs: int, longest: int, s: int, cpu: bool, dense: bool):
    """Tokens sorted by expert, their gate/up and down outputs, or with dense experts every expert's. K3's experts
    run in the latent (`latent_size` wide, 0 on Kimi-Linear), which its down projection's output z (all-gathered)
    and the combined latent (fp32, before the norm) add."""
    D, k, E, I_ = cfg.hidden_size, cfg.top_k, cfg.num_experts, cfg.expert_size // world
    W = cfg.latent_size or D  # what the experts read and write
    rows = padded_rows(tokens, k, E, PAD_ROWS if cpu else 1)  # sorted (CPU: padded) x, gate/up, act, down
    routed = rows * (W * s + 3 * I_ * s + W * s) + tokens * k * (W * s + W * 4 + 3 * 8)  # then [N*k] fp32
    if dense:  # every expert: gate/up, act, weighted fp32 act and its rounding; the output
        routed = tokens * (E * I_ * (3 * s + 4 + s) + E * 4 + W * (s + 4))
    router = tokens * E * 4 * 4
    shared = tokens * 3 * cfg.shared_size // world * s
    latent = tokens * cfg.latent_size * (s + 4)  # z and the fp32 combine (0 on Kimi-Linear)
    return routed + router + shared + latent + tokens * D * 4 * 2


MOE = LayerKind(
    name="moe",
    role="mlp",
    layer_type="sparse",
    sizes=(
        ("num_experts", "num_experts"),
        ("num_experts_per_token", "top_k"),
        ("moe_intermediate_size", "expert_size"),
        ("num_expert_group", "num_expert_group"),
        ("topk_group", "topk_group"),
    ),
    splits=(
        ("expert size (moe_intermediate_size)", "expert_size"),
        ("latent MoE width (routed_expert_hidden_size)", "latent_size"),  # K3; 0 on Kimi-Linear
    ),
    tensors=_moe_tensors,
    k3_tensors=_k3_moe_tensors,
    placements=_moe_placements,
    policy=(
        (r"\.gate\.(weight|e_score_correction_bias)$", REPLICATED),  # router
        (r"\.experts\.\d+\.w[13]\.weight(_packed|_scale)?$", COLUMN),  # K3's MXFP4 pairs split as their weight
        (r"\.experts\.\d+\.w2\.weight(_packed|_scale)?$", ROW),  # whole groups of 32 (config.validate_topology)
        # K3's latent MoE (docs/model.md, "Kimi K3's TP plan"): the down projection split by latent row (z
        # all-gathered: every expert reads the whole latent), the experts by their columns as above (their fp32
        # combine all-reduced before the latent norm), the up projection by latent column (its partial output
        # summed in the MLP's all-reduce); the latent norm replicated
        (r"\.routed_expert_down_proj\.weight$", COLUMN),
        (r"\.routed_expert_up_proj\.weight$", ROW),
        _GATE_UP,
        _DOWN,
    ),
    activation=_moe_activation,
    widest_input=lambda cfg, world: cfg.shared_size // world,
)
