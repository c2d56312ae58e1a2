"""How the build record (`dtrain.parallel.build_record`) reads a torch call: whether it
writes its first argument in place, and what the function running in a frame was called
with, read from the frame itself (a constructor's or init method's arguments, at its first
torch call)."""

from __future__ import annotations

import dis
import functools
import inspect
from types import FrameType
from typing import Any

NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})
"""In-place by name, but they set no values."""
IN_PLACE_OPERATORS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or")
) | {"__ixor__", "__ilshift__", "__irshift__", "__setitem__"}
"""The operators that write their left operand (``x += y``, ``x[i] = y``)."""


def writes_in_place(name: str) -> bool:
    """Whether a torch function of this name writes its first argument in place."""
    if name.startswith("__"):
        return name in IN_PLACE_OPERATORS
    return name.endswith("_") and name not in NOT_WRITES


def call_arguments(frame: FrameType, first: int = 1) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments, from the `first` (1: after ``self``), that the function running in
    `frame` was called with (as its locals hold them now)."""
    code, local = frame.f_code, frame.f_locals
    names = code.co_varnames
    positional = code.co_argcount
    keywords = names[positional : positional + code.co_kwonlyargcount]
    args = tuple(local[n] for n in names[first:positional])
    kwargs = {n: local[n] for n in keywords}
    rest = positional + code.co_kwonlyargcount
    if code.co_flags & inspect.CO_VARARGS:
        args += tuple(local[names[rest]])
        rest += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local[names[rest]])
    return args, kwargs


@functools.cache
def rebound_argument(code: Any) -> str | None:
    """An argument (after ``self``) the function of `code` assigns or deletes, if any: its
    arguments are read at its first torch call, too late to see the value it was given."""
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    names = set(code.co_varnames[1:count])
    stores = (
        i.argval for i in dis.get_instructions(code) if i.opname in {"STORE_FAST", "DELETE_FAST"}
    )
    return next((n for n in stores if n in names), None)
