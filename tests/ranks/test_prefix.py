"""Exact prefix reuse on real ranks (fp32, world 1 and 2, three configs, one of them Kimi K3's): a chat's second turn
restored from the first turn's snapshot gives the greedy tokens and, within 1e-5, the top-5 logits of the run without
reuse; a prompt sharing a chunk-aligned prefix with an earlier one gives bit-identical logits; prompts branching from
a shared document inside a chunk are snapshotted at the branch point and restored there; and nothing else is a hit."""

import pytest

from k3dist.twin.checkpoint import write_checkpoint
from tests.support.configs import small_config, small_k3
from tests.support.harness import prefix_turns
from tests.support.ranks import expect_ok

DOC = [(37 * i) % 480 + 5 for i in range(40)]  # 40 tokens: snapshots at 16, 32 and 40 (chunk 8, every 16)
CONFIGS = {
    "small": small_config(),
    "mla-heavy": small_config(
        num_hidden_layers=5,
        linear_attn_config={"kda_layers": [2, 4], "full_attn_layers": [1, 3, 5], "short_conv_kernel_size": 3},
    ),
    "k3": small_k3(moe_intermediate_size=64),  # two MXFP4 groups: world 2 splits them; the bank holds no past
}
DEFAULT_TIER = ("small", "k3")


@pytest.fixture(
    scope="module",
    params=[n if n in DEFAULT_TIER else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CONFIGS)],
)
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"prefix-{request.param}")
    return str(write_checkpoint(CONFIGS[request.param], path, seed=21, dtype="float32", tokenizer=False))


def both(ranks, model_dir, turns, world, batch=2, pool=(2**30, 0), every=16, together=False):
    """The same turns with and without reuse on the module's `ranks` (shared_ranks): (with, without), rank 0's."""
    args = (model_dir, turns, batch, 8, every, "float32", 256, pool, together)
    return expect_ok(ranks(prefix_turns, world, *args))[0]


def close(a, b, rtol=1e-5):
    for x, y in zip(a, b, strict=True):
        assert [i for i, _ in x] == [i for i, _ in y]
        assert all(abs(u - v) <= rtol * max(abs(v), 1e-6) for (_, u), (_, v) in zip(x, y, strict=True)), (x, y)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_second_chat_turn_restores_the_first_turns_snapshot(shared_ranks, model_dir, world):
    turns = [
        [{"ids": DOC, "max_new_tokens": 7}, {"ids": DOC[:30], "max_new_tokens": 5, "temperature": 0.8, "seed": 3}],
        [{"after": 0, "then": [11, 12, 13, 14, 15]}, {"after": 1, "then": [7, 8], "temperature": 0.8, "seed": 4}],
    ]
    reused, plain = both(shared_ranks, model_dir, turns, world)
    for got, want in zip(reused, plain, strict=True):
        for g, w in zip(got["completions"], want["completions"], strict=True):
            assert g["tokens"] == w["tokens"]
            close(g["top"], w["top"])
    first, second = reused[0]["prefix"], reused[1]["prefix"]
    assert second["hits"] - first["hits"] == 2  # both turn-2 requests hit ...
    # ... their turn-1 prompt + completion: 40 + 7 and 30 + 5 tokens reused
    assert second["tokens_reused"] - first["tokens_reused"] == (40 + 7) + (30 + 5)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_shared_chunk_aligned_prefix_gives_bit_identical_logits(shared_ranks, model_dir, world):
    turns = [[{"ids": DOC}], [{"ids": DOC[:32] + [3, 4, 5, 6, 7, 8, 9]}, {"ids": DOC[:32] + [300, 2]}]]
    reused, plain = both(
        shared_ranks, model_dir, turns, world, together=True
    )  # both runs decode the same slots together
    assert reused[1]["prefix"]["tokens_reused"] == 32 + 32  # each restored at the 32-token chunk boundary
    for g, w in zip(reused[1]["completions"], plain[1]["completions"], strict=True):
        assert g == w  # tokens and top-5 logits, bit for bit


@pytest.mark.slow
def test_nothing_but_a_true_prefix_is_a_hit(shared_ranks, model_dir):
    changed = DOC[:20] + [999 % 480] + DOC[21:]
    turns = [[{"ids": DOC}], [{"ids": changed}], [{"ids": DOC[:37]}], [{"ids": DOC}]]
    reused, plain = both(shared_ranks, model_dir, turns, 1, batch=1)
    reuse = [r["prefix"]["tokens_reused"] for r in reused]
    assert reuse[0] == 0
    assert reuse[1] - reuse[0] == 16  # one middle token changed: only the 16 tokens before it
    assert reuse[2] - reuse[1] == 32  # a strict prefix of the 40-token snapshot: the 32-token one
    assert reuse[3] - reuse[2] == 40  # equal to a snapshot: its stored logits, no prefill at all
    for got, want in zip(reused, plain, strict=True):
        assert got["completions"] == want["completions"]


@pytest.mark.slow
def test_a_small_pool_evicts_to_the_host_tier_and_drops_on_every_rank(shared_ranks, model_dir):
    """A pool of two 40-token snapshots and a host tier of one: documents come and go, snapshots are demoted and
    dropped on both ranks alike, and every answer stays what it is without reuse."""
    from k3dist.config import load_config
    from k3dist.engine.snapshots import snapshot_bytes
    from k3dist.model.cache import cache_shapes

    cfg = load_config(model_dir)
    size = snapshot_bytes(cache_shapes(cfg, 2, 1, 1, cfg_dtype()), 40, -(-cfg.vocab_size // 2), 4)
    docs = [[(t * 13 + k * 7) % 480 + 5 for t in range(40)] for k in range(4)]
    turns = [[{"ids": d}] for d in docs] + [[{"ids": docs[3]}], [{"ids": docs[0]}]]
    reused, plain = both(shared_ranks, model_dir, turns, 2, batch=1, pool=(2 * size + 100, size + 100))
    assert [r["completions"] for r in reused] == [p["completions"] for p in plain]
    stats = reused[-1]["prefix"]
    assert stats["evictions"] > 0 and stats["demotions"] > 0 and stats["device_bytes"] <= 2 * size + 100
    assert reused[4]["prefix"]["tokens_reused"] > reused[3]["prefix"]["tokens_reused"]  # docs[3] again: some held


def cfg_dtype():
    import torch

    return torch.float32


QUESTIONS = [[400 + 7 * q + k for k in range(5)] for q in range(6)]  # six different 5-token questions


@pytest.mark.parametrize("world", [1, 2])
def test_prompts_branching_inside_a_chunk_hit_the_branch_point(shared_ranks, model_dir, world):
    """A 45-token document (the branch point is inside the chunk [40, 48); no grid point before 64) with different
    questions: the first request is a miss and snapshots only its end, the second learns the branch point and
    snapshots it, every later one restores it. Then four prompts admitted in one window (as on CUDA) over another
    document: the first snapshots their common prefix, the other two restore it at once, and the fourth, the
    document alone, takes its first token from that snapshot's logits (made by the window's one LM head pass before
    the restore). Every answer equals the run without reuse (tokens; top-5 logits within 1e-5)."""
    doc = [(37 * i) % 480 + 5 for i in range(45)]
    other = [(11 * i) % 470 + 9 for i in range(41)]
    turns = [[{"ids": doc + q}] for q in QUESTIONS[:4]] + [
        [{"ids": other + q} for q in QUESTIONS[3:]] + [{"ids": other}]
    ]
    reused, plain = both(shared_ranks, model_dir, turns, world, batch=4, every=64, together=True)
    for got, want in zip(reused, plain, strict=True):
        for g, w in zip(got["completions"], want["completions"], strict=True):
            assert g["tokens"] == w["tokens"]
            close(g["top"], w["top"])
    stats = [r["prefix"] for r in reused]
    assert [s["hits"] for s in stats] == [0, 0, 1, 2, 5]
    assert [s["tokens_reused"] for s in stats] == [0, 0, 45, 90, 90 + 3 * 41]
    assert [s["branches"] for s in stats] == [0, 1, 1, 1, 2]
    assert stats[0]["snapshots"] == 1  # a prompt sharing nothing with anything: its end, nothing more
    assert stats[1]["snapshots"] == 1 + 3  # then r1's prompt + completion, r2's branch point and its end
