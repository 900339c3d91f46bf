"""The decoder over one rank's weight store (docs/model.md): embedding, decoder layers, final norm, LM head; the
residual stream plain (Kimi-Linear) or with K3's block attention residuals (residuals.py).

Vocab-parallel embedding (masked lookup + all-reduce) and LM head (local logits; the caller gathers what it needs).
Two entry points with the cache each layer owns: `prefill` (chunks of prompt tokens into chosen slots) and `decode`
(one token per slot at per-slot positions: the static step). The residual stream stays in fp32 whatever the compute
dtype: each norm reads it unrounded, so low-precision runs drift less from fp32 (and pick the same experts).
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from ..base.threads import ThreadGovernor
from ..config import LayerSpec
from .layers import rmsnorm
from .residuals import BlockResiduals


class DecoderLayer:
    """Pre-norm residual block: h + mixer(norm(h)), then h + mlp(norm(h)); or, with K3's block attention residuals
    (`residuals`), the same over the stream and its bank of snapshots (residuals.py)."""

    def __init__(
        self,
        spec: LayerSpec,
        mixer,
        mlp,
        norm_in: Tensor,
        norm_post: Tensor,
        eps: float,
        residuals: BlockResiduals | None = None,
        norm=rmsnorm,
    ):
        """`norm`: the backend's RMSNorm (Kernels.rmsnorm), bound here to the layer's two weights."""
        self.spec, self.mixer, self.mlp, self.residuals = spec, mixer, mlp, residuals
        self.norm_in, self.norm_post = (partial(norm, weight=w, eps=eps) for w in (norm_in, norm_post))

    def _run(self, h, mixer, mlp, dtype: torch.dtype):
        if self.residuals is not None:
            return self.residuals.layer(h, mixer, mlp, self.norm_in, self.norm_post, dtype)
        h = h + mixer(self.norm_in(h).to(dtype))
        return h + mlp(self.norm_post(h))

    def prefill(self, h, slots: Tensor, start: int, dtype: torch.dtype):
        return self._run(h, lambda x: self.mixer.prefill(x, slots, start), self.mlp.prefill, dtype)

    def decode(self, h, positions: Tensor, dtype: torch.dtype, rows: int | None = None):
        return self._run(h, lambda x: self.mixer.decode(x, positions, rows), self.mlp.decode, dtype)


class K3Model:
    def __init__(
        self,
        cfg,
        *,
        embed: Tensor,
        layers: list[DecoderLayer],
        norm: Tensor,
        head: Tensor,
        comm,
        kernels,
        out_score: Tensor | None = None,
    ):
        """`out_score`: K3's mixing site before the final norm (residuals.py); None: a plain residual stream."""
        self.cfg, self.comm, self.kernels, self.out_score = cfg, comm, kernels, out_score
        self.embed, self.layers, self.norm, self.head = embed, layers, norm, head  # [V_local, D]; head: a Linear
        self.dtype = embed.dtype
        self.threads = ThreadGovernor(torch.get_num_threads()) if embed.device.type == "cpu" else None

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """Masked lookup in this rank's vocab rows, summed over ranks, fp32."""
        if self.comm.world == 1:
            return F.embedding(tokens, self.embed).float()
        local = tokens - self.comm.vocab_start
        mine = (local >= 0) & (local < self.embed.shape[0])
        rows = max(self.embed.shape[0] - 1, 0)
        h = F.embedding(local.clamp(0, rows), self.embed) if self.embed.shape[0] else self._zeros(tokens)
        return self.comm.all_reduce(h.float() * mine.unsqueeze(-1))

    def _zeros(self, tokens: Tensor) -> Tensor:
        return torch.zeros(*tokens.shape, self.cfg.hidden_size, dtype=self.dtype, device=tokens.device)

    def logits(self, h: Tensor) -> Tensor:
        """This rank's logits [..., V_local] of final hidden states [..., D] (fp32)."""
        return self.head(self.kernels.rmsnorm(h, self.norm, self.cfg.rms_norm_eps).to(self.dtype))

    @torch.inference_mode()
    def prefill(self, tokens: Tensor, slots: Tensor, start: int, all_logits: bool = False) -> Tensor:
        """tokens: [n, T], the next T prompt tokens of slots `slots` [n], which hold `start` tokens each.

        Writes the slots' cache in place (their positions are the caller's to advance). Returns this rank's logits
        of the last token [n, V_local], or of every token [n, T, V_local].
        """
        h = self.prefill_hidden(tokens, slots, start)
        return self.logits(h if all_logits else h[:, -1])

    @torch.inference_mode()
    def prefill_hidden(self, tokens: Tensor, slots: Tensor, start: int) -> Tensor:
        """As prefill, but returns the final hidden states [n, T, D] (fp32): a caller scoring every position turns
        them into logits a few rows at a time (engine/prompt_logprobs.py)."""
        if self.threads is not None:
            self.threads.prefill()
        h = self._begin(self.embed_tokens(tokens))
        for layer in self.layers:
            h = layer.prefill(h, slots, start, self.dtype)
        return self._end(h)

    def _begin(self, h: Tensor):
        """The stream the layers pass on: the hidden states, or K3's (stream, empty bank)."""
        return h if self.out_score is None else (h, ())

    def _end(self, h) -> Tensor:
        """The final norm's input: the hidden states, or K3's mixture at its output site."""
        if self.out_score is None:
            return h
        p, bank = h
        return self.kernels.res_mix(p, bank, self.out_score, self.cfg.rms_norm_eps)

    def decode(self, tokens: Tensor, positions: Tensor, rows: int | None = None) -> Tensor:
        """The static step's model part: tokens [B] at positions [B] (device tensors) -> logits [B, V_local].

        Every shape is fixed by the batch and the cache capacity; nothing is read on the host. An eager step may pass
        `rows`, a bound the host knows on every slot's position, so MLA attends to fewer cache rows. On the CPU an
        eager step first lets the thread governor time the previous one (base/threads.py).
        """
        if self.threads is not None and not torch.compiler.is_compiling():
            self.threads.tick()
        h = self._begin(self.embed_tokens(tokens))
        for layer in self.layers:
            h = layer.decode(h, positions, self.dtype, rows)
        return self.logits(self._end(h))
