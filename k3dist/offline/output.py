"""What rank 0 shows and writes while it generates: text streamed as it comes (one request), a progress bar over a
prompts file, and outputs.jsonl (one line per request, input order, written atomically at the end)."""

import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..base.outfiles import check_writable
from ..engine.sequences import Completion, Event, Prompt


def result_path(s) -> Path:
    return Path(s.out or "result.json")


def outputs_path(s) -> Path | None:
    """outputs.jsonl of a prompts file: generate.outputs, or beside result.json; None without a prompts file."""
    g = s.generate
    if g.prompts is None:
        return None
    return Path(g.outputs) if g.outputs else result_path(s).parent / "outputs.jsonl"


def check_targets(s) -> None:
    """Rank 0, before anything is loaded: every file it will write can be written (outfiles.check_writable)."""
    check_writable(result_path(s), "out")
    outputs = outputs_path(s)
    if outputs is not None:
        check_writable(outputs, "generate.outputs")


class Output:
    def __init__(self, s, rt, prompts: list[Prompt]):
        self.s, self.prompts, self.main = s, prompts, rt.is_main
        g = s.generate
        self.outputs = outputs_path(s)
        stream = g.stream == "on" or (g.stream == "auto" and sys.stdout.isatty())
        self.streaming = self.main and stream and len(prompts) == 1
        self.bar = None
        if self.main and g.prompts is not None:
            self.bar = tqdm(total=len(prompts), unit="req", desc="k3dist", file=sys.stderr, dynamic_ncols=True)
        self.tokens, self.start = 0, time.perf_counter()

    def on_event(self, event: Event) -> None:
        """Text as it comes (one request, streaming), the progress bar as requests end."""
        if self.streaming and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        if event.finished:
            self.tokens += len(event.completion.tokens)
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix_str(f"{self.tokens / (time.perf_counter() - self.start):.1f} tok/s")

    def close(self, completions: list[Completion]) -> None:
        if self.streaming:
            sys.stdout.write("\n")
            sys.stdout.flush()
        if self.bar is not None:
            self.bar.close()
        if self.main and self.outputs is not None:
            from ..text.prompt_file import write_jsonl

            rows = [
                {
                    "id": c.id,
                    "text": c.text,
                    "tokens": c.tokens,
                    "prompt_tokens": len(c.prompt),
                    "finish_reason": c.finish_reason,
                }
                for c in completions
            ]
            write_jsonl(self.outputs, rows)

    def paths(self) -> dict:
        return {"outputs": str(self.outputs)} if self.outputs is not None else {}
