"""The whole K3 decoder over one rank's weight store (docs/kimi-linear.md section 6).

Vocab-parallel embedding (masked lookup + all-reduce) and LM head (gathered logits); every mixer and MLP ends in
one all-reduce. The same forward serves prefill (T tokens) and decode (T = 1), writing the cache in place.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cache import DeviceHybridCache
from ..config import ModelConfig
from .kda import KDA
from .layers import rmsnorm
from .mla import MLA
from .moe import DenseMLP, MoE
from .tp import TPComm


class K3Model:
    def __init__(self, cfg: ModelConfig, weights: dict[str, Tensor], comm: TPComm, router_weights: str = "unbiased"):
        self.cfg, self.comm = cfg, comm
        self.embed = weights["model.embed_tokens.weight"]  # [V_local, D]
        self.head = weights["lm_head.weight"]
        self.norm = weights["model.norm.weight"]
        self.layers = []
        for spec in cfg.layers:
            p = f"model.layers.{spec.index}."
            mixer = (
                KDA(weights, p + "self_attn.", cfg.kda_head_dim, cfg.rms_norm_eps, comm)
                if spec.mixer == "kda"
                else MLA(weights, p + "self_attn.", cfg, comm)
            )
            mlp = (
                DenseMLP(weights, p + "mlp.", comm)
                if spec.mlp == "dense"
                else MoE(weights, p + "block_sparse_moe.", cfg, comm, biased=router_weights == "biased")
            )
            norms = weights[p + "input_layernorm.weight"], weights[p + "post_attention_layernorm.weight"]
            self.layers.append((spec, mixer, mlp, norms))

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """Masked lookup in this rank's vocab rows, summed over ranks."""
        if self.comm.world == 1:
            return F.embedding(tokens, self.embed)
        local = tokens - self.comm.vocab_start
        mine = (local >= 0) & (local < self.embed.shape[0])
        h = (
            F.embedding(local.clamp(0, max(self.embed.shape[0] - 1, 0)), self.embed)
            if self.embed.shape[0]
            else torch.zeros(*tokens.shape, self.cfg.hidden_size, dtype=self.embed.dtype, device=tokens.device)
        )
        return self.comm.all_reduce(h.float() * mine.unsqueeze(-1))  # fp32, like every other reduction

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: DeviceHybridCache, all_logits: bool = False) -> Tensor:
        """tokens: [B, T] continuing what `cache` holds. Returns logits [B, V] (last token) or [B, T, V].

        The residual stream stays in fp32 whatever the compute dtype: each norm reads it unrounded and only the
        mixer and MLP inputs are cast, so low-precision runs drift less from fp32 (and pick the same experts).
        """
        start = cache.reserve(tokens.shape[1])
        eps, dtype = self.cfg.rms_norm_eps, self.embed.dtype
        h = self.embed_tokens(tokens).float()
        for spec, mixer, mlp, (norm_in, norm_post) in self.layers:
            x = rmsnorm(h, norm_in, eps).to(dtype)
            if spec.mixer == "kda":
                h = h + mixer(x, cache.conv[spec.index], cache.state[spec.index])
            else:
                h = h + mixer(x, cache.latent[spec.index], start)
            h = h + mlp(rmsnorm(h, norm_post, eps))
        h = rmsnorm(h if all_logits else h[:, -1], self.norm, eps).to(dtype)
        return self.comm.gather_logits(F.linear(h, self.head))
