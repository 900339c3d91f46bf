"""Prefill in chunks (generate.prefill_chunk) is the same computation as one prefill: the same last logits and the
same cache, whatever the chunk and the MLA key block (the CPU path that expands the past block by block)."""

import pytest
import torch

from k3dist.model import mla
from tests.support.configs import small_config
from tests.support.models import random_model

PROMPT = torch.tensor([[7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 11, 13, 17, 19, 23, 29, 31], [5, 6, 7, 8] * 4 + [9]])


def _prefill(chunk: int):
    cfg, model, cache = random_model(small_config(), batch=2, cap=24, seed=5)
    rows = torch.arange(2)
    with torch.inference_mode():
        for at in range(0, PROMPT.shape[1], chunk):
            logits = model.prefill(PROMPT[:, at : at + chunk], rows, at)
    return logits, {n: t.clone() for n, t in cache.tensors.items()}


@pytest.mark.parametrize("chunk, key_block", [(5, 4), (3, 1024), (16, 3), (1, 2)])
def test_chunked_prefill_equals_one_prefill(monkeypatch, chunk, key_block):
    whole_logits, whole_cache = _prefill(PROMPT.shape[1])
    monkeypatch.setattr(mla, "KEY_BLOCK", key_block)
    logits, cache = _prefill(chunk)
    torch.testing.assert_close(logits, whole_logits, rtol=1e-5, atol=1e-5)
    for name, t in whole_cache.items():
        torch.testing.assert_close(cache[name], t, rtol=1e-5, atol=1e-5, msg=name)
