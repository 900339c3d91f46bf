"""Generation through the real engine on real ranks: sampling identical on every rank and reproducible per request,
greedy equal to the argmax, exact stops, and a batch of slots that changes nothing about any request's tokens."""

from functools import partial

import pytest

from k3dist.twin.checkpoint import write_checkpoint
from tests.support.configs import small_config
from tests.support.harness import generate
from tests.support.ranks import expect_ok

pytestmark = pytest.mark.slow  # the `slow` tier (README: Tests)

PROMPTS = [[5, 9, 2, 7, 3], [11, 4, 8, 6, 10], [1, 3, 5, 7, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_checkpoint(small_config(), tmp_path_factory.mktemp("gen"), seed=11, dtype="float32"))


def _requests(**sampling) -> list[dict]:
    return [{"ids": ids, "max_new_tokens": 12, "seed": 100 + i, **sampling} for i, ids in enumerate(PROMPTS)]


def tokens(results) -> list[list[int]]:
    return [c["tokens"] for c in results]


def test_sampling_is_identical_on_every_rank_and_seeded(shared_ranks, model_dir):
    """World 2 with dist.check_tokens: every window each rank's sampled ids are compared with rank 0's."""
    sampled = dict(temperature=1.0, top_p=0.9)
    per_rank = expect_ok(shared_ranks(generate, 2, model_dir, _requests(**sampled), 3))
    assert per_rank[1] is None  # rank 1 followed rank 0's windows and never looked at a token
    again = expect_ok(shared_ranks(generate, 1, model_dir, _requests(**sampled), 3))[0]
    other = [r | {"seed": r["seed"] + 50} for r in _requests(**sampled)]
    other_seed = expect_ok(shared_ranks(generate, 1, model_dir, other, 3))[0]
    greedy = expect_ok(shared_ranks(generate, 1, model_dir, _requests(), 3))[0]
    assert tokens(again) == tokens(per_rank[0])  # world 1 = world 2, same seeds
    assert tokens(other_seed) != tokens(per_rank[0]) and tokens(greedy) != tokens(per_rank[0])  # really samples
    assert all(len(t) == 12 for t in tokens(per_rank[0]))


def test_a_request_samples_the_same_whatever_shares_its_batch(shared_ranks, model_dir):
    """Per-request seeds: request 1 alone at batch 1 draws what it draws among others at batch 3 (top-k on)."""
    reqs = _requests(temperature=0.8, top_k=20)
    together = expect_ok(shared_ranks(generate, 1, model_dir, reqs, 3))[0]
    alone = expect_ok(shared_ranks(generate, 1, model_dir, [reqs[1]], 1))[0]
    assert together[1]["tokens"] == alone[0]["tokens"]


def test_greedy_tokens_are_the_argmax_of_their_logits(shared_ranks, model_dir):
    out = expect_ok(shared_ranks(generate, 2, model_dir, _requests(), 3))[0]
    for c in out:
        assert [top[0][0] for top in c["top"]] == c["tokens"]
        assert all(top[0][1] >= top[1][1] >= top[4][1] for top in c["top"])


@pytest.mark.parametrize("sync_every", [1, 8])
def test_each_sequence_stops_exactly_at_eos(shared_ranks, model_dir, sync_every):
    greedy = tokens(expect_ok(shared_ranks(generate, 1, model_dir, _requests(), 3))[0])
    eos = greedy[1][3]  # the 4th token of sequence 1 becomes the end-of-sequence token
    stop_at_eos = partial(generate, eos=(eos,), sync_every=sync_every)
    stopped = expect_ok(shared_ranks(stop_at_eos, 2, model_dir, _requests(), 3))[0]
    for full, cut in zip(greedy, stopped, strict=True):
        end = full.index(eos) + 1 if eos in full else len(full)
        assert cut["tokens"] == full[:end]
        assert cut["finish_reason"] == ("stop" if eos in full else "length")
    assert len(stopped[1]["tokens"]) == 4


def test_any_integer_seed_and_top_k_fit_a_slot(shared_ranks, model_dir):
    """The slots hold int64: a seed takes its low 64 bits (2**64-1 draws as -1, 2**63 as -2**63) and a top_k past the
    vocabulary cuts nothing, so no front's setting can overflow them in the middle of a run."""
    base = dict(ids=PROMPTS[0], max_new_tokens=6, temperature=1.0)
    reqs = [base | {"seed": 2**64 - 1}, base | {"seed": -1}, base | {"seed": 2**63, "top_k": 2**64}]
    reqs.append(base | {"seed": -(2**63)})
    out = tokens(expect_ok(shared_ranks(generate, 1, model_dir, reqs, 4))[0])
    assert out[0] == out[1] and out[2] == out[3] and out[0] != out[2]
