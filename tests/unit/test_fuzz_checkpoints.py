"""Fuzzed checkpoint headers, indexes and configs: the inventory either succeeds with every file inside the model dir
or refuses with one K3Error line; it never raises anything else, never hangs, never opens a file outside."""

import json
import re
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3dist.base.errors import K3Error
from k3dist.config import load_config, validate_topology
from k3dist.weights.inventory import INDEX, scan
from tests.support.bad_files import (
    OpenWatch,
    deadline,
    edit_index,
)
from tests.support.configs import small_config

# ---------------------------------------------------------------------------------------------- fuzz


def _scan_or_refuse(d: Path, watch: OpenWatch) -> None:
    """scan() either succeeds (every file inside d) or raises K3Error; never anything else, never a hang."""
    cfg = load_config(d)
    try:
        with deadline(20):
            inv = scan(d, cfg)
    except K3Error as exc:
        assert "\n" not in str(exc)
    else:
        assert all((d / f).resolve().is_relative_to(d.resolve()) for f in inv.files)
    assert not watch.opened(), "a file outside the model dir was opened"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    file_no=st.integers(0, 3),
    edits=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=8),
)
def test_fuzz_header_bytes(good, outside, file_no, edits):
    watch = OpenWatch(outside.parent)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp) / "model"
            shutil.copytree(good, d)
            path = sorted(d.glob("*.safetensors"))[file_no]
            blob = bytearray(path.read_bytes())
            region = 8 + struct.unpack("<Q", blob[:8])[0]  # the length prefix and the JSON header
            for pos, value in edits:
                blob[pos % region] = value
            path.write_bytes(bytes(blob))
            _scan_or_refuse(d, watch)
    finally:
        watch.close()


ESCAPES = [
    "{outside}",
    "../outside/outside.safetensors",
    "sub/../../outside/outside.safetensors",
    "linked.safetensors",
    "./../outside/outside.safetensors",
    "model-00001-of-00004.safetensors/..",
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    key=st.sampled_from(["lm_head.weight", "model.norm.weight", "model.layers.2.self_attn.A_log"]),
    target=st.one_of(st.sampled_from(ESCAPES), st.text(max_size=40)),
    edits=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), max_size=6),
)
def test_fuzz_index(good, outside, key, target, edits):
    """Random weight_map targets (escapes, arbitrary text) and random byte edits of the index text."""
    with tempfile.TemporaryDirectory() as tmp:
        # model dir and a valid file side by side, so the relative escapes aim at something scan could read
        away = Path(tmp) / "outside" / "outside.safetensors"
        away.parent.mkdir()
        shutil.copy(outside, away)
        d = Path(tmp) / "model"
        shutil.copytree(good, d)
        (d / "linked.safetensors").symlink_to(away)
        escape = target in ESCAPES
        target = target.replace("{outside}", str(away))
        edit_index(d, lambda wm: wm.update({key: target}))
        if edits:
            blob = bytearray((d / INDEX).read_bytes())
            for pos, value in edits:
                blob[pos % len(blob)] = value
            (d / INDEX).write_bytes(bytes(blob))
        watch = OpenWatch(away.parent)
        try:
            _scan_or_refuse(d, watch)
            if escape and not edits:
                with pytest.raises(K3Error, match="outside the model dir"):
                    scan(d, load_config(d))
                assert not watch.opened()
        finally:
            watch.close()


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(sorted(small_config())), st.one_of(st.just("<drop>"), _JSON_VALUES)),
        min_size=1,
        max_size=3,
    )
)
def test_fuzz_config_fields(tmp_path, edits):
    """Any field of config.json replaced by any JSON value (or dropped): a config or a K3Error, nothing else."""
    raw = small_config()
    for field, value in edits:
        if value == "<drop>":
            raw.pop(field, None)
        else:
            raw[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with deadline(10):
        try:
            cfg = load_config(path)
        except K3Error as exc:
            assert str(path) in str(exc) and "\n" not in str(exc)
            return
        try:
            validate_topology(cfg, 2)
        except K3Error as exc:
            assert re.search(r"world size 2 does not divide", str(exc))
