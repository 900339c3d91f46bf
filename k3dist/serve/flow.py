"""A generating request's way through the server, shared by completions, chat and the Responses API: a checked
request planned (fields.py), tokenized (the chat template in a worker thread), held to `cache.cap`, a chat's plan
bound to where its prompt leaves the answer, made into one engine Prompt per choice and submitted to the engine loop;
then its events taken back as they come, the client's connection looked at while none do."""

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..base.errors import K3Error
from ..engine.sequences import Prompt
from .chat_prompt import rendering
from .completions import Batch, batch_choices, budgets, prompt_batch
from .errors import bad
from .fields import CheckedFields
from .loop import Failure
from .protocol import choices
from .schema import ChatRequest, Sampling

LOOK_S = 0.5  # how often a whole (not streamed) response looks whether its client is still there


class Gone(Exception):
    """The client of a whole response went away before its end."""


@dataclass
class Submitted:
    """A request in the engine loop: what it asked (`req`, `plan`), its prompts and the queue their events come to."""

    req: Sampling
    plan: CheckedFields
    batch: Batch
    prompts: list[Prompt]
    events: asyncio.Queue
    logprobs: int | None  # log-probabilities asked per token (chat: top_logprobs with logprobs), or None
    internal: str  # the engine's id of the request, unique whatever request_id a client gives

    @property
    def index(self) -> dict[str, int]:
        """Each prompt's id -> its choice's number."""
        return {p.id: i for i, p in enumerate(self.prompts)}


def encode(front, req: Sampling) -> Batch:
    """Prompt ids, through the chat template for chat (in a worker thread: tokenizing is CPU work)."""
    try:
        if isinstance(req, ChatRequest):
            options = rendering(front.text, req)
            return Batch([front.text.encode_chat(req.messages, "messages", req.tools, **options)], [""], req.n)
        return prompt_batch(req, front.text.tokenizer, front.vocab)
    except K3Error as exc:
        raise bad(str(exc), "messages" if isinstance(req, ChatRequest) else "prompt") from None


async def submit(front, req: Sampling, arrived: float, kind: str) -> Submitted:
    """Plan, tokenize and submit a checked request (`front`: app.py's Front); `kind`: its ids' prefix. Every refusal
    comes before anything reaches the engine loop."""
    plan = await run_in_threadpool(front.forms.plan, req)  # refusals first; a grammar compiles off the loop too
    front.faults.in_route(0, req.user)
    if req.model is not None and req.model != front.model_name:
        raise bad(
            f"model {req.model!r} is not served here (this server serves {front.model_name!r})",
            "model",
            "model_not_found",
        )
    batch = await run_in_threadpool(encode, front, req)
    limits = budgets(req, batch, front.cap)
    chat = isinstance(req, ChatRequest)
    if chat:  # where the prompt leaves the answer, for its parser and a grammar that waits on it (fields.py)
        plan = await run_in_threadpool(front.forms.bind, plan, batch.ids[0])
    logprobs = (req.top_logprobs or 0 if req.logprobs else None) if chat else req.logprobs
    internal = f"{kind}-{uuid.uuid4().hex}"
    extra = plan.engine | {"priority": req.priority}
    if chat:
        prompts = choices(req, internal, batch.ids[0], limits[0], logprobs, sampling=plan.sampling, extra=extra)
    else:
        room = front.loop.max_waiting + front.loop.engine.cache.batch
        prompts = batch_choices(req, internal, batch, limits, room, plan.sampling, extra=extra)
    events: asyncio.Queue = asyncio.Queue()
    aio = asyncio.get_running_loop()
    front.loop.submit(prompts, lambda ev: aio.call_soon_threadsafe(events.put_nowait, ev), arrived)
    return Submitted(req, plan, batch, prompts, events, logprobs, internal)


async def engine_events(request: Request, events: asyncio.Queue, pending: dict):
    """The events of a whole response's choices (`pending`: the ids of those not ended yet, emptied as they end)
    until every one has ended. The connection is looked at every LOOK_S whether events flow or not: a client gone
    while its tokens keep coming must free its slots too (Gone), not hold them to the end. A Failure is raised as its
    error."""
    look = time.monotonic() + LOOK_S
    while pending:
        try:
            ev = await asyncio.wait_for(events.get(), timeout=max(0.0, look - time.monotonic()))
        except TimeoutError:
            ev = None
        if time.monotonic() >= look:
            if await request.is_disconnected():
                raise Gone
            look = time.monotonic() + LOOK_S
        if ev is None:
            continue
        if isinstance(ev, Failure):
            raise ev.error()
        if ev.finished:
            del pending[ev.id]
        yield ev
