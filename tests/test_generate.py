"""Generation: sampling gives the same tokens on every rank, greedy is the argmax, sequences stop at EOS."""

import pytest

from k3dist.weights.twin import write_checkpoint

from .configs import small_config
from .harness import sample
from .ranks import expect_ok, run_ranks

PROMPT = [[5, 9, 2, 7, 3], [11, 4, 8, 6, 10], [1, 3, 5, 7, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_checkpoint(small_config(), tmp_path_factory.mktemp("gen"), seed=11, dtype="float32"))


def test_sampling_is_identical_on_every_rank_and_seeded(model_dir):
    per_rank = expect_ok(run_ranks(sample, 2, model_dir, PROMPT, 12, 1.0, 0.9, 123))
    assert per_rank[0] == per_rank[1]
    again = expect_ok(run_ranks(sample, 2, model_dir, PROMPT, 12, 1.0, 0.9, 123))[0]
    other_seed = expect_ok(run_ranks(sample, 2, model_dir, PROMPT, 12, 1.0, 0.9, 124))[0]
    greedy = expect_ok(run_ranks(sample, 1, model_dir, PROMPT, 12, 0.0, 1.0, 0))[0]
    assert again == per_rank[0]
    assert other_seed != per_rank[0] and greedy != per_rank[0]  # sampling really samples
    assert all(len(t) == 12 for t in per_rank[0])


def test_each_sequence_stops_at_eos(model_dir):
    greedy = expect_ok(run_ranks(sample, 1, model_dir, PROMPT, 10, 0.0, 1.0, 0))[0]
    eos = greedy[1][3]  # the 4th token of sequence 1 becomes the end-of-sequence token
    stopped = expect_ok(run_ranks(sample, 2, model_dir, PROMPT, 10, 0.0, 1.0, 0, eos))[0]
    for full, cut in zip(greedy, stopped, strict=True):
        end = full.index(eos) + 1 if eos in full else len(full)
        assert cut == full[:end]
    assert len(stopped[1]) == 4
