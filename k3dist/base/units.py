"""Byte sizes as users write them (`512MiB`, `2GiB`, `1e9`) and as people read them."""

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def byte_size(value) -> int:
    """`512MiB` -> 536870912. Anything else raises ValueError saying why (`is not a byte size ...`)."""
    if isinstance(value, bool):
        raise ValueError("is not a byte size")
    if isinstance(value, (int, float)):
        number, unit = value, ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError("is not a byte size (use an int or e.g. 512MiB, 2GiB, 1GB)")
        number, unit = float(m.group(1)), m.group(2).lower()
    if number < 0:
        raise ValueError("is negative")
    return int(number * _UNITS[unit])


def parse_bytes(value, key: str = "size") -> int:
    """`512MiB` -> 536870912. Refuses anything else with an `error:` naming the key."""
    from .errors import K3Error

    try:
        return byte_size(value)
    except ValueError as why:
        raise K3Error(f"{key}={value!r} {why}") from None


def fmt_bytes(n: float) -> str:
    """536870912 -> '512.0 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
