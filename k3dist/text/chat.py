"""Chat templates: the checkpoint's own template, rendered in a sandbox set up the way transformers sets up its own.

The template is untrusted code from the model dir, so it runs in Jinja's immutable sandbox, bounded in time and in
the size of what it builds (sandbox.py), sees only plain JSON data, and every way it can fail (syntax,
`raise_exception`, undefined names, type errors, a render too long or too large) is one K3Error line naming the
template's file and line. The environment offers what chat templates written for transformers rely on:
trim_blocks/lstrip_blocks, loop controls, `{% generation %}`, a `tojson` that keeps non-ASCII text and takes
indent/separators/sort_keys, `raise_exception`, `strftime_now`, `dict` and an underscore-refusing `namespace`.
"""

import json
import re
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.meta
from jinja2.ext import Extension, loopcontrols
from jinja2.utils import Namespace

from ..base.errors import K3Error
from ..base.files import optional_file, read_json_object, read_text
from .sandbox import BoundedSandbox, RenderTooLarge, limits

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# A role is written verbatim into the turn header, so only plain names count as roles.
ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is the one chat templates read
RENDER_LIMIT_S = 10.0  # a chat render that takes longer is stopped
RENDER_MAX_CHARS = 2**24  # what a render may build where the caller names no bound (it names the prompt's)


def load_chat_template(model_dir: str | Path) -> tuple[str, str] | None:
    """(template text, the file it came from): chat_template.jinja, else tokenizer_config.json's chat_template."""
    model_dir = Path(model_dir)
    if path := optional_file(model_dir, TEMPLATE_FILE, "the chat template"):
        return read_text(path), str(path)
    path = optional_file(model_dir, TOKENIZER_CONFIG, "the tokenizer config")
    template = read_json_object(path).get("chat_template") if path else None
    if template is None:
        return None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise K3Error(f"{path}: chat_template lists templates {sorted(map(str, named))} but none named 'default'")
        template = named["default"]
    if not isinstance(template, str):
        raise K3Error(f"{path}: chat_template must be a template text or a list of named templates")
    return template, str(path)


def render_chat(
    template: str,
    source: str,
    messages: list[dict],
    tools: list | None = None,
    add_generation_prompt: bool = True,
    time_limit_s: float = RENDER_LIMIT_S,
    max_chars: int = RENDER_MAX_CHARS,
    *,
    documents: list | None = None,
    variables: dict | None = None,
    continue_final: bool = False,
    **special,
) -> str:
    """The prompt text for `messages`, as transformers' apply_chat_template(..., tokenize=False) renders it.

    `special` holds the template variables transformers passes from the tokenizer (bos_token, eos_token, ...);
    `variables` more of them (a request's chat_template_kwargs), `documents` its documents. `continue_final`: the
    text ends where the last message's text does (its turn left open for the model to continue, as transformers'
    continue_final_message). Rendering stops with an error after `time_limit_s` (a template looping over hostile
    input never hangs a rank) or once it would build more than `max_chars` characters, in any value or in its output
    (sandbox.py).
    """
    if problem := messages_problem(messages):
        raise K3Error(f"chat messages: {problem}")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise K3Error(f"chat tools must be a list of JSON objects (function schemas), got {_kind(tools)}")
    try:
        plain = {"messages": messages, "tools": tools, "documents": documents, "special": special | (variables or {})}
        data = json.loads(json.dumps(plain))
    except (TypeError, ValueError) as exc:
        raise K3Error(f"chat messages, tools and template variables must be plain JSON data ({exc})") from None
    chat = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in data["messages"]]
    compiled = _compile(template, source)
    limits.at, limits.chars = time.monotonic() + time_limit_s, max_chars
    try:
        args = dict(messages=chat, tools=data["tools"], documents=data["documents"])
        out, size = [], 0
        for piece in compiled.generate(**data["special"], **args, add_generation_prompt=add_generation_prompt):
            size += len(piece)
            if size > max_chars:
                raise RenderTooLarge(f"the rendered prompt passes {max_chars} characters, the most a prompt may have")
            out.append(piece)
        text = "".join(out)
    except Exception as exc:  # anything the template does wrong is the template's error, reported in one line
        cause = exc.message if isinstance(exc, jinja2.TemplateError) and exc.message else f"{type(exc).__name__}: {exc}"
        raise K3Error(f"{_where(source, _template_line(exc))} chat template failed: {cause}") from None
    finally:
        limits.at = limits.chars = None
    return _left_open(text, chat[-1]) if continue_final else text


def _left_open(text: str, last: dict) -> str:
    """The render cut right after the last message's text, as transformers cuts it for continue_final_message."""
    content = last.get("content")
    if isinstance(content, list):
        content = next((part["text"] for part in reversed(content) if "text" in part), None)
    if not isinstance(content, str) or content.strip() not in text:
        raise K3Error("continue_final_message: the last message's text does not appear in the rendered chat")
    at = text.rindex(content.strip())
    kept = content.lstrip() if text[at : at + len(content.lstrip())] == content.lstrip() else content.strip()
    return text[: at + len(kept)]


def template_variables(template: str, source: str) -> frozenset[str]:
    """The variables a template reads from its context (what a request's chat_template_kwargs or documents can
    change; any other is refused rather than dropped)."""
    return _variables(template, source)


@lru_cache(maxsize=16)
def _variables(template: str, source: str) -> frozenset[str]:
    _compile(template, source)  # a syntax error is said once, as a render would say it
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))


def _with_reasoning_aliases(message: dict) -> dict:
    """A message's reasoning under every name templates read it by, as transformers passes it.

    Keys whose value is null were dropped before (templates treat a missing key better than a literal None).
    """
    reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def messages_problem(messages) -> str | None:
    """What is wrong with a chat (None when it is a list of {"role": name, "content": text or parts} objects).

    An unknown role is one that is not a plain name: it is not a string, is empty, or holds anything but letters,
    digits, `_`, `.`, `-` (the role is printed into the turn header, where `<|...|>` or a newline would forge a
    turn). Any named role is otherwise fine: Kimi renders every role but user and assistant as a system turn, and a
    template that refuses a role says so through raise_exception.
    """
    if not isinstance(messages, list):
        return f"must be a list of {{role, content}} objects, got {_kind(messages)}"
    if not messages:
        return "the list of messages is empty"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] must be a {{role, content}} object, got {_kind(message)}"
        role = message.get("role")
        if not isinstance(role, str) or not ROLE.fullmatch(role):
            return f"messages[{i}] has unknown role {role!r}: a role is a name such as user, assistant, system, tool"
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            return f"messages[{i}] ({role}) has no content"
        if content is not None and not isinstance(content, str | list):
            return f"messages[{i}] ({role}) content must be a text or a list of content parts, got {_kind(content)}"
        if isinstance(content, list) and not all(isinstance(part, dict) for part in content):
            return f"messages[{i}] ({role}) content parts must be objects such as {{'type': 'text', 'text': ...}}"
    return None


def _kind(value) -> str:
    name = type(value).__name__
    return "null" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _where(source: str, line: int | None) -> str:
    if line is None:
        return f"{source}:"
    return f"{source}:{line}:" if source.endswith(".jinja") else f"{source}: chat_template line {line}:"


def _template_line(exc: BaseException) -> int | None:
    """The template line being rendered when `exc` was raised (Jinja maps template frames to "<template>")."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line or getattr(exc, "lineno", None)


@lru_cache(maxsize=16)
def _compile(template: str, source: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise K3Error(f"{_where(source, exc.lineno)} chat template syntax error: {exc.message}") from None
    except (jinja2.TemplateError, RecursionError, MemoryError) as exc:
        raise K3Error(f"{source}: chat template does not compile ({type(exc).__name__}: {exc})") from None


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders as is."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Namespace(Namespace):
    """`namespace()` whose attribute names may not start with `_` (no way near Python's internals)."""

    def __init__(*args, **kwargs):  # Jinja's own signature trick, so namespace(self=...) still works
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _refuse_private(name)
        Namespace.__init__(args[0], attrs)

    def __setitem__(self, name, value):
        _refuse_private(name)
        Namespace.__setitem__(self, name, value)


def _refuse_private(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, keys, value=None):
        return dict.fromkeys(keys, value)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> BoundedSandbox:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.add_filter("tojson", _tojson)
    env.globals |= {"raise_exception": _raise_exception, "strftime_now": _strftime_now}
    env.globals |= {"dict": _Dict(), "namespace": _Namespace}
    return env
