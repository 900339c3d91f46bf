"""What a person sees at the end: a compact per-rank table of plan, load, prefill and decode.

`read` is the page-granular checkpoint bytes the rank reads (weights/reads.py): more than its share where row splits
leave less than a page of each row to it.
"""

from ..base.units import fmt_bytes


def print_summary(result: dict) -> None:
    rows = [("rank", "local", "read", "cache", "admitted", "free", "fits")]
    for p in result.get("plan", []):
        rows.append(
            (
                str(p["rank"]),
                fmt_bytes(p["local_bytes"]),
                fmt_bytes(p["read_bytes"]) if "read_bytes" in p else "-",
                fmt_bytes(p["cache_bytes"]),
                fmt_bytes(p["admitted"]),
                fmt_bytes(p["free"]),
                "yes" if p["fits"] else "NO",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(
        f"k3dist: world {result['world_size']} {result['backend']}/{result['device']} {result['dtype']} "
        f"mode {result['mode']}"
    )
    for r in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    if "verdict" in result:
        counted = f"{result['params']:,} params in {result['tensors']:,} tensors"
        print(f"  verdict: {result['verdict']} ({counted}): {margin(result)}")
        for line in result.get("refusals", []):
            print(f"    {line}")
        if result["tp_traffic"]["routed_experts"]:
            print(f"  {pure_tp(result['tp_traffic'])}")
    if "load_seconds" in result:
        print(f"  load {result['load_seconds']:.2f} s", end="")
        if "tokens" in result:
            print(
                f", prefill {result['prefill_seconds'] * 1e3:.0f} ms, decode "
                f"{result['decode_tokens_per_second']:.1f} tok/s (p50 {result['step_ms']['p50']:.1f} ms/step)"
            )
            texts = result.get("text") or [None] * len(result["tokens"])
            for i, (seq, text) in enumerate(list(zip(result["tokens"], texts, strict=True))[:4]):
                shown = repr(text[:120]) if text is not None else f"{seq[:16]}{' ...' if len(seq) > 16 else ''}"
                print(f"  seq {i} ({len(seq)} tokens, {result['finish_reason'][i]}): {shown}")
        else:
            print()


def margin(result: dict) -> str:
    """The tightest rank's headroom, or how far short it is."""
    room, rank = result["headroom"], result["tightest_rank"]
    if room >= 0:
        return f"fits with {fmt_bytes(room)} to spare (rank {rank}, the tightest)"
    return f"short by {fmt_bytes(-room)} (rank {rank}, the furthest)"


def pure_tp(t: dict) -> str:
    """How a model with routed experts is split, and what that costs per token."""
    n = t["world"]
    if n == 1:
        return (
            f"parallelism: one rank holds each of the {t['routed_experts']} routed experts whole (k3dist has no expert "
            "parallelism yet); no collectives"
        )
    where = f"across {t['nodes']} nodes of {t['node_gpus']} GPUs" if t["nodes"] > 1 else "within one node"
    return (
        f"parallelism: one pure TP group of {n} ranks {where}; k3dist has no expert parallelism yet (each rank holds "
        f"1/{n} of each of the {t['routed_experts']} routed experts); per token it all-reduces "
        f"{t['all_reduce_bytes']:,} bytes and all-gathers {t['all_gather_bytes']:,}: {t['ring_bytes']:,} bytes of "
        "ring traffic a rank"
    )
