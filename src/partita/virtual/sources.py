"""The user's source line of each op recorded on the virtual device.

A recorded op keeps ``(code, line)`` of its innermost user frame (the notion of user code of
:mod:`partita.capture.source`), kept beside the recording's op list rather than in its entries,
which are the structural key: the same step from another line is the same program. Backward ops
are recorded inside the autograd engine, whose stack shows no user frame; they take the source
of the forward op that created their autograd node (matched by sequence number), as capture
does. The replay pins each op's source for capture (:func:`partita.capture.source.pin_source`),
so the compiled step's nodes and Plan point at the model's lines, not at ``partita.sync()``.
"""

from __future__ import annotations

import sys
from types import CodeType

import torch

from partita.capture.source import stack_entry, user_frame

__all__ = ["Source", "op_source", "stack_entries"]

#: ``(code, line)`` of the user frame of an op, or None when the stack shows no user code.
Source = tuple[CodeType, int] | None


def op_source(forward: dict[int, Source]) -> Source:
    """The source of the op being recorded now; ``forward`` maps the sequence numbers of the
    autograd nodes created while recording to their forward op's source (updated here)."""
    grad_node = torch._C._current_autograd_node()
    if grad_node is not None:  # inside the autograd engine: a backward op
        src = forward.get(grad_node._sequence_nr())
        if src is not None:
            return src
    frame = user_frame(sys._getframe(1))
    if frame is None:
        return None
    src = (frame.f_code, frame.f_lineno)
    if grad_node is None and torch.is_grad_enabled():
        # The op's autograd node (if any) was created just before dispatch; the first op to
        # see a sequence number is the one that created it.
        forward.setdefault(torch.autograd._get_sequence_nr() - 1, src)
    return src


def stack_entries(sources: list[Source]) -> list[str | None]:
    """Each source as the one-frame fx ``stack_trace`` entry capture pins."""
    return [None if s is None else stack_entry(*s) for s in sources]
