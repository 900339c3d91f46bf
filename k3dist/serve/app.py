"""The HTTP front (FastAPI): OpenAI's completions and chat routes, streamed as server-sent events or whole, the
Responses API (responses_api.py), /v1/models, /health, /metrics and the worker-info routes a router reads
(worker_info.py). Every refusal is an OpenAI error envelope; nothing a request holds reaches the engine before it has
been checked, tokenized and found to fit."""

import hmac
import json
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from ..base.fault_injection import Faults
from .chat_prompt import ChatEcho
from .completions import Echo
from .errors import APIError, bad, internal_error
from .fields import Forms
from .flow import Gone, engine_events, submit
from .loop import EngineLoop, Failure
from .protocol import Unknown, parse_body
from .response_store import ResponseStore
from .responses import Shape, usage
from .responses_api import add_responses_routes
from .schema import ChatRequest, CompletionRequest
from .tokenizer_routes import PATHS as TOKENIZER_PATHS
from .tokenizer_routes import add_tokenizer_routes
from .worker_info import WorkerInfo, add_worker_routes

log = logging.getLogger("k3dist")


class Front:
    """What the routes need: the engine loop, the text tools, the model's name and limits."""

    def __init__(
        self,
        loop: EngineLoop,
        text,
        *,
        model_name: str,
        cap: int,
        vocab: int,
        api_key,
        max_body: int,
        unknown_fields: str = "refuse",
        faults: Faults | None = None,
        store: ResponseStore | None = None,
        worker: WorkerInfo,
    ):
        """`worker`: what a router's worker-info routes answer (worker_info.py)."""
        self.loop, self.text, self.model_name, self.worker = loop, text, model_name, worker
        self.cap, self.vocab, self.api_key, self.max_body = cap, vocab, api_key, max_body
        self.unknown = Unknown(unknown_fields)  # serve.unknown_fields: refuse or ignore (and log) undeclared fields
        self.faults = faults or Faults()  # tests only (fault.raise_in=route)
        self.store = store if store is not None else ResponseStore(0, 0)  # the Responses API's (serve.store_*)
        template = text.template[0] if text.template else None  # with the tokenizer, it decides the chat format
        self.forms = Forms(text.tokenizer, vocab, template)  # logit processors, structured outputs, tool calls
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
        return bad(str(exc)[:300], "body").response()

    @app.exception_handler(Exception)
    async def _fault(request, exc: Exception):
        """k3dist's own fault on a request's path: a 500 envelope saying what failed; the server serves on."""
        log.error("k3_serve_fault path=%s %s: %s", request.url.path, type(exc).__name__, exc, exc_info=exc)
        return internal_error(exc).response()

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

    add_responses_routes(app, front, _body)
    add_tokenizer_routes(app, front, _body)
    add_worker_routes(app, front, front.worker)
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


async def _generate(front: Front, request: Request, kind):
    arrived = time.monotonic()
    raw = await _body(request, front.max_body)
    req = await run_in_threadpool(parse_body, raw, kind, front.unknown)  # megabytes of JSON: off the event loop
    chat = kind is ChatRequest
    kind_id = "chatcmpl" if chat else "cmpl"
    run = await submit(front, req, arrived, kind_id)
    batch, logprobs = run.batch, run.logprobs
    asked_ids = (batch.ids[0] if len(batch.ids) == 1 else batch.ids) if req.return_token_ids else None
    shown = f"{kind_id}-{req.request_id}" if req.request_id is not None else run.internal
    shape = Shape(shown, front.model_name, chat, front.text.tokenizer, asked_ids)
    echo = ChatEcho.of(req) if chat else Echo(batch, shape, logprobs is not None) if req.echo else None
    tools = run.plan.tool_calls(len(run.prompts))
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(
                front,
                shape,
                run.events,
                index=run.index,
                prompt_len=batch.tokens,
                include_usage=include,
                scored=logprobs is not None,
                echo=echo,
                tools=tools,
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    index, prompt_len = run.index, batch.tokens
    return await _whole(front, request, shape, run.events, index=index, prompt_len=prompt_len, echo=echo, tools=tools)


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
            text, reasoning, calls, finish = (
                tools.delta(i, ev.text, ev.finish_reason) if tools else (ev.text, "", [], ev.finish_reason)
            )
            if text or reasoning or calls or ev.finished or logprobs or (ev.tokens and shape.prompt_ids is not None):
                parts = [[call] for call in calls] or [[]]  # one tool-call delta per chunk, as OpenAI sends them
                for k, part in enumerate(parts):
                    first, last = k == 0, k == len(parts) - 1
                    piece = dict(logprobs=logprobs, tokens=ev.tokens, reasoning=reasoning) if first else {}
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
    except Exception as exc:  # k3dist's own fault once the stream has begun: an error event, the server serves on
        log.error("k3_serve_fault stream %s: %s", type(exc).__name__, exc, exc_info=exc)
        yield _sse(internal_error(exc).body)
    finally:
        if pending:  # the client went away (or the server failed): free the slots at the next window
            front.loop.abort(list(pending))


async def _whole(front: Front, request: Request, shape: Shape, events, *, index: dict, prompt_len: int, echo, tools):
    """The whole response once every choice has ended (flow.engine_events: a client gone frees its slots). With
    `tools` each choice's text is parsed into content, reasoning and tool calls."""
    results = [{"text": "", "tokens": [], "logprobs": [], "finish": None, "prompt": None} for _ in index]
    pending = dict(index)
    try:
        async for ev in engine_events(request, events, pending):
            r = results[index[ev.id]]
            r["text"] += ev.text
            r["tokens"] += ev.tokens
            r["logprobs"] += ev.logprobs
            r["prompt"] = ev.prompt_logprobs if ev.prompt_logprobs is not None else r["prompt"]
            if ev.finished:
                r["finish"] = ev.finish_reason
        for i, r in enumerate(results if tools else ()):
            r["text"], r["reasoning"], r["tool_calls"], r["finish"] = tools.whole(i, r["text"], r["finish"])
        body = shape.whole(results, usage(prompt_len, sum(len(r["tokens"]) for r in results)))
        return JSONResponse(echo.whole(body, [r["prompt"] for r in results]) if echo is not None else body)
    except Gone:
        return Response(status_code=499)
    finally:
        if pending:
            front.loop.abort(list(pending))
