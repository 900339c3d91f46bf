"""What changes a slot's logits before its token is chosen: a grammar's mask, logit_bias, min_tokens and the
repetition, frequency and presence penalties, as per-slot device buffers the captured step reads.

A request's settings (its `SamplingParams`, sampling.py) travel in its admission record, so every rank loads the
same values into its own buffers; the counts the penalties need are kept on the device, over each rank's vocabulary
shard, from the tokens the step chooses (identical on every rank), so nothing is read back and no shape changes. A
grammar's mask comes from rank 0 with every window that has a constrained slot (control.py): each rank expands its own
shard of the bitmask here, outside the step. Only windows in a `process` sampling mode run any of it (sampling.py).

The order is vLLM's: the mask, min_tokens, logit_bias, then the repetition penalty (prompt and output: a positive
logit divided by it, a negative one multiplied), the frequency penalty (times each token's count in the output) and
the presence penalty (once per token in the output). Neutral settings change no logit at all, so a slot that asked
for none of it draws the same tokens whatever shares its window. The first three are one pass over the fp32 logits
(MASKS: the mask is kept as 0 or -inf and added, which a CPU does several times faster than a masked fill, and the
single-token edits are one scatter); the penalties read and keep the counts (PENALTIES), and only windows with a
penalized slot run them.
"""

import torch
from torch import Tensor

from .sampling import MAX_BIAS, MAX_HELD, PENALTIES, SamplingParams

EDITS = MAX_BIAS + MAX_HELD  # a slot's single-token edits: biases, then tokens held back
NEG_INF = float("-inf")


class LogitProcessors:
    """Per-slot processor settings, output counts and grammar masks over this rank's vocabulary [start, stop).

    memory/runtime.py's `processor_bytes` counts these buffers for the memory plan."""

    def __init__(self, batch: int, vocab_start: int, vocab_stop: int, device: torch.device):
        B, V = batch, vocab_stop - vocab_start
        self.start, self.width, self.device = vocab_start, V, device
        full = lambda shape, value, dtype: torch.full(shape, value, dtype=dtype, device=device)  # noqa: E731
        # single-token edits, in this rank's shard (made at admission): where, what is added, whether min_tokens holds
        # the token back there; an entry outside the shard adds 0 at index 0
        self.edit_at = full((B, EDITS), 0, torch.int64)
        self.edit_add = full((B, EDITS), 0.0, torch.float32)
        self.edit_held = full((B, EDITS), False, torch.bool)
        self.min_tokens = full((B,), 0, torch.int64)
        self.presence = full((B,), 0.0, torch.float32)
        self.frequency = full((B,), 0.0, torch.float32)
        self.repetition = full((B,), 1.0, torch.float32)
        self.counts = full((B, V), 0.0, torch.float32)  # each token's count in the slot's output
        self.seen = full((B, V), False, torch.bool)  # tokens of the slot's prompt or output
        self.veto = full((B, V), 0.0, torch.float32)  # the grammar's mask, added: -inf on the tokens it rules out
        # a bitmask row's bytes, little-endian, hold tokens 8j..8j+7 in byte j: each byte's 8 entries by table
        table = [[0.0 if (b >> i) & 1 else NEG_INF for i in range(8)] for b in range(256)]
        self.veto_table = torch.tensor(table, dtype=torch.float32, device=device)
        self.first_byte, self.skip = vocab_start // 8, vocab_start % 8

    def reset(self) -> None:
        """Every slot neutral again (after a warm-up ran the processed modes)."""
        for t, value in ((self.edit_at, 0), (self.edit_add, 0.0), (self.edit_held, False), (self.min_tokens, 0)):
            t.fill_(value)
        for t, value in ((self.presence, 0.0), (self.frequency, 0.0), (self.repetition, 1.0), (self.counts, 0.0)):
            t.fill_(value)
        self.seen.fill_(False)
        self.veto.fill_(0.0)

    def _local(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Token ids -> (index in this rank's shard, clamped into it; whether the id is in the shard)."""
        local = ids - self.start
        return local.clamp(0, max(self.width - 1, 0)), (local >= 0) & (local < self.width)

    def apply(self, logits: Tensor, rows: Tensor, gen: Tensor, level: int, first: int | None = None) -> Tensor:
        """logits [n, V_local] of slots `rows` whose next outputs have index `gen` -> the processed fp32 logits (fp32
        logits are changed in place: the caller's scratch). `first`: `rows` are the first `first` slots (a decode
        step), so the per-slot buffers are read as views, not gathered."""
        of = (lambda t: t[:first]) if first is not None else (lambda t: t[rows])  # noqa: E731
        x = logits.float().add_(of(self.veto))
        held = of(self.edit_held) & (gen < of(self.min_tokens))[:, None]
        x.scatter_add_(1, of(self.edit_at), of(self.edit_add).masked_fill(held, NEG_INF).to(x.dtype))
        if level < PENALTIES:
            return x
        rep = of(self.repetition)[:, None]
        x = torch.where(of(self.seen), torch.where(x > 0, x / rep, x * rep), x)
        counts = of(self.counts)
        return x - of(self.frequency)[:, None] * counts - of(self.presence)[:, None] * (counts > 0)

    def count(self, rows: Tensor, token: Tensor) -> None:
        """The chosen tokens of slots `rows` join their output counts (those in this rank's shard)."""
        at, mine = self._local(token[:, None])
        where = (rows[:, None], at)
        self.counts.index_put_(where, self.counts[where] + mine)
        self.seen.index_put_(where, self.seen[where] | mine)

    def load(self, slot: int, p: SamplingParams, prompt: tuple[int, ...]) -> None:
        """A request takes `slot`: its settings, its prompt's tokens for the repetition penalty. Host-to-device
        writes, outside any step; a grammar's mask is loaded by load_masks."""
        edits = [(t, v, False) for t, v in p.logit_bias] + [(t, 0.0, True) for t in p.held]
        mine = [(t - self.start, v, h) for t, v, h in edits if self.start <= t < self.start + self.width]
        mine += [(0, 0.0, False)] * (EDITS - len(mine))
        self.edit_at[slot] = torch.tensor([e[0] for e in mine], dtype=torch.int64)
        self.edit_add[slot] = torch.tensor([e[1] for e in mine], dtype=torch.float32)
        self.edit_held[slot] = torch.tensor([e[2] for e in mine], dtype=torch.bool)
        self.min_tokens[slot], self.presence[slot] = p.min_tokens, p.presence_penalty
        self.frequency[slot], self.repetition[slot] = p.frequency_penalty, p.repetition_penalty
        if p.penalized:
            self.counts[slot] = 0.0
            at, mine = self._local(torch.tensor(prompt, dtype=torch.int64, device=self.device))
            self.seen[slot] = False
            self.seen[slot, at[mine]] = True
        if not p.grammar:
            self.veto[slot] = 0.0

    def load_masks(self, slots: tuple[int, ...], bitmask: Tensor) -> None:
        """Rank 0's bitmask rows [len(slots), ceil(V / 32)] int32 (bit t % 32 of word t // 32: token t allowed) ->
        this rank's shard of each slot's mask (one table lookup per byte of the shard)."""
        last_byte = -(-(self.start + self.width) // 8)
        own = bitmask.contiguous().view(torch.uint8)[:, self.first_byte : last_byte].to(self.device)
        veto = self.veto_table[own.long()].view(len(slots), -1)[:, self.skip : self.skip + self.width]
        self.veto[torch.tensor(slots, device=self.device)] = veto
