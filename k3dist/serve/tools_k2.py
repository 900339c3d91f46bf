"""Kimi-K2's tool-call format, Kimi-Linear's: five tool tokens, found by name in the checkpoint's tokenizer.

The format: content, then `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`, then `<|tool_calls_section_end|>`. The tool tokens are not
special in Kimi's tokenizer, so they stay in the decoded text, and the parser reads text. It tolerates what engines
met in the wild: the singular section token, a missing section begin or end, a missing call end at the end of the
output, ids without `functions.`. A call that does not parse (no argument marker, an id that is not a name, arguments
that are not JSON) is returned as content; text after the section ends is dropped.
"""

import json
import re
from dataclasses import dataclass

from .tool_stream import TOOL_INDEX, call_deltas, call_object, held

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
TOKENS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
SECTION_BEGINS = (SECTION_BEGIN, "<|tool_call_section_begin|>")  # the singular one is met in the wild
SECTION_ENDS = (SECTION_END, "<|tool_call_section_end|>")
STARTS = (*SECTION_BEGINS, CALL_BEGIN)  # where content ends and calls begin
CALL_ID = re.compile(r"(?:functions\.)?([\w.\-]+?)(?::(\d+))?")


@dataclass(frozen=True)
class ToolTokens:
    """The ids of Kimi's five tool tokens in this checkpoint's tokenizer."""

    section_begin: int
    section_end: int
    call_begin: int
    argument_begin: int
    call_end: int

    @property
    def ids(self) -> tuple[int, ...]:
        return (self.section_begin, self.section_end, self.call_begin, self.argument_begin, self.call_end)


@dataclass(frozen=True)
class K2Format:
    """tools.py's ToolFormat for Kimi-K2's tool tokens."""

    tokens: ToolTokens
    name: str = "kimi_k2"
    always: bool = False  # an answer without calls is plain text

    @staticmethod
    def find(tokenizer) -> "K2Format | None":
        """By name in the tokenizer's files; None when any is missing."""
        ids = [tokenizer.backend.token_id(name) for name in TOKENS]
        return None if None in ids else K2Format(ToolTokens(*ids))

    @staticmethod
    def written_in(template: str) -> bool:
        return SECTION_BEGIN in template or CALL_BEGIN in template

    @property
    def refused(self) -> tuple[int, ...]:
        return self.tokens.ids

    @property
    def token_ids(self) -> frozenset[int]:
        return frozenset(self.tokens.ids)

    @property
    def text_ids(self) -> frozenset[int]:
        return frozenset()

    def stream(self, calls: bool, parallel: bool, opened: str, tools=()) -> "K2Stream":
        return K2Stream(parallel)

    def opening(self, tokenizer, prompt_ids) -> str:
        return "response"  # the answer's text starts where the prompt ends

    def tag(self, plan, inner, opened: str):
        """The calls as an xgrammar structural tag: the markers by token id, each call's arguments in its tool's
        schema (compact JSON, as structured.py's). `required` and a named tool start with the section; `auto` is free
        text (no tool token in it) until the section's token, after which the calls are constrained. At most
        plan.most calls; after the section the output can only end. A structured output (`inner`) is compiled
        alone."""
        if plan is None:
            return None
        import xgrammar
        from xgrammar import structural_tag as st

        tokens = self.tokens

        def arguments(function: dict):
            schema = function.get("parameters") or {"type": "object"}
            return st.GrammarFormat(grammar=str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)))

        heads = [
            st.SequenceFormat(
                elements=[
                    st.ConstStringFormat(value=f"functions.{f['name']}:"),
                    st.RegexFormat(pattern=TOOL_INDEX),
                    st.TokenFormat(token=tokens.argument_begin),
                    arguments(f),
                ]
            )
            for f in plan.tools
        ]
        call = st.TagFormat(
            begin=st.TokenFormat(token=tokens.call_begin),
            content=heads[0] if len(heads) == 1 else st.OrFormat(elements=heads),
            end=st.TokenFormat(token=tokens.call_end),
        )
        calls = st.RepeatFormat(min=1, max=plan.most, content=call)
        begin, end = st.TokenFormat(token=tokens.section_begin), st.TokenFormat(token=tokens.section_end)
        if plan.choice == "auto":
            section = st.TagFormat(begin=begin, content=calls, end=end)
            others = [tokens.section_end, tokens.call_begin, tokens.argument_begin, tokens.call_end]
            return st.TokenTriggeredTagsFormat(
                trigger_tokens=[tokens.section_begin], tags=[section], exclude_tokens=others, stop_after_first=True
            )
        return st.SequenceFormat(elements=[begin, calls, end])


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
    return call_object(name, idx if idx is not None else index, arguments.strip())


class K2Stream:
    """One choice's output, text in, (content, reasoning, tool-call deltas) out; K2 writes no reasoning apart."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.text = ""
        self.sent = 0  # characters of content sent (before the calls begin)
        self.start: int | None = None  # where the calls begin in the text
        self.pieces = 0  # calls (and what stood in their place) dealt with
        self.calls: list[dict] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        self.text += text
        content = ""
        if self.start is None:
            at = [i for m in STARTS if (i := self.text.find(m, self.sent)) >= 0]
            if at:
                self.start = min(at)
                content, self.sent = self.text[self.sent : self.start], self.start
            else:
                end = len(self.text) if final else len(self.text) - held(self.text[self.sent :], STARTS)
                content, self.sent = self.text[self.sent : end], end
                return content, "", []
        more, deltas = self._calls(final)
        return content + more, "", deltas

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
            deltas += call_deltas(call, len(self.calls))
            self.calls.append(call)
        return content, deltas
