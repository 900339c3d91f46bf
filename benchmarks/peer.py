"""The peer the benchmarks compare with: transformers' KimiLinearForCausalLM on the same twin, in a fresh process.

    python benchmarks/peer.py MODE SPEC.json OUT.json        # started by load.py, decode.py, prefill.py

- load: `from_pretrained(dir, dtype=bfloat16)` seconds and the process's peak RSS; then the seconds to read every
  weight once, since its tensors may stay views of the file mmap and the first forward would pay for the pages.
- decode: per batch, one untimed forward over the prompt (first-call costs), then `generate` (greedy, exactly
  max_new_tokens) with a logits processor stamping each step: decode step times exclude the prefill.
- prefill: an untimed warm-up forward, then per prompt `repeats` forwards over it, keeping the last token's logits
  only (`logits_to_keep=1`, as generate's own prefill does); seconds of each.

A fresh process per benchmark, so its imports, threads (torch's default: all cores) and peak memory are its own.
"""

import json
import re
import resource
import sys
import time
from pathlib import Path

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _load(spec: dict):
    import transformers

    start = time.perf_counter()
    model = transformers.KimiLinearForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.bfloat16)
    model = model.to(spec["device"]).eval()
    _sync(spec["device"])
    return model, time.perf_counter() - start


def _base(device: str) -> dict:
    import transformers

    return {"transformers": transformers.__version__, "threads": torch.get_num_threads(), "device": device}


def _peak_rss() -> int:
    """This process's own resident peak: VmHWM on Linux (ru_maxrss would carry the parent's size across exec)."""
    try:
        return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024
    except (OSError, TypeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def load(spec: dict) -> dict:
    rss = _peak_rss
    before = rss()
    model, seconds = _load(spec)
    out = _base(spec["device"]) | {"seconds": seconds, "rss_before": before, "peak_rss": rss()}
    start = time.perf_counter()
    with torch.inference_mode():
        for p in model.parameters():
            p.sum()
    _sync(spec["device"])
    out |= {"touch_seconds": time.perf_counter() - start, "peak_rss_after_touch": rss()}
    if spec["device"] == "cuda":
        out["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    return out


def decode(spec: dict) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Called once per generated token, right after that step's forward: a timestamp per step."""

        def __init__(self, device: str):
            self.device, self.stamps = device, []

        def __call__(self, input_ids, scores):
            _sync(self.device)
            self.stamps.append(time.perf_counter())
            return scores

    device, n = spec["device"], spec["max_new_tokens"]
    model, _ = _load(spec)
    out = _base(device) | {"runs": {}}
    for key, prompt in spec["prompts"].items():
        ids = torch.tensor(prompt, device=device)
        mask = torch.ones_like(ids)
        clock = StepClock(device)
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
            gen = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
            )
        steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)]
        out["runs"][key] = {
            "step_seconds": steps,
            "decode_tokens_per_second": len(prompt) * len(steps) / sum(steps) if steps else 0.0,
            "tokens": gen[:, ids.shape[1] :].tolist(),
        }
        print(f"  transformers batch {len(prompt)}: {out['runs'][key]['decode_tokens_per_second']:.2f} tok/s")
    return out


def prefill(spec: dict) -> dict:
    device = spec["device"]
    model, _ = _load(spec)
    out = _base(device) | {"runs": {}}
    with torch.inference_mode():
        warm = torch.tensor(spec["runs"][0]["ids"], device=device)[:1, :16]
        model(input_ids=warm, attention_mask=torch.ones_like(warm), logits_to_keep=1)
        for run in spec["runs"]:
            ids = torch.tensor(run["ids"], device=device)
            seconds = []
            for _ in range(spec["repeats"]):
                _sync(device)
                start = time.perf_counter()
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
                _sync(device)
                seconds.append(time.perf_counter() - start)
            out["runs"][run["key"]] = {"seconds": seconds}
            print(f"  transformers {run['key']}: {min(seconds):.2f} s (best of {len(seconds)})")
    return out


if __name__ == "__main__":
    mode, spec_path, out_path = sys.argv[1:4]
    result = {"load": load, "decode": decode, "prefill": prefill}[mode](json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
