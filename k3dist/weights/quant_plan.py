"""Which weights `model.quant=int8` turns into int8 at bind time, and what that does to a rank's memory plan.

One rule for both sides: build_model quantises a projection iff `quantized(store key)` says so, and the plan counts
the same keys from the same per-rank shapes (tp_plan.store_shapes; memory/terms.py's int8_terms), before anything is
loaded. Quantised: the LM head and every attention and dense-MLP projection; the embedding (one row read per token),
norms, convs, the router, MLA's kv_b (used per head), and the routed and shared experts stay in the compute dtype
(docs/model.md).

The loader still uploads the compute-dtype weights, so the load's peak is unchanged; binding then holds one weight
twice at a time (its int8 copy beside it, plus a bounded fp32 block while its scales are found): `derived_bytes`.
What the rank holds afterwards is `bound_bytes` = local_bytes minus what int8 saved.
"""

import re

from ..kinds.registry import KINDS

# the LM head, and each layer kind's own projections (kinds/: its `quantized`)
QUANTIZED = re.compile("|".join((r"^lm_head\.weight$", *(kind.quantized for kind in KINDS if kind.quantized))))


def quantized(key: str) -> bool:
    return QUANTIZED.search(key) is not None
