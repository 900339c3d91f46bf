"""The what-if from the config alone: planned by shape family, it gives every figure the tensor-by-tensor plan gives
(uneven splits and MXFP4 experts included); and what a TP group's collectives move per token."""

import pytest
import torch

from k3dist.config import load_config, parse_config
from k3dist.kinds.mlps import MOE
from k3dist.memory.traffic import tp_traffic
from k3dist.weights.memory import memory_plan
from k3dist.weights.tp_plan import plan_rank
from k3dist.weights.whatif import config_entries, plan_all_ranks
from tests.support.configs import CONFIGS, K3_TWIN, TWIN, small_config, small_k3

K3 = CONFIGS / "Kimi-K3-2.8T-A50B-config.json"


@pytest.mark.parametrize(
    "cfg",
    [
        parse_config(small_config()),
        parse_config(small_k3()),
        load_config(TWIN),
        load_config(K3_TWIN),
    ],
    ids=["small", "small_k3", "twin", "k3_twin"],
)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_planning_by_family_gives_the_figures_of_every_tensor(cfg, world):
    entries = config_entries(cfg)
    by_family = plan_all_ranks(cfg, None, world, torch.bfloat16, 2**30)
    by_tensor = [memory_plan(r, plan_rank(cfg, entries, world, r, torch.bfloat16), 2**30) for r in range(world)]
    assert by_family == by_tensor


def test_tp_traffic_of_k3_is_the_tp_plans():
    """docs/model.md's figures: at world 8 a K3 MoE layer all-gathers z (7,168 bytes, 6,272 of ring traffic a rank)
    and all-reduces the combine (14,336 bytes, 25,088 a rank); every layer's mixer and MLP, and the embedding,
    all-reduce the fp32 hidden state; the logits are gathered whole in fp32. A single rank runs no collective."""
    cfg = load_config(K3)
    moe, layers, hidden = cfg.count(mlp=MOE.name), len(cfg.layers), 7168 * 4
    t = tp_traffic(cfg, 8, 2)
    assert (moe, layers, t.nodes, t.routed_experts) == (92, 93, 1, 896)
    assert t.all_reduce_bytes == hidden * (1 + 2 * layers) + moe * 14_336
    assert t.all_gather_bytes == moe * 7_168 + 163_840 * 4
    assert t.ring_bytes == hidden * (1 + 2 * layers) * 2 * 7 // 8 + moe * (25_088 + 6_272) + 163_840 * 4 * 7 // 8
    assert tp_traffic(cfg, 32, 2).nodes == 4 and tp_traffic(cfg, 32, 2).ring_bytes > t.ring_bytes
    one = tp_traffic(cfg, 1, 2)
    assert one.all_reduce_bytes == one.all_gather_bytes == one.ring_bytes == 0


def test_tp_traffic_of_kimi_linear_has_no_latent():
    cfg = load_config(CONFIGS / "Kimi-Linear-48B-A3B-config.json")
    t = tp_traffic(cfg, 8, 2)
    assert t.all_reduce_bytes == cfg.hidden_size * 4 * (1 + 2 * len(cfg.layers))
    assert t.all_gather_bytes == 8 * -(-cfg.vocab_size // 8) * 4
