"""Request bodies read and checked: bytes -> JSON -> the route's declared model (schema.py), every problem a 400
naming the field; then the engine Prompts of a checked request, one per choice (`n`), each with its own derived seed.

An unknown field is refused (`serve.unknown_fields=refuse`, the default) or dropped and logged once by name
(`ignore`: a gateway that adds fields of its own). Everything a body can hold is bounded here, by its model or by
`serve.max_body`: JSON by depth, strings as text a tokenizer takes, prompts by `cache.cap`.
"""

import json
import logging
import secrets
import threading
from dataclasses import replace

from pydantic import BaseModel, ValidationError

from ..engine.sampling import SamplingParams
from ..engine.sequences import Prompt
from .errors import APIError, bad
from .schema import INT64, ChatRequest, CompletionRequest, Sampling

log = logging.getLogger("k3dist")
MAX_DEPTH = 32  # JSON nesting a body may have (tools schemas nest; nothing needs more)
UNKNOWN_LOGGED = 64  # unknown field names logged (once each) at most: bodies of made-up keys flood no log or memory


class Unknown:
    """What a route does with a field its model does not declare (`serve.unknown_fields`): refuse it with a 400
    naming it, or drop it and log its name, once per name and at most UNKNOWN_LOGGED names."""

    def __init__(self, mode: str = "refuse"):
        self.mode, self.logged, self._lock = mode, set(), threading.Lock()

    def handle(self, names: list[str]) -> None:
        if self.mode == "refuse":
            listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise bad(
                f"unknown field{'s' if len(names) > 1 else ''} {listed}: not part of this route's request "
                "(docs/serving.md lists the fields; serve.unknown_fields=ignore accepts and logs them)",
                names[0],
                "unknown_field",
            )
        with self._lock:
            new = [n for n in dict.fromkeys(names) if n not in self.logged][: UNKNOWN_LOGGED - len(self.logged)]
            self.logged.update(new)
        for name in new:
            log.warning("k3_serve_unknown_field name=%s (ignored: serve.unknown_fields=ignore)", name[:80])


def parse_body(raw: bytes, model: type[BaseModel], unknown: Unknown | None = None) -> BaseModel:
    """Bytes -> a checked request; every problem is a 400, naming the field wherever one is to blame."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the body is not valid JSON ({str(exc)[:200]})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad(f"the body must be a JSON object, got {type(data).__name__}")
    for key, value in data.items():
        if _depth(value) >= MAX_DEPTH:
            raise bad(f"{key:.80} nests deeper than {MAX_DEPTH} levels", key)
        _check_text(key, value)
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        extra = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
        if not extra:
            raise refusal(exc) from None
        (unknown or Unknown()).handle([".".join(map(str, loc)) for loc in extra])
        for loc in extra:  # ignored: dropped where they stand
            _drop(data, loc)
        try:
            req = model.model_validate(data)
        except ValidationError as again:
            raise refusal(again) from None
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs needs logprobs=true", "top_logprobs")
    return req


def refusal(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    param = str(first["loc"][0]) if first["loc"] else None  # the field, not the union member pydantic tried
    message = first["msg"].removeprefix("Value error, ")
    return bad(f"{where}: {message}" if where else message, param)


def _drop(data: dict, loc: tuple) -> None:
    node = data
    for step in loc[:-1]:
        node = node[step]
    node.pop(loc[-1], None)


def _depth(value, limit: int = MAX_DEPTH + 1) -> int:
    """Nesting depth of parsed JSON, counted without recursion and no further than `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if depth < limit:
                stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _check_text(key: str, value) -> None:
    """Every string must be text the tokenizer can take: a lone surrogate (\\ud800) is refused here, naming the
    top-level field that holds it."""
    stack = [key, value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                name = key.encode("utf-8", "replace").decode()
                raise bad(f"{name:.80} holds a string that is not valid Unicode (a lone surrogate)", name) from None
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def budget(req: Sampling, prompt_len: int, cap: int) -> int:
    """max_tokens (chat: max_completion_tokens first), checked against the cache; default: the rest of the cache."""
    asked, where = req.budget, "prompt" if isinstance(req, CompletionRequest) else "messages"
    if not prompt_len:
        raise bad("the prompt is empty", where)
    if asked is None:
        if prompt_len >= cap:
            raise bad(f"the prompt has {prompt_len} tokens; cache.cap={cap} leaves no room for any new token", where)
        return cap - prompt_len
    if prompt_len + asked > cap:
        raise bad(
            f"the prompt has {prompt_len} tokens and max_tokens={asked}: {prompt_len + asked} > cache.cap={cap}",
            "max_completion_tokens" if isinstance(req, ChatRequest) and req.max_completion_tokens else "max_tokens",
        )
    return asked


def draw_seed(req: Sampling) -> int:
    """The request's seed; without one rank 0 draws one (the record carries it to every rank)."""
    return req.seed if req.seed is not None else secrets.randbits(62)


def choices(
    req: Sampling,
    request_id: str,
    ids: list[int],
    max_new: int,
    logprobs,
    *,
    sampling: SamplingParams,
    first=0,
    score=None,
    extra: dict | None = None,
) -> list[Prompt]:
    """One engine Prompt per choice, numbered from `first` (a batch's prompt i starts at i * n), choice j seeded
    `sampling.seed + j` (so a prompt's choices in a batch are those it has alone); `score`: the prompt
    log-probabilities' k (echo with logprobs), or None; `extra`: more Prompt fields (fields.py's plan: grammar, stop
    ids, detokenizing)."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    common = dict(ids=tuple(ids), max_new_tokens=max_new, stop=stop, logprobs=logprobs, prompt_logprobs=score)
    seed = sampling.seed
    return [
        Prompt(
            f"{request_id}-{first + i}",
            sampling=replace(sampling, seed=(seed + i + INT64) % (2 * INT64) - INT64),
            **common,
            **(extra or {}),
        )
        for i in range(req.n)
    ]


def raise_unavailable(message: str, retry_after: int = 1) -> None:
    raise APIError(503, message, code="unavailable", retry_after=retry_after)
