"""Typed job settings from the composed Hydra config (a plain dict, so it crosses process boundaries)."""

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import K3Error
from .faults import Faults
from .units import parse_bytes

CONFIGS = Path(__file__).parent / "configs"
COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODES = ("generate", "load", "plan")


@dataclass(frozen=True)
class Settings:
    config_file: Path
    model_path: str | None
    dtype: str
    twin_seed: int
    router_weights: str
    nproc: int
    plan_world: int | None
    timeout_s: float
    backend: str
    device: str
    reserve: int
    free: int | None
    cap: int
    prompt: list[int] | None
    prompt_len: int
    batch: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    mode: str
    out: str | None
    faults: Faults

    def compute_dtype(self, checkpoint_dtype: str) -> torch.dtype:
        return COMPUTE_DTYPES[checkpoint_dtype if self.dtype == "auto" else self.dtype]


def _int(section: dict, key: str, where: str, low: int = 0, optional: bool = False):
    value = section.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise K3Error(f"{where}.{key}={value!r} must be an integer >= {low}")
    return value


def _float(section: dict, key: str, where: str, low: float = 0.0) -> float:
    value = section.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < low:
        raise K3Error(f"{where}.{key}={value!r} must be a number >= {low}")
    return float(value)


def _choice(section: dict, key: str, where: str, choices) -> str:
    value = section.get(key)
    if value not in choices:
        raise K3Error(f"{where}.{key}={value!r} must be one of {list(choices)}")
    return value


def parse(job: dict) -> Settings:
    """Check every value a user can override; a bad one is an `error:` line naming the key."""
    model, dist, mem, cache, gen, run = (
        job.get(k) or {} for k in ("model", "dist", "memory", "cache", "generate", "run")
    )
    fault = job.get("fault") or {}
    config_file = Path(str(model.get("config_file") or ""))
    if model.get("path") is None:
        if not config_file.is_absolute():
            config_file = CONFIGS / config_file
        if not config_file.is_file():
            raise K3Error(f"model.config_file={model.get('config_file')!r}: no such config ({config_file})")
    prompt = gen.get("prompt")
    if prompt is not None and (
        not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt)
    ):
        raise K3Error(f"generate.prompt={prompt!r} must be a non-empty list of token ids")
    return Settings(
        config_file=config_file,
        model_path=None if model.get("path") is None else str(model["path"]),
        dtype=_choice(model, "dtype", "model", ("auto", *COMPUTE_DTYPES)),
        twin_seed=_int(model, "seed", "model"),
        router_weights=_choice(model, "router_weights", "model", ("unbiased", "biased")),
        nproc=_int(dist, "nproc", "dist", 1),
        plan_world=_int(dist, "world_size", "dist", 1, optional=True),
        timeout_s=_float(dist, "timeout_s", "dist", 1.0),
        backend=_choice(dist, "backend", "dist", ("auto", "gloo", "nccl")),
        device=_choice(dist, "device", "dist", ("auto", "cpu", "cuda")),
        reserve=parse_bytes(mem.get("reserve", 0), "memory.reserve"),
        free=None if mem.get("free") is None else parse_bytes(mem["free"], "memory.free"),
        cap=_int(cache, "cap", "cache", 1),
        prompt=prompt,
        prompt_len=_int(gen, "prompt_len", "generate", 1),
        batch=_int(gen, "batch", "generate", 1),
        max_new_tokens=_int(gen, "max_new_tokens", "generate", 0),
        temperature=_float(gen, "temperature", "generate"),
        top_p=_float(gen, "top_p", "generate"),
        seed=_int(gen, "seed", "generate"),
        mode=_choice(run, "mode", "run", MODES),
        out=job.get("out"),
        faults=Faults(
            **{k: (parse_bytes(v, "fault.free") if k == "free" and v is not None else v) for k, v in fault.items()}
        ),
    )
