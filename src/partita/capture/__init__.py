"""Capture: trace a user function into a functional fx graph of aten ops (a Program).

``trace(fn, args, ...)`` -> :class:`Program`; ``annotate(t, mesh, spec)`` inside a traced
function; ``is_tracing()``; ``source_line(node)``. The op set a Program may contain is fixed by
``decompositions`` and ``normalize``. Tensor constants become inputs (``lift``), in-place
updates of inputs become extra outputs (``functionalize``), failures are explained by
``diagnose``, and ``module`` turns an ``nn.Module`` into a function of its weights. This package
does not propagate or partition.
"""

from __future__ import annotations

from partita.capture import ops
from partita.capture.annotate import ANNOTATE_OP, Annotation, annotate, is_tracing
from partita.capture.decompositions import KEPT_OPS, SDPA_OPS, decomposition_table
from partita.capture.normalize import VALUE_VIEW_OPS, normalize
from partita.capture.program import Program
from partita.capture.source import source_line
from partita.capture.threads import TRACING, serialized
from partita.capture.trace import trace

__all__ = [
    "ANNOTATE_OP",
    "KEPT_OPS",
    "SDPA_OPS",
    "TRACING",
    "VALUE_VIEW_OPS",
    "Annotation",
    "Program",
    "annotate",
    "decomposition_table",
    "is_tracing",
    "normalize",
    "ops",
    "serialized",
    "source_line",
    "trace",
]
