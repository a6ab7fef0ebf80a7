"""When the LocalMesh traces a segment's vmap to a flat graph, and the trace itself.

A segment runs as nested ``torch.vmap`` calls (``runtime.segments``). Traced with ``make_fx``
to a flat graph of batched aten ops, it runs without functorch's per-op overhead; but tracing
costs about a millisecond per node, 25 to 50 times one eager run of a small segment (a tiny
model's forward, an optimizer update), about as much as compiling the whole program. Traced at
the second run, that made a jitted function's second call as slow as its first.

So a segment is traced once its eager runs have cost as much as the trace is expected to
(ski rental: whatever the number of runs, the time spent is at most twice what the best
choice in hindsight would have spent). The expected cost is the segment's node count times
the seconds per node of the traces made so far in this process (1 ms per node before the
first); both are thread CPU time, and a segment's first run is not counted (it also pays
one-time costs). A large segment whose eager run is long (a GPT step's forward or backward)
is traced at its third run; a tiny model's forward after some dozens of calls, and a function
called a few times never. The runs are counted per segment, not per input signature: a flat
graph's outputs may have other strides than vmap's, so tracing one segment changes the
signature of the next; counted per signature, each segment waited a call more than the one
before it (GPT's 2-D step traced 14 segments at its second call and 12 at its third).
Counted per segment, a segment that is due traces a new signature at once: the 2-D step
traces all 26 in one call. ``PARTITA_TRACE_FLAT_AT=n`` traces every segment at its ``n``-th
run instead (``2``: the second; ``0``: never). A caller that knows it runs in a loop (a training
step: ``partita.train_step``) runs inside :func:`repeated`, which traces every segment at its
second run unless ``trace_flat_at`` says otherwise: the loop will run it far more often than
the break-even (a tiny GPT's 2-D step traced in 0.8 s saves 10 ms per step). The results of
eager and flat runs agree to float rounding (the flat graph may fold a broadcast ``bmm`` into
one ``mm``: another summation order).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from partita.capture.fake_inputs import fake_inputs
from partita.capture.gc_pause import gc_paused
from partita.capture.threads import TRACING
from partita.runtime.flat_foreach import foreach_elementwise
from partita.runtime.flat_matmul import fold_broadcast_bmms, fuse_bias_adds
from partita.runtime.flat_views import fold_permutes

__all__ = [
    "FlatTracer",
    "no_fallback_warning",
    "no_new_traces",
    "record_trace_cost",
    "repeated",
    "significant_strides",
    "timed_run",
    "trace_fake",
    "trace_flat",
    "vmap_axis",
]

aten = torch.ops.aten

_TO_RESHAPE = {aten.view.default, aten._unsafe_view.default}
#: Seconds per traced node assumed before this process has traced anything.
_DEFAULT_SECONDS_PER_NODE = 1e-3
#: Traces made in this process: [seconds, nodes] (the estimate of the next trace's cost).
_TRACED = [0.0, 0]
#: Inside :func:`repeated`: the cost-based choice traces at the second run.
_REPEATED: contextvars.ContextVar[bool] = contextvars.ContextVar("partita_repeated", default=False)


#: Inside :func:`no_new_traces`: no segment is traced (the whole step is being traced).
_NO_TRACES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "partita_no_traces", default=False
)


@contextlib.contextmanager
def no_new_traces() -> Iterator[None]:
    """No segment is traced inside (``runtime.fused_step`` traces the whole step through
    them: a segment without a flat graph for its signature is traced through its vmap)."""
    token = _NO_TRACES.set(True)
    try:
        yield
    finally:
        _NO_TRACES.reset(token)


@contextlib.contextmanager
def repeated() -> Iterator[None]:
    """Runs inside are one step of a loop (a training step): a segment whose tracing is left
    to the cost (``trace_flat_at`` None) is traced at its second run, not at the break-even."""
    token = _REPEATED.set(True)
    try:
        yield
    finally:
        _REPEATED.reset(token)


class FlatTracer:
    """The eager runs so far of one segment (any input signature), and when to trace it.

    ``due(n_nodes, at)`` says whether this run should trace (``at``: the ``trace_flat_at``
    option, None for the cost-based choice); ``spent(seconds)`` records an
    eager run."""

    __slots__ = ("runs", "seconds")

    def __init__(self) -> None:
        self.runs = 0
        self.seconds = 0.0

    def due(self, n_nodes: int, at: int | None = None) -> bool:
        if _NO_TRACES.get():
            return False
        if at is None and _REPEATED.get():
            at = 2
        if at is not None:
            return at > 0 and self.runs + 1 >= at
        seconds, nodes = _TRACED
        per_node = seconds / nodes if nodes else _DEFAULT_SECONDS_PER_NODE
        return self.runs > 1 and self.seconds >= per_node * n_nodes

    def spent(self, seconds: float) -> None:
        """Record an eager run. The first is not counted: it also pays one-time costs (the
        dispatcher's and the allocator's first use), which would trace a segment early."""
        self.runs += 1
        if self.runs > 1:
            self.seconds += seconds


def timed_run(fn: Callable[..., Any], args: list[Any], tracer: FlatTracer) -> Any:
    """``fn(*args)``, its thread CPU time recorded as one eager run (CPU time, as the traces
    are timed: other processes' load inflates neither)."""
    start = time.thread_time()
    out = fn(*args)
    tracer.spent(time.thread_time() - start)
    return out


def trace_fake(fn: Callable[..., Any], args: Sequence[Any]) -> fx.GraphModule:
    """``make_fx(fn, tracing_mode="fake")(*args)`` for a graph that is only run, with less
    work and the same graph: no torch-function mode recording each call's function in
    ``node.meta`` (nothing reads it; with it, every tensor method leaves the C++ fast path),
    plain inputs made fake from their metadata (``capture.fake_inputs``: ``from_tensor``
    describes each tensor in full and logs it to torch's structured trace), the cyclic
    collector paused, and a lazy ``GraphModule``: its Python code is generated once, when
    it first runs or its ``code`` is read, not again at every ``recompile()`` of the passes
    that edit it after. The caller holds :data:`~partita.capture.threads.TRACING`."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    fakes = iter(fake_inputs(tensors))
    inputs = [next(fakes) if isinstance(a, torch.Tensor) else a for a in args]
    with gc_paused(), _use_lazy_graph_module(True):
        return make_fx(
            fn,
            tracing_mode="fake",
            _allow_non_fake_inputs=True,
            _disable_torch_fn_metadata_mode=True,
        )(*inputs)


def trace_flat(
    fn: Callable[..., Any], args: list[Any], n_nodes: int = 0
) -> Callable[..., Any] | None:
    """``fn`` (nested vmaps) traced on ``args``' metadata to a flat graph of batched aten
    ops, or ``fn`` itself when its batching rules cannot be traced; None, to try again later,
    while another thread traces. ``n_nodes`` (the segment's) calibrates the cost estimate of
    later traces."""
    # make_fx keeps process-global state (see TRACING): while another thread traces, this
    # segment keeps its vmaps (correct, not flattened) rather than wait, since that thread
    # may be waiting for the step this one runs.
    if not TRACING.acquire(blocking=False):
        return None
    start = time.thread_time()
    try:
        flat = trace_fake(fn, args)
    except Exception:  # a batching rule that make_fx cannot trace: vmap stays correct
        return fn
    finally:
        TRACING.release()
    for node in flat.graph.nodes:
        if node.target in _TO_RESHAPE:  # traced on fake strides; reshape is safe on any
            node.target = aten.reshape.default
    flat.graph.eliminate_dead_code()  # views the batching rules made and nothing reads
    flat.recompile()
    fold_broadcast_bmms(flat)
    fuse_bias_adds(flat)
    fold_permutes(flat)
    foreach_elementwise(flat)
    record_trace_cost(time.thread_time() - start, n_nodes)
    return flat


def significant_strides(t: torch.Tensor) -> tuple[int | None, ...]:
    """``t``'s strides with those of its dims of size 1 as None: they address nothing, and
    real and fake tensors disagree on them (``aten.reshape`` to the same shape recomputes
    them on a real tensor and keeps them on a fake one), so a segment keyed on them missed
    its flat graph when the whole step was traced on fake values (``runtime.fused_step``)
    and the fused graph ran that segment's vmap, with other kernels than the interpreter."""
    return tuple(None if n == 1 else s for n, s in zip(t.shape, t.stride(), strict=True))


def record_trace_cost(seconds: float, n_nodes: int) -> None:
    """Count a trace of ``n_nodes`` nodes that took ``seconds`` of thread CPU time in the
    estimate of the next trace's cost (``n_nodes`` 0: not counted)."""
    if n_nodes:
        _TRACED[0] += seconds
        _TRACED[1] += n_nodes


class _Box:
    """An output that does not vary along one vmap's axis, carried out of that vmap as is.

    vmap refuses to return, with ``out_dims=None``, a tensor batched at *any* level; a value
    that varies only along an outer mesh axis is batched at the outer level only, and is
    right to leave the inner vmap unchanged."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


@contextlib.contextmanager
def no_fallback_warning() -> Iterator[None]:
    """No "There is a performance drop because we have not yet implemented the batching rule"
    warnings from inside partita's own vmaps (the user cannot act on them: the LocalMesh
    simply runs such an op once per device). Turned back on after, torch's default."""
    # exists at runtime; torch's stub of torch._C._functorch does not list it
    torch._C._functorch._set_vmap_fallback_warning_enabled(False)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(True)  # type: ignore[attr-defined]


def vmap_axis(
    fn: Callable[..., Any], in_dims: tuple[int | None, ...], out_dims: tuple[int | None, ...]
) -> Callable[..., Any]:
    """``vmap(fn)`` over one mesh axis; the outputs with ``out_dims`` None pass through boxed."""

    def boxed(*args: Any) -> tuple[Any, ...]:
        outs = fn(*args)
        return tuple(_Box(o) if d is None else o for o, d in zip(outs, out_dims, strict=True))

    # vmap takes None in out_dims (an output that is not mapped); its annotation omits it
    mapped = torch.vmap(boxed, in_dims=in_dims, out_dims=out_dims)  # type: ignore[arg-type]

    def unboxed(*args: Any) -> tuple[Any, ...]:
        return tuple(o.value if isinstance(o, _Box) else o for o in mapped(*args))

    return unboxed
