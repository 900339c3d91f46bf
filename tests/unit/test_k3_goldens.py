"""llama.cpp's golden logits of the K3 twin (tests/data/k3): they load, agree with themselves (each greedy token is
its row's argmax, each decode step fed the row before's choice, the margins are the rows' own), stay small, and a
rerun of benchmarks/k3_reference.py reproduces them where llama.cpp and gguf-py are installed (slow tier)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.k3_goldens import DATA, load

ROOT = Path(__file__).resolve().parents[2]


SETS = [DATA, DATA / "block12"]  # the twin at block size 5 (five prompt lengths), and at K3's 12 (two)


def test_the_goldens_are_small_and_name_what_made_them():
    assert sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file()) < 1_000_000
    lengths = [len(p.ids) for p in load().prompts]
    assert 1 in lengths and any(n > 16 for n in lengths) and any(n > 512 for n in lengths)  # KDA and prefill chunks
    for data in SETS:
        g = load(data)
        m = g.manifest
        config = json.loads((ROOT / "k3dist" / "configs" / m["twin"]["config"]).read_text())
        assert config["text_config"]["attn_res_block_size"] == (5 if data == DATA else 12)
        assert m["twin"]["variant"] == "dequantized" and "0c1e57098" in m["llama_cpp"]["tree"]
        assert "f32" in m["llama_cpp"]["context"] and "flash_attn off" in m["llama_cpp"]["context"]
        vocab = config["text_config"]["vocab_size"]
        assert all(0 <= i < vocab - 256 for p in g.prompts for i in p.ids)  # ordinary ids, no control token
        assert len(set(g.vocab_subset.tolist())) == len(g.vocab_subset) and g.vocab_subset.max() < vocab


@pytest.mark.parametrize("data", SETS, ids=["block5", "block12"])
def test_each_greedy_token_is_its_rows_argmax_with_the_recorded_margin(data):
    g = load(data)
    for p in g.prompts:
        last_prefill = int(np.flatnonzero(p.prefill.at == len(p.ids) - 1)[0])
        choices = np.concatenate([p.prefill.top_ids[last_prefill : last_prefill + 1, 0], p.decode.top_ids[:, 0]])
        assert choices.tolist() == p.greedy, p.name
        assert p.decode.at.tolist() == p.greedy[:-1], p.name  # step i fed the choice of the row before
        gaps = np.concatenate([p.prefill.top[last_prefill : last_prefill + 1], p.decode.top])[:, :2]
        assert np.allclose(gaps[:, 0] - gaps[:, 1], p.margins, atol=1e-5), p.name
        assert min(p.margins) >= g.manifest["min_margin"], p.name
        for rows in (p.prefill, p.decode):
            assert (np.diff(rows.top, axis=-1) <= 0).all() and np.array_equal(rows.top[:, 0], rows.max)
            assert (rows.subset <= rows.max[:, None]).all() and (rows.lse >= rows.max).all()
            assert np.isfinite(rows.subset).all() and rows.subset.std() > 0.1  # real logits, not a placeholder


def tree() -> Path | None:
    path = os.environ.get("LLAMA_CPP")
    return Path(path) if path and (Path(path) / "conversion" / "kimi_k3.py").is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(tree() is None, reason="$LLAMA_CPP names no llama.cpp tree with conversion/kimi_k3.py")
@pytest.mark.parametrize("data", SETS, ids=["block5", "block12"])
def test_a_rerun_reproduces_the_goldens(data, tmp_path, k3_cache):
    """The script again, on the committed prompts: the same greedy paths, and every kept logit within 1e-5 of its
    row's largest (bit-identical on the machine that wrote them; another CPU's SIMD may sum in another order)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    pytest.importorskip("gguf", reason="gguf-py is not installed")
    script = ROOT / "benchmarks" / "k3_reference.py"
    cmd = [sys.executable, str(script), "--llama-cpp", str(tree()), "--out", str(tmp_path)]
    subprocess.run([*cmd, "--reuse-prompts", str(data / "manifest.json")], check=True, timeout=3000)
    ours, theirs = load(tmp_path), load(data)
    assert np.array_equal(ours.vocab_subset, theirs.vocab_subset)
    for a, b in zip(ours.prompts, theirs.prompts, strict=True):
        assert a.ids == b.ids and a.greedy == b.greedy
        for ra, rb in ((a.prefill, b.prefill), (a.decode, b.decode)):
            assert np.array_equal(ra.at, rb.at) and np.array_equal(ra.top_ids[:, 0], rb.top_ids[:, 0])
            scale = np.abs(rb.top).max(-1, keepdims=True)
            assert (np.abs(ra.subset - rb.subset) <= 1e-5 * scale).all(), a.name
            assert (np.abs(ra.top - rb.top) <= 1e-5 * scale).all(), a.name
