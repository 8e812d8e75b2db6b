"""The sandbox chat templates render in: Jinja's immutable sandbox, bounded in time and size.

A chat template comes from a model's files: it is untrusted code, and Jinja's sandbox keeps it from
reaching Python's internals but not from looping for ever or building a gigabyte of text. Here a
render runs under `Limits` (a deadline and a size), and fails with `RenderTimeout` or `TooBig`:

  time  checked at each item of a `{% for %}`, at each test, and wherever a size is checked (below),
        so between two checks runs one operation on values the size limit bounds. The slowest of
        those are filters that run Python per item, such as groupby on the longest list the limit
        allows; striptags, quadratic, is refused on long texts. (A trace function would stop even
        those, but it costs a Python call per line and per call: several times the render itself.)
        It works in any thread: the limits live in a ContextVar.
  size  no value the template builds, nor its output, may be longer than the limit plus
        _INPUT_REPEATS times the size of the inputs. A size is about len(str(value)) (see _size):
        strings by length, ints by digits, containers by their items, counted deeply. It is checked
        before the value is built where an operator could make it huge ('a' * 10**9, 2 ** 10**9,
        '%1000000000s' % x, '{:>1000000000}'.format(x), `~`, `{{ value }}`, the int arguments of str
        methods and of the center/indent/batch/slice/tojson filters), and once it is built everywhere
        else (calls, filters, list/tuple/dict literals), so that nothing grows by repetition or
        nesting, e.g. `{% set ns.s = ns.s ~ ns.s %}` in a loop. `range` keeps the sandbox's 100,000
        items. Compiling folds only what the source spells out (see _LIMITS); chat_template.py
        refuses sources over MAX_TEMPLATE_CHARS.

Not bounded before the fact are the string operations that multiply two bounded sizes, such as
s.replace('', t) or t.join(items): their result is checked once built.
"""

from __future__ import annotations

import functools
import re
import string
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any, TypeVar

import jinja2
import jinja2.filters
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import soft_str

T = TypeVar("T")

RENDER_TIMEOUT_S = 1.0  # a render that runs longer fails
MAX_RENDER_CHARS = 1_000_000  # the template's own allowance for any one value and for its output
# On top of MAX_RENDER_CHARS a render may use its inputs this many times over (tools as JSON, content
# as reasoning and as text, ...), so that a long conversation is never taken for an attack.
_INPUT_REPEATS = 4
# Compiling is not timed: it takes a few microseconds a character, which this bounds (Hub templates
# are tens of thousands of characters at most).
MAX_TEMPLATE_CHARS = 200_000


class RenderTimeout(BaseException):
    """The render passed its deadline. A BaseException, so that no `except Exception` on its way out
    (Jinja's own, or a filter's) swallows it."""


class TooBig(Exception):
    """A value the template builds, or its output, would be longer than the render's limit."""


class Limits:
    """A render's deadline and size limit. The limit starts at `max_chars`; the first size to pass it
    raises it, once, by _INPUT_REPEATS times the size of the inputs (measuring them costs about as
    much as rendering a short conversation, so only a render that needs it does)."""

    def __init__(self, timeout_s: float, max_chars: int, inputs: Any) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.max_chars = max_chars
        self._inputs = inputs

    def __enter__(self) -> None:  # the limits of the checks that Jinja calls in this thread, until __exit__
        self._token = _LIMITS.set(self)

    def __exit__(self, *exc_info: object) -> None:
        _LIMITS.reset(self._token)

    def raise_limit(self) -> bool:
        """Raises max_chars by the inputs' share, the first time it is called: whether it did."""
        if self._inputs is None:
            return False
        self.max_chars += _INPUT_REPEATS * _size(self._inputs)
        self._inputs = None
        return True

    def check(self, size: int) -> None:
        """Raises TooBig for a size over the limit, and RenderTimeout past the deadline."""
        if size > self.max_chars and not (self.raise_limit() and size <= self.max_chars):
            raise TooBig(f"the template builds a value or an output longer than {self.max_chars} characters")
        if time.monotonic() > self.deadline:
            raise RenderTimeout


# The limits of the render running in this thread (or context), for the checks that Jinja calls.
# Unset while compiling, so that every check raises LookupError then, which Jinja's constant folding
# takes for "not a constant": compiling runs no filter, test or intercepted operator of the template.
_LIMITS: ContextVar[Limits] = ContextVar("chat_template_limits")


def checked(value: T) -> T:
    limits = _LIMITS.get()
    limits.check(len(value) if type(value) is str else _size(value, limits))
    return value


def _check_ints(args: tuple, kwargs: Mapping[str, Any]) -> None:
    # For the functions whose result is as long as an int argument says ('a'.center(10**9)): that
    # result would be allocated before it could be checked.
    limits = _LIMITS.get()
    for value in (*args, *kwargs.values()):
        if isinstance(value, int):
            limits.check(abs(value))


# About what repr adds around each item of a container (quotes, ", " or ": "), and the length of
# the repr of any other object (a function, a range, a loop, "<generator object ... at 0x...>").
_ITEM_CHARS = 4
_OBJECT_CHARS = 100
_SEQUENCES = (list, tuple, set, frozenset, type({}.keys()), type({}.values()), type({}.items()))


def _size(value: Any, limits: Limits | None = None) -> int:
    """About len(str(value)), from above, without building it: characters of a string, digits of an
    int, and for a list, tuple, set, dict (or its views), namespace or cycler, its items each time
    they occur plus _ITEM_CHARS each. Counting stops past the limit (once raised), so that it takes
    at most about limit / _ITEM_CHARS steps, even for a list that holds another many times over
    (which is small in memory, but huge as text)."""
    if type(value) is str:  # the common case, quickly
        return len(value)
    limit = sys.maxsize if limits is None else limits.max_chars
    total, pending = 0, [value]
    while pending:
        if total > limit:
            if limits is None or not limits.raise_limit():
                break
            limit = limits.max_chars
        item = pending.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, _SEQUENCES):
            total += 2 + _ITEM_CHARS * len(item)
            pending.extend(item)
        elif isinstance(item, dict):
            total += 2 + 2 * _ITEM_CHARS * len(item)
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 1  # decimal digits are bits * log10(2) < bits / 3
        elif isinstance(item, float):
            total += 24
        elif isinstance(item, jinja2.utils.Namespace):  # its attributes are in a name-mangled dict
            total += 12
            pending.append(object.__getattribute__(item, "_Namespace__attrs"))
        elif isinstance(item, jinja2.utils.Cycler):
            pending.append(item.items)
        else:
            total += _OBJECT_CHARS
    return total


def _binop_size(operator: str, left: Any, right: Any, limits: Limits) -> int:
    """About the size of `left <operator> right`, for the operators of intercepted_binops, from above
    and before it is computed."""
    if operator == "%" and isinstance(left, str):
        return _format_size(left, _PERCENT_FIELD.findall(left), right, limits)
    if isinstance(left, int) and isinstance(right, int):  # the digits of a power, a product or a sum
        if operator == "**":
            return _size(left, limits) * max(right, 0)
        return _size(left, limits) + _size(right, limits)
    if operator == "*" and isinstance(right, int):
        return _size(left, limits) * max(right, 0)
    if operator == "*" and isinstance(left, int):
        return _size(right, limits) * max(left, 0)
    return _size(left, limits) + _size(right, limits)


# A conversion of printf-style formatting; group 1 holds its flags, width and precision.
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?([-#0 +*.\d]*)")
_NUMBER = re.compile(r"\d+")


def _format_size(fmt: str, fields: list[str], args: Any, limits: Limits) -> int:
    """About the length of `fmt % args` or `fmt.format(...)`, from above, given the specs (flags,
    width, precision) of fmt's fields: each field may hold all the arguments, padded to the widest
    number in the specs. Widths taken from the arguments (`%*d`, `{:{}}`) are refused."""
    if any("*" in spec or "{" in spec for spec in fields):
        raise TooBig("chat templates cannot take field widths from arguments")
    width = max((int(number) for spec in fields for number in _NUMBER.findall(spec)), default=0)
    return len(fmt) + len(fields) * (_size(args, limits) + width)


def _brace_fields(fmt: str) -> list[str]:
    return [spec for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator, with checks where the template's code builds values or repeats
    without a call that could check them: each item of a loop, the parts `~` joins (before they
    become text), and list, tuple and dict literals."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop_iterables: set[int] = set()  # ids of the nodes that `{% for %}`s iterate over

    def visit_For(self, node: jinja2.nodes.For, frame: Frame) -> None:
        self._loop_iterables.add(id(node.iter))
        super().visit_For(node, frame)

    def visit(self, node: jinja2.nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self._loop_iterables:
            return super().visit(node, *args, **kwargs)
        self.write("environment.each(")
        super().visit(node, *args, **kwargs)
        self.write(")")

    @optimizeconst
    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        # CodeGenerator.visit_Concat, with the parts passed through environment.check_parts
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"{join}(environment.check_parts((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write(")))")

    def visit_Tuple(self, node: jinja2.nodes.Tuple, frame: Frame) -> None:
        if node.ctx == "load":  # not the targets of `{% for a, b in ... %}`
            self.checked(super().visit_Tuple, node, frame)
        else:
            super().visit_Tuple(node, frame)

    def visit_List(self, node: jinja2.nodes.List, frame: Frame) -> None:
        self.checked(super().visit_List, node, frame)

    def visit_Dict(self, node: jinja2.nodes.Dict, frame: Frame) -> None:
        self.checked(super().visit_Dict, node, frame)

    def checked(self, visit: Callable, node: jinja2.nodes.Expr, frame: Frame) -> None:
        self.write("environment.checked(")
        visit(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with the checks of ChatTemplate's docstring."""

    code_generator_class = _CodeGenerator
    # Intercepting an operator also keeps Jinja from folding it at compile time ('a' * 10**9).
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        limits = _LIMITS.get()
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, quickly
            limits.check(len(left) + len(right))
        else:
            limits.check(_binop_size(operator, left, right, limits))
        return self.binop_table[operator](left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if isinstance(getattr(__obj, "__self__", None), (str, bytes)):  # 'a'.center(10**9)
            _check_ints(args, kwargs)
        if isinstance(__obj, jinja2.runtime.Macro) and (__obj.catch_varargs or __obj.catch_kwargs):
            checked((args, kwargs))  # the macro keeps them, as `varargs` and `kwargs`
        return checked(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        format_method = super().wrap_str_format(value)
        if format_method is None:
            return None
        fmt = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            limits = _LIMITS.get()
            limits.check(_format_size(fmt, _brace_fields(fmt), (args, kwargs), limits))
            return format_method(*args, **kwargs)

        return functools.update_wrapper(bounded, format_method)

    def each(self, iterable: Iterable[T]) -> Iterator[T]:
        limits = _LIMITS.get()
        for item in iterable:
            limits.check(0)
            yield item

    checked = staticmethod(checked)

    def check_parts(self, parts: tuple) -> tuple:
        limits = _LIMITS.get()
        limits.check(sum(_size(part, limits) for part in parts))
        return parts

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]
        """The parts joined, failing as soon as the text passes the limit: the template's output,
        and what its blocks, macros and `{% set %}...{% endset %}` capture."""
        joined, length, limits = [], 0, _LIMITS.get()
        for part in parts:
            length += len(part)
            if length > limits.max_chars:
                limits.check(length)
            joined.append(part)
        return "".join(joined)


def finalize(value: Any) -> Any:
    # Each `{{ value }}`, checked before it becomes text (a string is checked by concat).
    return value if type(value) is str else checked(value)


# Filters whose result is as long as an int argument says: those arguments are checked first.
_WIDTH_FILTERS = frozenset({"center", "indent", "batch", "slice", "tojson"})


def _bounded_filter(name: str, function: Callable) -> Callable:
    takes_width = name in _WIDTH_FILTERS

    @functools.wraps(function)  # which keeps Jinja's pass_context & co., kept in __dict__
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if takes_width:
            _check_ints(args[1:], kwargs)  # args[0] is the value filtered
        return checked(function(*args, **kwargs))

    return bounded


def _timed_test(function: Callable) -> Callable:
    # the clock checked at each test, which `select` and `reject` run on every item of a list
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        _LIMITS.get().check(0)
        return function(*args, **kwargs)

    return timed


# Markupsafe's striptags copies the rest of the text for each tag it removes, in quadratic time: it is
# refused where it would copy more characters than this.
_MAX_STRIPTAGS_COPIES = 10**9


@functools.wraps(jinja2.filters.do_striptags)
def _striptags(value: Any) -> str:
    text = soft_str(value)
    if len(text) * text.count("<") > _MAX_STRIPTAGS_COPIES:
        raise TooBig(f"striptags would take too long on a text of {len(text)} characters")
    return jinja2.filters.do_striptags(value)


@functools.wraps(jinja2.filters.do_format)
def _format_filter(value: Any, *args: Any, **kwargs: Any) -> str:
    fmt, limits = soft_str(value), _LIMITS.get()
    limits.check(_format_size(fmt, _PERCENT_FIELD.findall(fmt), args or kwargs, limits))
    return jinja2.filters.do_format(fmt, *args, **kwargs)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    _LIMITS.get().check(n * max * 13)  # up to `max` words of up to 12 letters, in each of n paragraphs
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def bound(env: BoundedSandbox) -> BoundedSandbox:
    """Put every filter and test of `env` (its own helpers included: call this last) under the
    render's limits, with bounded versions of the builtins that can build huge text."""
    env.filters["format"] = _format_filter
    env.filters["striptags"] = _striptags
    env.filters = {name: _bounded_filter(name, function) for name, function in env.filters.items()}
    env.tests = {name: _timed_test(function) for name, function in env.tests.items()}
    env.globals["lipsum"] = _lipsum
    return env


def check_in_render(value: Any) -> None:
    """Check the size of `value` against the limit of the render in progress, if one is."""
    if (limits := _LIMITS.get(None)) is not None:
        limits.check(_size(value, limits))
