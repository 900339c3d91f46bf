"""Kimi K3's answer format: everything in tags of three markup tokens, `<|open|>NAME attr="v"...<|sep|>` ...
`<|close|>NAME<|sep|>`, the message ended by `<|end_of_msg|>` (generation stops on it).

An assistant message is `<|open|>message role="assistant"<|sep|>`, a think tag (the reasoning), a response tag (the
content), a tools tag holding `<|open|>call tool="NAME" index="N"<|sep|>` tags, then `<|close|>message<|sep|>`. A
call's arguments are one `<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>` per key (a
`string` as it is, any other type as JSON) or one `<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>`.
K3's template opens the think tag in the generation prompt (the response tag without thinking), so the parser starts
where the prompt left the answer (`opening`). It reads every chat answer: the think tag's text is the reasoning, the
rest outside the tools tag the content (openers and closers may be missing, as in a truncated answer); a call that
does not parse is content as written, and so is the whole tools tag when the request makes no calls; text after the
message's end is dropped.
"""

import json
import re
from dataclasses import dataclass

from ..text.tokenizer import MARKUP
from .errors import bad
from .tool_stream import TOOL_INDEX, call_deltas, call_object, held

(OPEN, CLOSE, SEP), END_OF_MESSAGE = MARKUP, "<|end_of_msg|>"
MESSAGE = f'{OPEN}message role="assistant"{SEP}'


def _tags(name: str) -> tuple[str, str]:
    return f"{OPEN}{name}{SEP}", f"{CLOSE}{name}{SEP}"


(THINK, THOUGHT), (RESPONSE, RESPONDED), (TOOLS, TOOLS_END) = _tags("think"), _tags("response"), _tags("tools")
CALL_END, MESSAGE_END = _tags("call")[1], _tags("message")[1]
ENDS = {MESSAGE_END: "done", END_OF_MESSAGE: "done"}
# In each text state, the markers that end it and the state each leads to; the state's text is reasoning in `think`,
# content elsewhere.
MOVES = {
    "start": {MESSAGE: "start", THINK: "think", RESPONSE: "response", TOOLS: "tools"} | ENDS,
    "think": {THOUGHT: "between", RESPONSE: "response", TOOLS: "tools"} | ENDS,
    "response": {RESPONDED: "between", TOOLS: "tools"} | ENDS,
    "between": {THINK: "think", RESPONSE: "response", TOOLS: "tools"} | ENDS,
}
IN_TOOLS = (CALL_END, TOOLS_END, *ENDS)
ATTRS = r'((?:\s+[\w.\-]+="[^"]*")*)\s*'
CALL = re.compile(rf"\s*{re.escape(OPEN)}call{ATTRS}{re.escape(SEP)}")
CHILD = re.compile(rf"\s*{re.escape(OPEN)}(argument|json){ATTRS}{re.escape(SEP)}")
ATTR = re.compile(r'([\w.\-]+)="([^"]*)"')
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
CONSTRAINTS = {"enum", "const", "pattern", "format", "minLength", "maxLength", "anyOf", "oneOf", "allOf"}


@dataclass(frozen=True)
class K3Format:
    """tools.py's ToolFormat for K3's tags."""

    markup: frozenset[int]  # the ids of <|open|>, <|close|>, <|sep|>
    end_of_message: int
    name: str = "kimi_k3"
    always: bool = True  # only the parser can tell the thinking from the response
    refused: tuple[int, ...] = ()  # every answer is written in the markup: tool_choice none reads calls as content
    token_ids: frozenset[int] = frozenset()

    @staticmethod
    def find(tokenizer) -> "K3Format | None":
        """By name among the tokenizer's special tokens; None when any is missing."""
        ids = [tokenizer.special_ids.get(name) for name in (*MARKUP, END_OF_MESSAGE)]
        return None if None in ids else K3Format(frozenset(ids[:3]), ids[3])

    @staticmethod
    def written_in(template: str) -> bool:
        return all(marker in template for marker in (OPEN, CLOSE, END_OF_MESSAGE))

    @property
    def text_ids(self) -> frozenset[int]:
        return self.markup  # a grammar spells the tags out: the markup tokens are their text

    def stream(self, calls: bool, parallel: bool, opened: str, tools=()) -> "K3Stream":
        return K3Stream(calls, parallel, opened, tools)

    def opening(self, tokenizer, prompt_ids) -> str:
        """The state the prompt's last assistant message leaves the answer in: `think` or `response` after K3's
        generation prompt (or inside a message continued with continue_final_message); `start` when the prompt ends
        no assistant message's opening."""
        ids = list(prompt_ids)
        last = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] == self.end_of_message), -1)
        tail = tokenizer.decode(ids[last + 1 :])
        at = tail.rfind(MESSAGE)
        if at < 0:
            return "start"
        reader = K3Stream(False, True, "start")
        reader.feed(tail[at:])
        return reader.state if reader.state != "done" else "start"

    def tag(self, plan, inner, opened: str):
        """The answer as an xgrammar structural tag, from where the prompt left it (free reasoning in an open think
        tag) on: for `required` and a named tool an empty response and one to plan.most calls; for `auto` free
        content, then calls or none; for a structured output (`inner()`, a format) that output as the response. The
        output ends there, on the end-of-message token: the closers after it say nothing the parser needs (it reads
        an answer without them), and each costs tokens. Free text holds no <|open|> or <|close|>; arguments follow
        their tool's schema in K3's argument tags (xgrammar's kimi_k3_xml style), with at most one whitespace
        character where JSON allows any."""
        from xgrammar import structural_tag as st

        if opened not in ("think", "response"):
            param = "tools" if plan is not None else "response_format"
            raise bad(
                "with K3's format a constrained answer starts in the think or response tag K3's generation prompt "
                "opens, and this prompt opens neither (set add_generation_prompt)",
                param,
            )

        def free():
            return st.AnyTextFormat(excludes=[OPEN, CLOSE])

        head = [st.TagFormat(begin="", content=free(), end=THOUGHT + RESPONSE)] if opened == "think" else []
        if plan is None:
            return st.SequenceFormat(elements=[*head, inner()]) if head else inner()
        calls = st.RepeatFormat(min=1, max=plan.most, content=_calls(st, plan.tools))
        if plan.choice == "auto":
            tools = st.OptionalFormat(content=st.SequenceFormat(elements=[st.ConstStringFormat(value=TOOLS), calls]))
            answer = [st.TagFormat(begin="", content=free(), end=RESPONDED), tools]
        else:
            answer = [st.ConstStringFormat(value=RESPONDED + TOOLS), calls]
        return st.SequenceFormat(elements=[*head, *answer])


def _calls(st, functions):
    tags = [
        st.TagFormat(
            begin=f'{OPEN}call tool="{f["name"]}" index="',
            content=st.SequenceFormat(
                elements=[
                    st.RegexFormat(pattern=TOOL_INDEX),
                    st.ConstStringFormat(value='"' + SEP),
                    st.JSONSchemaFormat(
                        json_schema=f.get("parameters") or {"type": "object"},
                        style="kimi_k3_xml",
                        max_whitespace_cnt=1,
                        excludes=list(MARKUP),
                    ),
                ]
            ),
            end=CALL_END,
        )
        for f in functions
    ]
    return tags[0] if len(tags) == 1 else st.OrFormat(elements=tags)


class K3Stream:
    """One choice's answer: text in, (content, reasoning, tool-call deltas) out."""

    def __init__(self, calls: bool, parallel: bool, opened: str, tools=()):
        self.reads_calls, self.parallel = calls, parallel
        self.schemas = {f["name"]: f.get("parameters") or {} for f in tools}  # how each tool's arguments are typed
        self.state = opened if opened in (*MOVES, "tools") else "start"
        self.text = ""  # what is not dealt with yet
        self.calls: list[dict] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        self.text += text
        content, reasoning, deltas = [], [], []
        while self.text and self.state != "done":
            if self.state == "tools":
                if not self._tools(final, content, deltas):
                    break
                continue
            moves = MOVES[self.state]
            found = [(i, m) for m in moves if (i := self.text.find(m)) >= 0]
            at, marker = min(found) if found else (len(self.text) - (0 if final else held(self.text, tuple(moves))), "")
            (reasoning if self.state == "think" else content).append(self.text[:at])
            self.text = self.text[at + len(marker) :]
            if not marker:
                break
            self.state = moves[marker]
            if self.state == "tools" and not self.reads_calls:
                content.append(marker)  # no calls are read: the tools tag is content as written
        if self.state == "done":
            self.text = ""
        return "".join(content), "".join(reasoning), deltas

    def _tools(self, final: bool, content: list, deltas: list) -> bool:
        """One piece of the tools tag dealt with (a call, or the tag's end); False when it waits for more text."""
        found = [(i, m) for m in IN_TOOLS if (i := self.text.find(m)) >= 0]
        if not found and not final:
            return False
        at, marker = min(found) if found else (len(self.text), "")
        piece, self.text = self.text[:at], self.text[at + len(marker) :]
        written = piece + marker if marker == CALL_END else piece
        if piece.strip() or marker == CALL_END:
            call = _call(piece, len(self.calls) + 1, self.schemas) if self.reads_calls else None
            if call is None or (self.calls and not self.parallel):
                content.append(written)
            else:
                deltas += call_deltas(call, len(self.calls))
                self.calls.append(call)
        if marker != CALL_END:
            if marker == TOOLS_END and not self.reads_calls:
                content.append(marker)
            self.state = "between" if marker == TOOLS_END else "done"
        return True


def _attrs(text: str) -> dict[str, str]:
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in ATTR.findall(text)}


def _call(piece: str, position: int, schemas: dict) -> dict | None:
    """A call tag's inside (its closer cut off) as OpenAI's call, or None when it does not parse."""
    head = CALL.match(piece)
    if head is None:
        return None
    attrs = _attrs(head.group(1))
    name, index = attrs.get("tool", ""), attrs.get("index", "")
    if not NAME.fullmatch(name):
        return None
    rest, values, block = piece[head.end() :], {}, None
    properties = (schemas.get(name) or {}).get("properties") or {}
    while rest.strip():
        child = CHILD.match(rest)
        if child is None or block is not None:
            return None
        kind, closer = child.group(1), _tags(child.group(1))[1]
        end = rest.find(closer, child.end())
        if end < 0:
            return None
        value, rest = rest[child.end() : end], rest[end + len(closer) :]
        if kind == "json":
            if values or not _is_object(value):
                return None
            block = value.strip()
            continue
        attrs = _attrs(child.group(2))
        key, kind_of = attrs.get("key"), attrs.get("type")
        if key is None or key in values or (parsed := _value(value, kind_of, properties.get(key))) is _BAD:
            return None
        values[key] = parsed
    arguments = block if block is not None else json.dumps(values, ensure_ascii=False)
    return call_object(name, index if index.isdigit() else position, arguments)


_BAD = object()


def _value(text: str, kind: str | None, schema):
    """An argument's value: a `string` as written, any other type as JSON (no type: JSON if it reads, else text).
    A string the tool's schema constrains (enum, const, pattern, a length, a union) is trimmed: xgrammar's K3
    grammar lets a whitespace character stand on either side of such a value, never of a plain string's."""
    if kind == "string":
        plain = not isinstance(schema, dict) or (schema.get("type") == "string" and not CONSTRAINTS & schema.keys())
        return text if plain else text.strip()
    try:
        return json.loads(text)
    except ValueError:
        return text if kind is None else _BAD


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
