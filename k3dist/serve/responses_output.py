"""A Responses API answer in OpenAI's shapes: the Response object, and its output built from the engine's events as
items (a `reasoning` item with one `reasoning_text` part where the checkpoint's format writes its reasoning apart, as
K3 does; an assistant `message` with one `output_text` part; a `function_call` item per tool call) together with the
stream events that announce them, in OpenAI's order:

    response.created, response.in_progress,
    per reasoning: as a message, with response.reasoning_text.delta x n and response.reasoning_text.done
    per message: response.output_item.added, response.content_part.added, response.output_text.delta x n,
                 response.output_text.done, response.content_part.done, response.output_item.done
    per call:    response.output_item.added, response.function_call_arguments.delta,
                 response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete, when the answer ran out of max_output_tokens or cache.cap)

each with its `sequence_number`. A whole response is built by the same `Output` fed the same events, its stream
events left unsent, so a stream's deltas always add up to the whole answer. Content, reasoning and tool calls are
chat's (tools.py): a call is announced once it is complete; text around the calls is the message's. Usage counts an
engine event's tokens as reasoning tokens when all its text was reasoning.
"""

import copy
import time
import uuid

from ..engine.sequences import Event
from .responses_schema import ResponsesRequest
from .tools import ToolCalls


def response_object(req: ResponsesRequest, response_id: str, model: str, store: bool) -> dict:
    """The Response as it starts: what the request asked for, echoed as OpenAI echoes it, no output yet."""
    fmt = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "completed_at": None,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "store": store,
        "temperature": req.temperature,
        "text": {"format": {"type": "text"}} | fmt,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": list(req.tools or ()),
        "top_logprobs": req.top_logprobs or 0,
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": dict(req.metadata or {}),
    }


def _id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


KINDS = {  # item type -> (its id's prefix, its part, the stream events' word for the part's text)
    "message": ("msg", {"type": "output_text", "text": "", "annotations": [], "logprobs": []}, "output_text"),
    "reasoning": ("rs", {"type": "reasoning_text", "text": ""}, "reasoning_text"),
}


class Output:
    """One response's output, built from its engine events (one choice): the items, the stream events announcing
    them (`feed`'s and `start`'s return), and the Response at the end. `shape`: responses.py's Shape of a chat
    answer, for log-probabilities (None: none asked); `tools`: the answer's parser (None: the text as it is)."""

    def __init__(self, response: dict, *, tools: ToolCalls | None, shape=None):
        self.response, self.tools, self.shape = response, tools, shape
        self.sequence = 0
        self.message: dict | None = None  # the message or reasoning item being written
        self.logprobs: list = []  # the tokens' log-probabilities not yet sent with a delta
        self.produced = self.reasoned = self.held = 0  # held: tokens whose text is not out yet (a split character)

    @property
    def items(self) -> list[dict]:
        return self.response["output"]

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return event

    def start(self) -> list[dict]:
        snapshot = dict(self.response, output=[])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, ev: Event, prompt_len: int) -> list[dict]:
        """One engine event's stream events; the last one ends the response (its usage counts `prompt_len`)."""
        if self.shape is not None and ev.logprobs:
            self.logprobs += self.shape.logprobs(ev.logprobs, ev.tokens)["content"]
        self.produced += len(ev.tokens)
        text, reasoning, calls = self.tools.delta(0, ev.text, ev.finish_reason)[:3] if self.tools else (ev.text, "", [])
        self.held += len(ev.tokens)
        if reasoning or text or calls:  # the held tokens count with the text they completed
            self.reasoned += self.held if reasoning and not (text or calls) else 0
            self.held = 0
        out = self._text(reasoning, "reasoning") if reasoning else []
        out += self._text(text) if text else []
        for delta in calls:
            out += self._call(delta)
        return out + (self._end(ev.finish_reason, prompt_len) if ev.finished else [])

    def error(self, exc) -> dict:
        """The event that ends a stream which cannot go on (`exc`: an errors.APIError): the engine failed, or k3dist's
        own fault."""
        return self._event("error", code=exc.code or "server_error", message=exc.message, param=exc.param)

    def _open(self, kind: str = "message") -> list[dict]:
        """A message (or reasoning) item begun, with its one part."""
        prefix, part, _ = KINDS[kind]
        self.message = {"id": _id(prefix), "type": kind} | ({"role": "assistant"} if kind == "message" else {})
        self.message |= {"summary": []} if kind == "reasoning" else {}
        self.message["status"] = "in_progress"
        added = self._event(
            "response.output_item.added", output_index=len(self.items), item=self.message | {"content": []}
        )
        self.message["content"] = [copy.deepcopy(part)]
        self.items.append(self.message)
        return [added, self._event("response.content_part.added", **self._at(), part=dict(part))]

    def _text(self, text: str, kind: str = "message") -> list[dict]:
        out = [] if self.message is not None and self.message["type"] == kind else self._close("completed")
        out += self._open(kind) if self.message is None else []
        part, word = self.message["content"][0], KINDS[kind][2]
        part["text"] += text
        scored = {"logprobs": self.logprobs} if kind == "message" else {}
        if kind == "message":
            part["logprobs"] += self.logprobs
            self.logprobs = []
        out.append(self._event(f"response.{word}.delta", **self._at(), delta=text, **scored))
        return out

    def _at(self) -> dict:
        return {"item_id": self.message["id"], "output_index": self.items.index(self.message), "content_index": 0}

    def _close(self, status: str) -> list[dict]:
        """The message (or reasoning) being written, ended."""
        if self.message is None:
            return []
        message = self.message["type"] == "message"
        out = self._text("") if self.logprobs and message else []  # the last tokens' log-probabilities, no text
        part, at, word = self.message["content"][0], self._at(), KINDS[self.message["type"]][2]
        scored = {"logprobs": part["logprobs"]} if message else {}
        out.append(self._event(f"response.{word}.done", **at, text=part["text"], **scored))
        out.append(self._event("response.content_part.done", **at, part=part))
        self.message["status"] = status
        out.append(self._event("response.output_item.done", output_index=at["output_index"], item=self.message))
        self.message = None
        return out

    def _call(self, delta: dict) -> list[dict]:
        """A tools.py call delta: the first of a call opens its item, the second carries its whole arguments."""
        if "id" in delta:
            out = self._close("completed")
            item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "arguments": ""}
            item |= {"call_id": delta["id"], "name": delta["function"]["name"]}
            out.append(self._event("response.output_item.added", output_index=len(self.items), item=dict(item)))
            self.items.append(item)
            return out
        item = self.items[-1]
        arguments, at = delta["function"]["arguments"], {"item_id": item["id"], "output_index": len(self.items) - 1}
        item |= {"arguments": arguments, "status": "completed"}
        return [
            self._event("response.function_call_arguments.delta", **at, delta=arguments),
            self._event("response.function_call_arguments.done", **at, name=item["name"], arguments=arguments),
            self._event("response.output_item.done", output_index=at["output_index"], item=item),
        ]

    def _end(self, finish: str, prompt_len: int) -> list[dict]:
        status = "incomplete" if finish == "length" else "completed"
        out = [] if self.items else self._open()  # an answer of no text and no call still has its message
        out += self._close(status)
        usage = {"input_tokens": prompt_len, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}}
        usage |= {"output_tokens": self.produced, "output_tokens_details": {"reasoning_tokens": self.reasoned}}
        usage["total_tokens"] = prompt_len + self.produced
        self.response |= {"status": status, "usage": usage, "completed_at": int(time.time())}
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        return out + [self._event(f"response.{status}", response=self.response)]
