"""The projections' weight holders (k3dist/model/linear.py): a prefill widened to fp32 on a CPU without units for the
compute dtype computes what the low-precision GEMM computes (fp32 sums, one rounding), a block of rows at a time;
decode rows of a plain low-precision weight go through the CPU ops' rows op."""

import pytest
import torch
import torch.nn.functional as F

from k3dist.kernels import cpu_ops
from k3dist.model.linear import (
    DECODE_ROWS,
    PLAIN_SLOTS,
    ROWS_OP_MAX,
    Linear,
    has_amx,
    packable,
    packs,
    widened,
    widened_linear,
)
from k3dist.weights.memory import proc_status


def _pair(rows: int, out: int = 10, cols: int = 48, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    w = (0.1 * torch.randn(out, cols, generator=gen)).to(dtype)
    return x, w


def test_widened_blocks_equal_one_fp32_gemm_rounded_once():
    x, w = _pair(20)
    whole = F.linear(x.float(), w.float()).to(x.dtype)
    for block in (1, 3, 10, 64):  # blocks that split the rows unevenly, and one past them
        assert torch.equal(widened_linear(x, w, block), whole)
    exact = F.linear(x.double(), w.double())
    assert (widened_linear(x, w).double() - exact).abs().max() <= exact.abs().max() * 2**-8  # one bf16 rounding


def test_a_linear_widens_prefill_rows_only():
    lin = Linear(_pair(1)[1], widen=True)
    for rows in (1, DECODE_ROWS, DECODE_ROWS + 1, 40):
        x, _ = _pair(rows)
        want = widened_linear(x, lin.weight) if rows > DECODE_ROWS else F.linear(x, lin.weight)
        got = lin(x.view(1, rows, -1))  # a prefill's [n, T, D] input keeps its leading dims
        assert got.shape == (1, rows, 10) and got.dtype == x.dtype and torch.equal(got[0], want)


@pytest.mark.skipif(not cpu_ops.available(), reason="the CPU ops do not build here")
def test_decode_rows_go_through_the_rows_op_and_wider_inputs_widen():
    w = _pair(1)[1]
    lin = Linear(w, widen=True, rows=cpu_ops.linear_rows)
    for rows in (1, DECODE_ROWS, ROWS_OP_MAX, ROWS_OP_MAX + 1):
        x, _ = _pair(rows)
        want = cpu_ops.linear_rows(x, w) if rows <= ROWS_OP_MAX else widened_linear(x, w)
        assert torch.equal(lin(x), want)
    assert Linear(w, rows=cpu_ops.linear_rows).rows is not None  # any plain low-precision weight's decode rows
    wide = Linear(w.float(), rows=cpu_ops.linear_rows)  # fp32 too: a row's result whatever rows come with it
    x = _pair(ROWS_OP_MAX)[0].float()
    assert wide.rows is not None and all(torch.equal(wide(x[i : i + 1])[0], wide(x)[i]) for i in range(len(x)))
    if packable(w.dtype, w.device):
        assert Linear(w, pack=True, rows=cpu_ops.linear_rows).rows is None  # a packed weight is oneDNN's alone


def test_widening_is_for_cpus_without_units_for_the_dtype():
    cpu = torch.device("cpu")
    assert not widened(torch.float32, cpu)
    if torch.backends.mkldnn.is_available():
        assert widened(torch.bfloat16, cpu) == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_few_slots_on_an_amx_cpu_keep_plain_weights():
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    amx = has_amx()
    for batch in (1, PLAIN_SLOTS, PLAIN_SLOTS + 1, 16):
        plain = amx and batch <= PLAIN_SLOTS
        assert packs(bf16, cpu, batch, rows_op=True) == (packable(bf16, cpu) and not plain)
        assert packs(bf16, cpu, batch, rows_op=False) == packable(bf16, cpu)  # no rows op: packing still pays
    assert not packs(torch.float32, cpu, 1, rows_op=True)


@pytest.mark.skipif(not packable(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 kernels on this CPU")
def test_a_prefill_gemm_reads_a_plain_weight_in_place():
    """What lets a run keep plain weights: oneDNN's bf16 GEMM over many rows allocates its output, not a reordered
    copy of the weight (64 MiB here; the output is 16 MiB)."""
    w = torch.randn(32768, 1024).to(torch.bfloat16)
    x = torch.randn(256, 1024).to(torch.bfloat16)
    F.linear(x[:32], w)  # first use: the primitive and its scratchpad
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the resident set
    before = proc_status()["VmHWM"]
    y = F.linear(x, w)
    grown = proc_status()["VmHWM"] - before
    assert grown < y.numel() * y.element_size() + 16 * 2**20, grown
