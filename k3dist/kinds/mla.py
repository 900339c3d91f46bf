"""The MLA mixer kind (multi-head latent attention, NoPE): its tensors, TP rules, cache entry and prefill bytes.

Per slot it keeps one latent row per token (the normalised latent and the shared key slice), up to cache.cap.
"""

from .spec import COLUMN, REPLICATED, ROW, CacheEntry, LayerKind, Placement

KEY_BLOCK = 1024  # CPU prefill expands the cached latent this many positions at a time (model/mla.py)
# kernels/csrc/mla_decode.cpp's PIECES and PIECE (tests/unit/test_kinds.py reads them there): the most pieces a
# sequence is cut into, and the fewest rows a piece holds
MLA_PIECES, MLA_PIECE = 64, 256


def _tensors(cfg) -> dict:
    D, Ha, r, dr = cfg.hidden_size, cfg.mla_heads, cfg.kv_lora_rank, cfg.qk_rope_dim
    return {
        "self_attn.q_proj.weight": (Ha * cfg.qk_head_dim, D),
        "self_attn.kv_a_proj_with_mqa.weight": (r + dr, D),
        "self_attn.kv_a_layernorm.weight": (r,),
        "self_attn.kv_b_proj.weight": (Ha * (cfg.qk_nope_dim + cfg.v_head_dim), r),
        "self_attn.o_proj.weight": (D, Ha * cfg.v_head_dim),
    }


def _k3_tensors(cfg) -> dict:
    D, Ha, r, dr, q = cfg.hidden_size, cfg.mla_heads, cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.q_lora_rank
    return {
        "self_attn.q_a_proj.weight": (q, D),
        "self_attn.q_a_layernorm.weight": (q,),
        "self_attn.q_b_proj.weight": (Ha * (cfg.qk_nope_dim + dr), q),
        "self_attn.kv_a_proj_with_mqa.weight": (r + dr, D),
        "self_attn.kv_a_layernorm.weight": (r,),
        "self_attn.kv_b_proj.weight": (Ha * (cfg.qk_nope_dim + cfg.v_head_dim), r),
        "self_attn.g_proj.weight": (Ha * cfg.v_head_dim, D),
        "self_attn.o_proj.weight": (D, Ha * cfg.v_head_dim),
    }


def _placements(cfg, layer: str) -> dict:
    """Every projection of the normed input in one: Kimi-Linear's q and the latent's; K3's latent, q-LoRA down and
    output gate."""
    a = layer + "self_attn."
    fused = ("kv_a_proj_with_mqa", "q_a_proj", "g_proj") if cfg.q_lora_rank else ("q_proj", "kv_a_proj_with_mqa")
    return {f"{a}{n}.weight": Placement(a + "q_kv_a_proj.weight", part=i) for i, n in enumerate(fused)}


def _activation(cfg, world: int, *, tokens: int, seqs: int, longest: int, s: int, cpu: bool, dense: bool) -> int:
    """The latent rows expanded through kv_b_proj back to the start of the longest prompt (on the CPU at most one
    key block of them at a time), attention scores."""
    D, H, r, dr = cfg.hidden_size, cfg.mla_heads // world, cfg.kv_lora_rank, cfg.qk_rope_dim
    dqk, dv = cfg.qk_nope_dim + dr, cfg.v_head_dim
    chunk = tokens // seqs
    rows = seqs * (min(longest, KEY_BLOCK + chunk) if cpu else longest)  # expanded keys and values
    proj = tokens * (H * dqk + r + dr) * s * 2
    expanded = rows * ((r + dr) * s + H * (cfg.qk_nope_dim + dv) * s + H * dqk * s)  # rows, kv, keys
    merged = 3 * tokens * H * dqk * 4  # block outputs and the running merge, fp32 (padded to dqk)
    return proj + expanded + merged + tokens * H * dv * s * 2 + tokens * D * 4 * 2


def _decode_op_bytes(cfg, world: int, batch: int, cap: int) -> int:
    """The CPU MLA decode op's buffers at `batch` slots of `cap` rows (kernels/csrc/mla_decode.cpp keeps them between
    steps): scores [H, rows] fp32 (one block past the end), each piece's max and sum per head, partial contexts
    [H, r] per piece, q_abs and q_pe per (slot, head) in fp32, and in bf16 and bf16 pairs for the dot-product and
    tile kernels."""
    H, r, dr = cfg.mla_heads // world, cfg.kv_lora_rank, cfg.qk_rope_dim
    pad = lambda n, lanes=16: -(-n // lanes) * lanes  # noqa: E731  (the widest vector's float lanes; 32 bf16)
    pieces = batch * min(MLA_PIECES, -(-max(cap, 1) // MLA_PIECE))  # a piece holds MLA_PIECE rows or more
    q_bf16 = batch * H * pad(r + dr, 32) * (2 + 2)
    return 4 * (H * (batch * cap + 32) + pieces * H * (2 + pad(r, 32)) + batch * H * pad(r + dr)) + q_bf16


MLA = LayerKind(
    name="mla",
    role="mixer",
    layer_type="full_attention",
    layer_list="full_attn_layers",
    sizes=(
        ("num_attention_heads", "mla_heads"),
        ("qk_nope_head_dim", "qk_nope_dim"),
        ("v_head_dim", "v_head_dim"),
        ("kv_lora_rank", "kv_lora_rank"),
    ),
    splits=(("MLA heads (num_attention_heads)", "mla_heads"),),
    tensors=_tensors,
    k3_tensors=_k3_tensors,
    placements=_placements,
    policy=(
        (r"\.self_attn\.kv_a_proj_with_mqa\.weight$", REPLICATED),
        (r"\.self_attn\.q_a_proj\.weight$", REPLICATED),  # K3's q-LoRA down: every head reads the whole rank
        (r"\.self_attn\.q_b_proj\.weight$", COLUMN),  # by head
        (r"\.self_attn\.[qkv]_proj\.weight$", COLUMN),  # q_proj, by head
        (r"\.self_attn\.kv_b_proj\.weight$", COLUMN),
        (r"\.self_attn\.g_proj\.weight$", COLUMN),  # K3's output gate [H*v, D], by head
        (r"\.self_attn\.o_proj\.weight$", ROW),
    ),
    cache=(
        CacheEntry("latent", lambda cfg, w, b, cap: (b, cap, cfg.kv_lora_rank + cfg.qk_rope_dim), None, grows=True),
    ),
    activation=_activation,
    widest_input=lambda cfg, world: cfg.mla_heads // world * cfg.v_head_dim,
    decode_op_bytes=_decode_op_bytes,
    quantized=r"\.self_attn\.(q_kv_a_proj|q_b_proj|o_proj)\.weight$",
)
