"""Bad checkpoints and configs are refused with one K3Error line naming the file, the tensor and the numbers.

Header-level corruptions are crafted by hand (8-byte little-endian length + JSON header + data) from a real small
checkpoint; schema-level ones are real safetensors files; one case runs the real CLI on two ranks.
"""

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file

from k3dist.base.errors import K3Error
from k3dist.config import load_config, validate_topology
from k3dist.weights.inventory import INDEX, scan
from tests.support.bad_files import (
    ROOT,
    SHARD,
    OpenWatch,
    deadline,
    edit_config,
    edit_index,
    load_all,
    read_raw,
    tensors_by_offset,
    write_raw,
)

# ---------------------------------------------------------------------------------------------- the cases


@dataclass
class Case:
    id: str
    mutate: object  # (model_dir, outside file) -> fragments the message must hold (besides the model dir)
    check: str = "scan"  # scan | config | topology


def _truncate(d, _):
    path = d / SHARD
    header, data = read_raw(path)
    name, (begin, end) = tensors_by_offset(header)[-1]
    path.write_bytes(path.read_bytes()[:-100])
    return [str(path), f"tensor {name}", f"[{begin}, {end}]", f"{len(data) - 100} data bytes"]


def _header_too_long(d, _):
    path = d / SHARD
    blob = bytearray(path.read_bytes())
    size = len(blob)
    blob[:8] = struct.pack("<Q", size + 1000)
    path.write_bytes(bytes(blob))
    return [str(path), f"header length {size + 1000} does not fit the file of {size} bytes"]


def _header_not_json(d, _):
    path = d / SHARD
    _, data = read_raw(path)
    write_raw(path, b'{"model.layers.1.self_attn.q_proj.weight": {"dtype": "BF16", ', data)
    return [str(path), "header is not JSON"]


def _header_not_object(d, _):
    path = d / SHARD
    _, data = read_raw(path)
    write_raw(path, b"[1, 2, 3]", data)
    return [str(path), "JSON list, not an object"]


def _offsets_out_of_bounds(d, _):
    path = d / SHARD
    header, data = read_raw(path)
    name, (begin, end) = tensors_by_offset(header)[-1]
    header[name]["data_offsets"] = [begin + 64, end + 64]
    write_raw(path, header, data)
    return [str(path), f"tensor {name}", f"[{begin + 64}, {end + 64}]", f"{len(data)} data bytes"]


def _offsets_overlap(d, _):
    path = d / SHARD
    header, data = read_raw(path)
    (a, (_, a_end)), (b, (b_begin, b_end)) = tensors_by_offset(header)[:2]
    header[b]["data_offsets"] = [b_begin - 2, b_end - 2]
    write_raw(path, header, data)
    return [str(path), f"tensor {b}", f"[{b_begin - 2}, {b_end - 2}]", f"overlap tensor {a}", f"ends at {a_end}"]


def _offsets_gap(d, _):
    path = d / SHARD
    header, data = read_raw(path)
    (a, (_, a_end)), (b, (b_begin, b_end)) = tensors_by_offset(header)[:2]
    del header[a]  # its bytes stay: a hole at the start of the data
    write_raw(path, header, data)
    return [str(path), f"tensor {b} data_offsets [{b_begin}, {b_end}] leave a gap after byte 0"]


def _offsets_do_not_cover(d, _):
    path = d / SHARD
    header, data = read_raw(path)
    write_raw(path, header, data + bytes(64))
    return [str(path), f"cover {len(data)} of the {len(data) + 64} data bytes"]


def _unknown_dtype(dtype):
    def mutate(d, _):
        path = d / SHARD
        header, data = read_raw(path)
        name = tensors_by_offset(header)[0][0]
        header[name]["dtype"] = dtype
        write_raw(path, header, data)
        return [str(path), f"tensor {name} has unknown dtype '{dtype}'"]

    return mutate


def _shape_vs_offsets(d, _):
    path = d / SHARD
    header, data = read_raw(path)
    name, (begin, end) = tensors_by_offset(header)[0]
    shape = header[name]["shape"]
    header[name]["shape"] = [shape[0] + 1, *shape[1:]]
    write_raw(path, header, data)
    return [str(path), f"tensor {name}", f"[{begin}, {end}]", f"hold {end - begin} bytes"]


def _rewrite(d, fn):
    """Rewrite SHARD as a real safetensors file after fn(tensors) edits its dict; returns the edited key."""
    path = d / SHARD
    tensors = load_all(path)
    key = fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, key


def _unsupported_dtype(dtype, name):
    def mutate(d, _):
        def edit(t):
            key = next(k for k in t if t[k].dim() == 2)
            t[key] = t[key].to(dtype)
            return key

        path, key = _rewrite(d, edit)
        return [str(path), f"tensor {key} has dtype {name}", "supported:"]

    return mutate


def _shape_mismatch(d, _):
    shape = []

    def edit(t):
        key = next(k for k in t if t[k].dim() == 2)
        shape.extend(t[key].shape)
        t[key] = t[key][:-1].clone()
        return key

    path, key = _rewrite(d, edit)
    return [str(path), f"tensor {key} has shape [{shape[0] - 1}, {shape[1]}], the config needs {shape}"]


def _tensor_missing(d, _):
    gone = []

    def edit(t):
        key = next(k for k in t if k.endswith("o_proj.weight"))
        gone.append((key, list(t.pop(key).shape)))
        return key

    path, key = _rewrite(d, edit)
    edit_index(d, lambda wm: wm.pop(key))
    return [f"tensor {key} is missing", f"expected shape {gone[0][1]}"]


def _tensor_missing_but_indexed(d, _):
    def edit(t):
        key = next(k for k in t if k.endswith("o_proj.weight"))
        del t[key]
        return key

    path, key = _rewrite(d, edit)
    return [str(path), f"tensor {key} is missing"]


def _tensor_duplicated(d, _):
    first = d / "model-00001-of-00004.safetensors"
    extra = next(iter(load_all(first).items()))
    path, _ = _rewrite(d, lambda t: t.update([extra]))
    return [str(path), f"tensor {extra[0]} is duplicated", "model-00001-of-00004.safetensors"]


def _tensor_unexpected(d, _):
    path, _ = _rewrite(d, lambda t: t.update({"model.layers.1.self_attn.extra_proj.weight": torch.zeros(4, 4)}))
    return [str(path), "tensor model.layers.1.self_attn.extra_proj.weight is unexpected"]


def _index_missing_file(d, _):
    edit_index(d, lambda wm: wm.update({"lm_head.weight": "model-00009-of-00004.safetensors"}))
    return [str(d / "model-00009-of-00004.safetensors"), "does not exist"]


def _index_absolute(d, outside):
    edit_index(d, lambda wm: wm.update({"lm_head.weight": str(outside)}))
    return [str(d / INDEX), repr(str(outside)), "outside the model dir"]


def _index_dotdot(d, outside):
    rel = os.path.relpath(outside, d)
    assert rel.startswith("..")
    edit_index(d, lambda wm: wm.update({"lm_head.weight": rel}))
    return [str(d / INDEX), repr(rel), "outside the model dir"]


def _index_symlink_out(d, outside):
    (d / "linked.safetensors").symlink_to(outside)
    edit_index(d, lambda wm: wm.update({"lm_head.weight": "linked.safetensors"}))
    return [str(d / "linked.safetensors"), f"resolves to {outside.resolve()}", "outside the model dir"]


def _glob_symlink_out(d, outside):
    (d / INDEX).unlink()
    (d / "linked.safetensors").symlink_to(outside)
    return [str(d / "linked.safetensors"), f"resolves to {outside.resolve()}", "outside the model dir"]


def _index_symlink_loop(d, _):
    (d / "loop.safetensors").symlink_to(d / "loop.safetensors")
    edit_index(d, lambda wm: wm.update({"lm_head.weight": "loop.safetensors"}))
    return ["'loop.safetensors'", "cannot be resolved"]


def _index_nul_byte(d, _):
    edit_index(d, lambda wm: wm.update({"lm_head.weight": "model\x00.safetensors"}))
    return ["'model\\x00.safetensors'", "cannot be resolved"]


def _index_name_too_long(d, _):
    edit_index(d, lambda wm: wm.update({"lm_head.weight": "a" * 5000 + ".safetensors"}))
    return ["cannot be resolved", "File name too long"]


def _index_not_json(d, _):
    (d / INDEX).write_text('{"weight_map": {"lm_head.weight": "model-00004-of-00004.safetensors",')
    return [str(d / INDEX), "not valid JSON"]


def _index_weight_map_not_object(d, _):
    (d / INDEX).write_text(json.dumps({"weight_map": ["model-00001-of-00004.safetensors"]}))
    return [str(d / INDEX), "needs a weight_map object"]


def _config_missing_field(d, _):
    edit_config(d, lambda raw: raw.pop("hidden_size"))
    return [str(d / "config.json"), "required field hidden_size is missing"]


def _config_bad_type(d, _):
    edit_config(d, lambda raw: raw.update(hidden_size="64"))
    return [str(d / "config.json"), "field hidden_size='64' must be int"]


def _config_bad_float(d, _):
    edit_config(d, lambda raw: raw.update(rms_norm_eps="1e-5"))
    return [str(d / "config.json"), "field rms_norm_eps='1e-5' must be float"]


def _config_float_value(key, value):
    def edit(d, _):
        edit_config(d, lambda raw: raw.update({key: value}))  # json writes NaN/Infinity, and reads them back
        return [str(d / "config.json"), f"field {key}={value} must be a finite number > 0"]

    return edit


def _config_model_type(value):
    def mutate(d, _):
        edit_config(d, lambda raw: raw.update(model_type=value))
        return [str(d / "config.json"), f"model_type={value!r} is not one of"]

    return mutate


def _config_layers_not_ints(d, _):
    edit_config(d, lambda raw: raw["linear_attn_config"].update(kda_layers=[1, "2", 3]))
    return [str(d / "config.json"), "kda_layers/full_attn_layers must be lists"]


def _config_not_json(d, _):
    (d / "config.json").write_text('{"model_type": "kimi_linear",')
    return [str(d / "config.json"), "not valid JSON"]


def _config_heads_vs_world(d, _):
    edit_config(d, lambda raw: raw["linear_attn_config"].update(num_heads=6))
    return [str(d / "config.json"), "world size 4 does not divide", "num_heads)=6", "world sizes that fit: [1, 2]"]


CASES = [
    Case("truncated-file", _truncate),
    Case("header-length-beyond-file", _header_too_long),
    Case("header-not-json", _header_not_json),
    Case("header-not-object", _header_not_object),
    Case("offsets-out-of-bounds", _offsets_out_of_bounds),
    Case("offsets-overlap", _offsets_overlap),
    Case("offsets-gap", _offsets_gap),
    Case("offsets-do-not-cover-data", _offsets_do_not_cover),
    Case("unknown-dtype-F8_XYZ", _unknown_dtype("F8_XYZ")),
    Case("unknown-dtype-I4", _unknown_dtype("I4")),
    Case("shape-vs-offsets", _shape_vs_offsets),
    Case("unsupported-dtype-I64", _unsupported_dtype(torch.int64, "I64")),
    Case("unsupported-dtype-F8_E4M3", _unsupported_dtype(torch.float8_e4m3fn, "F8_E4M3")),
    Case("shape-mismatch-vs-config", _shape_mismatch),
    Case("tensor-missing", _tensor_missing),
    Case("tensor-missing-but-indexed", _tensor_missing_but_indexed),
    Case("tensor-duplicated-across-files", _tensor_duplicated),
    Case("tensor-unexpected", _tensor_unexpected),
    Case("index-names-missing-file", _index_missing_file),
    Case("index-absolute-path", _index_absolute),
    Case("index-dotdot", _index_dotdot),
    Case("index-symlink-leaves-dir", _index_symlink_out),
    Case("glob-symlink-leaves-dir", _glob_symlink_out),
    Case("index-symlink-loop", _index_symlink_loop),
    Case("index-nul-byte", _index_nul_byte),
    Case("index-name-too-long", _index_name_too_long),
    Case("index-not-json", _index_not_json),
    Case("index-weight-map-not-object", _index_weight_map_not_object),
    Case("config-missing-field", _config_missing_field, "config"),
    Case("config-field-type", _config_bad_type, "config"),
    Case("config-float-field-type", _config_bad_float, "config"),
    Case("config-eps-nan", _config_float_value("rms_norm_eps", float("nan")), "config"),
    Case("config-eps-negative", _config_float_value("rms_norm_eps", -1.0), "config"),
    Case("config-scale-infinite", _config_float_value("routed_scaling_factor", float("inf")), "config"),
    Case("config-model-type", _config_model_type("llama"), "config"),
    Case("config-model-type-list", _config_model_type(["kimi_linear"]), "config"),
    Case("config-layers-not-ints", _config_layers_not_ints, "config"),
    Case("config-not-json", _config_not_json, "config"),
    Case("config-heads-vs-world", _config_heads_vs_world, "topology"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_with_one_line(case, good, outside, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(good, d, symlinks=True)
    fragments = case.mutate(d, outside)
    watch = OpenWatch(outside.parent)
    with deadline(30), pytest.raises(K3Error) as err:
        if case.check == "config":
            load_config(d)
        elif case.check == "topology":
            validate_topology(load_config(d), 4)
        else:
            scan(d, load_config(d))
    opened = watch.opened()
    watch.close()
    msg = str(err.value)
    assert "\n" not in msg and err.value.line == f"error: {msg}"
    assert str(d) in msg, msg  # names the file (or the model dir and the offending name)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    assert not opened, f"a file outside the model dir was opened: {msg}"


def test_cli_two_ranks_refuse_a_truncated_file(good, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(good, d)
    bad = d / SHARD
    bad.write_bytes(bad.read_bytes()[:-100])
    cmd = [sys.executable, "launch.py", f"model.path={d}", "dist.nproc=2", "run.mode=load", f"out={tmp_path}/r.json"]
    cmd.append(f"hydra.run.dir={tmp_path}/hydra")  # keep the repo's outputs/ clean
    env = os.environ | {"K3DIST_CACHE": str(tmp_path / "cache")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.perf_counter() - start
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines, proc.stderr[-3000:]
    assert any(str(bad) in line and "data bytes" in line for line in lines), lines
    assert not (tmp_path / "r.json").exists()
    assert elapsed < 90, f"took {elapsed:.1f} s"
