"""Sparse checkpoints for what-if planning: real safetensors headers, data regions left as holes.

`python -m k3dist.twin.sparse OUT_DIR [--config CONFIG.json]` writes the real 48B layout (about 98 GB apparent,
a few MB on disk) so `run.mode=plan model.path=OUT_DIR` plans from checkpoint headers without the weights.
The headers are written here because safetensors only serialises tensors it holds; it still parses them on load.
"""

import argparse
import json
import math
from pathlib import Path

from ..base.dtypes import BY_NAME, COMPUTE
from ..config import parse_config
from ..weights.schema import expected_tensors
from .checkpoint import shard_layout, write_index


def write_sparse(raw_config: dict, out_dir: str | Path, dtype: str = "bfloat16", shard_bytes: int = 5 * 10**9) -> Path:
    schema = expected_tensors(parse_config(raw_config))
    code, itemsize = BY_NAME[dtype].code, BY_NAME[dtype].itemsize
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = shard_layout(schema, itemsize, shard_bytes)
    for file, names in layout.items():
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in names:
            nbytes = math.prod(schema[name]) * itemsize
            header[name] = {"dtype": code, "shape": list(schema[name]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data start to 8 bytes
        with open(out_dir / file, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            f.truncate(8 + len(text) + offset)  # the data region: a hole, no blocks allocated
    write_index(out_dir, raw_config, layout, sum(math.prod(s) for s in schema.values()) * itemsize, dtype)
    return out_dir


def main() -> None:
    default = Path(__file__).resolve().parent.parent / "configs" / "Kimi-Linear-48B-A3B-config.json"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--config", type=Path, default=default, help="config.json to lay out (default: the real 48B)")
    ap.add_argument("--dtype", default="bfloat16", choices=COMPUTE)
    args = ap.parse_args()
    out = write_sparse(json.loads(args.config.read_text()), args.out_dir, args.dtype)
    apparent = sum(p.stat().st_size for p in out.iterdir())
    on_disk = sum(p.stat().st_blocks * 512 for p in out.iterdir())
    print(f"wrote {out}: {apparent / 1e9:.1f} GB apparent, {on_disk / 2**20:.1f} MiB on disk")


if __name__ == "__main__":
    main()
