"""A Responses API request as the chat request it is, so that it takes chat's whole way (fields.py's checks and
sampling, the checkpoint's template, tool calls, grammars, flow.py): `instructions` a system message first, then a
previous response's conversation (`previous_response_id`), then `input`'s items as chat messages; `tools` and
`tool_choice` in chat's shape; `text.format` as `response_format`; `max_output_tokens` as `max_completion_tokens`;
`top_logprobs` with `include: ["message.output_text.logprobs"]` as `logprobs`. A refusal chat would word with its
own field names is renamed to the Responses field (RENAMED).

Items become messages as a conversation reads: a message item its role's message (input_text and output_text parts
as text parts); a `function_call` item a call of the assistant message before it (an assistant message item, or
calls of the same turn), or of a new assistant message; a `function_call_output` item a `tool` message answering its
`call_id`; a `reasoning` item the reasoning_content of the assistant turn it begins. An answer's output items read
back the same way, so a conversation continued by `previous_response_id` renders to the ids the client's own copy of
it would.
"""

import re

from pydantic import ValidationError

from .errors import APIError, bad
from .fields import refuse_unserved
from .protocol import refusal
from .responses_schema import LOGPROBS, REASONING, ResponsesRequest
from .schema import NOT_SERVED, ChatRequest, Generating

RENAMED = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "logprobs": "top_logprobs",
}
WORDS = re.compile(r"\b(messages|max_completion_tokens|max_tokens|response_format)\b")
SHARED = tuple(Generating.model_fields)  # the fields chat takes as they are


def renamed(exc: APIError) -> APIError:
    """A chat refusal named by the Responses request's field, in `param` and in its message."""
    message = WORDS.sub(lambda m: RENAMED[m.group(0)], exc.message)
    return APIError(exc.status, message, RENAMED.get(exc.param, exc.param), exc.code, exc.retry_after)


def refuse_unhonoured(req: ResponsesRequest) -> None:
    """The Responses fields chat has no counterpart of, refused with a 400 naming them where they ask for what is not
    served."""
    refuse_unserved(req)
    reasoning = req.reasoning
    if reasoning is not None and reasoning.effort not in (None, "none"):
        raise bad(f"reasoning.effort={reasoning.effort!r}: reasoning " + NOT_SERVED, "reasoning")
    if reasoning is not None and (reasoning.summary or reasoning.generate_summary):
        raise bad("reasoning summaries are " + NOT_SERVED + " (reasoning the model writes comes whole)", "reasoning")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise bad(f"text.verbosity={req.text.verbosity!r} " + NOT_SERVED + " (medium, the default, is)", "text")
    for entry in req.include or ():
        if entry not in (LOGPROBS, REASONING):
            raise bad(f"include {entry!r}: built-in tools and images are " + NOT_SERVED, "include")
    if req.top_logprobs and LOGPROBS not in (req.include or ()):
        raise bad(f"top_logprobs needs include: [{LOGPROBS!r}]", "top_logprobs")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise bad("stream_options.include_obfuscation " + NOT_SERVED, "stream_options")


def chat_request(req: ResponsesRequest, conversation: list[dict], thinks: bool = False) -> ChatRequest:
    """The chat request `req` is: its instructions, then `conversation` (a stored response's messages, if it
    continues one, and its input's: input_messages). `thinks`: the checkpoint's template reads `thinking` (K3's),
    which `reasoning.effort` none turns off."""
    refuse_unhonoured(req)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body = req.model_dump(include=set(SHARED), exclude_unset=True, by_alias=True)
    body["messages"] = system + conversation
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if LOGPROBS in (req.include or ()):
        body |= {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": {k: t[k] for k in t if k != "type"}} for t in req.tools]
    if req.tool_choice is not None and (req.tools or req.tool_choice not in ("auto", "none")):
        body["tool_choice"] = _tool_choice(req.tool_choice)  # auto or none without tools asks for nothing
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.text is not None and req.text.format is not None:
        body["response_format"] = _response_format(req.text.format.model_dump(by_alias=True, exclude_none=True))
    if thinks and req.reasoning is not None and req.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"thinking": False}
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise renamed(refusal(exc)) from None


def input_messages(req: ResponsesRequest) -> list[dict]:
    return [{"role": "user", "content": req.input}] if isinstance(req.input, str) else messages_of(req.input)


def messages_of(items: list[dict]) -> list[dict]:
    """Items (checked by responses_schema.py) as chat messages: a reasoning item begins an assistant turn (its
    reasoning_content) that the assistant message and function_call items after it complete."""
    out: list[dict] = []
    turn: dict | None = None  # the assistant message a function_call item joins
    for item in items:
        kind = item.get("type")
        if kind == "reasoning":
            thought = "".join(part["text"] for part in item["content"])
            turn = {"role": "assistant", "content": "", "reasoning_content": thought}
            out.append(turn)
        elif kind == "function_call":
            if turn is None:
                turn = {"role": "assistant"}
                out.append(turn)
            call = {"name": item["name"], "arguments": item["arguments"]}
            turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": call})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
            turn = None
        elif item["role"] == "assistant" and turn is not None and not turn.get("content") and "tool_calls" not in turn:
            turn["content"] = _text(item["content"])  # the message after its reasoning
        else:
            out.append({"role": item["role"], "content": _text(item["content"])})
            turn = out[-1] if item["role"] == "assistant" else None
    return out


def _text(content):
    """A text as it is; parts (input_text, output_text) as chat's text parts."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part["text"]} for part in content]


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function" and set(choice) == {"type", "name"} and isinstance(choice["name"], str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools":
        raise bad("tool_choice allowed_tools " + NOT_SERVED + ": send the tools allowed", "tool_choice")
    raise bad(
        f"tool_choice must be none, auto, required or {{'type': 'function', 'name': ...}}; {kind!r:.40} is not served",
        "tool_choice",
    )


def _response_format(fmt: dict) -> dict:
    if fmt["type"] != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}
