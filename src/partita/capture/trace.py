"""trace(): a Python function over pytrees of tensors -> a functional :class:`Program`.

How. The tensor leaves of ``(args, kwargs)`` become graph inputs; every other leaf must be a
static Python value and is baked into the graph. ``make_fx`` traces in fake mode (no memory is
allocated for real shapes; real inputs are converted to fake tensors) below autograd, so a
function that calls ``torch.autograd.grad`` traces to one graph holding forward, backward and
update. Functionalization (``FunctionalTensorMode``, the mode AOTAutograd and ``torch.export``
use; it lets the function call ``requires_grad_`` and ``autograd.grad``) turns every in-place
op into its functional form. The decomposition table of :mod:`decompositions` fixes the op set
and :mod:`normalize` then rewrites views, transposes and splits to a few ops.

Annotations: ``in_specs`` add ``partita::annotate`` nodes right after the inputs, ``out_specs``
right before the output, and :func:`partita.capture.annotate` calls inside the function add
their own; ``Program.annotations`` maps each annotate node to its Annotation.

``in_specs`` follows the JAX convention, PyTorch-spelled: a *prefix* of the ``args`` pytree
whose leaves are ``P`` (or None for "not annotated"). ``in_specs=(P('x'), None)`` annotates
every tensor of the first argument with ``P('x')``; ``in_specs=({'w': P(None, 'y')},)`` one
entry of a dict; a single ``P`` applies to every tensor argument. Keyword arguments are not
annotated by ``in_specs``. ``out_specs`` is a prefix of the result pytree in the same way.

Tensor constants: a tensor the function uses without receiving it (a closed-over tensor, a
literal such as ``torch.tensor(2.0)``, the parameters of a module it calls) is lifted into a
program input after the user's inputs (:mod:`lift`; ``Program.constants`` holds the values,
annotated replicated), so later stages only see inputs.

Results: the tensor leaves of the result are the graph's outputs. A non-tensor leaf (None, a
number, a string, a shape: the static types inputs may have) is computed while tracing, so it is
the same on every call with this signature (a value read from a tensor is data-dependent and
fails, below); ``Program.static_outputs`` keeps it and ``unflatten_outputs`` puts it back.

In-place updates of inputs (``x.add_(1)``, ``x[0] = 5``, a buffer's ``mul_``) take effect as in
``torch.compile``: the graph returns each updated input's new value after the result
(``Program.mutated_inputs``) and the caller copies it back (:mod:`functionalize`).

What trace does not do: it does not propagate or check shardings, and it does not support
data-dependent code (``.item()``, ``.tolist()``, a Python branch on a tensor value): that fails
with a CaptureError naming the user's line (:mod:`diagnose`).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.fx.traceback as fx_traceback
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from partita.capture.annotate import ANNOTATE_OP, lookup, new_key, tracing_scope
from partita.capture.decompositions import decomposition_table
from partita.capture.diagnose import (
    DATA_DEPENDENT_HINT,
    capture_error,
    check_data_independent,
    quiet_meta_failures,
)
from partita.capture.fake_inputs import fake_inputs
from partita.capture.functionalize import InputUpdates, functionalized
from partita.capture.fx_nodes import add_node
from partita.capture.gc_pause import gc_paused
from partita.capture.kv_cache import flatten_registering_caches, kv_cache_hint
from partita.capture.layer_loop import inline_layer_calls
from partita.capture.layers import scan_scope
from partita.capture.lift import lift_constants
from partita.capture.normalize import normalize
from partita.capture.program import Program
from partita.capture.rng import DrawKeys, replay_draws, tracing_rng
from partita.capture.source import format_source, source_from_stack_trace, user_frame
from partita.capture.spec_tree import broadcast_specs, is_size, unflatten_args
from partita.capture.threads import TRACING
from partita.errors import CaptureError, CompilerError, PartitaError
from partita.ir import node_meta
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec

__all__ = ["broadcast_specs", "input_path", "trace"]

_STATIC_TYPES = (
    type(None), bool, int, float, complex, str, bytes, type(Ellipsis), slice, enum.Enum,
    torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size, Mesh, PartitionSpec,
)  # fmt: skip


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _check_leaves(paths: list[tuple[Any, Any]], fn_name: str) -> None:
    for path, leaf in paths:
        if isinstance(leaf, torch.Tensor) or isinstance(leaf, _STATIC_TYPES):
            continue
        raise CaptureError(
            f"Cannot trace {fn_name!r}: input {input_path(path)} is a "
            f"{type(leaf).__name__} ({leaf!r:.80}), which is neither a tensor (a graph input) "
            f"nor a static Python value (int, float, bool, str, None, dtype, ...). Convert it "
            f"with torch.as_tensor, or close over it in the function instead of passing it."
        )


def trace(
    fn: Callable[..., Any],
    args: tuple[Any, ...] | list[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    in_specs: Any = None,
    out_specs: Any = None,
    mesh: Mesh | None = None,
    kwarg_specs: dict[str, Any] | None = None,
    leaf_specs: Sequence[PartitionSpec | None] | None = None,
) -> Program:
    """Capture ``fn(*args, **kwargs)`` as a functional graph of aten ops.

    Args:
        fn: a function of pytrees (dicts, lists, tuples) of tensors; non-tensor leaves are static.
        args, kwargs: example inputs; only their shapes and dtypes matter (traced as fakes).
        in_specs: a prefix of the ``args`` pytree with ``P`` / None leaves (see module doc).
        out_specs: a prefix of the result pytree with ``P`` / None leaves.
        mesh: the mesh of ``in_specs`` and ``out_specs`` (required when they are given).
        kwarg_specs: the specs of keyword arguments, by name (a prefix of the ``kwargs``
            pytree); a keyword argument without one is replicated.
        leaf_specs: one spec (or None) per leaf of ``(args, kwargs)``, already broadcast.

    Raises:
        CaptureError: ``fn`` cannot be traced (the message names fn and the cause).
        ShardingConflictError: annotations on two different meshes.

    Example:
        >>> mesh = Mesh.create((2, 4), ("x", "y"))
        >>> program = trace(torch.mm, (torch.ones(8, 4), torch.ones(4, 8)), mesh=mesh,
        ...                 in_specs=(P("x", None), None), out_specs=P("x", None))
        >>> len(program.annotations)
        2
    """
    # One trace at a time in the process: make_fx's tracer keeps process-global state (torch.fx
    # patches module globals through one CURRENT_PATCHER), so two threads tracing at once
    # corrupt each other's trace. Other threads still run programs meanwhile.
    with TRACING, gc_paused():  # every object built here lives until we return: see gc_pause
        return _trace(fn, args, kwargs, in_specs, out_specs, mesh, kwarg_specs, leaf_specs)


def _trace(
    fn: Callable[..., Any],
    args: tuple[Any, ...] | list[Any],
    kwargs: dict[str, Any] | None,
    in_specs: Any,
    out_specs: Any,
    mesh: Mesh | None,
    kwarg_specs: dict[str, Any] | None = None,
    leaf_specs: Sequence[PartitionSpec | None] | None = None,
) -> Program:
    name = _fn_name(fn)
    if not isinstance(args, (tuple, list)):
        raise CaptureError(
            f"trace({name!r}, args): args must be a tuple, got {type(args).__name__}."
        )
    args, kwargs = tuple(args), dict(kwargs or {})
    given = (in_specs, out_specs, kwarg_specs, leaf_specs)
    if any(s is not None for s in given) and not isinstance(mesh, Mesh):
        raise CaptureError(
            f"trace({name!r}) got in_specs/out_specs but mesh={mesh!r}: pass mesh=Mesh(...)."
        )
    leaf_paths, in_tree = flatten_registering_caches((args, kwargs))
    _check_leaves(leaf_paths, name)
    leaves = [leaf for _, leaf in leaf_paths]
    tensor_idx = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    statics = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
    n_arg_leaves = pytree.tree_structure(args).num_leaves
    in_spec_flat: list[PartitionSpec | None] = [None] * len(leaves)
    if leaf_specs is not None:  # one per leaf, broadcast by the front end (partita.pipeline)
        if len(leaf_specs) != len(leaves):
            raise CompilerError(f"trace({name!r}): {len(leaf_specs)} specs, {len(leaves)} leaves")
        in_spec_flat = list(leaf_specs)
    if in_specs is not None:
        in_spec_flat[:n_arg_leaves] = broadcast_specs(in_specs, args, "in_specs", name)
    if kwarg_specs:
        unknown = sorted(set(kwarg_specs) - set(kwargs))
        if unknown:
            raise CaptureError(
                f"in_specs of {name!r} name {unknown}, which are not keyword arguments of this "
                f"call (it has {sorted(kwargs)})."
            )
        by_key = {k: kwarg_specs.get(k) for k in kwargs}
        in_spec_flat[n_arg_leaves:] = broadcast_specs(by_key, kwargs, "in_specs", name)
    out_tree_box: list[pytree.TreeSpec] = []
    received: list[torch.Tensor] = []  # what fn itself received, per tensor input
    out_spec_box: list[tuple[PartitionSpec | None, str]] = []
    static_outs: dict[int, Any] = {}  # non-tensor result leaves, by leaf index

    def flat_fn(*tensors: torch.Tensor) -> list[torch.Tensor]:
        full = list(leaves)
        received.clear()
        for i, t in zip(tensor_idx, tensors, strict=True):
            full[i] = t
            received.append(t)
        call_args, call_kwargs = unflatten_args(full, in_tree)
        result = fn(*call_args, **call_kwargs)
        # A torch.Size is one static leaf (pytree would return it as a plain tuple of ints).
        out_paths, out_tree = flatten_registering_caches(result, is_leaf=is_size)
        outs = [leaf for _, leaf in out_paths if isinstance(leaf, torch.Tensor)]
        static_outs.clear()
        for i, (path, leaf) in enumerate(out_paths):
            if isinstance(leaf, torch.Tensor):
                continue
            where = pytree.keystr(path) or "the top level"
            if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise CaptureError(
                    f"{name!r} returns a Python number read from a tensor at {where} (.item(), "
                    f".tolist()): {DATA_DEPENDENT_HINT}"
                )
            if not isinstance(leaf, _STATIC_TYPES):
                raise CaptureError(
                    f"{name!r} returned {type(leaf).__name__} {leaf!r:.80} at "
                    f"{where}; a traced function returns "
                    f"tensors and static Python values (None, numbers, strings, dtypes) in "
                    f"dicts, lists and tuples. Return the tensors it is made of, or build the "
                    f"object outside the traced function{kv_cache_hint(leaf)}."
                )
            static_outs[i] = leaf  # fixed for the signature: it cannot depend on values
        if out_specs is not None:  # annotated after tracing (_annotate_inputs_outputs)
            specs = broadcast_specs(out_specs, result, "out_specs", name)
            out_spec_box[:] = [
                (s, f"out_specs for output{pytree.keystr(p)}")
                for (p, leaf), s in zip(out_paths, specs, strict=True)
                if isinstance(leaf, torch.Tensor)
            ]
        out_tree_box.append(out_tree)
        return outs

    input_names = tuple(input_path(leaf_paths[i][0]) for i in tensor_idx)
    shapes = [tuple(leaves[i].shape) for i in tensor_idx]
    specs = [in_spec_flat[i] for i in tensor_idx]
    updates = InputUpdates(received, input_names, shapes, specs, mesh, name)
    draws = DrawKeys()  # each random op's generator state (capture/rng.py)
    with tracing_scope(mesh, "trace(mesh=...)") as state, scan_scope(name):
        try:
            # A lazy GraphModule generates its Python code only when it is run or printed:
            # later stages read the graph, and normalising and lifting edit it, so the code
            # of a thousands-node step would be generated (up to 3 times) for nothing.
            with (
                fx_traceback.preserve_node_meta(),
                _compiling(),
                _use_lazy_graph_module(True),
                quiet_meta_failures(),
                tracing_rng(),
            ):
                gm = make_fx(
                    functionalized(flat_fn, updates),
                    decomposition_table=draws.wrap(decomposition_table()),
                    tracing_mode="fake",
                    # No TorchFunctionMode recording each torch call's function in node.meta
                    # (nothing reads it): with one active every tensor method leaves the C++ fast
                    # path for Python; 14% of GPT-M's trace (measured, same graph).
                    _disable_torch_fn_metadata_mode=True,
                    _allow_non_fake_inputs=True,
                )(*fake_inputs(_distinct([leaves[i] for i in tensor_idx])))
        except PartitaError:
            raise
        except Exception as e:
            raise capture_error(name, e) from e
        replay_draws(gm, draws, name)  # a checkpointed block's dropout draws its mask once
        inline_layer_calls(gm)  # layers traced once (partita.scan_layers) become their graphs
        if mesh is not None:
            ins = [(in_spec_flat[i], f"in_specs for {input_path(leaf_paths[i][0])}")
                   for i in tensor_idx]  # fmt: skip
            where = format_source(user_frame())  # the user's call, as a traced annotate has
            _annotate_inputs_outputs(gm, mesh, ins, out_spec_box, where)
        check_data_independent(gm, name)
        normalize(gm)
        annotations = {}
        for node in gm.graph.nodes:
            if node.op == "call_function" and not node_meta.has_source(node):
                node_meta.set_source(node, source_from_stack_trace(node.meta.get("stack_trace")))
            if node.op == "call_function" and node.target == ANNOTATE_OP:
                ann = lookup(node.args[1])
                if ann is None:
                    raise CaptureError(f"Annotation {node.args[1]} of {name!r} was lost.")
                node_meta.set_annotation(node, ann)
                annotations[node] = ann
        del state
    constants, constant_annotations = lift_constants(gm, mesh)
    annotations.update(constant_annotations)
    gm.graph.lint()
    gm.recompile()
    _check_functional(gm, name)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return Program(
        graph_module=gm,
        in_tree=in_tree,
        out_tree=out_tree_box[-1],
        input_nodes=inputs,
        num_inputs=len(inputs),
        annotations=annotations,
        tensor_leaves=tensor_idx,
        static_leaves=statics,
        name=name,
        constants=tuple(constants),
        mutated_inputs=tuple(updates.positions),
        input_names=input_names,
        static_outputs=dict(static_outs),
    )


def _annotate_inputs_outputs(
    gm: torch.fx.GraphModule,
    mesh: Mesh,
    ins: list[tuple[PartitionSpec | None, str]],
    outs: list[tuple[PartitionSpec | None, str]],
    where: str | None,
) -> None:
    """Add the annotate nodes of ``in_specs`` (right after the inputs) and ``out_specs`` (right
    before the output) to the traced graph, as tracing ``annotate`` calls would have."""
    graph = gm.graph

    def add(value: torch.fx.Node, spec: PartitionSpec, source: str) -> torch.fx.Node:
        key = new_key(mesh, spec, value.meta["val"].ndim, source=source)
        node = add_node(graph, ANNOTATE_OP, (value, key), name="annotate")
        node.meta["val"] = value.meta["val"]
        node_meta.set_source(node, where)
        return node

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    for node, (spec, source) in zip(placeholders, ins, strict=True):
        if spec is None:
            continue
        with graph.inserting_after(anchor):
            annotated = add(node, spec, source)
        node.replace_all_uses_with(annotated, delete_user_cb=lambda u, a=annotated: u is not a)
        anchor = annotated
    output = graph.output_node()
    results = list(cast("Sequence[torch.fx.Node]", output.args[0]))
    for i, (spec, source) in enumerate(outs):
        if spec is not None:
            with graph.inserting_before(output):
                results[i] = add(results[i], spec, source)
    output.args = (results,)


def input_path(path: Any) -> str:
    """``args[0]['w']`` / ``kwargs['x']`` for a path into ``(args, kwargs)``."""
    text = pytree.keystr(path)
    if text.startswith("[0]"):
        return "args" + text[3:]
    if text.startswith("[1]"):
        return "kwargs" + text[3:]
    return text


def _check_functional(gm: torch.fx.GraphModule, name: str) -> None:
    """No captured op may mutate (an internal invariant; a failure is a partita bug)."""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable:
            raise CaptureError(
                f"Capturing {name!r} left the mutating op {node.target} at "
                f"{node_meta.source(node) or 'an unknown line'}; this is a partita bug, "
                f"please report it with the function."
            )


def _distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor object per input leaf: make_fx maps one object to one placeholder, so the same
    tensor passed twice would make two inputs one (only shapes and dtypes matter here)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        out.append(torch.empty_like(t) if id(t) in seen else t)
        seen.add(id(t))
    return out


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """Say that a compiler is tracing, as torch.export does: model libraries check
    ``torch.compiler.is_compiling()`` to skip data-dependent Python branches
    (``if mask.all(): ...``) that cannot run on fake tensors. torch.compile'd functions run
    eagerly meanwhile (``set_stance("force_eager")``)."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    # A CPU nn.LSTM picks oneDNN's fused layer (aten.mkldnn_rnn_layer: no sharding rule) while
    # oneDNN is on; off, it traces to its cells' matmuls and activations, as nn.GRU and nn.RNN
    # do. The flag only selects kernels: every other traced op is the same. (Not
    # torch.backends.mkldnn.flags, which also sets the TF32 precision and warns about it.)
    # A torch.compile'd function called inside (a compiled submodule, transformers' flex
    # attention masks) runs its Python code, traced like the rest: compiled, its kernel would
    # run on fake tensors, which have no data.
    mkldnn = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        torch._C._set_mkldnn_enabled(mkldnn)
        torch.compiler._is_compiling_flag = old
