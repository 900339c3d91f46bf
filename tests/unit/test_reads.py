"""What a rank reads: the read schedule (merged ranges, row chunks, the staging ring) and `read_bytes`, the pages
those reads touch, checked against the page cache (mincore) after copy_shard and after the loader itself."""

import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3dist.base.dist import Runtime
from k3dist.base.fault_injection import Faults
from k3dist.config import load_config
from k3dist.twin.checkpoint import write_checkpoint
from k3dist.weights import reads
from k3dist.weights.inventory import TensorEntry, layout, scan
from k3dist.weights.loader import upload
from k3dist.weights.memory import memory_plan
from k3dist.weights.reads import CHUNK, MERGE, PAGE, SLOTS, schedule, staging
from k3dist.weights.tp_plan import copy_shard, plan_rank, plan_tensor
from k3dist.weights.whatif import config_entries
from tests.support.configs import small_config
from tests.support.residency import SUPPORTED, evict, no_readahead, resident, write_synced

ROOT = Path(__file__).resolve().parents[2]
REAL_CONFIG = ROOT / "k3dist" / "configs" / "Kimi-Linear-48B-A3B-config.json"
CPU_RANK = Runtime(0, 1, 0, 1, torch.device("cpu"), "gloo", None, 30.0)  # a world of one: agreements are local

needs_linux = pytest.mark.skipif(not SUPPORTED, reason="needs mincore, madvise and posix_fadvise")


def _read_pages(ranges: list[tuple[int, int]]) -> set[int]:
    return {page for start, size in ranges for page in range(start // PAGE, (start + size - 1) // PAGE + 1)}


def _ranges(chunks) -> list[tuple[int, int]]:
    """Every file range the chunks read: preads and spans."""
    return [r[:2] for c in chunks for r in c.reads] + [(s.offset, s.size) for c in chunks for s in c.spans]


# --------------------------------------------------------------------------------------------------- copy_shard

# name (its axis comes from the name), shape: rank 5 of 8 reads ...
COPY_CASES = {
    "dim0": ("lm_head.weight", (1024, 2048)),  # ... 128 rows of 4 KiB: one range, rounded out to pages
    "dim1-subpage": ("model.layers.1.self_attn.o_proj.weight", (512, 2048)),  # ... 512 B of each 4 KiB row: all
    "dim1-wide": ("model.layers.1.self_attn.o_proj.weight", (16, 8 * 65536)),  # ... 128 KiB of each 1 MiB row
    "replicated": ("model.layers.0.input_layernorm.weight", (300_001,)),  # ... all of it
}


@needs_linux
@pytest.mark.parametrize("case", list(COPY_CASES))
def test_read_bytes_are_the_pages_copy_shard_touches(tmp_path, case):
    """With the file evicted and readahead off on safetensors' mapping, the pages copy_shard brings into the page
    cache are exactly the pages of the scheduled reads, and the tensor's first page, which safetensors touches when
    it makes the slice (the loader's own reads have no such page: test_the_loader_reads_exactly_read_bytes)."""
    name, shape = COPY_CASES[case]
    full = (torch.arange(math.prod(shape), dtype=torch.int64) % 251).reshape(shape).to(torch.bfloat16)
    path = tmp_path / "t.safetensors"
    pad = torch.zeros(2**19 + 777, dtype=torch.bfloat16)  # 1 MiB and change first: header faults stay far away
    save_file({"a_pad": pad, name: full}, str(path))
    write_synced(path)
    fd = os.open(path, os.O_RDONLY)
    offset = layout(fd)[name][2]
    os.close(fd)
    assert offset > 2**20 and offset % PAGE  # the tensor starts mid-page
    plan = plan_tensor(TensorEntry(name, name, path.name, shape, "BF16", offset), 8, 5, torch.bfloat16)
    chunks = schedule([plan])[path.name]
    planned = _read_pages(_ranges(chunks))
    first, last = offset // PAGE, (offset + full.numel() * 2 - 1) // PAGE
    with safe_open(path, framework="pt") as handle:
        if not no_readahead(path):
            pytest.skip("this safetensors build does not mmap the file")
        evict(path)
        if {p for p in resident(path) if first <= p <= last}:
            pytest.skip("the page cache cannot be evicted here")
        piece = copy_shard(handle, plan)
        touched = {p for p in resident(path) if first <= p <= last}
    expect = full if plan.axis.dim is None else full.narrow(plan.axis.dim, plan.start, plan.stop - plan.start)
    assert torch.equal(piece, expect)
    assert touched == planned | {first}, (case, len(touched), len(planned))
    assert reads.pages(chunks) == len(planned)
    every = set(range(first, last + 1))
    if case in ("dim1-subpage", "replicated"):
        assert touched == every  # every page of the tensor
    if case == "dim1-subpage":
        assert len(touched) * PAGE >= 7 * plan.source_bytes
    if case == "dim0":
        assert len(planned) == plan.source_bytes // PAGE + 1  # 128 rows of 4 KiB, unaligned: one page more
    if case == "dim1-wide":  # holes of 896 KiB are not read: 16 separate reads of 128 KiB (33 pages each)
        assert len(chunks[0].reads) == 16 and len(planned) == 16 * 33 < len(every) // 6


# ------------------------------------------------------------------------------------------------- the loader


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> Path:
    d = write_checkpoint(small_config(), tmp_path_factory.mktemp("ckpt") / "m", seed=3, shard_bytes=200_000)
    for f in d.glob("*.safetensors"):
        write_synced(f)
    return d


def _expected_pages(plans, file: str) -> set[int]:
    """The header, then every scheduled read of one file."""
    data = min(p.offset for p in plans if p.file == file)
    return _read_pages([(0, data)] + _ranges(schedule(plans)[file]))


@needs_linux
@pytest.mark.parametrize(
    "world, rank, dtype",
    [(1, 0, torch.bfloat16), (4, 1, torch.bfloat16), (4, 3, torch.float32)],
    ids=["w1-bf16", "w4r1-bf16", "w4r3-fp32"],
)
def test_the_loader_reads_exactly_read_bytes(small_ckpt, world, rank, dtype):
    """The loader's own reads (readahead off on its descriptor) bring exactly `read_bytes` into the page cache, and
    it places exactly the rank's slices."""
    cfg = load_config(small_ckpt)
    inv = scan(small_ckpt, cfg)
    plans = plan_rank(cfg, inv.entries.values(), world, rank, dtype)
    mp = memory_plan(rank, plans, 2**40)
    for f in inv.files:
        evict(small_ckpt / f)
    if any(resident(small_ckpt / f) for f in inv.files):
        pytest.skip("the page cache cannot be evicted here")
    tensors = upload(inv, plans, CPU_RANK, Faults())
    seen = {f: resident(small_ckpt / f) for f in inv.files}
    assert seen == {f: _expected_pages(plans, f) for f in inv.files}
    assert sum(map(len, seen.values())) * PAGE == mp.read_bytes
    full = {}
    for f in inv.files:
        full |= load_file(small_ckpt / f)
    for p in plans:
        mine = tensors[p.dest] if p.slot is None else tensors[p.dest][p.slot]
        mine = mine if p.row is None else mine[p.row : p.row + p.local_shape[0]]
        expect = full[p.key] if p.axis.dim is None else full[p.key].narrow(p.axis.dim, p.start, p.stop - p.start)
        assert torch.equal(mine, expect.to(p.dtype)), p.name


# ---------------------------------------------------------------------------------------------- the schedule


def test_consecutive_tensors_read_as_one_range_at_world_1(small_ckpt):
    """At world 1 a file's data is one contiguous range (stacked experts, fused projections and all): its chunks
    are one read each, back to back, from the end of the header to the end of the file, 64 MiB at most."""
    cfg = load_config(small_ckpt)
    inv = scan(small_ckpt, cfg)
    plans = plan_rank(cfg, inv.entries.values(), 1, 0, torch.bfloat16)
    chunks_by_file = schedule(plans)
    for file, chunks in chunks_by_file.items():
        spans = [c.reads for c in chunks]
        assert all(len(r) == 1 for r in spans), file
        ranges = [r[0][:2] for r in spans]
        assert ranges[0][0] == min(p.offset for p in plans if p.file == file)
        assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
        assert ranges[-1][0] + ranges[-1][1] == (small_ckpt / file).stat().st_size
        assert all(c.size <= CHUNK for c in chunks)
    index = {p.name: i for i, p in enumerate(plans)}
    e = "model.layers.1.block_sparse_moe.experts."
    stacked = [
        {index[f"{e}{k}.{w}.weight"] for w in ("w1", "w2", "w3")} | {index[f"{e}{k + 1}.w1.weight"]}
        for k in range(cfg.num_experts - 1)
    ]
    stacked = [group for group in stacked if len({plans[i].file for i in group}) == 1]
    assert stacked  # some experts share a file
    for group in stacked:  # expert k's w1, w2, w3 and expert k + 1's w1 in one read
        assert any(
            group <= {part.index for part in c.parts} and len(c.reads) == 1
            for cs in chunks_by_file.values()
            for c in cs
        )


def test_embedding_is_read_in_row_chunks_and_the_ring_stays_small():
    """The real 48B's embedding (720 MiB at world 1, 90 MiB at TP 8) is read in chunks of at most 64 MiB cut at
    row boundaries; the staging ring holds four such chunks, where one whole embedding was staged before."""
    cfg = load_config(REAL_CONFIG)
    for world in (1, 8):
        plans = plan_rank(cfg, config_entries(cfg), world, world - 1, torch.bfloat16)
        (embed,) = [p for p in plans if p.name == "model.embed_tokens.weight"]
        chunks = schedule([embed])[("tensor", 0)]
        row = cfg.hidden_size * 2
        parts = [part for c in chunks for part in c.parts]
        assert parts[0].begin == 0 and parts[-1].end == embed.source_bytes
        assert all(a.end == b.begin for a, b in zip(parts, parts[1:], strict=False))
        assert all(p.begin % row == 0 and c.size <= CHUNK for c in chunks for p in c.parts)
        assert len(chunks) == math.ceil(embed.source_bytes / (CHUNK // row * row))
        mp = memory_plan(0, plans, 2**62)
        slots, slot_bytes = staging(schedule(plans))
        assert slots == SLOTS and CHUNK - row < slot_bytes <= CHUNK
        assert mp.staging_peak == slots * slot_bytes <= SLOTS * CHUNK
        if world == 1:
            assert mp.staging_peak < embed.source_bytes / 2  # the old staging_peak: the largest tensor


def test_expert_w2_at_tp8_reads_every_page_of_the_48b():
    """Planned from the real 48B config: at TP 8 each expert's w2 [2304, 1024] leaves 256 bytes of every 2 KiB row
    to a rank, so the rank reads every page of it: 8x its share."""
    cfg = load_config(REAL_CONFIG)
    plans = plan_rank(cfg, config_entries(cfg), 8, 3, torch.bfloat16)
    w2 = [p for p in plans if p.name.endswith(".w2.weight")]
    moe_layers = sum(spec.mlp == "moe" for spec in cfg.layers)
    assert len(w2) == moe_layers * cfg.num_experts and w2[0].local_shape == (2304, 128)
    source = sum(p.source_bytes for p in w2)
    whole = sum(math.prod(p.full_shape) * 2 for p in w2)
    assert reads.read_bytes(w2) == whole == 8 * source
    assert all(not c.reads and len(c.spans) == 1 for cs in schedule(w2).values() for c in cs)  # each read whole
    mp = memory_plan(3, plans, 2**62)
    assert mp.read_bytes > 3 * mp.source_bytes and mp.read_bytes - whole >= mp.source_bytes - source
    one = memory_plan(0, plan_rank(cfg, config_entries(cfg), 1, 0, torch.bfloat16), 2**62)
    assert one.source_bytes <= one.read_bytes < one.source_bytes + one.tensors * PAGE  # world 1: pages rounded


def test_holes_under_merge_are_read_through():
    """Two row parts closer than MERGE are one read; farther apart, two."""
    name = "model.layers.1.self_attn.o_proj.weight"
    for cols, joined in ((MERGE // 2, True), (2 * MERGE, False)):  # row bytes = 2 * cols (bf16)
        plan = plan_tensor(TensorEntry(name, name, "f", (4, cols), "BF16", 4096), 2, 0, torch.bfloat16)
        (chunk,) = schedule([plan])["f"]
        assert len(chunk.spans) == joined and len(chunk.reads) == (0 if joined else 4)
