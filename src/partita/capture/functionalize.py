"""Run a flat traced function under functionalization, turning input updates into outputs.

Functionalization (``FunctionalTensorMode``, as AOTAutograd and ``torch.export`` use it) rewrites
every in-place op into its functional form. An in-place update of a program *input*
(``x.add_(1)``, ``x[0] = 5``, a module buffer's ``running_mean.mul_(0.9)``) cannot be rewritten
away: the caller sees it. As ``torch.compile`` does, the traced graph returns the new value of
each updated input after the function's own results, and the caller copies it back
(:class:`InputUpdates` records which inputs those are). An update of an input's *metadata*
(``x.t_()``, ``x.resize_(...)``) has no such copy-back and is refused.

This module does not trace (``trace`` calls make_fx on the function returned here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensor

from partita.capture.annotate import record
from partita.capture.bounded import BoundedIndices
from partita.capture.control_flow import lifting
from partita.capture.control_flow import register as register_control_flow
from partita.capture.decompositions import DROPPED_CHECKS
from partita.capture.layer_dispatch import add_layer_call
from partita.capture.layer_graph import LAYER_CALL_OP
from partita.capture.source import SourceTrackingMode
from partita.errors import CaptureError
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec

__all__ = ["InputUpdates", "functionalized"]


@dataclass
class InputUpdates:
    """The in-place updates of one trace's inputs.

    Attributes:
        received: the tensor each input became inside the function (after its in_specs
            annotation); filled by the traced function as it starts.
        names: a readable name per input (``args[0]``), for messages.
        shapes: the shape of each input as passed, for messages.
        specs: the in_specs of each input; an updated value keeps its input's sharding.
        mesh: the mesh of those specs.
        fn_name: the traced function's name, for messages.
        positions: filled by the trace: the inputs that were updated, in input order.
    """

    received: list[torch.Tensor]
    names: tuple[str, ...]
    shapes: list[tuple[int, ...]]
    specs: list[PartitionSpec | None]
    mesh: Mesh | None
    fn_name: str
    positions: list[int] = field(default_factory=list)

    def collect(self) -> list[torch.Tensor]:
        """The new value of every updated input (call after the function returned)."""
        self.positions.clear()
        news = []
        for i, t in enumerate(self.received):
            torch._sync(t)
            if torch._functionalize_has_metadata_mutation(t.elem):  # type: ignore[attr-defined]
                raise CaptureError(
                    f"{self.fn_name!r} changes the shape or strides of its input "
                    f"{self.names[i]} (shape {self.shapes[i]}, then {tuple(t.shape)}) in place "
                    f"(t_(), transpose_(), resize_(), as_strided_() ...). A captured program can "
                    f"write new values into an input but not re-shape it: use the out-of-place "
                    f"op (x = x.t()) and return x."
                )
            if not torch._functionalize_has_data_mutation(t.elem):  # type: ignore[attr-defined]
                continue
            spec = self.specs[i]
            if spec is not None and self.mesh is not None:
                source = f"in-place update of {self.names[i]}"
                t = record(t, self.mesh, spec, source=source)
            self.positions.append(i)
            news.append(t)
        return news


@cache
def _traced_through() -> dict[Any, Callable[..., Any]]:
    """PyTorch's own Python custom ops that are traced as their implementation: the chunked
    ``F.linear_cross_entropy`` (``options=``), whose loop over batch chunks is plain torch ops
    (sharded like any others) and whose registered backward reads the op's outputs."""
    try:
        from torch.nn.modules import linear_cross_entropy as lce
    except ImportError:  # an older torch
        return {}
    ops = {}
    for name in (
        "_linear_cross_entropy_batch_chunked",
        "_linear_cross_entropy_batch_chunked_no_reduction",
    ):
        op_def = getattr(lce, name, None)
        if op_def is not None and hasattr(op_def, "_init_fn"):
            ops[getattr(torch.ops.torch_nn, name).default] = op_def._init_fn
    return ops


class _CaptureMode(SourceTrackingMode):
    """Source-tracking functionalization that records no data-dependent check
    (:data:`~partita.capture.decompositions.DROPPED_CHECKS`): those ops return nothing and only
    raise on values a trace cannot see. They are dropped here, before functionalization would
    ask for an effect token they cannot have outside AOTAutograd. The custom ops of
    :func:`_traced_through` run their implementation under this mode, so that its in-place
    updates (of buffers it allocates) are functionalized too."""

    def __init__(self) -> None:
        super().__init__()
        self.bounded = BoundedIndices()  # nonzero traced with a static bound (capture/bounded)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in DROPPED_CHECKS:
            return None
        out = self.bounded.dispatch(
            lambda f, a, k: super(_CaptureMode, self).__torch_dispatch__(f, types, a, k),
            func, tuple(args), dict(kwargs or {}),
        )  # fmt: skip
        if out is not NotImplemented:
            return out
        impl = _traced_through().get(func)
        if impl is not None:
            with self:
                return impl(*args, **(kwargs or {}))
        if func is LAYER_CALL_OP:  # a placeholder: added to the graph directly (layer_dispatch)
            outs = add_layer_call(self, *args)
            if outs is not None:
                return outs
        return super().__torch_dispatch__(func, types, args, kwargs)


register_control_flow(_CaptureMode)  # torch.cond, while_loop, scan, map: bodies as subprograms


def functionalized(
    flat_fn: Callable[..., list[torch.Tensor]], updates: InputUpdates
) -> Callable[..., list[torch.Tensor]]:
    """``flat_fn`` under functionalization (with source tracking); its outputs are followed by
    the new values of the inputs it updated in place (see ``updates.positions``)."""

    def inner(*tensors: torch.Tensor) -> list[torch.Tensor]:
        mode = _CaptureMode()
        exclude = torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
        )
        with exclude, mode, lifting():
            wrapped = [FunctionalTensor.to_functional(t) for t in tensors]
            outs = flat_fn(*wrapped)
            mode.bounded.refuse_results(outs)
            news = updates.collect()
            results = []
            for o in [*outs, *news]:
                if isinstance(o, FunctionalTensor):
                    torch._sync(o)
                    o = torch._from_functional_tensor(o.elem)
                results.append(o)
            return results

    return inner
