"""Tool calls: the checkpoint's chat format (chosen once, from its tokenizer's special tokens and its template), the
request's `tools` and `tool_choice` checked, and each choice's output read into OpenAI's content, reasoning and
`tool_calls`, whole or as stream deltas.

Two formats implement one interface (ToolFormat), docs/tool-calls.md sets them side by side:
- `kimi_k2` (tools_k2.py), Kimi-Linear's: calls in a section of five tool tokens after the content, arguments as
  JSON; the parser runs when a request may make calls.
- `kimi_k3` (tools_k3.py), K3's: the whole answer in tags (thinking, response, tools), arguments one tag per key; the
  parser runs on every chat answer, as only it can tell the thinking from the response.

Rendering is the checkpoint's template's job; a format parses (whole, and streamed with deltas that add up to the
whole: the whole is the stream parser fed the whole text at once), says how its calls are constrained for `required`
and a named tool (structured.py compiles it with xgrammar) and names its calls' ids. A call that does not parse is
returned as content, never an error. A call is sent once it is complete: a first delta with its index, id, type and
name, then one with its whole arguments.
"""

import re
from dataclasses import dataclass
from typing import Protocol

from .errors import bad
from .tools_k2 import TOKENS, K2Format
from .tools_k3 import MARKUP, K3Format

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128
MAX_CALLS = 16  # tool calls in one answer under a grammar (so even random weights end it)
FORMATS = (K2Format, K3Format)  # when a tokenizer holds both, the one the template is written in; else the first
__all__ = ["TOKENS", "ToolFormat", "ToolPlan", "ToolCalls", "tool_plan", "chat_format"]


class Stream(Protocol):
    calls: list[dict]

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """More of the output: (content, reasoning, call deltas) newly known."""


class ToolFormat(Protocol):
    """How a checkpoint's answers are written: one value per checkpoint, chosen by `chat_format`."""

    name: str
    always: bool  # every chat answer is read by the parser (K3's tags), not only one that may make calls
    refused: tuple[int, ...]  # ids that cannot appear under tool_choice none (biased to -inf)
    token_ids: frozenset[int]  # ids a grammar names by id only (no text grammar reaches them)
    text_ids: frozenset[int]  # special ids a grammar reads as their text (K3's markup)

    def stream(self, calls: bool, parallel: bool, opened: str, tools: tuple[dict, ...] = ()) -> Stream:
        """A parser of one choice's output; `calls`: tool calls are read (else their text is content); `opened`:
        where the prompt left the answer (`opening`); `tools`: the function objects calls may name."""

    def opening(self, tokenizer, prompt_ids) -> str:
        """Where the prompt leaves the answer: in K3's think or response tag, or at a new message ("start")."""

    def tag(self, plan: "ToolPlan | None", inner, opened: str):
        """An xgrammar structural-tag format for the answer: the calls `plan` asks for, or `inner` (a structured
        output's format) where the answer's text goes; None where `inner` is compiled alone."""


def chat_format(tokenizer, template: str | None = None) -> ToolFormat | None:
    """The checkpoint's format: the one whose tokens its tokenizer holds (the one its template is written in, when
    it holds both); None when it holds neither (it makes no tool calls)."""
    found = [f for kind in FORMATS if tokenizer is not None and (f := kind.find(tokenizer)) is not None]
    written = [f for f in found if template is not None and f.written_in(template)]
    return (written or found or [None])[0]


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask for: `choice` none, auto, required or named (then `tools` holds that one)."""

    tools: tuple[dict, ...]  # the function objects ({"name", "parameters", ...}) calls may name
    choice: str
    parallel: bool

    @property
    def calls(self) -> bool:
        return self.choice != "none"

    @property
    def most(self) -> int:
        """The most calls one answer holds under a grammar."""
        return MAX_CALLS if self.parallel and self.choice != "named" else 1


def tool_plan(tools: list | None, tool_choice, parallel: bool, form: ToolFormat | None) -> ToolPlan | None:
    """`tools` and `tool_choice` checked (a 400 naming the field otherwise); None when the request has no tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None
    if form is None:
        raise bad(
            f"this checkpoint's tokenizer has no tool-call tokens (neither Kimi's {', '.join(TOKENS)} nor K3's "
            f"{', '.join(MARKUP)}): it cannot make tool calls, so requests with tools are refused",
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


class ToolCalls:
    """The parsed view of every choice of one chat request: content, reasoning and tool calls."""

    def __init__(self, form: ToolFormat, choices: int, calls: bool, parallel: bool, opened: str, tools=()):
        self.streams = [form.stream(calls, parallel, opened, tools) for _ in range(choices)]

    @staticmethod
    def of(form: ToolFormat | None, plan: ToolPlan | None, choices: int, opened: str) -> "ToolCalls | None":
        """The view a request's answers need; None where they are taken as they are (K2's without calls)."""
        calls = plan is not None and plan.calls
        if form is None or not (calls or form.always):
            return None
        parallel, tools = (plan.parallel, plan.tools) if plan is not None else (True, ())
        return ToolCalls(form, choices, calls, parallel, opened, tools)

    def delta(self, i: int, text: str, finish: str | None) -> tuple[str, str, list[dict], str | None]:
        """A streamed event's (content, reasoning, tool_calls deltas, finish_reason)."""
        stream = self.streams[i]
        content, reasoning, deltas = stream.feed(text, final=finish is not None)
        return content, reasoning, deltas, _finish(finish, stream)

    def whole(self, i: int, text: str, finish: str | None) -> tuple[str | None, str, list[dict], str | None]:
        """A whole choice's (content, reasoning, tool_calls, finish_reason); content None when there are calls and
        no text."""
        stream = self.streams[i]
        content, reasoning, _ = stream.feed(text, final=True)
        return (content or None) if stream.calls else content, reasoning, list(stream.calls), _finish(finish, stream)


def _finish(finish: str | None, stream: Stream) -> str | None:
    return "tool_calls" if finish == "stop" and stream.calls else finish
