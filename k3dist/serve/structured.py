"""Structured outputs with xgrammar: OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs`
(json, regex, choice, grammar) and the checkpoint's tool calls (tools.py's format), compiled against the
checkpoint's vocabulary, and one matcher per choice for the engine on rank 0 (engine/grammar.py).

The vocabulary xgrammar sees: base tokens as their bytes; Kimi-K2's tool tokens as 0xFF (a byte no UTF-8 text
holds) and their name, so no text grammar ever reaches them and a tool grammar names them by id; K3's markup tokens
as their text, so K3's grammars spell its tags out; every other special token as special (allowed only where the
output may end, as a stop token). JSON is compiled to one layout (`", "` and `": "`, no other whitespace), so
whitespace cannot grow without end and a schema of bounded values ends in a bounded number of tokens whatever the
weights. A chat's structured output under K3's format goes where K3 writes its answer: after the thinking, in the
response tag (tools_k3.py's `tag`). Compiled grammars are cached by source (xgrammar's cache, `CACHE_BYTES` at
most); compiling runs on worker threads (xgrammar releases the GIL) and one that takes longer than `COMPILE_S`, is
larger than `MAX_SOURCE` characters or is not valid is a 400 naming the field. The engine loop never waits on it.
"""

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from .errors import APIError, bad
from .tools import ToolFormat, ToolPlan

COMPILE_S = 10.0
COMPILERS = 2  # compiles at once (a hung one keeps its place until it ends: the bound holds anyway)
MAX_SOURCE = 64 * 1024  # characters of a schema, regex, grammar, choice list or tool set
CACHE_BYTES = 64 * 2**20
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class Ask:
    """What a request's output must be, checked but not compiled yet."""

    what: str  # "JSON schema", "regex", ..., "tools"
    source: object  # what the client sent, sized against MAX_SOURCE
    param: str  # the request field a refusal names
    plain: Callable | None = None  # compiler -> compiled grammar, for the output alone
    inner: Callable | None = None  # () -> the same as an xgrammar structural-tag format (a K3 chat's response)
    tools: ToolPlan | None = None


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

    def __init__(self, tokenizer, vocab_size: int, form: ToolFormat | None):
        self.tokenizer, self.vocab_size, self.form = tokenizer, vocab_size, form
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
                    need = "structured outputs need xgrammar (pip install 'k3dist[serve]')"
                    raise bad(need, "response_format") from None
                tok, form = self.tokenizer, self.form
                tool_ids, text_ids = (form.token_ids, form.text_ids) if form else (frozenset(), frozenset())
                specials = set(self.tokenizer.special_ids.values()) - text_ids
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

    def ask(self, response_format, structured_outputs, tools: ToolPlan | None) -> Ask | None:
        """What the request asks its output to be (None: nothing), each field checked (a 400 naming the first bad
        one). `response_format`, `structured_outputs`: the request's (schema.py's models) or None."""
        fmt = response_format.model_dump(by_alias=True, exclude_unset=True) if response_format is not None else None
        kind = fmt["type"] if fmt is not None else None
        structured = structured_outputs.model_dump(by_alias=True, exclude_unset=True) if structured_outputs else None
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
            return Ask("tools", tools.tools, "tools", tools=tools)
        return _response_format(fmt) if asked == ["response_format"] else _structured_outputs(structured)

    def compile(self, ask: Ask, form: ToolFormat | None = None, opened: str = "response"):
        """() -> a Matcher for each choice (a 400 for a grammar xgrammar refuses). `form`: a chat's format, which
        places the output in its answer (`opened`: where the prompt left it); None for completions."""

        def compile_with(compiler):
            built = None if form is None else form.tag(ask.tools, ask.inner, opened)
            if built is None:
                return ask.plain(compiler)  # a structured output first in the answer: compiled alone
            from xgrammar.structural_tag import StructuralTag

            return compiler.compile_structural_tag(StructuralTag(format=built))

        return self._compiled(ask.what, compile_with, ask.source, ask.param)

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
            if isinstance(result["error"], APIError):
                raise result["error"]
            raise bad(f"{param}: the {what} is not valid: {_reason(result['error'])}", param)
        return partial(_Matcher, result["compiled"])


def _response_format(fmt: dict) -> Ask:
    if fmt["type"] == "json_object":
        return _json("JSON object", {"type": "object"}, "", "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad("response_format json_schema needs {'name': ..., 'schema': {...}}", "response_format")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict) or not isinstance(spec.get("strict", False), bool | None):
        raise bad("response_format json_schema: schema must be an object and strict a boolean", "response_format")
    return _json("JSON schema", schema, schema, "response_format")


def _structured_outputs(spec) -> Ask:
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
        return _json("JSON object", {"type": "object"}, "", param)
    if key == "json" and isinstance(value, dict | str):
        return _json("JSON schema", value, value, param)
    if key == "regex" and isinstance(value, str):
        return Ask("regex", value, param, lambda c: c.compile_regex(value), partial(_format, "RegexFormat", value))
    if key == "grammar" and isinstance(value, str):
        inner = partial(_format, "GrammarFormat", value)
        return Ask("grammar", value, param, lambda c: c.compile_grammar(value), inner)
    if key == "choice" and isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        rule = "root ::= " + " | ".join(json.dumps(v, ensure_ascii=False) for v in dict.fromkeys(value))
        return Ask("choice", value, param, lambda c: c.compile_grammar(rule), partial(_format, "GrammarFormat", rule))
    raise bad(f"{param}.{key}: {value!r:.80} is not a valid value for it", param)


def _json(what: str, schema, source, param: str) -> Ask:
    def plain(compiler):
        return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)

    def inner():
        import xgrammar

        text = schema if isinstance(schema, str) else json.dumps(schema)
        grammar = xgrammar.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        return _format("GrammarFormat", str(grammar))

    return Ask(what, source, param, plain, inner)


def _format(kind: str, text: str):
    """A regex or an EBNF grammar as a piece of a structural tag."""
    from xgrammar import structural_tag as st

    return st.RegexFormat(pattern=text) if kind == "RegexFormat" else st.GrammarFormat(grammar=text)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its timestamp and source position."""
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip())
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)[:300]
