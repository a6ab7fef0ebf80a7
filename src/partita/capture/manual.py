"""The boundaries of manual (``shard_map``) regions inside a captured program.

A manual region is per-device code inside a global program. Capture marks where it starts and
ends with two identity-like custom ops that change the *shape* a value is traced with:

- ``partita::manual_enter(Tensor x, int key) -> Tensor``: a global value becomes the local
  block of one device (shape ``Boundary.local_shape``); the ops after it are traced on local
  shapes, exactly as they will run on each device;
- ``partita::manual_exit(Tensor x, int key) -> Tensor``: a local block becomes the global value
  whose sharding is ``Boundary.sharding`` (the region's out_specs).

``key`` indexes a module-level table of :class:`Boundary` records (kept for the life of the
process: a compiled program may be lowered again later). A key is a hash of the boundary's
contents, so the same region called again (every step of a virtual-device loop) gives the same
key, and a key means the same boundary in every process (it is part of the virtual device's
structural cache key, which its persistent cache shares between processes).

Each op's gradient is the other op: the cotangent of an enter is an exit back to the input's
sharding; the cotangent of an exit is an enter, summed over the manual axes the output was
*declared* varying over but did not vary over (JAX's implicit ``pvary``, whose transpose is a
``psum``).

:func:`local_nodes` classifies the nodes of a captured graph: which of them compute on local
blocks (the region bodies, forward and backward). Propagation leaves them alone and the
partitioner copies them verbatim. This module does not check the user's specs (``partita.manual``
does, at trace time) and does not lower anything.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from partita.ir.collectives import all_reduce
from partita.values.spec import Sharding

__all__ = [
    "ENTER_OP",
    "EXIT_OP",
    "Boundary",
    "boundary",
    "enter",
    "exit_region",
    "is_fully_manual",
    "local_nodes",
    "new_boundary",
]


@dataclass(frozen=True, slots=True)
class Boundary:
    """One crossing between the global program and a manual region.

    Attributes:
        sharding: the global side's sharding (an input's in_spec, an output's out_spec).
        global_shape, local_shape: the value's shape on each side.
        manual_axes: the mesh axes the region is manual over.
        psum_axes: for an exit, the manual axes its cotangent is summed over (declared varying
            by out_specs, invariant in the body).
        what: the value in words, for messages (``"shard_map(f) input 0"``).
        transpose: the key of the boundary its gradient crosses (an exit for an enter).
    """

    sharding: Sharding
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    manual_axes: tuple[str, ...]
    psum_axes: tuple[str, ...] = ()
    what: str = ""
    transpose: int = -1


_BOUNDARIES: dict[int, Boundary] = {}


def _content(b: Boundary) -> str:
    s, m = b.sharding, b.sharding.mesh
    return repr(
        (
            (s.dim_axes, s.partial, s.reduce_op),
            (m.shape, m.axis_names, m.device_ids),
            b.global_shape,
            b.local_shape,
            b.manual_axes,
            b.psum_axes,
            b.what,
            b.transpose,
        )
    )


def new_boundary(b: Boundary) -> int:
    """Record ``b``; returns its key (the same key for an equal boundary)."""
    digest = hashlib.sha256(_content(b).encode()).digest()
    key = int.from_bytes(digest[:8], "little") >> 2  # fits the schema's int64, non-negative
    while _BOUNDARIES.setdefault(key, b) != b:  # a collision of 62-bit hashes: next free key
        key += 1
    return key


def boundary(key: int) -> Boundary:
    """The boundary recorded under ``key``."""
    return _BOUNDARIES[key]


# --- the two ops -----------------------------------------------------------------------------


@torch.library.custom_op(
    "partita::manual_enter", mutates_args=(), schema="(Tensor x, int key) -> Tensor"
)
def _enter(x: Tensor, key: int) -> Tensor:
    return x.new_zeros(boundary(key).local_shape)


@_enter.register_fake
def _(x: Tensor, key: int) -> Tensor:
    return x.new_empty(boundary(key).local_shape)


@torch.library.custom_op(
    "partita::manual_exit", mutates_args=(), schema="(Tensor x, int key) -> Tensor"
)
def _exit(x: Tensor, key: int) -> Tensor:
    return x.new_zeros(boundary(key).global_shape)


@_exit.register_fake
def _(x: Tensor, key: int) -> Tensor:
    return x.new_empty(boundary(key).global_shape)


def _save_key(ctx: object, inputs: tuple[Tensor, int], output: Tensor) -> None:
    ctx.key = inputs[1]  # type: ignore[attr-defined]


def _enter_backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
    return _exit(grad, boundary(ctx.key).transpose), None  # type: ignore[attr-defined]


def _exit_backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:
    b = boundary(ctx.key)  # type: ignore[attr-defined]
    local = _enter(grad, b.transpose)
    if b.psum_axes:
        size = b.sharding.mesh.axes_size(b.psum_axes)
        local = all_reduce(local, "sum", b.psum_axes, size)
    return local, None


_enter.register_autograd(_enter_backward, setup_context=_save_key)
_exit.register_autograd(_exit_backward, setup_context=_save_key)

ENTER_OP = torch.ops.partita.manual_enter.default
EXIT_OP = torch.ops.partita.manual_exit.default


def enter(x: Tensor, key: int) -> Tensor:
    """The local block of ``x`` on entering a region (see the module doc)."""
    return _enter(x, key)


def exit_region(x: Tensor, key: int) -> Tensor:
    """The global value of the local block ``x`` on leaving a region."""
    return _exit(x, key)


# --- which nodes are local -------------------------------------------------------------------

#: The ``node.meta["custom"]`` key capture sets on the forward nodes of a region body (through
#: ``torch.fx.traceback.annotate``; its value: the region's manual axes), so that body ops
#: without tensor operands (``torch.zeros`` in the body) are known to be local too.
REGION_TAG = "partita_manual_region"


def local_nodes(gm: fx.GraphModule) -> dict[fx.Node, tuple[str, ...]]:
    """The nodes of ``gm`` that compute on local blocks, each with its region's manual axes:
    region entries and every node that reads a local value or was traced inside a region body,
    up to (not including) the exits.

    Example: in ``enter -> mm -> all_reduce -> exit -> relu`` the first three are local.
    """
    local: dict[fx.Node, tuple[str, ...]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is EXIT_OP:
            continue
        if node.target is ENTER_OP:
            local[node] = boundary(node.args[1]).manual_axes
            continue
        axes = None
        if node.target is not operator.getitem:
            custom = node.meta.get("custom")  # most nodes carry none: _tag is not called
            if custom:
                axes = _tag(node)
        if local:  # nothing is local before the first entry or tagged node
            for a in node.all_input_nodes:  # args then kwargs, as written (cheaper than pytree)
                if a in local:
                    axes = local[a]
                    break
        if axes is not None:
            local[node] = axes
    return local


def _tag(node: fx.Node) -> tuple[str, ...] | None:
    axes = (node.meta.get("custom") or {}).get(REGION_TAG)
    return tuple(axes) if axes is not None else None


def is_fully_manual(axes: tuple[str, ...], mesh_axes: tuple[str, ...]) -> bool:
    """Whether a region manual over ``axes`` leaves no mesh axis to propagation."""
    return set(mesh_axes) <= set(axes)
