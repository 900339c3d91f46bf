"""copy_shard's contract: every TP axis sliced and reassembled exactly, only rank-local bytes owned (never an alias
of the file), and no byte of another rank's slice ever touched (pages protected in a real mapping).

Every checkpoint here is a real safetensors file in a tmp dir; multi-rank checks run real gloo ranks.
"""

import math
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from k3dist.base.dtypes import BY_CODE
from k3dist.weights.inventory import TensorEntry
from k3dist.weights.schema import keeps_fp32
from k3dist.weights.tp_plan import (
    COLUMN,
    HEADS,
    POLICY,
    REPLICATED,
    ROW,
    VOCAB,
    copy_shard,
    plan_tensor,
)

ROOT = Path(__file__).resolve().parents[2]

# One tensor name per axis of the policy (the axis comes from the name, as in a checkpoint).
AXIS_EXAMPLES = {
    REPLICATED: "model.layers.0.input_layernorm.weight",
    VOCAB: "lm_head.weight",
    COLUMN: "model.layers.1.self_attn.q_proj.weight",
    ROW: "model.layers.1.self_attn.o_proj.weight",
    HEADS: "model.layers.1.self_attn.A_log",
}
ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _expected_slice(full: torch.Tensor, dim: int | None, start: int, stop: int) -> torch.Tensor:
    return full if dim is None else full.narrow(dim, start, stop - start)


# ---------------------------------------------------------------------------------------------- copy_shard


def test_policy_uses_exactly_the_axes_covered_here():
    assert {axis for _, axis in POLICY} == set(AXIS_EXAMPLES)
    assert (REPLICATED.dim, VOCAB.dim, COLUMN.dim, ROW.dim, HEADS.dim) == (None, 0, 0, 1, 2)


@st.composite
def _shard_case(draw):
    axis = draw(st.sampled_from(list(AXIS_EXAMPLES)))
    if axis is HEADS:
        shape = (1, 1, draw(st.integers(1, 16)), 1)  # A_log [1, 1, H, 1]
    else:
        ndim = draw(st.integers(2 if axis is ROW else 1, 3))
        shape = tuple(draw(st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim)))
    return (
        axis,
        shape,
        draw(st.integers(1, 8)),
        draw(st.sampled_from(sorted(ST_DTYPES))),
        draw(st.sampled_from([torch.bfloat16, torch.float32])),
        draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_shard_case())
def test_copy_shard_slices_and_reassembles_every_axis(case):
    axis, shape, world, src, compute, seed = case
    name = AXIS_EXAMPLES[axis]
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(ST_DTYPES[src])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.safetensors")
        save_file({name: full}, path)
        shards, covered = [], 0
        with safe_open(path, framework="pt") as handle:
            for rank in range(world):
                plan = plan_tensor(TensorEntry(name, name, "t.safetensors", shape, src), world, rank, compute)
                piece = copy_shard(handle, plan)
                assert plan.axis == axis and plan.full_shape == shape
                assert piece.dtype == ST_DTYPES[src] == BY_CODE[plan.src_dtype].torch
                assert tuple(piece.shape) == plan.local_shape
                # owned, contiguous, exactly the local bytes (no view of the whole tensor or of the file)
                assert piece.is_contiguous() and piece.untyped_storage().nbytes() == piece.numel() * piece.itemsize
                kept = torch.float32 if keeps_fp32(name) else compute
                assert plan.dtype == kept
                assert plan.numel == math.prod(plan.local_shape) == piece.numel()
                assert plan.local_bytes == piece.numel() * kept.itemsize
                assert plan.source_bytes == piece.numel() * piece.itemsize
                if axis.dim is None:
                    assert plan.local_shape == shape
                    assert torch.equal(piece, full)
                    continue
                # ranks tile [0, size) in rank order
                assert plan.start == covered <= plan.stop <= shape[axis.dim]
                covered = plan.stop
                assert plan.local_shape == tuple(
                    plan.stop - plan.start if i == axis.dim else n for i, n in enumerate(shape)
                )
                assert torch.equal(piece, _expected_slice(full, axis.dim, plan.start, plan.stop))
                if shape[axis.dim] % world == 0:
                    assert plan.local_shape[axis.dim] == shape[axis.dim] // world
                shards.append(piece)
        if axis.dim is not None:
            assert covered == shape[axis.dim]
            assert torch.equal(torch.cat(shards, dim=axis.dim), full)


def _big_tensor(path: str, name: str, shape: tuple[int, int]) -> torch.Tensor:
    full = (torch.arange(math.prod(shape), dtype=torch.int64) % 251).reshape(shape).to(torch.bfloat16)
    save_file({name: full}, path)
    return full


@pytest.mark.parametrize("axis", [VOCAB, ROW], ids=["dim0", "dim1"])
def test_copy_shard_owns_only_local_bytes_and_does_not_alias_the_file(tmp_path, axis):
    """A 64 MiB tensor, rank 3 of 8: the result holds 8 MiB, and rewriting the file afterwards does not change it."""
    name, world, rank = AXIS_EXAMPLES[axis], 8, 3
    shape = (4096, 8192)  # bf16: 64 MiB
    path = tmp_path / "big.safetensors"
    full = _big_tensor(str(path), name, shape)
    plan = plan_tensor(TensorEntry(name, name, path.name, shape, "BF16"), world, rank, torch.bfloat16)
    with safe_open(path, framework="pt") as handle:
        piece = copy_shard(handle, plan)
    local = full.numel() * 2 // world
    assert plan.local_bytes == plan.source_bytes == local == 8 * 2**20
    assert piece.untyped_storage().nbytes() == local and piece.is_contiguous()
    expect = _expected_slice(full, axis.dim, plan.start, plan.stop)
    assert torch.equal(piece, expect)
    # overwrite the whole data region in place: a view of the file's mmap would change with it
    size = path.stat().st_size
    with open(path, "r+b") as f:
        header = 8 + struct.unpack("<Q", f.read(8))[0]
        f.seek(header)
        f.write(b"\xff" * (size - header))
    assert torch.equal(piece, expect)


# Runs in a child process. For each file: make every page of the tensor that holds no byte of rank `rank`
# unreadable (PROT_NONE) in the mapping safetensors made of the file, check from /proc/self/maps that they are,
# then copy the shard. Last, the control: a full read under the same protection, which must kill the process.
_PROTECTED_READ = r"""
import ctypes, json, mmap, os, struct, sys
import torch
from safetensors import safe_open
from k3dist.weights.inventory import TensorEntry
from k3dist.weights.tp_plan import copy_shard, plan_tensor

libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
page = mmap.PAGESIZE
world, rank = int(sys.argv[1]), int(sys.argv[2])


def mapping(path):
    return [line.split() for line in open("/proc/self/maps") if line.rstrip().endswith(" " + path)]


def shard_under_protection(path, name, rows, cols, control):
    path = os.path.realpath(path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        base = 8 + n + json.loads(f.read(n))[name]["data_offsets"][0]
    plan = plan_tensor(TensorEntry(name, name, "f", (rows, cols), "BF16"), world, rank, torch.bfloat16)
    with safe_open(path, framework="pt") as handle:
        maps = mapping(path)
        if not maps:
            print("NOMAP", flush=True)
            sys.exit(0)
        wanted = 0

        def protect(a, b):
            nonlocal wanted
            for m in maps:
                lo, hi = (int(v, 16) for v in m[0].split("-"))
                off = int(m[2], 16)
                s, e = max(a, off), min(b, off + hi - lo)
                s, e = (s + page - 1) // page * page, e // page * page
                if e > s:
                    assert libc.mprotect(lo + s - off, e - s, 0) == 0, ctypes.get_errno()
                    wanted += e - s

        if plan.axis.dim == 0:
            protect(base, base + plan.start * cols * 2)
            protect(base + plan.stop * cols * 2, base + rows * cols * 2)
        else:
            for r in range(rows):
                row = base + r * cols * 2
                protect(row, row + plan.start * 2)
                protect(row + plan.stop * 2, row + cols * 2)
        spans = [(m[0].split("-"), m[1]) for m in mapping(path)]
        none = sum(int(b, 16) - int(a, 16) for (a, b), perm in spans if perm.startswith("---"))
        assert none == wanted, (none, wanted)
        if control:
            print("CONTROL", flush=True)
            handle.get_slice(name)[:].clone()
            print("READ-ALL", flush=True)
            return
        piece = copy_shard(handle, plan)
    full = (torch.arange(rows * cols, dtype=torch.int64) % 251).reshape(rows, cols).to(torch.bfloat16)
    assert torch.equal(piece, full.narrow(plan.axis.dim, plan.start, plan.stop - plan.start))
    print("OK", name, none, piece.untyped_storage().nbytes(), flush=True)


jobs = [a.split(":") for a in sys.argv[3:]]
for path, name, rows, cols in jobs:
    shard_under_protection(path, name, int(rows), int(cols), control=False)
path, name, rows, cols = jobs[-1]
shard_under_protection(path, name, int(rows), int(cols), control=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc/self/maps and mprotect")
def test_copy_shard_never_touches_other_ranks_bytes(tmp_path):
    """With every page of the other ranks' bytes unreadable, copy_shard still returns the exact shard (dim 0 and
    dim 1); the control, a full read under the same protection, kills the process, so the protection is real."""
    world, rank = 8, 5
    jobs = [(VOCAB, (1024, 2048)), (ROW, (128, 8 * 2048))]  # 4 MiB each; dim 1: one page per rank per row
    args = []
    for axis, (rows, cols) in jobs:
        path = tmp_path / f"{axis.name}.safetensors"
        _big_tensor(str(path), AXIS_EXAMPLES[axis], (rows, cols))
        args.append(f"{path}:{AXIS_EXAMPLES[axis]}:{rows}:{cols}")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", _PROTECTED_READ, str(world), str(rank), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
    if "NOMAP" in proc.stdout:
        pytest.skip("this safetensors build does not mmap the file")
    ok = [line.split() for line in proc.stdout.splitlines() if line.startswith("OK ")]
    assert [o[1] for o in ok] == [AXIS_EXAMPLES[a] for a, _ in jobs], proc.stdout + proc.stderr[-3000:]
    for (_, shape), o in zip(jobs, ok, strict=True):
        other = math.prod(shape) * 2 * (world - 1) // world  # the other ranks' bytes
        assert int(o[2]) >= other * 0.7  # most of them were unreadable (partial pages at the edges stay readable)
        assert int(o[3]) == math.prod(shape) * 2 // world
    assert "CONTROL" in proc.stdout and "READ-ALL" not in proc.stdout
    assert proc.returncode < 0, (proc.returncode, proc.stderr[-3000:])  # killed (SIGSEGV) reading a protected page
