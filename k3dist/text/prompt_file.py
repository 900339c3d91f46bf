"""Prompt files: one JSON request per line, each checked so a bad line is one error naming the file and line.

Results go out with write_jsonl, atomically, so a reader never sees half a file.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..base.errors import K3Error
from ..base.outfiles import atomic_write
from .chat import messages_problem

INPUTS = ("prompt", "messages", "ids")
SAMPLING = ("temperature", "top_p", "top_k", "seed")  # SamplingParams fields a line sets (engine/sampling.py: DOORS)
SETTINGS = ("max_new_tokens", *SAMPLING, "stop")
KEYS = ("id", *INPUTS, "tools", *SETTINGS)
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range


@dataclass(frozen=True)
class Request:
    """One line of a prompt file. Exactly one of prompt (raw text), messages (a chat), ids (token ids) is set;
    tools go with messages; sampling settings are None where the line does not give them."""

    index: int  # 0-based position among the file's requests (blank lines skipped)
    id: str  # given, or "req-{index}"
    prompt: str | None = None
    messages: list | None = None
    ids: list[int] | None = None
    tools: list | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None


def read_requests(path: str | Path) -> list[Request]:
    """Every request of a JSON-lines file, in order; an empty file or any bad line is a K3Error."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise K3Error(f"{path}: cannot read the requests ({exc.strerror or exc})") from None
    requests: list[Request] = []
    line_of_id: dict[str, int] = {}
    for number, raw_line in enumerate(data.split(b"\n"), 1):
        if not raw_line.strip():
            continue
        try:
            request = _parse(raw_line, len(requests))
        except ValueError as exc:
            raise K3Error(f"{path}:{number}: {exc}") from None
        if request.id in line_of_id:
            raise K3Error(f"{path}:{number}: id {request.id!r} is already used on line {line_of_id[request.id]}")
        line_of_id[request.id] = number
        requests.append(request)
    if not requests:
        raise K3Error(f"{path}: holds no requests (one JSON object per line, each with a prompt, messages or ids)")
    return requests


def _parse(raw_line: bytes, index: int) -> Request:
    """One line -> Request; ValueError says what is wrong with it."""
    try:
        text = raw_line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (byte {raw_line[exc.start]:#04x} at column {exc.start + 1})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_repeated_keys, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise ValueError("not JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a request is a JSON object, got a JSON {type(obj).__name__}")
    if unknown := [k for k in obj if k not in KEYS]:
        raise ValueError(f"unknown key {unknown[0]!r}; a request has {', '.join(KEYS)}")
    given = [k for k in INPUTS if k in obj]
    if len(given) != 1:
        which = "none" if not given else " and ".join(given)
        raise ValueError(f"a request needs exactly one of prompt, messages, ids; this one has {which}")
    fields = {k: _check(k, v) for k, v in obj.items()}
    if "tools" in fields and "messages" not in fields:
        raise ValueError("tools go with messages (a chat), not with a prompt or ids")
    fields.setdefault("id", f"req-{index}")
    return Request(index=index, **fields)


def _check(key: str, value):
    """The value of `key`, normalised (stop as a list); ValueError when it has the wrong type or range."""
    if key == "id":
        if not isinstance(value, str) or not value:
            raise ValueError(f"id must be a non-empty string, got {value!r}")
    elif key == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError(f"prompt must be a non-empty string, got {_short(value)}")
    elif key == "messages":
        if problem := messages_problem(value):
            raise ValueError(f"messages: {problem}")
    elif key == "ids":
        if not isinstance(value, list) or not value or not all(_is_int(i) and i >= 0 for i in value):
            raise ValueError(f"ids must be a non-empty list of non-negative integers, got {_short(value)}")
    elif key == "tools":
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            raise ValueError(f"tools must be a list of objects (function schemas), got {_short(value)}")
    elif key in ("max_new_tokens", "top_k"):
        if not _is_int(value) or value < 0:
            raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    elif key == "seed":
        if not _is_int(value) or not 0 <= value <= MAX_SEED:
            raise ValueError(f"seed must be an integer in 0..2**64-1, got {value!r}")
    elif key == "temperature":
        if not _is_number(value) or value < 0:
            raise ValueError(f"temperature must be a number >= 0, got {value!r}")
        return float(value)
    elif key == "top_p":
        if not _is_number(value) or not 0 < value <= 1:
            raise ValueError(f"top_p must be a number with 0 < top_p <= 1, got {value!r}")
        return float(value)
    elif key == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {_short(value)}")
        return stops
    return value


def _is_int(value) -> bool:
    return type(value) is int


def _is_number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        repeated = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {repeated!r} appears twice in one object")
    return obj


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Write one JSON object per line to `path`, whole or not at all (outfiles.atomic_write)."""
    atomic_write(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
