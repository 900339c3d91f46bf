"""Prompt scoring (engine/prompt_logprobs.py) over more positions than one block of logits: every position's
log-probability of the next token is the log-softmax of the model's logits there, its top-k the k best, and where the
next token is the best one its log-probability is the top entry's float exactly."""

import torch

from k3dist.engine.prompt_logprobs import SCORE_ROWS, PromptScores, score
from tests.support.configs import small_config
from tests.support.models import random_model


def test_scores_span_blocks_and_equal_a_log_softmax_of_all_logits():
    n = SCORE_ROWS + 6
    _, model, _ = random_model(small_config(), cap=n + 1, seed=4)
    ids = torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        h = model.prefill_hidden(ids, torch.tensor([0]), 0)
        ref = torch.log_softmax(model.logits(h[0, :-1]).double(), dim=-1)
        ids[0, 1:] = torch.where(torch.arange(n - 1) % 3 == 0, ref.argmax(-1), ids[0, 1:])  # some next tokens the best
        scores = PromptScores(20, [score(model, h[0, :-1], ids[0, 1:], 20)])
    entries = scores.entries()
    assert len(entries) == n and entries[0] is None
    for i, (logprob, top) in enumerate(entries[1:]):
        assert abs(logprob - float(ref[i, ids[0, i + 1]])) < 1e-5
        assert [t for t, _ in top] == ref[i].topk(20).indices.tolist()
        assert max(abs(v - float(r)) for (_, v), r in zip(top, ref[i].topk(20).values, strict=True)) < 1e-5
        if ids[0, i + 1] == top[0][0]:
            assert logprob == top[0][1]  # the same float, as evaluators' greediness checks want
