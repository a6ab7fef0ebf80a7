"""User source lines for captured ops: ``node_meta.source(node)`` is ``"file.py:LINE in func"``.

The source of an op is the innermost Python frame that is *user code*: outside torch and
outside partita's own machinery (``partita.models``, the reference models, and
``partita.training``, the step ``train_step`` compiles, count as user code).
Forward ops take it from the Python stack when they are dispatched. Backward ops run inside the
autograd engine, whose stack only shows the ``torch.autograd.grad`` call; they take the source of
the forward op that created their autograd node instead (matched by the node's sequence number),
so a gradient op points at the line whose forward it differentiates.

:class:`SourceTrackingMode` is the functionalization mode of capture with that bookkeeping
added; it hands each source to fx through ``torch.fx.traceback`` (as a one-frame
``stack_trace``). A caller that knows an op's source better than the stack does (the virtual
device replays ops recorded elsewhere, see :mod:`partita.virtual.step`) pins it with
:func:`pin_source` around the op. This module does not trace and does not touch graphs beyond
reading meta.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from types import CodeType, FrameType, TracebackType
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.functional_tensor import FunctionalTensorMode

from partita.ir import node_meta

__all__ = [
    "STACK_RE",
    "SourceTrackingMode",
    "format_source",
    "is_internal",
    "pin_source",
    "source_line",
    "stack_entry",
    "user_frame",
    "user_line_of_traceback",
]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# The package directory, from this file's place in it (importing ``partita`` here would be a
# cycle through the package root, which imports every stage).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Code that is the user's program though partita wrote it: the reference models, and the
# training step ``train_step`` compiles (its optimizer ops then point at the update's line).
_USER_DIRS_IN_PARTITA = tuple(
    os.path.join(_PACKAGE_DIR, d) + os.sep for d in ("models", "training")
)
STACK_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')

#: Per code object, its file and the answer. Code objects compare equal by their contents, not
#: their file: the same function at the same line in a torch file and in the user's is one key,
#: so a hit counts only for the file it was computed for.
_is_internal_cache: dict[CodeType, tuple[str, bool]] = {}


def is_internal(code: CodeType) -> bool:
    name = code.co_filename
    found = _is_internal_cache.get(code)
    hit = None if found is None or found[0] != name else found[1]
    if hit is None:
        if name.startswith(_PACKAGE_DIR):
            hit = not name.startswith(_USER_DIRS_IN_PARTITA)
        else:
            hit = (
                name.startswith(_TORCH_DIR)
                or name.startswith("<")
                or "/torch/" in name
                or "torchinductor" in name  # code torch.compile generated (its cache dir)
            )
        _is_internal_cache[code] = (name, hit)
    return hit


def user_frame(start: FrameType | None = None) -> FrameType | None:
    """The innermost frame outside torch and partita's machinery, or None."""
    frame: FrameType | None = start if start is not None else sys._getframe(1)
    while frame is not None and is_internal(frame.f_code):
        frame = frame.f_back
    return frame


def format_source(frame: FrameType | None) -> str | None:
    """``"file.py:LINE in func"`` for a frame (the file's base name)."""
    if frame is None:
        return None
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


def user_line_of_traceback(tb: TracebackType | None) -> str | None:
    """``"file.py:LINE in func"`` of the innermost user frame of an exception's traceback."""
    line = None
    while tb is not None:
        if not is_internal(tb.tb_frame.f_code):
            code = tb.tb_frame.f_code
            line = f"{os.path.basename(code.co_filename)}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return line


def _stack_entry(frame: FrameType) -> str:
    return stack_entry(frame.f_code, frame.f_lineno)


def stack_entry(code: CodeType, lineno: int) -> str:
    """One frame of an fx ``stack_trace``: ``File "path", line N, in func``."""
    return f'File "{code.co_filename}", line {lineno}, in {code.co_name}'


# The stack entry pinned by :func:`pin_source`, used by every op the same thread dispatches
# while it is set. Per thread: a virtual-device step may be traced while another thread
# traces or records (a step running in the background), and neither may see the other's pin.
_PINNED = threading.local()


def pin_source(entry: str | None) -> None:
    """Attribute the ops dispatched from now on to ``entry`` (a :func:`stack_entry`), not to the
    stack; ``None`` goes back to the stack.

    The virtual device replays recorded ops inside a trace, where the stack shows the replay
    and the user's ``partita.sync()``; it pins each op's recorded line instead.
    """
    _PINNED.entry = entry


def source_from_stack_trace(stack_trace: str | None) -> str | None:
    """Parse the last frame of an fx ``stack_trace`` into ``"file.py:LINE in func"``."""
    if not stack_trace:
        return None
    matches = list(STACK_RE.finditer(stack_trace))
    if not matches:
        return None
    m = matches[-1]
    return f"{os.path.basename(m['file'])}:{m['line']} in {m['func']}"


def source_line(node: torch.fx.Node) -> str | None:
    """The user's source line of a captured node, ``"file.py:LINE in func"``, if known.

    Example:
        >>> program = trace(lambda x: x.sin(), (torch.ones(2),))   # doctest: +SKIP
        >>> source_line(next(n for n in program.graph_module.graph.nodes
        ...                  if n.op == "call_function"))           # doctest: +SKIP
        '<stdin>:1 in <lambda>'
    """
    src = node_meta.source(node)
    if src is None:
        src = source_from_stack_trace(node.meta.get("stack_trace"))
    return src


class SourceTrackingMode(FunctionalTensorMode):
    """Functionalization that also records each op's user source line for fx.

    Must run under ``torch.fx.traceback.preserve_node_meta()`` so that the tracer copies the
    recorded ``stack_trace`` onto the nodes it creates.
    """

    def __init__(self) -> None:
        super().__init__()
        # autograd node sequence number -> stack entry of the forward op that created it
        self._forward_sources: dict[int, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        entry: str | None = getattr(_PINNED, "entry", None)
        if entry is not None:
            fx_traceback.set_stack_trace([entry])
            return super().__torch_dispatch__(func, types, args, kwargs)
        grad_node = torch._C._current_autograd_node()
        if grad_node is not None:  # inside the autograd engine: a backward op
            entry = self._forward_sources.get(grad_node._sequence_nr())
        if entry is None:
            frame = user_frame(sys._getframe(1))
            if frame is not None:
                entry = _stack_entry(frame)
                if grad_node is None and torch.is_grad_enabled():
                    # The autograd node of this op (if any) was created just before dispatch;
                    # the first op to see a sequence number is the one that created it.
                    self._forward_sources.setdefault(torch.autograd._get_sequence_nr() - 1, entry)
        if entry is not None:
            fx_traceback.set_stack_trace([entry])
        return super().__torch_dispatch__(func, types, args, kwargs)
