"""Numerics against an implementation nobody here wrote: transformers' KimiLinearForCausalLM, same checkpoint.

fp32 compute at world sizes 1, 2 and 4 on gloo: prefill logits and 16 decode steps within 1e-4 x max |logit|, and
identical greedy tokens. bf16 compute: teacher-forced on the same tokens, no farther from transformers' fp32 logits
than transformers' own bf16 logits are (within a factor of 1.5), as the mean over teacher-forced positions of the
largest logit error.
"""

import functools
import json
import tempfile
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from k3dist.config import load_config
from k3dist.kernels import cpu_ops
from k3dist.model.linear import packable
from k3dist.twin.checkpoint import write_checkpoint
from tests.support.configs import small_config
from tests.support.harness import generate, teacher_forced
from tests.support.ranks import expect_ok, run_ranks

STEPS = 16

# Two configs beyond the twin: other head counts and dims, expert counts, dense prefix, layer orders, an uneven
# vocab and dense split, grouped routing.
CONFIGS = {
    "small": small_config(),
    "mla_first": small_config(
        vocab_size=509,
        hidden_size=96,
        num_hidden_layers=6,
        intermediate_size=90,
        linear_attn_config={
            "kda_layers": [2, 3, 5],
            "full_attn_layers": [1, 4, 6],
            "head_dim": 32,
            "num_heads": 8,
            "short_conv_kernel_size": 3,
        },
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=48,
        qk_nope_head_dim=24,
        qk_rope_head_dim=16,
        v_head_dim=20,
        num_experts=12,
        num_experts_per_token=3,
        moe_intermediate_size=24,
        num_shared_experts=2,
        first_k_dense_replace=2,
        num_expert_group=2,
        topk_group=1,
        routed_scaling_factor=1.7,
    ),
}


@functools.cache
def hf_model(model_dir: str, dtype: torch.dtype):
    from transformers import KimiLinearForCausalLM

    return KimiLinearForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@functools.cache
def reference(ranks, model_dir: str, prompt_len: int = 12, batch: int = 2):
    """k3dist's own greedy tokens at world size 1 (fp32) on the module's `ranks` (shared_ranks), and transformers'
    fp32 logits teacher-forced on them.

    If transformers' argmax equals each of those tokens, its own greedy run would produce exactly them too.
    """
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(7))
    out = Path(tempfile.mkdtemp()) / "k3-greedy.safetensors"
    expect_ok(ranks(teacher_forced, 1, model_dir, "float32", prompt.tolist(), None, str(out), STEPS))
    tokens = load_file(out)["tokens"]
    return prompt, tokens, hf_logits(model_dir, torch.float32, prompt, tokens)


def hf_logits(model_dir: str, dtype: torch.dtype, prompt, tokens):
    with torch.no_grad():
        return hf_model(model_dir, dtype)(torch.cat([prompt, tokens], 1), use_cache=False).logits.float()


def k3_logits(ranks, model_dir, world, dtype, prompt, tokens, tmp_path, pack=False, dense_layers=None, backend="auto"):
    out = tmp_path / f"k3-{world}-{dtype}.safetensors"
    args = (
        str(model_dir),
        dtype,
        prompt.tolist(),
        tokens.tolist(),
        str(out),
        STEPS,
        "unbiased",
        "eager",
        pack,
        backend,
    )
    expect_ok(ranks(teacher_forced, world, *args))
    got = load_file(out)
    if dense_layers is not None:
        assert got["dense_layers"].item() == dense_layers
    return got["prefill"], got["steps"]


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {
        name: write_checkpoint(raw, root / name, seed=3, dtype="bfloat16", shard_bytes=1 << 20)
        for name, raw in CONFIGS.items()
    }


def check_fp32(ranks, model_dir, world, tmp_path):
    prompt, tokens, ref = reference(ranks, str(model_dir))
    prefill, steps = k3_logits(ranks, model_dir, world, "float32", prompt, tokens, tmp_path)
    T = prompt.shape[1]
    scale = ref.abs().max().item()
    assert (prefill - ref[:, :T]).abs().max().item() <= 1e-4 * scale
    assert (steps - ref[:, T - 1 : T - 1 + STEPS]).abs().max().item() <= 1e-4 * scale
    assert torch.equal(ref[:, T - 1 : T - 1 + STEPS].argmax(-1), tokens), "transformers' greedy tokens differ"
    assert torch.equal(steps.argmax(-1), tokens), f"greedy tokens at world size {world} differ"


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)])
def test_twin_fp32_matches_transformers(shared_ranks, twin_dir, world, tmp_path):
    check_fp32(shared_ranks, twin_dir, world, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_small_configs_fp32_match_transformers(shared_ranks, small_dirs, name, world, tmp_path):
    check_fp32(shared_ranks, small_dirs[name], world, tmp_path)


def packs() -> bool:
    return packable(torch.bfloat16, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, batch, pack, backend",
    [(1, 2, False, "auto"), (2, 2, False, "auto"), (1, 8, True, "auto"), (2, 8, True, "torch")],
    ids=["w1", "w2", "w1-b8-packed", "w2-b8-packed-torch"],
)
def test_twin_bf16_no_farther_than_transformers_bf16(shared_ranks, twin_dir, world, batch, pack, backend, tmp_path):
    """Packed at batch 8, the twin's 16 experts x top-2 are covered: with the torch kernels its MoE layers run dense
    (kernels/moe.py), where this CPU has oneDNN bf16 (else the packed case runs the plain weights and says so by its
    layer count); with the CPU ops they run the one-op block on the stacked weights instead."""
    prompt, tokens, ref = reference(shared_ranks, str(twin_dir), batch=batch)
    T = prompt.shape[1]
    hf_bf16 = hf_logits(str(twin_dir), torch.bfloat16, prompt, tokens)
    moe_layers = sum(spec.mlp == "moe" for spec in load_config(str(twin_dir)).layers)
    one_op = backend == "auto" and cpu_ops.available()
    dense = moe_layers if pack and packs() and not one_op else 0
    prefill, steps = k3_logits(
        shared_ranks, twin_dir, world, "bfloat16", prompt, tokens, tmp_path, pack, dense, backend
    )
    mine = torch.cat([prefill[:, : T - 1], steps], 1)
    theirs = hf_bf16[:, : T - 1 + STEPS]
    target = ref[:, : T - 1 + STEPS]
    # distance = max |logit error| at each teacher-forced position, averaged over positions and sequences
    err_mine = (mine - target).abs().amax(-1).mean().item()
    err_theirs = (theirs - target).abs().amax(-1).mean().item()
    assert err_mine <= 1.5 * err_theirs, (err_mine, err_theirs)


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory):
    """A checkpoint transformers itself wrote (save_pretrained): its names, its config.json (with mlp_layer_types,
    which for moe_layer_freq=2 says MoE everywhere after the dense prefix), the dense MLP under block_sparse_moe."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    raw = small_config(moe_layer_freq=2)
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    out = tmp_path_factory.mktemp("hf-saved")
    model.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_checkpoint_written_by_transformers_matches(shared_ranks, saved_by_transformers, world, tmp_path):
    check_fp32(shared_ranks, saved_by_transformers, world, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_compiled_engine_matches_transformers(shared_ranks, small_dirs, world):
    """decode.compile=on through the real engine: the same greedy tokens as transformers, and each step's top-5
    logits equal to transformers' logits at those tokens."""
    model_dir = str(small_dirs["small"])
    prompt, tokens, ref = reference(shared_ranks, model_dir)
    requests = [{"ids": p, "max_new_tokens": STEPS} for p in prompt.tolist()]
    out = expect_ok(  # on new ranks: the step compiles in processes that have compiled nothing before
        run_ranks(partial(generate, capture="compile"), world, model_dir, requests, len(requests), timeout=600)
    )
    T, scale = prompt.shape[1], ref.abs().max().item()
    for b, c in enumerate(out[0]):
        assert c["tokens"] == tokens[b].tolist()
        for t, top in enumerate(c["top"]):
            ids = [i for i, _ in top]
            want = ref[b, T - 1 + t, ids]
            assert (torch.tensor([v for _, v in top]) - want).abs().max().item() <= 1e-4 * scale
            assert ids == ref[b, T - 1 + t].topk(5).indices.tolist()
