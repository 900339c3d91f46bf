"""Golden logits of the K3 twin from llama.cpp's K3 port: the reference k3dist's K3 model is checked against.

    python benchmarks/k3_reference.py --llama-cpp TREE [--config C] [--out tests/data/k3] [--check-mxfp4] [--study]

TREE is a llama.cpp source tree with `conversion/kimi_k3.py` (the one llama-cpp-python 0.3.36 vendors; also read from
$LLAMA_CPP), and `llama_cpp` (llama-cpp-python, built from that sdist) must import. Nothing of llama.cpp goes into
this repository. Steps:

1. the dequantized twin (k3dist's twin writer, variant `dequantized`: bf16 values, MXFP4-exact experts) is written
   once into $K3DIST_CACHE, then converted to an f32 GGUF by the tree's own converter (benchmarks/k3_convert.py);
2. llama.cpp runs it on the CPU with an f32 K/V cache, flash attention off, each prompt in one batch, logits for
   every position: a prefill per prompt length, then 16 greedy decode steps, one token each;
3. prompts are seeded random ids; a candidate is kept only if every greedy choice on its path (the prefill's last
   position and each decode step) beats the runner-up by --min-margin logits, since a random twin's near-ties
   flip under any change of rounding (docs/k3.md);
4. what is kept (golden.npz and manifest.json, docs/k3.md "Goldens") is, per stored row, the logits at a fixed
   subset of vocabulary ids, the row's top 16 ids and values, its max and its log-sum-exp.

--reuse-prompts MANIFEST reruns a committed set (its twin config, seed, margin and prompts) without the search; on
the machine that wrote it, it writes the same bytes. --check-mxfp4 also converts the MXFP4 twin (experts repacked
by the converter) and checks that gguf-py dequantizes every expert block to exactly k3dist's unpacking. --study
compares llama.cpp with a naive float64 forward (k3_torch_ref.py) and measures each epsilon llama.cpp and Moonshot
disagree on; both go under `information`.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from k3dist.config import text_fields  # noqa: E402
from k3dist.offline.prompts import seeded_ids  # noqa: E402
from k3dist.twin.checkpoint import cache_root, ensure_twin  # noqa: E402
from k3dist.twin.k3_checkpoint import K3_TWIN_VERSION  # noqa: E402
from k3dist.twin.tokenizer import TWIN_TOKENIZER_VERSION  # noqa: E402

CONFIG = ROOT / "k3dist" / "configs" / "Kimi-K3-twin-0.4B-config.json"
OUT = ROOT / "tests" / "data" / "k3"
LENGTHS = (1, 7, 33, 130, 520)  # one past KDA's 16-token chunk several times, one past k3dist's 512-token chunk
STEPS = 16
TOP = 16
SUBSET = 256  # fixed vocabulary ids kept from every row
ALL_ROWS_UP_TO = 160  # longer prompts keep every 8th position and the last 16
TREE_COMMIT = "ggml-org/llama.cpp@0c1e57098 (as vendored by llama-cpp-python 0.3.36, its CHANGELOG)"
FORMAT = 1


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP"), help="llama.cpp source tree")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--seed", type=int, default=0, help="the twin's seed")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--min-margin", type=float, default=0.01, help="logits between the top two, on the greedy path")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--reuse-prompts",
        type=Path,
        help="a manifest.json to run again: its twin, seed, margin and prompts (no search)",
    )
    ap.add_argument("--check-mxfp4", action="store_true")
    ap.add_argument("--study", action="store_true", help="also the float64 forward and the epsilon study (slow)")
    args = ap.parse_args(argv)
    if args.llama_cpp is None or not (args.llama_cpp / "conversion" / "kimi_k3.py").is_file():
        ap.error(f"--llama-cpp (or $LLAMA_CPP) must name a llama.cpp tree with conversion/kimi_k3.py: {args.llama_cpp}")
    if args.reuse_prompts:
        reused = json.loads(args.reuse_prompts.read_text())
        args.config = CONFIG.parent / reused["twin"]["config"]
        args.seed, args.min_margin = reused["twin"]["seed"], reused["min_margin"]
        args.lengths = [p["length"] for p in reused["prompts"]]
    return args


def convert(tree: Path, model_dir: Path, outtype: str) -> Path:
    """The tree's converter on a twin dir, into $K3DIST_CACHE/gguf (once per twin and outtype)."""
    out = cache_root() / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        cmd = [sys.executable, str(ROOT / "benchmarks" / "k3_convert.py"), str(tree), str(model_dir)]
        subprocess.run([*cmd, "--outfile", str(tmp), "--outtype", outtype], check=True, capture_output=True)
        tmp.rename(out)
    return out


def context(gguf: Path, n_ctx: int, threads: int):
    """A fresh llama.cpp context: f32 K and V cache, no flash attention, the whole prompt in one ubatch."""
    import llama_cpp

    return llama_cpp.Llama(
        str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads, n_threads_batch=threads,
        logits_all=True, type_k=0, type_v=0, flash_attn=False, verbose=False,
    )  # fmt: skip


def margin(row: np.ndarray) -> float:
    top2 = np.partition(row, -2)[-2:]
    return float(top2[1] - top2[0])


def run_prompt(gguf: Path, ids: list[int], threads: int, min_margin: float | None):
    """(prefill rows [L, V], decode rows [STEPS, V], tokens fed [STEPS], margins [STEPS + 1]); None as soon as a
    greedy choice falls under min_margin."""
    llm = context(gguf, len(ids) + STEPS + 1, threads)
    llm.eval(ids)
    prefill = np.array(llm.scores[: len(ids)], dtype=np.float32)
    rows, fed, margins = [], [], [margin(prefill[-1])]
    last = prefill[-1]
    for _ in range(STEPS):
        if min_margin is not None and margins[-1] < min_margin:
            return None
        fed.append(int(np.argmax(last)))
        llm.eval([fed[-1]])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        rows.append(last)
        margins.append(margin(last))
    if min_margin is not None and margins[-1] < min_margin:
        return None
    return prefill, np.stack(rows), fed, margins


def stored_positions(length: int) -> list[int]:
    if length <= ALL_ROWS_UP_TO:
        return list(range(length))
    return sorted(set(range(0, length, 8)) | set(range(length - 16, length)))


def summarise(rows: np.ndarray, subset: np.ndarray) -> dict[str, np.ndarray]:
    """What is kept of logits rows [R, V]."""
    top = np.argsort(-rows, axis=-1, kind="stable")[:, :TOP]
    lse = torch.logsumexp(torch.from_numpy(rows).double(), dim=-1).numpy()
    return {
        "subset": rows[:, subset],
        "top_ids": top.astype(np.int32),
        "top": np.take_along_axis(rows, top, -1),
        "max": rows.max(-1),
        "lse": lse.astype(np.float32),
    }


def choose_prompt(args, gguf: Path, length: int, vocab: int, reuse: dict | None):
    """The first seeded prompt of this length whose greedy path keeps the margin (or the reused manifest's)."""
    if reuse is not None:
        ids = reuse["ids"]
        return reuse["prompt_seed"], reuse["candidates_tried"], ids, run_prompt(gguf, ids, args.threads, None)
    for tried, prompt_seed in enumerate(range(1000 * length, 1000 * length + 200), start=1):
        ids = seeded_ids(1, length, vocab, prompt_seed)[0]
        result = run_prompt(gguf, ids, args.threads, args.min_margin)
        print(f"  length {length} prompt seed {prompt_seed}: {'kept' if result else 'a near-tie, next'}", flush=True)
        if result is not None:
            return prompt_seed, tried, ids, result
    raise RuntimeError(f"no prompt of length {length} keeps a margin of {args.min_margin} in 200 tries")


def goldens(args, gguf: Path, raw: dict) -> tuple[dict, list[dict]]:
    vocab = text_fields(raw)["vocab_size"]
    arrays = {"vocab_subset": torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))[:SUBSET]}
    arrays["vocab_subset"] = np.sort(arrays["vocab_subset"].numpy()).astype(np.int32)
    reused = (
        {p["length"]: p for p in json.loads(args.reuse_prompts.read_text())["prompts"]} if args.reuse_prompts else {}
    )
    prompts = []
    for length in args.lengths:
        t0 = time.perf_counter()
        seed, tried, ids, (prefill, decode, fed, margins) = choose_prompt(
            args, gguf, length, vocab - 256, reused.get(length) if args.reuse_prompts else None
        )
        name = f"len{length}"
        positions = stored_positions(length)
        arrays[f"{name}.ids"] = np.array(ids, dtype=np.int32)
        arrays[f"{name}.prefill_positions"] = np.array(positions, dtype=np.int32)
        arrays |= {f"{name}.prefill_{k}": v for k, v in summarise(prefill[positions], arrays["vocab_subset"]).items()}
        arrays[f"{name}.decode_fed"] = np.array(fed, dtype=np.int32)
        arrays |= {f"{name}.decode_{k}": v for k, v in summarise(decode, arrays["vocab_subset"]).items()}
        prompts.append(
            {
                "name": name, "length": length, "prompt_seed": seed, "candidates_tried": tried, "ids": ids,
                "stored_positions": "all" if len(positions) == length else positions,
                "greedy": fed + [int(np.argmax(decode[-1]))], "margins": [round(m, 6) for m in margins],
                "min_margin": round(min(margins), 6),
            }
        )  # fmt: skip
        print(f"{name}: min margin {min(margins):.4f} after {tried} candidate(s), {time.perf_counter() - t0:.0f} s")
    return arrays, prompts


def manifest(args, prompts: list[dict], information: dict) -> dict:
    return {
        "format": FORMAT,
        "twin": {
            "config": args.config.name, "seed": args.seed, "dtype": "bfloat16", "variant": "dequantized",
            "k3_twin_version": K3_TWIN_VERSION, "tokenizer_version": TWIN_TOKENIZER_VERSION,
        },
        "llama_cpp": {
            "tree": TREE_COMMIT, "llama_cpp_python": _version("llama_cpp_python"), "gguf_py": _version("gguf"),
            "conversion": "convert_hf_to_gguf.py --outtype f32 via benchmarks/k3_convert.py (config.json read as "
            "plain JSON; a synthetic gpt2-style vocabulary of vocab_size tokens, control block last)",
            "context": "type_k f32, type_v f32, flash_attn off, n_batch = n_ubatch = n_ctx = prompt + 17, "
            "logits_all; a fresh context per prompt; prefill in one eval, then one eval per decode step",
            "threads": args.threads,
        },
        "rows": {
            "subset": f"logits at vocab_subset ({SUBSET} fixed ids, torch.randperm(vocab, seed 1234), sorted)",
            "top_ids/top": f"the row's {TOP} largest logits, descending (ties: lower id first)",
            "max/lse": "the row's max and log-sum-exp (float64, stored f32)",
            "prefill": "rows at prefill_positions of the prompt `ids`",
            "decode": f"{STEPS} steps: step i feeds decode_fed[i] (the last row's greedy token), keeps its row",
        },
        "prompt_ids": "k3dist.offline.prompts.seeded_ids(1, length, vocab_size - 256, prompt_seed)[0]: the first "
        "prompt_seed from 1000 * length whose greedy choices all clear min_margin (logits, top-1 minus top-2)",
        "min_margin": args.min_margin,
        "prompts": prompts,
        "information": information,
    }  # fmt: skip


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_mxfp4(tree: Path, config: Path, seed: int) -> dict:
    """Convert the MXFP4 twin (experts repacked, not dequantized) and compare gguf-py's MXFP4 dequantizer with
    k3dist's unpacking of the same experts: bit for bit."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize as gguf_dequantize
    from safetensors import safe_open

    from k3dist.weights.mxfp4 import dequantize

    model = ensure_twin(config, seed, "bfloat16", variant="mxfp4")
    reader = GGUFReader(convert(tree, model, "f32"))
    files = {}
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            files |= {k: f for k in st.keys()}
    proj = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
    checked = values = 0
    for t in reader.tensors:
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if kind not in proj:
            continue
        assert t.tensor_type == GGMLQuantizationType.MXFP4, f"{t.name} is {t.tensor_type.name}, not MXFP4"
        layer = int(t.name.split(".")[1])
        theirs = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(t.data, t.tensor_type)))
        base = f"language_model.model.layers.{layer}.block_sparse_moe.experts."
        for e in range(theirs.shape[0]):
            name = f"{base}{e}.{proj[kind]}.weight_"
            with safe_open(str(files[name + "packed"]), "pt") as st:
                ours = dequantize(st.get_tensor(name + "packed"), st.get_tensor(name + "scale"))
            if not torch.equal(ours.view(torch.int32), theirs[e].view(torch.int32)):
                raise AssertionError(f"{t.name} expert {e}: gguf-py and k3dist dequantize differently")
            values += ours.numel()
        checked += 1
    assert checked, "no MXFP4 expert tensor in the converted GGUF"
    return {"mxfp4_tensors_checked": checked, "mxfp4_values_bit_equal": values}


def study(model_dir: Path, gguf: Path, threads: int) -> dict:
    """llama.cpp against the naive float64 forward, and each epsilon difference alone: max |diff| / max |logit|."""
    import k3_torch_ref as ref

    cfg, w = ref.load(model_dir)
    ids = seeded_ids(1, 33, cfg["vocab_size"] - 256, 99)[0]
    llama = torch.from_numpy(run_prompt(gguf, ids, threads, None)[0]).double()
    base = ref.forward(cfg, w, ids)

    def rel(a, b):
        return float(((a - b).abs().amax(-1) / b.abs().amax(-1)).max())

    out = {"prompt": "33 seeded ids (seed 99)", "llama_cpp_vs_float64": rel(llama, base)}
    for label, eps in (
        ("q_a/kv_a eps 1e-6 (Moonshot) vs 1e-5 (llama.cpp)", ref.Eps(lora=1e-6)),
        ("KDA L2 eps 1e-6 (fla) vs 1e-5 (llama.cpp)", ref.Eps(l2=1e-6)),
        ("both", ref.MOONSHOT),
    ):
        out[label] = rel(ref.forward(cfg, w, ids, eps), base)
    return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in out.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    raw = json.loads(args.config.read_text())
    model = ensure_twin(args.config, args.seed, "bfloat16", variant="dequantized")
    gguf = convert(args.llama_cpp, model, "f32")
    print(f"twin {model.name}, GGUF {gguf}", flush=True)
    arrays, prompts = goldens(args, gguf, raw)
    information = {}
    if args.check_mxfp4:
        information |= check_mxfp4(args.llama_cpp, args.config, args.seed)
    if args.study:
        information["float64_study"] = study(model, gguf, args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "golden.npz", **arrays)
    (args.out / "manifest.json").write_text(json.dumps(manifest(args, prompts, information), indent=1) + "\n")
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1024:.0f} KiB) in {time.perf_counter() - started:.0f} s; {information}")


if __name__ == "__main__":
    main()
