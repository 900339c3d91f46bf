"""lm-evaluation-harness against k3dist's server, with nothing but its URL: correctness, then speed.

    pip install -e ".[bench]"                      # lm-eval (heavy: datasets, pandas, scikit-learn) and matplotlib
    python benchmarks/lm_eval_check.py             # the check, then the speed table (benchmarks/results/lm_eval.md)
    python benchmarks/lm_eval_check.py --check-only
    python benchmarks/lm_eval_check.py --speed-only --items 200 --concurrency 8

Check (a small fp32 checkpoint, 2 ranks): a local multiple-choice task and a generate_until task (`dataset_path:
json` with `data_files`: nothing is downloaded) run by lm-eval's `local-completions` with `tokenizer_backend=remote`,
through 1 connection, through 4 (more than the server's slots), and with `tokenized_requests=False`. Every choice's
log-likelihood must be within 1e-4 of one computed from transformers on the same checkpoint, the accuracy equal,
the runs' numbers the same, and the generations transformers' greedy ones.

Speed (the 0.40B twin, bf16, one rank of all cores, 8 slots): --items multiple-choice items of about 100 tokens (4
choices) scored by lm-eval at --concurrency connections; items/s, and the share of the wall time the server spent in
prefill (its /metrics), against transformers scoring the same items in this process, one forward per choice.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (benchmarks/ is the script dir; common puts the repo root on sys.path)
from serve import Server  # noqa: E402

TOL = 1e-4
CHOICES = 4
MC_TASK, GEN_TASK = "k3dist_mc", "k3dist_gen"


def write_items(path: Path, n: int, tokenizer, seed: int, context_tokens: int) -> list[dict]:
    """`n` items of seeded corpus words: a context of about `context_tokens` tokens, 4 choices of 3-12 words."""
    words = [w for w in (common.ROOT / "k3dist" / "twin" / "corpus.txt").read_text().split() if w.isalpha()]
    rng, items = random.Random(seed), []
    for _ in range(n):
        ids = tokenizer.encode(" ".join(rng.choices(words, k=2 * context_tokens)))[:context_tokens]
        question = tokenizer.decode(ids).strip()
        choices = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(CHOICES)]
        items.append({"question": question, "choices": choices, "answer": rng.randrange(CHOICES)})
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return items


def write_tasks(folder: Path, data: Path) -> None:
    """The two tasks as lm-eval YAML over the local JSON lines (dataset_path: json, data_files)."""
    common_keys = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / f"{MC_TASK}.yaml").write_text(
        f"task: {MC_TASK}\n{common_keys}output_type: multiple_choice\ndoc_to_text: question\n"
        "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    (folder / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n{common_keys}output_type: generate_until\ndoc_to_text: question\n"
        'doc_to_target: "{{choices[answer]}}"\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n'
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )


def evaluate(url: str, model: str, tasks: list[str], folder: Path, **model_args) -> dict:
    """One lm-eval run (in this process) against the server: per task, its metric and every sample's responses."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = {"base_url": f"{url}/completions", "model": model, "tokenizer_backend": "remote", "max_retries": 1}
    args |= model_args
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=",".join(f"{k}={v}" for k, v in args.items()),
        tasks=tasks,
        task_manager=TaskManager(include_path=str(folder)),
        log_samples=True,
    )
    return {t: {"metrics": out["results"][t], "samples": out["samples"][t]} for t in tasks}


def worst_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def best(row: list[float]) -> int:
    return max(range(len(row)), key=row.__getitem__)


def likelihoods(run: dict) -> list[list[float]]:
    """Per item (in doc order), each choice's log-likelihood as lm-eval got it."""
    samples = sorted(run[MC_TASK]["samples"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def reference(model_dir: Path, items: list[dict], dtype, tokenizer) -> tuple[list[list[float]], float]:
    """Transformers' log-likelihood of every choice (lm-eval's split of context and continuation ids), and the
    seconds its forwards took (one per choice, in this process)."""
    import torch
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out, seconds = [], 0.0
    for item in items:
        context = tokenizer.encode(item["question"])
        row = []
        for choice in item["choices"]:
            whole = tokenizer.encode(item["question"] + " " + choice)
            start = time.perf_counter()
            with torch.no_grad():
                logits = model(torch.tensor([whole]), use_cache=False).logits[0].double()
            seconds += time.perf_counter() - start
            scores = torch.log_softmax(logits[len(context) - 1 : -1], dim=-1)
            row.append(float(scores.gather(1, torch.tensor(whole[len(context) :])[:, None]).sum()))
        out.append(row)
    return out, seconds


def greedy_texts(model_dir: Path, items: list[dict], tokenizer, steps: int) -> list[str]:
    """Transformers' greedy continuation of each question, cut where the server stops (an eos id, a newline)."""
    import torch
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = []
    for item in items:
        ids = tokenizer.encode(item["question"])
        new = []
        for _ in range(steps):
            with torch.no_grad():
                token = int(model(torch.tensor([ids + new]), use_cache=False).logits[0, -1].argmax())
            if token in tokenizer.eos_ids:
                break
            new.append(token)
        texts.append(tokenizer.decode(new).split("\n")[0])
    return texts


def k3dist_server(model_dir: Path, tmp: Path, name: str, *overrides: str) -> Server:
    port = common.free_port()
    cmd = [sys.executable, "launch.py", "run.mode=serve", f"model.path={model_dir}", "serve.host=127.0.0.1"]
    cmd += [f"serve.port={port}", f"hydra.run.dir={tmp / name}", "hydra.output_subdir=null", *overrides]
    server = Server(name, cmd, f"http://127.0.0.1:{port}", tmp)
    server.start(timeout=600)
    return server


def check(args, tmp: Path) -> tuple[str, bool]:
    """The correctness half: (a Markdown table, whether every check held)."""
    import torch

    from k3dist.text.tokenizer import load_tokenizer
    from k3dist.twin.checkpoint import write_checkpoint
    from tests.support.configs import small_config

    model_dir = write_checkpoint(small_config(), tmp / "small", seed=3, dtype="float32")
    tok = load_tokenizer(model_dir)
    items = write_items(tmp / "check.jsonl", args.check_items, tok, args.seed, 40)
    write_tasks(tmp, tmp / "check.jsonl")
    server = k3dist_server(model_dir, tmp, "check", "dist.nproc=2", "generate.batch=2", "cache.cap=256")
    try:
        url = f"{server.url}/v1"
        runs = {
            "1 connection": evaluate(url, server.model, [MC_TASK, GEN_TASK], tmp, max_length=256),
            "4 connections": evaluate(url, server.model, [MC_TASK, GEN_TASK], tmp, max_length=256, num_concurrent=4),
            "text requests": evaluate(url, server.model, [MC_TASK], tmp, max_length=256, tokenized_requests=False),
        }
    finally:
        server.stop()
    ref, _ = reference(model_dir, items, torch.float32, tok)
    ref_acc = sum(best(row) == it["answer"] for row, it in zip(ref, items, strict=True)) / len(items)
    texts = greedy_texts(model_dir, items, tok, 12)
    rows, ok = [], True
    first = likelihoods(runs["1 connection"])
    for name, run in runs.items():
        lls = likelihoods(run)
        worst = worst_diff(lls, ref)
        acc = run[MC_TASK]["metrics"]["acc,none"]
        same = lls == first
        gen = sorted(run.get(GEN_TASK, {}).get("samples", []), key=lambda s: s["doc_id"])
        gen_ok = all(s["resps"][0][0] == t for s, t in zip(gen, texts, strict=True)) if gen else None
        said = sum(bool(t) for t in texts)
        good = worst <= TOL and acc == ref_acc and same and gen_ok is not False
        ok &= good
        rows.append(
            [
                name,
                f"{len(lls) * CHOICES}",
                f"{worst:.2e}",
                f"{acc:.3f} / {ref_acc:.3f}",
                "yes" if same else "no",
                "n/a" if gen_ok is None else f"{'yes' if gen_ok else 'no'} ({said} of {len(texts)} not empty)",
                "**pass**" if good else "**FAIL**",
            ]
        )
    head = ["lm-eval run", "choices", "max abs(ll - transformers)", "acc (lm-eval / transformers)"]
    head += ["lls equal to 1 connection's", "generate_until = transformers' greedy", "verdict"]
    return common.md_table(head, rows), ok


def speed(args, tmp: Path) -> tuple[str, dict]:
    """The speed half: lm-eval over the server vs transformers in one process, on the twin (bf16)."""
    import httpx
    import torch

    from k3dist.text.tokenizer import load_tokenizer

    twin = common.twin_dir()
    tok = load_tokenizer(twin)
    items = write_items(tmp / "speed.jsonl", args.items, tok, args.seed + 1, args.context)
    folder = tmp / "speed"
    folder.mkdir()
    write_tasks(folder, tmp / "speed.jsonl")
    peer = items[: args.peer_items]  # transformers scores these, half before the server's run and half after it
    half = len(peer) // 2
    ref, hf_seconds = reference(twin, peer[:half], torch.bfloat16, tok)
    server = k3dist_server(twin, tmp, "speed", f"generate.batch={args.slots}", "cache.cap=512")
    try:
        metrics = lambda: common_metrics(httpx.get(f"{server.url}/metrics", timeout=30).text)  # noqa: E731
        before, start = metrics(), time.perf_counter()
        run = evaluate(f"{server.url}/v1", server.model, [MC_TASK], folder, num_concurrent=args.concurrency)
        wall, after = time.perf_counter() - start, metrics()
    finally:
        server.stop()
    rest, more = reference(twin, peer[half:], torch.bfloat16, tok)
    ref, hf_seconds, lls = ref + rest, hf_seconds + more, likelihoods(run)[: len(peer)]
    count = lambda chosen: sum(len(tok.encode(it["question"] + " " + c)) for it in chosen for c in it["choices"])  # noqa: E731
    tokens, peer_tokens = count(items), count(peer)
    prefill = after["k3dist_prefill_seconds"] - before["k3dist_prefill_seconds"]
    worst, agree = worst_diff(lls, ref), sum(best(a) == best(b) for a, b in zip(lls, ref, strict=True))
    k3_rate, hf_rate = len(items) / wall, len(peer) / hf_seconds
    rows = [
        ["k3dist + lm-eval", f"{len(items)}", f"{args.concurrency}", f"{wall:.1f}", f"{k3_rate:.2f}"]
        + [f"{tokens / wall:.0f}", f"{100 * prefill / wall:.0f}%", f"**{k3_rate / hf_rate:.0f}**"],
        ["transformers (one process)", f"{len(peer)}", "1", f"{hf_seconds:.1f}", f"{hf_rate:.3f}"]
        + [f"{peer_tokens / hf_seconds:.0f}", "100% (forwards only)", "1"],
    ]
    head = ["system", "items", "concurrency", "seconds", "items/s", "scored tok/s", "prefill share", "items/s vs peer"]
    data = {"wall_s": wall, "hf_s": hf_seconds, "prefill_s": prefill, "tokens": tokens, "max_abs_ll_diff": worst}
    data |= {"argmax_agree": agree, "items": len(items), "peer_items": len(peer)}
    return common.md_table(head, rows), data


def common_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("k3dist_") and value:
            out[name] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--speed-only", action="store_true")
    ap.add_argument("--check-items", type=int, default=24, help="items of the correctness check")
    ap.add_argument("--items", type=int, default=200, help="items of the speed measurement")
    ap.add_argument("--context", type=int, default=90, help="context tokens of a speed item (choices add 3-20)")
    ap.add_argument("--concurrency", type=int, default=8, help="lm-eval's num_concurrent in the speed run")
    ap.add_argument("--slots", type=int, default=8, help="the speed server's generate.batch")
    ap.add_argument("--peer-items", type=int, default=4, help="items transformers scores (the first ones)")
    ap.add_argument("--seed", type=int, default=0)
    common.add_output_args(ap)
    args = ap.parse_args()
    args.out_md = args.out_md or common.RESULTS / "lm_eval.md"
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local JSON task: nothing to fetch
    if common.version_of("lm_eval") is None:
        print("lm_eval_check: lm-eval is not installed (pip install -e '.[bench]')")
        return 1
    started, tmp = time.perf_counter(), Path(tempfile.mkdtemp(prefix="k3bench-lmeval-"))
    lm_eval = common.version_of("lm_eval")
    m = common.machine(f"k3dist one rank (the check: 2), transformers torch default; lm-eval {lm_eval}")
    tables, notes, data, ok = [], [], {}, True
    if not args.speed_only:
        table, ok = check(args, tmp)
        tables.append(table)
        notes.append(
            f"check: {args.check_items} items x {CHOICES} choices of a seeded fp32 checkpoint (tests' small config) "
            "served at world 2 with 2 slots; lm-eval `local-completions`, `tokenizer_backend=remote`, through 1 "
            "and 4 connections and with `tokenized_requests=False`; a generate_until task (12 tokens, until a "
            f"newline) in the first two; tolerance {TOL}."
        )
    if not args.check_only:
        table, data = speed(args, tmp)
        tables.append(table)
        notes.append(
            f"speed: {args.items} items of about {args.context} context tokens + a choice of 3-12 words, "
            f"{CHOICES} choices each, on the twin (bf16) with {args.slots} slots; lm-eval at num_concurrent "
            f"{args.concurrency}, batch_size 1, its remote tokenizer's requests included in the wall time; "
            "`prefill share`: the server's prefill seconds (prompt scoring included; /metrics) over the wall time. "
            f"transformers: the first {args.peer_items} of the same items (one bf16 forward of ~100 tokens took "
            f"{data['hf_s'] / (data['peer_items'] * CHOICES):.1f} s here: all {args.items} would take hours), one "
            "forward per choice, in this process, half before the server's run and half after it (the host is "
            f"shared). On those items the log-likelihoods differ by at most {data['max_abs_ll_diff']:.3f} (bf16) and "
            f"the best choice is the same on {data['argmax_agree']} of {data['peer_items']}."
        )
    common.publish(args, "lm-eval against the server", tables, notes, m, data | {"ok": ok}, started)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
