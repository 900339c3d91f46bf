"""A short serve check (gpu_check.sh runs it on CUDA; `--device cpu` rehearses it here): start the server on the bf16
twin (on CUDA one graph per sampling mode is captured, the processed modes included), drive it with the real `openai`
client through 8 concurrent streams mixing greedy and sampling plus one under a `json_schema` grammar (its masks go
through the captured step beside the free streams), check each finished, that the constrained one is valid JSON ended
by `stop` and that a greedy request answers the same twice, then SIGTERM it and check the drain's exit code. Writes
what it measured as JSON.

    python benchmarks/serve_smoke.py --device cuda --json $OUT/serve.json
"""

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import common

READY = re.compile(r"serving '([^']+)' at (http://\S+/v1)")


def start_server(args, twin: Path) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, "launch.py", "run.mode=serve", "serve.port=0", f"model.path={twin}",
           f"generate.batch={args.batch}", f"cache.cap={args.cap}", f"dist.device={args.device}",
           "hydra.run.dir=/tmp/k3dist-serve-smoke", "hydra.output_subdir=null"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=common.ROOT, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"}
    )
    deadline = time.monotonic() + args.timeout
    for line in proc.stderr:
        print(line, end="", file=sys.stderr)
        if m := READY.search(line):
            return proc, m.group(1), m.group(2)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("serve_smoke: the server never said it was serving")


SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}


async def constrained(client, model: str) -> dict:
    """One chat stream under a json_schema grammar: its text must be an object of SCHEMA, ended by stop."""
    fmt = {"type": "json_schema", "json_schema": {"name": "smoke", "schema": SCHEMA, "strict": True}}
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A colour and a count"}], response_format=fmt,
        max_tokens=64, temperature=0.8, seed=5, stream=True,
    )  # fmt: skip
    text, finish = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    try:
        value = json.loads(text)
        valid = set(value) == {"colour", "count"} and value["colour"] in ("red", "green") and 0 <= value["count"] <= 9
    except (ValueError, TypeError):
        valid = False
    return {"text": text, "finish_reason": finish, "valid": valid and finish == "stop"}


async def streams(url: str, model: str, n: int, max_tokens: int) -> tuple[list[dict], dict]:
    import openai

    async def one(i: int) -> dict:
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": i}
        start, first, chunks = time.perf_counter(), None, 0
        stream = await client.completions.create(
            model=model, prompt=f"Request {i}: tell me about lighthouses", max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, **sampling,
        )  # fmt: skip
        usage = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
                chunks += 1
            usage = chunk.usage or usage
        return {"ttft_s": first - start, "e2e_s": time.perf_counter() - start, "tokens": usage.completion_tokens}

    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300) as client:
        *free, shaped = await asyncio.gather(*(one(i) for i in range(n)), constrained(client, model))
        return free, shaped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cap", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    proc, model, url = start_server(args, common.twin_dir())
    out = {"device": args.device, "batch": args.batch, "ok": False}
    try:
        import openai

        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
        greedy = [client.completions.create(model=model, prompt="Hello", max_tokens=16, temperature=0).choices[0].text
                  for _ in range(2)]  # fmt: skip
        start = time.perf_counter()
        results, shaped = asyncio.run(streams(url, model, args.batch - 1, args.max_tokens))
        wall = time.perf_counter() - start
        out |= {"greedy_repeatable": greedy[0] == greedy[1], "streams": results, "constrained": shaped, "wall_s": wall}
        out["output_tok_s"] = sum(r["tokens"] for r in results) / wall
        out["all_finished"] = all(r["tokens"] >= 1 for r in results)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out["exit_code"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out["exit_code"] = None
    shaped_ok = out.get("constrained", {}).get("valid")
    out["ok"] = bool(out.get("greedy_repeatable") and out.get("all_finished") and shaped_ok and out["exit_code"] == 143)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
