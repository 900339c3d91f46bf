"""The layer-kind registry (k3dist/kinds/): every kind declares every spec entry, the registry is the only place a
kind's name is matched, and the kernel constants the specs use are the kernels' own."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

from k3dist.base.files import read_json
from k3dist.config import parse_config, read_k3
from k3dist.kernels import kda as kda_kernel
from k3dist.kinds import kda as kda_kind
from k3dist.kinds import mla as mla_kind
from k3dist.kinds.registry import CACHE_ENTRIES, KINDS, MIXERS, MLPS, cache_entry, present
from k3dist.kinds.spec import LayerKind
from k3dist.model import mla as mla_model
from k3dist.model.cache import cache_shapes
from k3dist.model.kinds import BUILDERS
from k3dist.weights.schema import expected_tensors, placements
from k3dist.weights.tp_plan import POLICY, axis_of
from tests.support.configs import small_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "k3dist" / "configs"
K3 = CONFIGS / "Kimi-K3-2.8T-A50B-config.json"


def test_every_kind_declares_every_spec_entry():
    """Each kind sets every field of LayerKind (a mixer also its layer list and cache entries), and model/kinds.py
    builds exactly the registry's kinds."""
    assert [k.name for k in KINDS] == [*MIXERS, *MLPS] and len(set(MIXERS) | set(MLPS)) == len(KINDS)
    required = {f.name for f in dataclasses.fields(LayerKind)} - {"cache", "layer_list", "decode_op_bytes", "quantized"}
    for kind in KINDS:
        missing = [name for name in sorted(required) if getattr(kind, name) in (None, "")]
        assert not missing, (kind.name, missing)
        assert kind.role == ("mixer" if kind.name in MIXERS else "mlp")
        if kind.role == "mixer":
            assert kind.layer_list and kind.cache, kind.name
    assert set(BUILDERS) == {k.name for k in KINDS}
    assert len(CACHE_ENTRIES) == sum(len(k.cache) for k in KINDS)  # entry names are unique across kinds


def test_each_spec_describes_its_layers():
    """On a config with every kind: each kind's tensors are the schema's for its layers, its placements place only
    its own tensors, its TP rules cover every one of them, its cache entries are the cache's, and its activation and
    widest input are positive."""
    cfg = parse_config(small_config())
    assert present(cfg) == KINDS
    schema = expected_tensors(cfg)
    placed = placements(cfg)
    shapes = cache_shapes(cfg, 2, 3, 64, torch.bfloat16)
    for kind in KINDS:
        layers = [spec.index for spec in cfg.layers if getattr(spec, kind.role) == kind.name]
        assert layers and kind.present(cfg) == len(layers)
        for i in layers:
            prefix = f"model.layers.{i}."
            names = {prefix + n for n in kind.tensors(cfg)}
            assert names <= set(schema), kind.name
            assert set(kind.placements(cfg, prefix)) <= names and set(kind.placements(cfg, prefix)) <= set(placed)
            for name in names:  # every tensor has a rule, and the first rule that matches it is one of the kind's
                axis_of(name)
            for entry in kind.cache:
                assert f"{entry.name}.{i}" in shapes and cache_entry(f"{entry.name}.{i}") is entry
        assert set(kind.policy) <= set(POLICY)
        assert kind.activation(cfg, 2, tokens=64, seqs=2, longest=96, s=2, cpu=True, dense=False) > 0
        assert kind.widest_input(cfg, 2) > 0
    assert cache_entry("positions") is None
    assert {n.split(".")[0] for n in shapes} - {"positions"} == set(CACHE_ENTRIES)


def test_each_spec_lists_k3_tensors():
    """K3's checkpoint names: every kind lists its K3 variant's tensors (a KDA, MLA and MoE layer all present)."""
    cfg = read_k3(read_json(K3), str(K3))
    for kind in KINDS:
        tensors = kind.k3_tensors(cfg)
        assert tensors and all(isinstance(s, tuple) for s in tensors.values()), kind.name


# Names a kind is known by: a kind's name, its layer type in config.json, a cache entry's tensor prefix. Outside
# k3dist/kinds/ no source file may hold one as a string literal: a test of a kind's name would be a branch the next
# kind has to find. model/kinds.py names kinds through their specs (KDA.name), as every other module must.
KIND_LITERALS = {k.name for k in KINDS} | {k.layer_type for k in KINDS} | {e + "." for e in CACHE_ENTRIES}
LITERAL = re.compile("([\"'])(" + "|".join(re.escape(n) for n in sorted(KIND_LITERALS)) + ")\\1")


def test_the_registry_is_the_only_place_kind_names_are_matched():
    sources = [*ROOT.glob("k3dist/**/*.py"), *ROOT.glob("kernels/*.py")]
    literal = LITERAL
    keyword = re.compile(r"\b(mixer|mlp)\s*=\s*[\"']")  # cfg.count(mixer="...")
    found = []
    for path in sources:
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("k3dist", "kinds"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if literal.search(line) or keyword.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, found


def test_the_grep_sees_a_kind_test():
    """The check above finds what it forbids (so a pattern that matches nothing cannot pass it)."""
    literal = LITERAL
    assert literal.search('if spec.mixer == "kda":') and literal.search("n.startswith(('conv.', 'state.'))")
    assert not literal.search('"kda_layers"')


def _cpp_constant(name: str) -> int:
    text = (ROOT / "kernels" / "csrc" / "mla_decode.cpp").read_text()
    found = re.findall(rf"constexpr\s+int64_t\s+{name}\s*=\s*(\d+)\s*;", text)
    assert len(found) == 1, (name, found)
    return int(found[0])


def test_mla_decode_constants_are_the_cpp_ones():
    """The memory plan sizes the C++ MLA decode op's piece buffers with kernels/csrc/mla_decode.cpp's values."""
    assert (mla_kind.MLA_PIECES, mla_kind.MLA_PIECE) == (_cpp_constant("PIECES"), _cpp_constant("PIECE"))


def test_kernel_constants_are_the_kernels_own():
    """KDA's chunk length is kernels/kda.py's (its prefill's default), and MLA's key block the model's."""
    assert kda_kind.CHUNK is kda_kernel.CHUNK
    assert inspect.signature(kda_kernel.kda_prefill).parameters["chunk_size"].default == kda_kernel.CHUNK
    assert mla_model.KEY_BLOCK == mla_kind.KEY_BLOCK


@pytest.mark.parametrize("types", [["linear_attention", "full_attention"], ["full_attention", "full_attention"]])
def test_layer_types_read_through_the_specs(types):
    """config.json's layer_types map to the kinds whose spec names that type."""
    raw = small_config(num_hidden_layers=2, first_k_dense_replace=0)
    raw.pop("linear_attn_config", None)
    raw |= {"layer_types": types, "linear_num_heads": 4, "linear_head_dim": 16}
    by_type = {k.layer_type: k.name for k in MIXERS.values()}
    assert [s.mixer for s in parse_config(raw).layers] == [by_type[t] for t in types]
