"""The Responses API: `POST /v1/responses` on chat's way through the server (responses_input.py makes the chat
request it is; flow.py plans, tokenizes and submits it; the same checks, engine and tool-call parser), answered whole
or streamed as Responses events (responses_output.py); and the stored responses (response_store.py): `store`,
`previous_response_id`, `GET` and `DELETE /v1/responses/{id}`.

A response is stored unless the request says `store: false` (OpenAI's default, and what the SGLang Model Gateway
writes into every body it forwards), before its last event or its body leaves, so a client that continues it at once
finds it. A response id that is not (or no longer) stored is a 404 naming it.
"""

import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .chat_prompt import template_reads
from .errors import APIError, bad, internal_error
from .flow import Gone, Submitted, engine_events, submit
from .loop import Failure
from .protocol import parse_body
from .response_store import ResponseStore, Stored
from .responses import Shape
from .responses_input import chat_request, input_messages, messages_of, renamed
from .responses_output import Output, response_object
from .responses_schema import ResponsesRequest

log = logging.getLogger("k3dist")


def add_responses_routes(app: FastAPI, front, body) -> None:
    """`front`: app.py's Front (its `store` among the rest); `body`: app.py's body reader (serve.max_body)."""

    @app.post("/v1/responses")
    async def create(request: Request):
        arrived = time.monotonic()
        raw = await body(request, front.max_body)
        req = await run_in_threadpool(parse_body, raw, ResponsesRequest, front.unknown)
        keep = _keeps(req, front.store)
        conversation = await run_in_threadpool(_conversation, req, front.store)
        thinks = "thinking" in template_reads(front.text)
        chat = await run_in_threadpool(chat_request, req, conversation, thinks)
        try:
            run = await submit(front, chat, arrived, "resp")
        except APIError as exc:
            raise renamed(exc) from None
        response_id = f"resp_{req.request_id if req.request_id is not None else uuid.uuid4().hex}"
        scored = Shape(response_id, front.model_name, True, front.text.tokenizer) if run.logprobs is not None else None
        start = response_object(req, response_id, front.model_name, keep)
        output = Output(start, tools=run.plan.tool_calls(1), shape=scored)
        finished = _Finished(front.store if keep else None, response_id, conversation)
        if req.stream:
            events = _stream(front, run, output, finished)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(front, request, run, output, finished)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        _no_query(request)
        stored = await run_in_threadpool(front.store.get, response_id)
        if stored is None:
            raise missing(response_id, "response_id")
        return JSONResponse(stored.response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request):
        _no_query(request)
        if not front.store.delete(response_id):
            raise missing(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def missing(response_id: str, param: str) -> APIError:
    return APIError(
        404,
        f"{param} {response_id!r:.300}: no such response is stored here (it was never stored, was deleted, or was "
        "evicted: serve.store_responses and serve.store_bytes bound the store, oldest first)",
        param,
        "response_not_found",
    )


def _no_query(request: Request) -> None:
    """OpenAI's retrieval takes `include`, `stream`, ...: none of them is served, and none is dropped."""
    for name in request.query_params:
        raise bad(f"query parameter {name!r:.60} is not served on this route", name)


def _keeps(req: ResponsesRequest, store: ResponseStore) -> bool:
    """Whether the response is stored: unless store is false, while the store is on (store=true is refused when it
    is off: it would be dropped)."""
    if req.store is False:
        return False
    if not store.on and req.store:
        raise bad("store=true: nothing is stored here (serve.store_responses or serve.store_bytes is 0)", "store")
    return store.on


def _conversation(req: ResponsesRequest, store: ResponseStore) -> list[dict]:
    """The previous response's conversation (with its output), then this request's input, as chat messages."""
    if req.previous_response_id is None:
        return input_messages(req)
    stored = store.get(req.previous_response_id)
    if stored is None:
        raise missing(req.previous_response_id, "previous_response_id")
    return stored.messages + input_messages(req)


class _Finished:
    """What a response does once its output has ended, before its last event leaves: it is stored (with its
    conversation and output, for a later previous_response_id) unless it said store false."""

    def __init__(self, store: ResponseStore | None, response_id: str, conversation: list[dict]):
        self.store, self.id, self.conversation = store, response_id, conversation

    def __call__(self, output: Output) -> None:
        if self.store is not None:
            self.store.put(self.id, Stored(output.response, self.conversation + messages_of(output.items)))


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _stream(front, run: Submitted, output: Output, finished: _Finished):
    pending = run.index
    try:
        for event in output.start():
            yield _sse(event)
        while pending:
            ev = await run.events.get()
            if isinstance(ev, Failure):
                yield _sse(output.error(ev.error()))
                return
            if ev.finished:
                del pending[ev.id]
            events = output.feed(ev, run.batch.tokens)
            if ev.finished:
                finished(output)
            for event in events:
                yield _sse(event)
    except Exception as exc:  # k3dist's own fault once the stream has begun: an error event, the server serves on
        log.error("k3_serve_fault responses stream %s: %s", type(exc).__name__, exc, exc_info=exc)
        yield _sse(output.error(internal_error(exc)))
    finally:
        if pending:  # the client went away (or the server failed): free the slot at the next window
            front.loop.abort(list(pending))


async def _whole(front, request: Request, run: Submitted, output: Output, finished: _Finished):
    pending = run.index
    try:
        async for ev in engine_events(request, run.events, pending):
            output.feed(ev, run.batch.tokens)
    except Gone:
        return Response(status_code=499)
    finally:
        if pending:
            front.loop.abort(list(pending))
    finished(output)
    return JSONResponse(output.response)
