"""model.quant=int8: the quantisation itself, the int8 Linear against its dequantised weight, and the plan's bytes
against what build_model really holds, at several world sizes and configs."""

import pytest
import torch

from k3dist.config import parse_config
from k3dist.kernels import cpu_ops
from k3dist.kernels.backend import select
from k3dist.kernels.quant import dequantize, int8_bytes, quantize_int8
from k3dist.memory.terms import int8_terms
from k3dist.model.build import build_model, choices
from k3dist.model.cache import HybridCache
from k3dist.model.linear import Int8Linear
from k3dist.model.tp import TPComm
from k3dist.weights.quant_plan import quantized
from k3dist.weights.tp_plan import plan_rank, store_shapes
from k3dist.weights.whatif import config_entries
from tests.ranks.test_parity import CONFIGS
from tests.support.configs import twin_config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantisation_error_is_at_most_half_a_step_per_row(dtype):
    w = torch.randn(300, 72, generator=torch.Generator().manual_seed(1)).to(dtype)
    w[7] = 0  # an all-zero row keeps a usable scale
    q, s = quantize_int8(w, rows=64)  # several blocks, the last one short
    assert q.dtype == torch.int8 and s.dtype == dtype and q.abs().max() <= 127
    err = (dequantize(q, s) - w.float()).abs().amax(1)
    assert (err <= s.float() / 2 * (1 + 1e-6)).all()
    assert (dequantize(q, s)[7] == 0).all()
    assert (s.float() <= w.float().abs().amax(1) / 127 * 1.01 + torch.finfo(dtype).tiny).all()  # no wasted range


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(509, 72), (96, 64), (9000, 128), (7, 13)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_int8_linear_multiplies_by_its_dequantised_weight(rows, cols, m, dtype):
    """Decode rows (int8 GEMM, where the width allows it) and prefill rows (dequantised blocks) alike."""
    g = torch.Generator().manual_seed(rows + m)
    lin = Int8Linear(torch.randn(rows, cols, generator=g).to(dtype))
    x = torch.randn(2, m, cols, generator=g).to(dtype)
    y = lin(x)
    ref = x.float() @ dequantize(lin.weight, lin.scales).T
    assert y.shape == (2, m, rows) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    assert (y.float() - ref).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.skipif(not cpu_ops.available(), reason="the CPU ops do not build here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(509, 72), (96, 64), (9000, 128), (7, 13), (300, 1000)])
def test_one_row_goes_through_the_cpu_int8_gemv(rows, cols, dtype):
    """A single decode row takes the CPU op (any width); it computes torch's int8 GEMM's sums."""
    g = torch.Generator().manual_seed(rows)
    lin = Int8Linear(torch.randn(rows, cols, generator=g).to(dtype), cpu_ops.int8_mm)
    x = torch.randn(1, cols, generator=g).to(dtype)
    y = lin(x)
    ref = x.float() @ dequantize(lin.weight, lin.scales).T
    assert y.shape == (1, rows) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (y.float() - ref).abs().max().item() <= tol * ref.abs().max().item()
    if cols % 16 == 0:
        torch.testing.assert_close(y, torch.ops.aten._weight_int8pack_mm(x, lin.weight, lin.scales))


def _linears(obj, seen=None):
    """Every Int8Linear reachable from the model's objects."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.Tensor, str, int, float, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, Int8Linear):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _linears(item, seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("k3dist"):
        for value in vars(obj).values():
            yield from _linears(value, seen)


@pytest.mark.parametrize("name", ["twin", *sorted(CONFIGS)])
@pytest.mark.parametrize("world", [1, 2])
def test_plan_counts_what_binding_quantises(name, world):
    """int8_terms' saved bytes equal the bytes the bound model's int8 weights saved; the transient covers the
    largest of them; only the named projections are int8."""
    raw = twin_config() if name == "twin" else CONFIGS[name]
    if name == "twin":
        raw = raw | {"num_hidden_layers": 3, "vocab_size": 4096}  # the twin's shapes, fewer and smaller
        raw["linear_attn_config"] = raw["linear_attn_config"] | {"kda_layers": [1, 2], "full_attn_layers": [3]}
    cfg, dtype = parse_config(raw), torch.bfloat16
    for rank in range(world):
        shapes = store_shapes(plan_rank(cfg, config_entries(cfg), world, rank, dtype))
        weights = {k: torch.randn(shape).to(dt) for k, (shape, dt) in shapes.items()}
        cache = HybridCache(cfg, world, 1, 8, dtype, torch.device("cpu"))
        cpu = torch.device("cpu")
        planned = choices(cfg, dtype, cpu, batch=1, pack=False, cpu_ops=False)  # the torch kernels
        model = build_model(
            cfg,
            weights,
            TPComm(world, rank, cfg.vocab_size),
            cache,
            select("torch", cpu),
            quant="int8",
            **vars(planned),
        )
        made = list(_linears(model))
        assert len(made) == sum((s[0][0] if len(s[0]) == 3 else 1) for k, s in shapes.items() if quantized(k))
        saved = sum(lin.shape.numel() * dtype.itemsize - int8_bytes(*lin.shape, dtype) for lin in made)
        planned, transient = int8_terms(cfg, world, rank, dtype)
        assert planned == saved > 0
        assert transient >= max(lin.weight.numel() + lin.scales.numel() * dtype.itemsize for lin in made)
        assert model.head.__class__ is Int8Linear and "model.embed_tokens.weight" not in {
            k for k in shapes if quantized(k)
        }
