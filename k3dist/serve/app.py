"""The HTTP front (FastAPI): OpenAI's completions and chat routes, streamed as server-sent events or whole, plus
/v1/models, /health and /metrics. Every refusal is an OpenAI error envelope; nothing a request holds reaches the
engine before it has been checked, tokenized and found to fit."""

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from ..base.errors import K3Error
from .completions import Batch, Echo, batch_choices, budgets, prompt_batch
from .errors import APIError, bad
from .fields import UNSERVED, Forms
from .loop import EngineLoop, Failure
from .protocol import ChatRequest, CompletionRequest, choices, parse_body
from .responses import Shape, usage
from .tokenizer_routes import PATHS as TOKENIZER_PATHS
from .tokenizer_routes import add_tokenizer_routes

log = logging.getLogger("k3dist")
LOOK_S = 0.5  # how often a whole (not streamed) response looks whether its client is still there
UNKNOWN_LOGGED = 64  # unknown field names logged (once each) at most: bodies of made-up keys flood no log or memory


class Front:
    """What the routes need: the engine loop, the text tools, the model's name and limits."""

    def __init__(self, loop: EngineLoop, text, *, model_name: str, cap: int, vocab: int, api_key, max_body: int):
        self.loop, self.text, self.model_name = loop, text, model_name
        self.cap, self.vocab, self.api_key, self.max_body = cap, vocab, api_key, max_body
        self.unknown_logged: set[str] = set()
        self.forms = Forms(text.tokenizer, vocab)  # logit processors, structured outputs, tool calls
        threading.Thread(target=self.forms.grammars.warm, name="k3dist-grammar-warm", daemon=True).start()


class _Responding:
    """ASGI middleware: counts each HTTP response from its start until its last byte is sent, so the process ends
    only after every answer (an error included) has left (EngineLoop.flushed)."""

    def __init__(self, app, loop: EngineLoop):
        self.app, self.loop = app, loop

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.loop.responding(+1)
        done = False

        async def sending(message):
            nonlocal done
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done:
                done = True
                self.loop.responding(-1)

        try:
            await self.app(scope, receive, sending)
        finally:
            if not done:
                self.loop.responding(-1)


class _Auth:
    """ASGI middleware: with a key, every /v1 route and the tokenizer routes want `Authorization: Bearer <key>` (401
    otherwise). Plain ASGI, not `@app.middleware`: Starlette's BaseHTTPMiddleware wraps `receive` so that
    Request.is_disconnected() never sees a client leave, and a whole response would then hold its slots to the end
    for nobody."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        keyed = scope.get("path", "").startswith("/v1") or scope.get("path") in TOKENIZER_PATHS
        if self.key and scope["type"] == "http" and keyed:
            scheme, _, token = Headers(scope=scope).get("authorization", "").strip().partition(" ")
            given = token.strip().encode("latin-1")  # the header's own bytes; the scheme's case is free (RFC 7235)
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.key.encode()):
                wanted = "a valid API key is needed: Authorization: Bearer <key>"
                return await APIError(401, wanted, code="invalid_api_key").response()(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(front: Front) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Responding, loop=front.loop)
    app.add_middleware(_Auth, key=front.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        what = "no such route" if exc.status_code == 404 else str(exc.detail)
        return APIError(exc.status_code, f"{what}: {request.method} {request.url.path}").response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        return bad(str(exc)[:300]).response()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if front.loop.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": front.loop.state, "error": front.loop.failure}, status_code=503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return Response(front.loop.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        card = {
            "id": front.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "k3dist",
            "max_model_len": front.cap,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(front, request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(front, request, ChatRequest)

    add_tokenizer_routes(app, front, _body)
    return app


async def _body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by its Content-Length, or as it streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body has {declared} bytes; serve.max_body={limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the body is over serve.max_body={limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _encode(front: Front, req) -> Batch:
    """Prompt ids, through the chat template for chat (in a worker thread: tokenizing is CPU work)."""
    try:
        if isinstance(req, ChatRequest):
            return Batch([front.text.encode_chat(req.messages, "messages", req.tools)], [""], req.n)
        return prompt_batch(req, front.text.tokenizer, front.vocab)
    except K3Error as exc:
        raise bad(str(exc), "messages" if isinstance(req, ChatRequest) else "prompt") from None


async def _generate(front: Front, request: Request, kind):
    arrived = time.monotonic()
    raw = await _body(request, front.max_body)
    req = await run_in_threadpool(parse_body, raw, kind)  # megabytes of JSON are parsed off the event loop
    plan = await run_in_threadpool(front.forms.plan, req)  # refusals first; a grammar compiles off the loop too
    room = max(0, UNKNOWN_LOGGED - len(front.unknown_logged))
    for name in sorted(set(req.model_extra or ()) - front.unknown_logged - UNSERVED.keys())[:room]:
        front.unknown_logged.add(name)
        log.warning("k3_serve_unknown_field name=%s (ignored)", name[:80])
    if req.model is not None and req.model != front.model_name:
        raise bad(
            f"model {req.model!r} is not served here (this server serves {front.model_name!r})",
            "model",
            "model_not_found",
        )
    batch = await run_in_threadpool(_encode, front, req)
    limits = budgets(req, batch, front.cap)
    chat = kind is ChatRequest
    logprobs = (req.top_logprobs or 0 if req.logprobs else None) if chat else req.logprobs
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    asked_ids = (batch.ids[0] if len(batch.ids) == 1 else batch.ids) if req.return_token_ids else None
    shape = Shape(request_id, front.model_name, chat, front.text.tokenizer, asked_ids)
    if chat:
        prompts = choices(req, shape.id, batch.ids[0], limits[0], logprobs, extra=plan.engine)
    else:
        room = front.loop.max_waiting + front.loop.engine.cache.batch
        prompts = batch_choices(req, shape.id, batch, limits, room, extra=plan.engine)
    echo = Echo(batch, shape, logprobs is not None) if getattr(req, "echo", False) else None
    tools = plan.tool_calls(len(prompts))
    events: asyncio.Queue = asyncio.Queue()
    aio = asyncio.get_running_loop()
    front.loop.submit(prompts, lambda ev: aio.call_soon_threadsafe(events.put_nowait, ev), arrived)
    index = {p.id: i for i, p in enumerate(prompts)}
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(
                front,
                shape,
                events,
                index=index,
                prompt_len=batch.tokens,
                include_usage=include,
                scored=logprobs is not None,
                echo=echo,
                tools=tools,
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return await _whole(front, request, shape, events, index=index, prompt_len=batch.tokens, echo=echo, tools=tools)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(
    front: Front, shape: Shape, events, *, index: dict, prompt_len: int, include_usage: bool, scored, echo, tools
):
    pending, produced, offsets = dict(index), 0, [0] * len(index)
    echoed: set[int] = set()  # choices whose prompt (echo) went out: the first chunk of each
    try:
        if shape.chat:
            for i in range(len(index)):
                yield _sse(shape.chunk(i, "", first=True, usage=include_usage))
        while pending:
            ev = await events.get()
            if isinstance(ev, Failure):
                yield _sse(ev.error().body)
                return
            i = index[ev.id]
            if echo is not None and i not in echoed:
                echoed.add(i)
                text, head = echo.head(i, ev.prompt_logprobs)
                yield _sse(shape.chunk(i, text, logprobs=head, usage=include_usage))
                offsets[i] = len(text)
            logprobs = shape.logprobs(ev.logprobs, ev.tokens, offsets[i]) if scored else None
            offsets[i] += len(ev.text)
            text, calls, finish = (
                tools.delta(i, ev.text, ev.finish_reason) if tools else (ev.text, [], ev.finish_reason)
            )
            if text or calls or ev.finished or logprobs or (ev.tokens and shape.prompt_ids is not None):
                parts = [[call] for call in calls] or [[]]  # one tool-call delta per chunk, as OpenAI sends them
                for k, part in enumerate(parts):
                    first, last = k == 0, k == len(parts) - 1
                    piece = dict(logprobs=logprobs, tokens=ev.tokens) if first else {}
                    finished = finish if last else None
                    yield _sse(
                        shape.chunk(i, text if first else "", finished, usage=include_usage, tool_calls=part, **piece)
                    )
            if ev.finished:
                del pending[ev.id]
                produced += len(ev.completion.tokens)
        if include_usage:
            yield _sse(shape.usage_chunk(usage(prompt_len, produced)))
        yield "data: [DONE]\n\n"
    finally:
        if pending:  # the client went away (or the server failed): free the slots at the next window
            front.loop.abort(list(pending))


async def _whole(front: Front, request: Request, shape: Shape, events, *, index: dict, prompt_len: int, echo, tools):
    """The whole response once every choice has ended. The connection is looked at every LOOK_S whether events
    flow or not: a client gone while its tokens keep coming must free its slots too, not hold them to the end.
    With `tools` each choice's text is parsed into content and tool calls."""
    results = [{"text": "", "tokens": [], "logprobs": [], "finish": None, "prompt": None} for _ in index]
    pending, look = dict(index), time.monotonic() + LOOK_S
    try:
        while pending:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=max(0.0, look - time.monotonic()))
            except TimeoutError:
                ev = None
            if time.monotonic() >= look:
                if await request.is_disconnected():
                    return Response(status_code=499)
                look = time.monotonic() + LOOK_S
            if ev is None:
                continue
            if isinstance(ev, Failure):
                raise ev.error()
            r = results[index[ev.id]]
            r["text"] += ev.text
            r["tokens"] += ev.tokens
            r["logprobs"] += ev.logprobs
            r["prompt"] = ev.prompt_logprobs if ev.prompt_logprobs is not None else r["prompt"]
            if ev.finished:
                r["finish"] = ev.finish_reason
                del pending[ev.id]
        for i, r in enumerate(results if tools else ()):
            r["text"], r["tool_calls"], r["finish"] = tools.whole(i, r["text"], r["finish"])
        body = shape.whole(results, usage(prompt_len, sum(len(r["tokens"]) for r in results)))
        return JSONResponse(echo.whole(body, [r["prompt"] for r in results]) if echo is not None else body)
    finally:
        if pending:
            front.loop.abort(list(pending))
