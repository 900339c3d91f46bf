"""The OpenAI request bodies this server takes, checked field by field (types strict, numbers finite and in range),
and turned into engine Prompts: one per choice (`n`), each with its own derived seed.

Fields the models do not declare are ignored; the app logs each unknown name once. Everything a body can hold is
bounded here or by `serve.max_body`: stop strings by count and length, JSON by depth, prompts by `cache.cap`.
"""

import json
import secrets

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.decode_step import WIDEST
from ..engine.sequences import Prompt
from .errors import APIError, bad

MAX_STOPS, MAX_STOP_CHARS = 16, 256  # per request (OpenAI allows 4)
MAX_DEPTH = 32  # JSON nesting a body may have (tools schemas nest; nothing needs more)
MAX_N = 16
TOP_LOGPROBS = WIDEST  # the most log-probabilities per token a request may ask for (OpenAI's and vLLM's 20)
INT64 = 2**63


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    """What completions and chat share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # an extension (vLLM's): 0 or -1 = no cut
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False  # an extension (vLLM's): token_ids per choice, prompt_token_ids
    # what shapes the output beyond sampling (fields.py): logit processors, structured outputs; identifiers
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM's
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)  # vLLM's
    stop_token_ids: list[int] | None = None  # vLLM's
    ignore_eos: bool = False  # vLLM's
    response_format: dict | None = None
    structured_outputs: dict | None = None  # vLLM's
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt or a batch (serve/completions.py)
    max_tokens: int | None = Field(None, ge=0)  # 0: nothing generated (with echo and logprobs: the prompt scored)
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's extension: refused (serve/completions.py), echo + logprobs instead


class ChatRequest(Sampling):
    messages: list[dict]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True


def parse_body(raw: bytes, model: type[_Body]) -> _Body:
    """Bytes -> a checked request; every problem is a 400 naming the field."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"the body is not valid JSON ({str(exc)[:200]})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad(f"the body must be a JSON object, got {type(data).__name__}")
    if _depth(data) > MAX_DEPTH:
        raise bad(f"the body nests deeper than {MAX_DEPTH} levels")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None  # the field, not the union member pydantic tried
        raise bad(f"{where}: {first['msg']}" if where else first["msg"], param=param) from None
    _check_text(data)
    given = req.stop if isinstance(req, Sampling) else None  # the tokenizer routes' bodies have none
    stop = [given] if isinstance(given, str) else (given or [])
    if len(stop) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise bad(f"stop takes at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters", "stop")
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs needs logprobs=true", "top_logprobs")
    return req


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


def _check_text(value) -> None:
    """Every string must be text the tokenizer can take: a lone surrogate (\\ud800) is refused here."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise bad("the body holds a string that is not valid Unicode (a lone surrogate)") from None
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def budget(req: Sampling, prompt_len: int, cap: int) -> int:
    """max_tokens (chat: max_completion_tokens first), checked against the cache; default: the rest of the cache."""
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if not prompt_len:
        raise bad("the prompt is empty", "prompt" if isinstance(req, CompletionRequest) else "messages")
    if asked is None:
        if prompt_len >= cap:
            raise bad(f"the prompt has {prompt_len} tokens; cache.cap={cap} leaves no room for any new token")
        return cap - prompt_len
    if prompt_len + asked > cap:
        raise bad(
            f"the prompt has {prompt_len} tokens and max_tokens={asked}: {prompt_len + asked} > cache.cap={cap}",
            "max_tokens",
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
    first=0,
    seed=None,
    score=None,
    extra: dict | None = None,
) -> list[Prompt]:
    """One engine Prompt per choice, numbered from `first` (a batch's prompt i starts at i * n), choice j seeded
    `seed + j` (so a prompt's choices in a batch are those it has alone); `score`: the prompt log-probabilities'
    k (echo with logprobs), or None; `extra`: more Prompt fields (fields.py's plan: logit processors, grammar,
    stop ids)."""
    seed = draw_seed(req) if seed is None else seed
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    common = dict(ids=tuple(ids), max_new_tokens=max_new, temperature=req.temperature, top_p=req.top_p)
    common |= dict(top_k=max(req.top_k, 0), stop=stop, logprobs=logprobs, prompt_logprobs=score) | (extra or {})
    return [
        Prompt(f"{request_id}-{first + i}", seed=(seed + i + INT64) % (2 * INT64) - INT64, **common)
        for i in range(req.n)
    ]


def raise_unavailable(message: str, retry_after: int = 1) -> None:
    raise APIError(503, message, code="unavailable", retry_after=retry_after)
