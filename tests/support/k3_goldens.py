"""llama.cpp's golden logits of the K3 twin (tests/data/k3, written by benchmarks/k3_reference.py; docs/k3.md
"Goldens"), read into rows a test compares its own logits with."""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parents[1] / "data" / "k3"


@dataclass(frozen=True)
class Rows:
    """What is kept of R logits rows: `at` (prefill: positions in the prompt; decode: the token each step fed)."""

    at: np.ndarray  # [R] int
    subset: np.ndarray  # [R, S] logits at Goldens.vocab_subset
    top_ids: np.ndarray  # [R, 16] the row's largest logits' ids, descending
    top: np.ndarray  # [R, 16] their values
    max: np.ndarray  # [R]
    lse: np.ndarray  # [R] log-sum-exp of the whole row

    def check(self, i: int, logits: torch.Tensor, vocab_subset: np.ndarray) -> float:
        """max |logits - golden| over the kept ids of row i, over the row's max |logit| (a relative error)."""
        got = logits.detach().double().cpu().numpy()
        diff = max(np.abs(got[vocab_subset] - self.subset[i]).max(), np.abs(got[self.top_ids[i]] - self.top[i]).max())
        return float(diff / np.abs(self.top[i]).max())


@dataclass(frozen=True)
class Prompt:
    name: str
    ids: list[int]
    prefill: Rows
    decode: Rows
    greedy: list[int]  # the 17 greedy tokens: 16 fed to the decode steps, then the last step's choice
    margins: list[float]  # top-1 minus top-2 logit of each greedy choice


@dataclass(frozen=True)
class Goldens:
    manifest: dict
    vocab_subset: np.ndarray
    prompts: list[Prompt]


def load(data: Path = DATA) -> Goldens:
    manifest = json.loads((data / "manifest.json").read_text())
    arrays = np.load(data / "golden.npz")

    def rows(name: str, part: str, at: str) -> Rows:
        key = f"{name}.{part}_"
        return Rows(arrays[f"{name}.{at}"], *(arrays[key + k] for k in ("subset", "top_ids", "top", "max", "lse")))

    prompts = [
        Prompt(
            p["name"],
            [int(i) for i in arrays[f"{p['name']}.ids"]],
            rows(p["name"], "prefill", "prefill_positions"),
            rows(p["name"], "decode", "decode_fed"),
            p["greedy"],
            p["margins"],
        )
        for p in manifest["prompts"]
    ]
    return Goldens(manifest, arrays["vocab_subset"], prompts)
