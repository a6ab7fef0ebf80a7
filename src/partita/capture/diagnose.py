"""Explain why a function could not be captured: data-dependent code or a bug of its own.

Capture runs the user's function on fake tensors, which have shapes and dtypes but no values.
Code that needs a value (``.item()``, ``.tolist()``, ``.numpy()``, ``if t.sum() > 0``,
``int(t.max())``, boolean-mask indexing whose result shape depends on the data) cannot be
captured; :func:`capture_error` says so, with the user's line and the ways around it. Any other
failure (a shape mismatch in ``x @ w``, a TypeError) is the function's own bug: its message
names the line and does not blame fake tensors. :func:`check_data_independent` finds the
data-dependent values that tracing let through as symbolic scalars or shapes.

This module only builds messages; ``trace`` decides when to raise them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import fx
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from partita.capture.source import source_from_stack_trace, user_line_of_traceback
from partita.errors import CaptureError

__all__ = [
    "DATA_DEPENDENT_HINT",
    "capture_error",
    "check_data_independent",
    "is_data_dependent",
    "quiet_meta_failures",
]

_DATA_DEPENDENT_TYPES = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
)
_DATA_DEPENDENT_TEXT = (".numpy()", "data-dependent", "data dependent")

#: Why data-dependent code cannot be captured, and what to write instead.
DATA_DEPENDENT_HINT = (
    "This is data-dependent: the line needs a tensor's value (.item(), .tolist(), .numpy(), a "
    "Python if/while/int() on a tensor, a result whose shape depends on the data), but capture "
    "runs the function on fake tensors that have shapes and dtypes only. Keep the computation "
    "in tensor ops (torch.where(c, a, b) instead of `if`, t.sum() instead of t.sum().item()), "
    "or compute the value outside the jitted function and pass it as a static argument."
)


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def is_data_dependent(e: BaseException) -> bool:
    """True if ``e`` (or an exception it came from) says the code needed a tensor's value."""
    for err in _chain(e):
        if isinstance(err, _DATA_DEPENDENT_TYPES):
            return True
        text = str(err)
        if any(marker in text for marker in _DATA_DEPENDENT_TEXT):
            return True
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0].rstrip(".") if text else "(no message)"


def capture_error(fn_name: str, e: BaseException) -> CaptureError:
    """The CaptureError for ``e``, raised while capturing ``fn_name``."""
    where = user_line_of_traceback(e.__traceback__)
    at = f" at {where}" if where else ""
    head = f"Cannot trace {fn_name!r}{at}: {type(e).__name__}: {_first_line(e)}"
    if is_data_dependent(e):
        return CaptureError(f"{head}. {DATA_DEPENDENT_HINT}")
    return CaptureError(
        f"{head}. The function itself raised this while being captured (not partita's "
        f"sharding). If it runs eagerly on the same inputs, note that capture runs it with "
        f"torch.compiler.is_compiling() True, as torch.export does, so libraries take their "
        f"compile path: transformers, for one, then skips filling in "
        f"optional inputs (pass attention_mask= and the like explicitly). Otherwise fix the "
        f"call at that line."
    )


def check_data_independent(gm: fx.GraphModule, fn_name: str) -> None:
    """Refuse a traced graph holding a value or shape only known at run time."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            what = f"a Python number read from a tensor ({node.target})"
        elif isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape):
            what = f"a tensor whose shape depends on the data ({node.target}, shape {val.shape})"
        else:
            continue
        where = source_from_stack_trace(node.meta.get("stack_trace")) or "an unknown line"
        raise CaptureError(
            f"Cannot trace {fn_name!r} at {where}: it computes {what}. {DATA_DEPENDENT_HINT}"
        )


class _DropMetaFailure(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed while attempting to run meta")


@contextlib.contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """While tracing, FakeTensor logs a traceback at ERROR level for every op whose shape
    check fails, before the exception reaches partita, which re-raises it as a CaptureError
    naming the user's line (with the original chained): the log would print it twice."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    drop = _DropMetaFailure()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
