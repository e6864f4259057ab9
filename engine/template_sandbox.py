"""The sandbox chat templates run in, with a budget for each render.

jinja's immutable sandbox already refuses attribute escapes and caps `range()` at MAX_RANGE
items; it does not bound what one expression may build (`{{ 'x' * 200000000 }}` makes a
gigabyte string in two seconds) or how long a render may take. Here every operation the
sandbox sees — arithmetic, attribute and item reads, calls, filters, each piece of output —
checks the render's budget first: its deadline, the largest string or list one step may
make (sized *before* repetition, concatenation, power, `%`-formatting, padding and joining
run, so the refused ones allocate nothing), and the total all steps may make. Python code a
template cannot reach (a loop's own iteration, `~` joining) is bounded by the operations
around it.
"""
from __future__ import annotations

import contextvars
import functools
import re
import time
from collections.abc import Callable
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIME_S = 2.0  # real templates render in milliseconds; a render holds the GIL
MAX_CHARS = 16 << 20  # the output, and any one string or list a step makes (plus twice the input's size)
WORK_FACTOR = 4  # all steps together may make this many times MAX_CHARS
MAX_INT_BITS = 1 << 14  # `**` results; 10 ** 10 ** 9 would run for minutes
_SIZED = (str, bytes, list, tuple, dict)
_WIDTH = re.compile(r"%[#0 +\-]*(\d*)(?:\.(\d+))?")  # a %-conversion's width and precision
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")  # str.format's "{:>{width}}"
# Calls and filters whose count or width argument multiplies their input's size.
_WIDENING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_WIDENING_FILTERS = frozenset({"center", "indent", "batch", "slice"})


class RenderOverBudget(Exception):
    """A render ran past its deadline or would have built more than its size budget."""


class RenderTimedOut(RenderOverBudget):
    """A render ran past its deadline."""


class Budget:
    """One render's allowance; every check raises RenderOverBudget once it is spent."""

    def __init__(self, seconds: float = RENDER_TIME_S, chars: int = MAX_CHARS):
        self.deadline = time.monotonic() + seconds
        self.seconds, self.chars, self.work_left = seconds, chars, WORK_FACTOR * chars

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderTimedOut(f"the chat template ran past its {self.seconds:g} s render budget")

    def fits(self, size: int, what: str) -> None:
        """Refuse a step that would make `size` characters or items (checked before it runs)."""
        self.tick()
        if size > self.chars:
            raise RenderOverBudget(f"{what} would make {size:,} characters or items, over the chat "
                                   f"template's {self.chars:,} budget")

    def made(self, value: Any) -> Any:
        """Count what a step made against the render's total."""
        if isinstance(value, _SIZED):
            self.fits(len(value), "one step")
            self.work_left -= len(value)
            if self.work_left < 0:
                raise RenderOverBudget(f"the chat template's steps made over {WORK_FACTOR * self.chars:,} "
                                       f"characters or items in all")
        return value


_current: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("render_budget", default=None)


def budgeted(budget: Budget) -> contextvars.Token:
    """Make `budget` the one this thread's renders charge (reset with `_current.reset(token)`)."""
    return _current.set(budget)


def release(token: contextvars.Token) -> None:
    _current.reset(token)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 0


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _before_binop(budget: Budget, op: str, left: Any, right: Any) -> None:
    if op == "*":
        seq, n = (left, right) if _int(right) else (right, left)
        if isinstance(seq, _SIZED) and _int(n):
            budget.fits(len(seq) * max(n, 0), "repetition")
    elif op == "**" and _int(left) and _int(right) and right > 0:
        if abs(left).bit_length() * right > MAX_INT_BITS:
            raise RenderOverBudget(f"a power over {MAX_INT_BITS} bits")
    elif op == "%" and isinstance(left, str):
        _before_format(budget, left, right if isinstance(right, tuple) else (right,))


def _before_format(budget: Budget, fmt: str, args: tuple) -> None:
    widths = [int(n) for m in _WIDTH.finditer(fmt) for n in m.groups() if n]
    if "*" in fmt:  # widths taken from the arguments
        widths += [a for a in args if _int(a)]
    budget.fits(len(fmt) + sum(_size(a) for a in args) + sum(max(w, 0) for w in widths), "formatting")


def _before_call(budget: Budget, obj: Any, args: tuple, kwargs: dict) -> None:
    method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format in a checking formatter
    target, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(target, str):
        return budget.tick()
    if name in _WIDENING_METHODS:
        budget.fits(len(target) + sum(max(a, 0) for a in args if _int(a)), f"str.{name}")
    elif name == "join" and args and hasattr(args[0], "__len__"):
        budget.fits(len(target) * len(args[0]) + sum(_size(a) for a in args[0] if isinstance(a, str)), "str.join")
    elif name == "replace" and len(args) >= 2:
        _before_replace(budget, target, *args[:2])
    elif name in ("format", "format_map"):
        widths = sum(int(n) for n in re.findall(r"\d+", target))
        if _NESTED_FIELD.search(target):  # a width taken from the arguments
            widths += sum(max(a, 0) for a in (*args, *kwargs.values()) if _int(a))
        budget.fits(len(target) + widths, "str.format")
    else:
        budget.tick()


def _before_replace(budget: Budget, s: Any, old: Any, new: Any) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        hits = s.count(old) if old else len(s) + 1
        budget.fits(len(s) + hits * len(new), "replace")


def _widening_size(values: list) -> int:
    first = values[0] if values else None
    lines = first.count("\n") + 1 if isinstance(first, str) else 1
    return _size(first) + lines * sum(max(a, 0) if _int(a) else _size(a) for a in values[1:])


def _join_size(values: list) -> int | None:
    if not (values and hasattr(values[0], "__len__")):
        return None
    sep = values[1] if len(values) > 1 and isinstance(values[1], str) else ""
    return len(sep) * len(values[0])


def _wordwrap_size(values: list) -> int | None:  # a wrapstring at every break, at most
    if not (values and isinstance(values[0], str)):
        return None
    return len(values[0]) * (1 + max([_size(a) for a in values[1:] if isinstance(a, str)], default=1))


_FILTER_SIZES: dict[str, Callable[[list], int | None]] = {"join": _join_size, "wordwrap": _wordwrap_size}


def _before_filter(budget: Budget, name: str, args: tuple, kwargs: dict) -> None:
    # The filter's own arguments, past the context or environment jinja may pass it first.
    values = [a for a in args if not hasattr(a, "environment")] + list(kwargs.values())
    if name == "replace" and len(values) >= 3:
        return _before_replace(budget, *values[:3])
    if name == "format" and values and isinstance(values[0], str):
        return _before_format(budget, values[0], tuple(values[1:]))
    size = _widening_size if name in _WIDENING_FILTERS else _FILTER_SIZES.get(name)
    need = size(values) if size is not None else None
    if need is None:
        budget.tick()
    else:
        budget.fits(need, name)


def _guarded(name: str, f: Callable) -> Callable:
    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
    def guarded(*args, **kwargs):
        budget = _current.get()
        if budget is None:
            return f(*args, **kwargs)
        _before_filter(budget, name, args, kwargs)
        return budget.made(f(*args, **kwargs))
    return guarded


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, charging each operation to the current render's Budget."""

    # Not `+` (nor `~`): a concatenation makes no more than the values it joins, and reading any
    # value over the step size is refused, so repeated doubling stops there.
    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters = {name: _guarded(name, f) for name, f in self.filters.items()}

    def add_filter(self, name: str, f: Callable) -> None:
        """A filter of our own, budgeted like jinja's."""
        self.filters[name] = _guarded(name, f)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = _current.get()
        if budget is None:
            return super().call_binop(context, operator, left, right)
        _before_binop(budget, operator, left, right)
        return budget.made(super().call_binop(context, operator, left, right))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return self._read(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return self._read(super().getitem(obj, argument))

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's own spelling
        budget = _current.get()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        _before_call(budget, __obj, args, kwargs)
        return budget.made(super().call(__context, __obj, *args, **kwargs))

    @staticmethod
    def _read(value: Any) -> Any:
        """Reads allocate nothing, but a value over the step size could only have been built
        around the budget (joined with `+` or `~` into a namespace): refused before it doubles
        again. The commonest interception, so kept short."""
        budget = _current.get()
        if budget is not None and (time.monotonic() > budget.deadline
                                   or (isinstance(value, _SIZED) and len(value) > budget.chars)):
            budget.fits(_size(value), "a value read")
        return value
