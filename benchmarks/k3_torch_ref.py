"""A naive float64 forward of a K3 twin, written from docs/k3.md, to check that note against llama.cpp's logits.

Information only, never a golden: it reads a dequantized K3 twin's safetensors (K3's names, `language_model.`), runs
the whole sequence at once (KDA as its token-by-token recurrence, MLA un-absorbed with a causal mask), and returns
every position's logits. `Eps` holds the epsilons where llama.cpp and Moonshot's code differ, so the effect of each
difference on the logits can be measured (k3_reference.py --eps-study).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

P = "language_model.model."


@dataclass(frozen=True)
class Eps:
    """rms: every RMSNorm but q_a/kv_a; lora: q_a_layernorm and kv_a_layernorm; l2: inside KDA's q/k L2 norm
    (x * rsqrt(sum x^2 + l2)). llama.cpp: 1e-5 / 1e-5 / 1e-5; Moonshot and fla: 1e-5 / 1e-6 / 1e-6."""

    rms: float = 1e-5
    lora: float = 1e-5
    l2: float = 1e-5


LLAMA_CPP = Eps()
MOONSHOT = Eps(lora=1e-6, l2=1e-6)


def load(model_dir: Path) -> tuple[dict, dict]:
    """(text config fields, name -> fp32 tensor) of a dequantized K3 twin."""
    raw = json.loads((model_dir / "config.json").read_text())
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            weights |= {k: st.get_tensor(k).float() for k in st.keys() if k.startswith("language_model.")}
    return raw | raw["text_config"], weights


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def lin(x, w):
    return x @ w.double().T


def situ(g, u, cfg):
    b, bl = cfg["activation_situ_beta"], cfg["activation_situ_linear_beta"]
    return b * torch.tanh(g / b) * torch.sigmoid(g) * bl * torch.tanh(u / bl)


def mix(p, bank, norm_w, proj_w, eps):
    """Block attention residual: softmax over candidates (the bank, then p) of their weightless RMS norm dotted with
    norm * proj; the output mixes the raw candidates."""
    if not bank:
        return p
    cands = torch.stack([*bank, p])  # [n+1, T, D]
    scores = (cands * torch.rsqrt(cands.pow(2).mean(-1, keepdim=True) + eps) * (norm_w * proj_w[0]).double()).sum(-1)
    alpha = torch.softmax(scores, dim=0)
    return (alpha.unsqueeze(-1) * cands).sum(0)


def kda(x, w, a, cfg, eps: Eps):
    T = x.shape[0]
    lac = cfg["linear_attn_config"]
    H, d, K = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]

    def conv(name):
        y = lin(x, w[a + f"{name}_proj.weight"])  # [T, P]
        kernel = w[a + f"{name}_conv1d.weight"].double()[:, 0, :]  # [P, K]
        padded = torch.cat([torch.zeros(K - 1, y.shape[1], dtype=y.dtype), y])
        out = sum(padded[j : j + T] * kernel[:, j] for j in range(K))
        return F.silu(out).view(T, H, d)

    q, k, v = conv("q"), conv("k"), conv("v")
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + eps.l2)
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + eps.l2)
    f = lin(lin(x, w[a + "f_a_proj.weight"]), w[a + "f_b_proj.weight"]) + w[a + "dt_bias"].double()
    A = torch.exp(w[a + "A_log"].double()[:H]).view(1, H, 1)
    g = lac["gate_lower_bound"] * torch.sigmoid(A * f.view(T, H, d))  # [T, H, d]
    beta = torch.sigmoid(lin(x, w[a + "b_proj.weight"]))  # [T, H]
    S = torch.zeros(H, d, d, dtype=x.dtype)  # [H, key, value]
    out = torch.empty(T, H, d, dtype=x.dtype)
    for t in range(T):
        S = S * torch.exp(g[t]).unsqueeze(-1)
        pred = torch.einsum("hk,hkv->hv", k[t], S)
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t].unsqueeze(-1) * (v[t] - pred))
        out[t] = torch.einsum("hk,hkv->hv", q[t], S) * d**-0.5
    o = rms(out, w[a + "o_norm.weight"], eps.rms) * torch.sigmoid(lin(x, w[a + "g_proj.weight"])).view(T, H, d)
    return lin(o.reshape(T, H * d), w[a + "o_proj.weight"])


def mla(x, w, a, cfg, eps: Eps):
    T, H = x.shape[0], cfg["num_attention_heads"]
    dn, dr, dv, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    q = lin(rms(lin(x, w[a + "q_a_proj.weight"]), w[a + "q_a_layernorm.weight"], eps.lora), w[a + "q_b_proj.weight"])
    q = q.view(T, H, dn + dr)
    kv_a = lin(x, w[a + "kv_a_proj_with_mqa.weight"])
    latent = rms(kv_a[:, :r], w[a + "kv_a_layernorm.weight"], eps.lora)
    k_pe = kv_a[:, r:]  # NoPE: the "rope" part is used as it is
    kv = lin(latent, w[a + "kv_b_proj.weight"]).view(T, H, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe.unsqueeze(1).expand(T, H, dr)], -1)
    scores = torch.einsum("thc,shc->hts", q, k) * (dn + dr) ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shc->thc", torch.softmax(scores, -1), kv[..., dn:]).reshape(T, H * dv)
    return lin(o * torch.sigmoid(lin(x, w[a + "g_proj.weight"])), w[a + "o_proj.weight"])


def mlp(x, w, m, cfg):
    return lin(situ(lin(x, w[m + "gate_proj.weight"]), lin(x, w[m + "up_proj.weight"]), cfg), w[m + "down_proj.weight"])


def moe(x, w, m, cfg, eps: Eps):
    scores = torch.sigmoid(lin(x, w[m + "gate.weight"]))  # [T, E]
    chosen = torch.topk(scores + w[m + "gate.e_score_correction_bias"].double(), cfg["num_experts_per_token"]).indices
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * cfg["routed_scaling_factor"]
    z = lin(x, w[m + "routed_expert_down_proj.weight"])
    y = torch.zeros_like(z)
    for e in chosen.unique().tolist():
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        ex = f"{m}experts.{e}."
        h = situ(lin(z[rows], w[ex + "w1.weight"]), lin(z[rows], w[ex + "w3.weight"]), cfg)
        y[rows] += weights[rows, slot].unsqueeze(-1) * lin(h, w[ex + "w2.weight"])
    y = lin(rms(y, w[m + "routed_expert_norm.weight"], eps.rms), w[m + "routed_expert_up_proj.weight"])
    return y + mlp(x, w, m + "shared_experts.", cfg)


def forward(cfg: dict, w: dict, ids: list[int], eps: Eps = LLAMA_CPP) -> torch.Tensor:
    """Logits [T, vocab] in float64 for the token ids `ids` (one sequence, from an empty state)."""
    full = cfg["linear_attn_config"]["full_attn_layers"]
    block = cfg["attn_res_block_size"]
    p = w[P + "embed_tokens.weight"][torch.tensor(ids)].double()
    bank: list[torch.Tensor] = []
    for i in range(cfg["num_hidden_layers"]):
        lp = f"{P}layers.{i}."
        h = mix(p, bank, w[lp + "self_attention_res_norm.weight"], w[lp + "self_attention_res_proj.weight"], eps.rms)
        banked = i % block == 0
        if banked:
            bank.append(p)
        x = rms(h, w[lp + "input_layernorm.weight"], eps.rms)
        a = (mla if (i + 1) in full else kda)(x, w, lp + "self_attn.", cfg, eps)
        p = a if banked else p + a
        h = mix(p, bank, w[lp + "mlp_res_norm.weight"], w[lp + "mlp_res_proj.weight"], eps.rms)
        x = rms(h, w[lp + "post_attention_layernorm.weight"], eps.rms)
        dense = i < cfg["first_k_dense_replace"]
        p = p + (mlp(x, w, lp + "mlp.", cfg) if dense else moe(x, w, lp + "block_sparse_moe.", cfg, eps))
    h = mix(p, bank, w[P + "output_attn_res_norm.weight"], w[P + "output_attn_res_proj.weight"], eps.rms)
    return lin(rms(h, w[P + "norm.weight"], eps.rms), w["language_model.lm_head.weight"])
