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
        print(f"  verdict: {result['verdict']} ({result['params']:,} params in {result['tensors']:,} tensors)")
        for line in result.get("refusals", []):
            print(f"    {line}")
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
