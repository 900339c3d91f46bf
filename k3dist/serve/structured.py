"""Structured outputs with xgrammar: OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs`
(json, regex, choice, grammar) and Kimi's tool-call section, compiled against the checkpoint's vocabulary, and one
matcher per choice for the engine on rank 0 (engine/grammar.py).

The vocabulary xgrammar sees: base tokens as their bytes; Kimi's tool tokens as 0xFF (a byte no UTF-8 text holds)
and their name, so no text grammar ever reaches them and a tool grammar names them by id; every other special token
as special (allowed only where the output may end, as a stop token). JSON is compiled to one layout (`", "` and
`": "`, no other whitespace), so whitespace cannot grow without end and a schema of bounded values ends in a bounded
number of tokens whatever the weights. Compiled grammars are cached by source (xgrammar's cache, `CACHE_BYTES` at
most); compiling runs on worker threads (xgrammar releases the GIL) and one that takes longer than `COMPILE_S`, is
larger than `MAX_SOURCE` characters or is not valid is a 400 naming the field. The engine loop never waits on it.
"""

import json
import re
import threading
from functools import partial

from .errors import APIError, bad
from .tools import ToolPlan, ToolTokens

COMPILE_S = 10.0
COMPILERS = 2  # compiles at once (a hung one keeps its place until it ends: the bound holds anyway)
MAX_SOURCE = 64 * 1024  # characters of a schema, regex, grammar, choice list or tool set
CACHE_BYTES = 64 * 2**20
TOOL_INDEX = r"[0-9]{1,4}"  # a call's number in the conversation, as the model writes it
MAX_CALLS = 16  # tool calls in one answer's section (so even random weights end it)
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class _Matcher:
    """engine/grammar.py's Matcher over xgrammar's."""

    def __init__(self, compiled):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)

    def fill(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)


class Grammars:
    """The xgrammar compiler over one checkpoint's vocabulary (made on first use), and what requests ask of it."""

    def __init__(self, tokenizer, vocab_size: int, tools: ToolTokens | None):
        self.tokenizer, self.vocab_size, self.tools = tokenizer, vocab_size, tools
        self._compiler = None
        self._lock = threading.Lock()
        self._places = threading.BoundedSemaphore(COMPILERS)

    def warm(self) -> None:
        """Make the compiler now (importing xgrammar takes seconds), so the first structured request does not wait;
        a missing xgrammar is said by that request instead."""
        try:
            self.compiler()
        except APIError:
            pass

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                except ImportError:
                    raise bad("structured outputs need xgrammar (pip install 'k3dist[serve]')") from None
                tok, specials = self.tokenizer, set(self.tokenizer.special_ids.values())
                tool_ids = set(self.tools.ids) if self.tools else set()
                vocab = [
                    b"\xff" + tok.decode_bytes([i])
                    if i in tool_ids
                    else b""
                    if i in specials
                    else tok.decode_bytes([i])
                    for i in range(min(tok.vocab_size, self.vocab_size))
                ]
                info = xgrammar.TokenizerInfo(vocab, vocab_size=self.vocab_size, stop_token_ids=list(tok.eos_ids))
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def for_request(self, req, tools: ToolPlan | None):
        """() -> a Matcher for each choice, or None when the request is unconstrained (a 400 for a bad grammar)."""
        fmt = getattr(req, "response_format", None)
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        structured = getattr(req, "structured_outputs", None)
        if fmt is not None and kind not in ("text", "json_object", "json_schema"):
            raise bad(f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format")
        asked = [
            name
            for name, on in (("response_format", kind not in (None, "text")), ("structured_outputs", structured))
            if on
        ]
        if tools is not None and tools.choice != "none":
            asked.append("tools")
        if len(asked) > 1:
            raise bad(f"{' and '.join(asked)} each set the output's form: ask for one", asked[1])
        if not asked:
            return None
        if asked == ["tools"]:
            return self._compiled("tools", partial(self._tools, tools), tools.tools, "tools")
        if asked == ["response_format"]:
            return self._compiled(*_response_format(fmt))
        return self._compiled(*_structured_outputs(structured))

    def _compiled(self, what: str, compile_with, source, param: str):
        size = len(json.dumps(source)) if not isinstance(source, str) else len(source)
        if size > MAX_SOURCE:
            raise bad(f"{param}: the {what} has {size} characters; at most {MAX_SOURCE} are compiled", param)
        compiler, late = self.compiler(), bad(f"{param}: the {what} did not compile within {COMPILE_S:.0f} s", param)
        if not self._places.acquire(timeout=COMPILE_S):
            raise late
        done, result = threading.Event(), {}

        def work():  # a daemon thread: a compile that never ends holds no request and no exit
            try:
                result["compiled"] = compile_with(compiler)
            except Exception as exc:  # xgrammar reports a bad schema, regex or grammar as RuntimeError or ValueError
                result["error"] = exc
            finally:
                self._places.release()
                done.set()

        threading.Thread(target=work, name="k3dist-grammar", daemon=True).start()
        if not done.wait(COMPILE_S):
            raise late
        if "error" in result:
            raise bad(f"{param}: the {what} is not valid: {_reason(result['error'])}", param)
        return partial(_Matcher, result["compiled"])

    def _tools(self, plan: ToolPlan, compiler):
        from xgrammar.structural_tag import StructuralTag

        return compiler.compile_structural_tag(StructuralTag(format=tool_format(plan, self.tools)))


def _response_format(fmt: dict):
    if fmt["type"] == "json_object":
        return "JSON object", _json({"type": "object"}), "", "response_format"
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad("response_format json_schema needs {'name': ..., 'schema': {...}}", "response_format")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict) or not isinstance(spec.get("strict", False), bool | None):
        raise bad("response_format json_schema: schema must be an object and strict a boolean", "response_format")
    return "JSON schema", _json(schema), schema, "response_format"


def _structured_outputs(spec):
    param = "structured_outputs"
    if not isinstance(spec, dict):
        raise bad(f"{param} must be an object with one of {', '.join(STRUCTURED_KEYS)}", param)
    given = [k for k, v in spec.items() if v not in (None, False)]
    unknown = [k for k in given if k not in STRUCTURED_KEYS]
    if unknown:
        raise bad(f"{param}.{unknown[0]} is not supported here (only {', '.join(STRUCTURED_KEYS)})", param)
    if len(given) != 1:
        raise bad(f"{param} takes exactly one of {', '.join(STRUCTURED_KEYS)}, got {given}", param)
    key, value = given[0], spec[given[0]]
    if key == "json_object" and value is True:
        return "JSON object", _json({"type": "object"}), "", param
    if key == "json" and isinstance(value, dict | str):
        return "JSON schema", _json(value), value, param
    if key == "regex" and isinstance(value, str):
        return "regex", lambda c: c.compile_regex(value), value, param
    if key == "grammar" and isinstance(value, str):
        return "grammar", lambda c: c.compile_grammar(value), value, param
    if key == "choice" and isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        rule = "root ::= " + " | ".join(json.dumps(v, ensure_ascii=False) for v in dict.fromkeys(value))
        return "choice", lambda c: c.compile_grammar(rule), value, param
    raise bad(f"{param}.{key}: {value!r:.80} is not a valid value for it", param)


def _json(schema):
    return lambda c: c.compile_json_schema(schema, any_whitespace=False, strict_mode=True)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its timestamp and source position."""
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip())
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)[:300]


def tool_format(plan: ToolPlan, tokens: ToolTokens):
    """Kimi's tool-call section as an xgrammar structural tag: the markers by token id, each call's arguments in its
    tool's schema (compact JSON, as `_json`). `required` and a named tool start with the section; `auto` is free text
    (no tool token in it) until the section's token, after which the calls are constrained. At most MAX_CALLS calls,
    one without parallel_tool_calls or with a named tool; after the section the output can only end."""
    import xgrammar
    from xgrammar import structural_tag as st

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
    calls = st.RepeatFormat(min=1, max=MAX_CALLS if plan.parallel and plan.choice != "named" else 1, content=call)
    if plan.choice == "auto":
        section = st.TagFormat(
            begin=st.TokenFormat(token=tokens.section_begin),
            content=calls,
            end=st.TokenFormat(token=tokens.section_end),
        )
        others = [tokens.section_end, tokens.call_begin, tokens.argument_begin, tokens.call_end]
        return st.TokenTriggeredTagsFormat(
            trigger_tokens=[tokens.section_begin], tags=[section], exclude_tokens=others, stop_after_first=True
        )
    begin, end = st.TokenFormat(token=tokens.section_begin), st.TokenFormat(token=tokens.section_end)
    return st.SequenceFormat(elements=[begin, calls, end])
