"""The sandbox chat templates render in: Jinja's immutable sandbox, bounded in time and in the size of what it builds.

A template is untrusted code, and the sandbox keeps it away from Python's internals but not from the machine's
memory: `{{ 'x' * 10**9 }}` builds a gigabyte in a fraction of a second, and a time limit checked only at calls and
attribute lookups never sees it. So every render has a size bound (`limits.chars`: the longest prompt the slots
could hold, render_chat's `max_chars`), and here
- operations whose result's size follows from their operands are refused before they run past it: repetition
  (`*`), concatenation (`+`, `~`), powers and products of integers, `%` and `str.format` field widths, and any call
  or filter given an integer larger than the bound (padding widths: `center`, `ljust`, `indent`, ...);
- whatever an operator, a call or a filter returns is weighed (strings and bytes by length, containers by their
  items), and so is every value printed, before it becomes text;
- lazy sequences handed to a filter (`join`, `list`, ...) are consumed within the bound, item by item;
- the output is counted as the render yields it (chat.py);
and the time limit (`limits.at`) is checked at every call, attribute, item and operator, so a loop doing anything at
all passes a check (the sandbox's `range()` is bounded too).
"""

import functools
import re
import string
import threading
import time

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_INT_BITS = 2**16  # integers a template computes: far past any count or id, far short of a slow product
limits = threading.local()  # the render running in this thread: .at (its deadline), .chars (its size bound)
_WIDTHS = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")  # printf-style field widths


class RenderTooLarge(jinja2.exceptions.SecurityError):
    """A template tried to build more than its render may hold."""


def _bound() -> int | None:
    return getattr(limits, "chars", None)


def weight(value, limit: int) -> int:
    """About how many characters `value` is as text (strings and bytes by length, containers by their items, an
    integer by its digits), counted no further than just past `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str | bytes):
            total += len(v)
        elif isinstance(v, dict):
            total += len(v) + 1
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple | set | frozenset):
            total += len(v) + 1
            stack.extend(v)
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1  # decimal digits, at most
        else:
            total += 1
    return total


def refuse_over(size: int, what: str) -> None:
    limit = _bound()
    if limit is not None and size > limit:
        raise RenderTooLarge(f"{what} would build about {size} characters, more than the {limit} a prompt may have")


def bounded(value, what: str):
    """`value` if it weighs no more than the render may build."""
    limit = _bound()
    if limit is not None:
        refuse_over(weight(value, limit), what)
    return value


def _check_ints(args, kwargs, what: str) -> None:
    """A call given an integer past the bound is refused: padding widths and counts pass through here."""
    limit = _bound()
    for v in (*args, *kwargs.values()):
        if limit is not None and isinstance(v, int) and not isinstance(v, bool) and v > limit:
            raise RenderTooLarge(f"{what} was given {v}, more than the {limit} characters a prompt may have")


def _check_widths(fmt: str, what: str) -> None:
    """Field widths and precisions written into a format string (`%9999d`, `{:>9999}`) within the bound."""
    specs = [m.group(1) or "" for m in _WIDTHS.finditer(fmt)] + [m.group(2) or "" for m in _WIDTHS.finditer(fmt)]
    try:
        specs += [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
    except ValueError:
        pass  # not a format string: str.format would refuse it anyway
    _check_ints([int(n) for spec in specs for n in re.findall(r"\d+", spec)], {}, what)


def _check_replace(text, old, new, what: str) -> None:
    """str.replace's result, before it is made: every occurrence of `old` (or every gap, for '') becomes `new`."""
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        refuse_over(len(text) + (text.count(old) if old else len(text) + 1) * len(new), what)


def _lazily_bounded(items, what: str):
    """An iterator's items, refused once they weigh more than the render may build."""
    limit, total = _bound(), 0
    for item in items:
        if limit is not None:
            total += weight(item, limit) + 1
            refuse_over(total, what)
        yield item


def bounded_filter(name: str, fn):
    """A filter run within the bound: integer arguments, lazy sequences it consumes, and what it returns."""

    @functools.wraps(fn)  # keeps jinja_pass_arg: the environment or context still comes first where asked for
    def run(*args, **kwargs):
        what = f"the {name!r} filter"
        _check_ints(args, kwargs, what)
        if name == "replace" and len(args) >= 4:
            _check_replace(*args[1:4], what)  # eval_ctx, s, old, new
        args = tuple(_lazily_bounded(a, what) if _is_lazy(a) else a for a in args)
        return bounded(fn(*args, **kwargs), what)

    return run


def _is_lazy(value) -> bool:
    return hasattr(value, "__next__") and not isinstance(value, str | bytes)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code, with `~` joining its operands through the environment's bounded join."""

    def visit_Concat(self, node, frame):
        self.write("environment.concat_bounded((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, **options):
        super().__init__(finalize=self._printed, **options)
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs in one call: no chat template needs it
        self.filters = {name: bounded_filter(name, fn) for name, fn in self.filters.items()}

    def add_filter(self, name: str, fn) -> None:
        self.filters[name] = bounded_filter(name, fn)

    def _check(self):
        at = getattr(limits, "at", None)
        if at is not None and time.monotonic() > at:
            raise jinja2.exceptions.TemplateRuntimeError("rendering took longer than its time limit")

    @staticmethod
    def _printed(value):
        return bounded(value, "a printed value")

    def concat(self, parts):
        """Macro bodies and filter blocks: their output, joined within the bound."""
        return "".join(_lazily_bounded((str(p) for p in parts), "a block's output"))

    def concat_bounded(self, parts):
        refuse_over(sum(weight(p, _bound() or 0) for p in parts), "'~'")
        return "".join(map(str, parts))

    def call_binop(self, context, operator, left, right):
        self._check()
        limit, what = _bound() or 0, f"{operator!r}"
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*" and ints:
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise RenderTooLarge(f"'*' of integers of {left.bit_length()} and {right.bit_length()} bits")
        elif operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and isinstance(seq, str | bytes | list | tuple):
                refuse_over(weight(seq, limit) * max(n, 0), what)
        elif operator == "**" and ints and abs(left) > 1 and right > 0:
            if right * left.bit_length() > MAX_INT_BITS:
                raise RenderTooLarge(f"'**' would make an integer of about {right * left.bit_length()} bits")
        elif operator == "+" and not ints:
            refuse_over(weight(left, limit) + weight(right, limit), what)
        elif operator == "%" and isinstance(left, str):
            _check_widths(left, what)
            _check_ints(right if isinstance(right, tuple) else (right,), {}, what)
        return bounded(super().call_binop(context, operator, left, right), what)

    def call(self, *args, **kwargs):  # (context, callable, *its args, **its kwargs), as the sandbox's own
        self._check()
        obj = getattr(args[1], "__wrapped__", args[1])  # the sandbox wraps str.format in a function of its own
        name, text = getattr(obj, "__name__", "a function"), getattr(obj, "__self__", None)
        what = f"calling {name}"
        _check_ints(args[2:], kwargs, what)
        if isinstance(text, str) and name in ("format", "format_map"):
            _check_widths(text, what)
        elif isinstance(text, str) and name == "replace" and len(args) >= 4:
            _check_replace(text, args[2], args[3], what)
        elif isinstance(text, str) and name == "join" and len(args) >= 3:
            args = (*args[:2], _lazily_bounded(args[2], what), *args[3:])
        return bounded(super().call(*args, **kwargs), what)

    def getattr(self, obj, attribute):
        self._check()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self._check()
        return super().getitem(obj, argument)
