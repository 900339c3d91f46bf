"""Kimi's tool calls: the five tokens (found by name in the checkpoint's tokenizer), the request's `tools` and
`tool_choice` checked, and the model's output parsed into OpenAI's `tool_calls`, whole or as stream deltas.

The format: content, then `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`, then `<|tool_calls_section_end|>`. The tool tokens are not
special in Kimi's tokenizer, so they stay in the decoded text, and the parser reads text. It tolerates what engines
met in the wild: the singular section token, a missing section begin or end, a missing call end at the end of the
output, ids without `functions.`. A call that does not parse (no argument marker, an id that is not a name, arguments
that are not JSON) is returned as content, never an error; text after the section ends is dropped.

A whole answer is the stream parser fed the whole text at once, so streamed deltas always add up to it. A call is
sent once it is complete (its end, the next call or the section's end, or the end of the output): a first delta with
its index, id, type and name, then one with its arguments.
"""

import json
import re
from dataclasses import dataclass

from .errors import bad

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
TOKENS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
SECTION_BEGINS = (SECTION_BEGIN, "<|tool_call_section_begin|>")  # the singular one is met in the wild
SECTION_ENDS = (SECTION_END, "<|tool_call_section_end|>")
STARTS = (*SECTION_BEGINS, CALL_BEGIN)  # where content ends and calls begin
CALL_ID = re.compile(r"(?:functions\.)?([\w.\-]+?)(?::(\d+))?")
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolTokens:
    """The ids of Kimi's five tool tokens in this checkpoint's tokenizer."""

    section_begin: int
    section_end: int
    call_begin: int
    argument_begin: int
    call_end: int

    @staticmethod
    def find(tokenizer) -> "ToolTokens | None":
        """By name in the tokenizer's files; None when any is missing (the checkpoint makes no tool calls)."""
        ids = [tokenizer.backend.token_id(name) for name in TOKENS]
        return None if None in ids else ToolTokens(*ids)

    @property
    def ids(self) -> tuple[int, ...]:
        return (self.section_begin, self.section_end, self.call_begin, self.argument_begin, self.call_end)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask for: `choice` none, auto, required or named (then `tools` holds that one)."""

    tools: tuple[dict, ...]  # the function objects ({"name", "parameters", ...}) calls may name
    choice: str
    parallel: bool

    @property
    def calls(self) -> bool:
        return self.choice != "none"


def tool_plan(tools: list | None, tool_choice, parallel: bool, tokens: ToolTokens | None) -> ToolPlan | None:
    """`tools` and `tool_choice` checked (a 400 naming the field otherwise); None when the request has no tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None
    if tokens is None:
        raise bad(
            "this checkpoint's tokenizer has no tool-call tokens (" + ", ".join(TOKENS) + "): it cannot make tool "
            "calls, so requests with tools are refused",
            "tools",
        )
    if len(tools) > MAX_TOOLS:
        raise bad(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise bad(
                f"tools[{i}]: only function tools are served ({{'type': 'function', 'function': {{...}}}})", "tools"
            )
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, got {name!r}", "tools")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if any(f["name"] == name for f in functions):
            raise bad(f"tools[{i}]: two tools are named {name!r}", "tools")
        functions.append(function)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad(
                "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
        named = [f for f in functions if f["name"] == name]
        if not named:
            raise bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolPlan(tuple(named), "named", parallel)
    if choice not in ("none", "auto", "required"):
        raise bad(f"tool_choice must be none, auto, required or a named function, got {choice!r}", "tool_choice")
    return ToolPlan(tuple(functions), choice, parallel)


def _call(head: str, arguments: str, index: int) -> dict | None:
    """One call as OpenAI gives it, or None when it does not parse."""
    m = CALL_ID.fullmatch(head.strip())
    try:
        json.loads(arguments)
    except ValueError:
        return None
    if m is None or not arguments.strip():
        return None
    name, idx = m.group(1), m.group(2)
    call_id = f"functions.{name}:{idx if idx is not None else index}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments.strip()}}


class ToolStream:
    """One choice's output, text in, (content, tool-call deltas) out."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.text = ""
        self.sent = 0  # characters of content sent (before the calls begin)
        self.start: int | None = None  # where the calls begin in the text
        self.pieces = 0  # calls (and what stood in their place) dealt with
        self.calls: list[dict] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += text
        content = ""
        if self.start is None:
            at = [i for m in STARTS if (i := self.text.find(m, self.sent)) >= 0]
            if at:
                self.start = min(at)
                content, self.sent = self.text[self.sent : self.start], self.start
            else:
                end = len(self.text) if final else len(self.text) - _held(self.text[self.sent :])
                content, self.sent = self.text[self.sent : end], end
                return content, []
        more, deltas = self._calls(final)
        return content + more, deltas

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("", final=True)

    def _calls(self, final: bool) -> tuple[str, list[dict]]:
        body = self.text[self.start :]
        for m in SECTION_BEGINS:
            if body.startswith(m):
                body = body[len(m) :]
        ends = [i for m in SECTION_ENDS if (i := body.find(m)) >= 0]
        closed = bool(ends)
        body = body[: min(ends)] if ends else body
        pieces = body.split(CALL_BEGIN)[1:]  # what stands before the first call is dropped, as after the section
        content, deltas = "", []
        while self.pieces < len(pieces):
            piece, last = pieces[self.pieces], self.pieces == len(pieces) - 1
            if last and not (closed or final or CALL_END in piece):
                break
            self.pieces += 1
            written, ended, _ = piece.partition(CALL_END)  # what follows a call's end before the next is dropped
            head, marker, arguments = written.partition(ARGUMENT_BEGIN)
            call = _call(head, arguments, len(self.calls)) if marker else None
            if call is None or (self.calls and not self.parallel):
                content += CALL_BEGIN + written + ended
                continue
            index = len(self.calls)
            self.calls.append(call)
            first = {"index": index, "id": call["id"], "type": "function"}
            deltas.append(first | {"function": {"name": call["function"]["name"], "arguments": ""}})
            deltas.append({"index": index, "function": {"arguments": call["function"]["arguments"]}})
        return content, deltas


def _held(text: str) -> int:
    """How many trailing characters could still become the start of a call marker."""
    for size in range(min(len(text), max(map(len, STARTS)) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in STARTS):
            return size
    return 0


class ToolCalls:
    """The tool-call view of every choice of one chat request."""

    def __init__(self, choices: int, parallel: bool):
        self.streams = [ToolStream(parallel) for _ in range(choices)]

    def delta(self, i: int, text: str, finish: str | None) -> tuple[str, list[dict], str | None]:
        """A streamed event's (content, tool_calls deltas, finish_reason)."""
        stream = self.streams[i]
        content, deltas = stream.feed(text)
        if finish is not None:
            more, last = stream.finish()
            content, deltas = content + more, deltas + last
        return content, deltas, _finish(finish, stream)

    def whole(self, i: int, text: str, finish: str | None) -> tuple[str | None, list[dict], str | None]:
        """A whole choice's (content, tool_calls, finish_reason); content None when there are calls and no text."""
        stream = self.streams[i]
        content, _ = stream.feed(text)
        content += stream.finish()[0]
        return (content or None) if stream.calls else content, list(stream.calls), _finish(finish, stream)


def _finish(finish: str | None, stream: ToolStream) -> str | None:
    return "tool_calls" if finish == "stop" and stream.calls else finish
