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
import linecache
import logging
import re
from collections.abc import Iterator
from types import TracebackType

import torch
from torch import fx
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from partita.capture.source import (
    STACK_RE,
    is_internal,
    source_from_stack_trace,
    user_line_of_traceback,
)
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
_DATA_DEPENDENT_TEXT = (
    ".numpy()",
    "data-dependent",
    "data dependent",
    "its data is not allocated yet",  # a kernel read a fake tensor's values
)

#: Why data-dependent code cannot be captured, and what to write instead.
DATA_DEPENDENT_HINT = (
    "This is data-dependent: the line needs a tensor's value (.item(), .tolist(), .numpy(), a "
    "Python if/while/int() on a tensor, a result whose shape depends on the data), but capture "
    "runs the function on fake tensors that have shapes and dtypes only. Keep the computation "
    "in tensor ops (torch.where(c, a, b) instead of `if`, t.sum() instead of t.sum().item()), "
    "or compute the value outside the jitted function and pass it as a static argument."
)

#: Calls whose result shape (or an argument) comes from the data, each with the way to write it
#: without: (a pattern of the op's name in the message or of the call in the user's line, fix).
_FIXES: tuple[tuple[str, str], ...] = (
    (r"one_hot", "Pass num_classes= to one_hot (without it the width is the largest index + 1)."),
    (
        r"repeat_interleave",
        "Pass output_size= (the total number of repeats) to repeat_interleave.",
    ),
    (
        r"\bnonzero|argwhere",
        "Use torch.nonzero_static(x, size=n) (padded with fill_value), or keep the mask and "
        "use torch.where.",
    ),
    (
        r"masked_select|aten\.index\.Tensor",
        "Indexing with a boolean mask (x[mask], masked_select) keeps as many elements as the "
        "mask has Trues: keep the shape with torch.where(mask, x, 0) or x.masked_fill(~mask, 0).",
    ),
    (
        r"bincount",
        "Count into a known number of bins: torch.zeros(n).scatter_add_(0, i, torch.ones(...)) "
        "or F.one_hot(i, n).sum(0).",
    ),
    (r"tensor_split", "Pass the split points of tensor_split as a list of ints, not a tensor."),
    (
        r"narrow",
        "Pass narrow's start as an int, or read the window with "
        "index_select(dim, start + torch.arange(length)).",
    ),
    (
        r"\b(cov|corrcoef)\(",
        "torch.cov and torch.corrcoef check values inside; write it out: xm = x - x.mean(1, "
        "keepdim=True); xm @ xm.T / (x.shape[1] - 1).",
    ),
    (
        r"gaussian_nll_loss|GaussianNLLLoss",
        "F.gaussian_nll_loss checks any(var < 0) in Python; write the loss out: "
        "v = var.clamp_min(eps); (0.5 * (v.log() + (input - target) ** 2 / v)).mean().",
    ),
    (
        r"ctc_loss|CTCLoss",
        "ctc_loss sizes its work by the longest target, a value: compute it outside the "
        "jitted function.",
    ),
    (
        r"\bunique",
        "unique has as many elements as the data has distinct values: compute it outside the "
        "jitted function.",
    ),
)


#: Higher-order ops (a function as an argument) that capture cannot trace into, and what to write
#: (torch.cond, while_loop, scan and map are captured with their bodies: capture/control_flow).
_HOP_FIXES: dict[str, str] = {
    "while_loop_stack_output": (
        "take gradients through a scan over a fixed number of steps (torch's backward of "
        "while_loop stacks every iteration's values, a count known only when it runs)"
    ),
    "flex_attention": (
        "use F.scaled_dot_product_attention with the mask as a tensor (a score_mod or block "
        "mask can be written as an additive mask; in transformers pass "
        "attn_implementation='sdpa')"
    ),
}
_HOP = re.compile(r"no rule registered for HigherOrderOperator (\w+)")


def _higher_order_error(head: str, e: BaseException) -> CaptureError | None:
    """The CaptureError of a higher-order op (``torch.cond``, ``flex_attention`` ...) that
    capture's functionalization has no rule for, or None if ``e`` is not one."""
    m = next((m for err in _chain(e) if (m := _HOP.search(str(err)))), None)
    if m is None:
        return None
    name = m.group(1)
    fix = _HOP_FIXES.get(name, "write its body as plain tensor ops")
    where = head.split(": ", 1)[0]
    return CaptureError(
        f"{where}: the higher-order op {name} (a function passed as an argument: "
        f"flex_attention, ...) cannot be captured by partita (torch.cond, while_loop, scan and "
        f"map can). Instead, {fix}."
    )


def _user_code(tb: TracebackType | None) -> str:
    """The text of the innermost user line of a traceback ('' if unknown)."""
    text = ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if not is_internal(code):
            text = linecache.getline(code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return text.strip()


def _code_of_stack_trace(stack_trace: str | None) -> str:
    matches = list(STACK_RE.finditer(stack_trace or ""))
    if not matches:
        return ""
    return linecache.getline(matches[-1]["file"], int(matches[-1]["line"])).strip()


def _hint(*texts: str) -> str:
    """The data-dependent hint, led by the specific fix of a known call in ``texts``."""
    for pattern, fix in _FIXES:
        if any(re.search(pattern, t) for t in texts):
            return f"{fix} {DATA_DEPENDENT_HINT}"
    return DATA_DEPENDENT_HINT


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
        return CaptureError(f"{head}. {_hint(_user_code(e.__traceback__), str(e))}")
    higher_order = _higher_order_error(head, e)
    if higher_order is not None:
        return higher_order
    if any("Cannot access data pointer of Tensor" in str(err) for err in _chain(e)):
        return CaptureError(
            f"{head}. A compiled kernel (a torch.compile'd function such as flex_attention's, "
            f"a C++ extension, a Triton kernel) ran on capture's fake tensors, which have no "
            f"data: partita must see the torch ops themselves. Call the uncompiled code (in "
            f"transformers, attn_implementation='sdpa' instead of 'flex_attention'), or wrap "
            f"the kernel as a custom op (torch.library.custom_op) with a sharding rule."
        )
    return CaptureError(
        f"{head}. The function itself raised this while being captured (not partita's "
        f"sharding). If it runs eagerly on the same inputs, note that capture runs it with "
        f"torch.compiler.is_compiling() True, as torch.export does, so libraries take their "
        f"compile path: transformers, for one, then skips filling in "
        f"optional inputs (pass attention_mask= and the like explicitly). Otherwise fix the "
        f"call at that line."
    )


def _drop_value_checks(gm: fx.GraphModule) -> None:
    """Remove the values read from a tensor only to be checked: ``torch._check`` on a tensor
    (``torch._check_tensor_all``, transformers' ``torch_compilable_check``) traces to a
    ``_local_scalar_dense`` that nothing in the graph uses (the check became a deferred
    assertion of the trace), and the aten ops that computed only it. Like
    :data:`~partita.capture.decompositions.DROPPED_CHECKS`, such checks are not run."""
    dense = torch.ops.aten._local_scalar_dense.default
    dead = [n for n in gm.graph.nodes if n.target is dense and not n.users]
    while dead:
        node = dead.pop()
        inputs = [a for a in node.all_input_nodes if a.op == "call_function"]
        gm.graph.erase_node(node)
        for a in inputs:
            pure_aten = isinstance(a.target, torch._ops.OpOverload) and a.target.namespace == "aten"
            if not a.users and pure_aten and not a.target._schema.is_mutable:
                dead.append(a)


def check_data_independent(gm: fx.GraphModule, fn_name: str) -> None:
    """Refuse a traced graph holding a value or shape only known at run time (after dropping
    the values read only for a check, :func:`_drop_value_checks`)."""
    _drop_value_checks(gm)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            what = f"a Python number read from a tensor ({node.target})"
        elif isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape):
            what = f"a tensor whose shape depends on the data ({node.target}, shape {val.shape})"
        else:
            continue
        stack = node.meta.get("stack_trace")
        where = source_from_stack_trace(stack) or "an unknown line"
        hint = _hint(str(node.target), _code_of_stack_trace(stack))
        raise CaptureError(f"Cannot trace {fn_name!r} at {where}: it computes {what}. {hint}")


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
