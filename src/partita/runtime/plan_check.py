"""Plan agreement: before every run of a compiled program, the ranks check that they all run it.

Processes that run different per-device programs deadlock at a collective, or worse: if the
programs differ only in their inputs' shapes, the collectives still match and every rank
silently computes a wrong result; if they differ in dtypes, the collectives exchange buffers of
different sizes and Gloo aborts the process. This holds for every call, not only a program's
first: two ranks that both compiled the shapes (8, 4) and (10, 4) can call one each later. So
before each run the ranks all-gather a 64-bit digest of :func:`program_lines` (one int64 per
rank on a group of its own, a collective that cannot mismatch; the digest is computed once per
program) and raise :class:`~partita.errors.PlanMismatchError` on every rank before any
collective of the program. The lines cover:

- every input's global shape, dtype and sharding, with the argument it comes from;
- the mesh, every node of the per-device graph, the output shardings and shapes;
- the torch version.

The error names the ranks of each plan and the first line that differs: this rank's line and
the other rank's, spelled out for an input (``args[0]``: shape, dtype, sharding on each). The
lines are exchanged only when the digests differ.

At a program's first run, :func:`check_replicas` also compares a digest of the bytes of every
input that should be an equal copy on several ranks (replicated over a mesh axis, e.g. the
parameters under data parallelism) and that the user supplied (values partita computed are
equal on their replicas by construction): unseeded initialisation otherwise leaves the
replicas different forever, with equal losses on every rank.
:class:`~partita.errors.ReplicaMismatchError` names the input and the ranks.

This module does not run programs; it only compares them.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from partita.errors import PlanMismatchError, ReplicaMismatchError
from partita.options import CompileOptions
from partita.options import current as current_options
from partita.runtime.comm import call_collective, gather_flat
from partita.runtime.dist_tensor import is_computed
from partita.values.mesh import Mesh
from partita.values.spec import Sharding

__all__ = [
    "CallChecks",
    "call_digest",
    "check_replicas",
    "check_same_program",
    "program_digest",
    "program_lines",
    "replicated_axes",
    "run_options",
    "tensor_digest",
]


def run_options() -> CompileOptions:
    """The options the checks run with (``check_calls``, ``check_replicas``): the current ones
    (``partita.options.current()``), read at each call."""
    return current_options()


class CallChecks:
    """The checks one DistributedMesh runs before each program, with what it remembers per
    program: its digest, whether every rank ran it once, whether its replicas were compared.

    Collective over every rank (``pg``: a group of all of them): every rank calls
    :meth:`program` and then :meth:`replicas` before running a compiled program.
    """

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._digests: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._agreed: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._replicas: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

    def program(self, compiled: Any, pg: Any) -> None:
        """:func:`check_same_program` on every call (its first only if ``check_calls`` is off)."""
        gm = compiled.local
        digest = self._digests.get(gm)
        if digest is None:
            digest = self._digests[gm] = call_digest(compiled)
        if run_options().check_calls or gm not in self._agreed:
            check_same_program(compiled, digest, self.mesh, pg)
            self._agreed[gm] = True

    def replicas(
        self, compiled: Any, leaves: Sequence[Any], inputs: Sequence[torch.Tensor], pg: Any
    ) -> None:
        """:func:`check_replicas` at the program's first run (unless ``check_replicas`` is off),
        on the inputs the user supplied (``leaves``: the arguments, ``inputs``: their shards)."""
        gm = compiled.local
        if gm in self._replicas or not run_options().check_replicas:
            return
        users = [not is_computed(leaf) for leaf in leaves]
        check_replicas(compiled, inputs, users, self.mesh, pg)
        self._replicas[gm] = True


_INPUT = "input "


def input_paths(program: Any) -> list[str]:
    """For each graph input, the argument it comes from: ``args[0]``, ``kwargs['mask'][1]``."""
    leaves = pytree.tree_unflatten(list(range(program.in_tree.num_leaves)), program.in_tree)
    by_leaf: dict[int, str] = {}
    for path, leaf in pytree.tree_flatten_with_path(leaves)[0]:
        head, rest = path[0], path[1:]
        root = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
        by_leaf[leaf] = root + pytree.keystr(rest)
    return [by_leaf.get(i, f"leaf {i}") for i in program.tensor_leaves]


def input_lines(compiled: Any) -> list[str]:
    """``input 0 (args[0]): shape (8, 4), dtype torch.float32, sharding P('data', None)``."""
    paths = input_paths(compiled.program)
    lines = []
    for i, (node, sharding) in enumerate(
        zip(compiled.program.input_nodes, compiled.input_shardings, strict=True)
    ):
        val = node.meta.get("val")
        shape = tuple(val.shape) if val is not None else "?"
        dtype = val.dtype if val is not None else "?"
        where = paths[i] if i < len(paths) else f"input {i}"
        lines.append(f"{_INPUT}{i} ({where}): shape {shape}, dtype {dtype}, sharding {sharding}")
    return lines


def program_lines(compiled: Any) -> list[str]:
    """What the ranks must agree on: the inputs first, then the program, then its outputs."""
    lines = input_lines(compiled)
    for sharding in [*compiled.input_shardings, *compiled.output_shardings][:1]:
        lines.append(f"mesh: {sharding.mesh!r} devices {list(sharding.mesh.device_ids)}")
    lines += [node.format_node() or "" for node in compiled.local.graph.nodes]
    lines.append(f"outputs: {[str(s) for s in compiled.output_shardings]}")
    lines.append(f"output shapes: {compiled.output_shapes}")
    lines.append(f"torch {torch.__version__}")
    return lines


def program_digest(compiled: Any) -> str:
    return hashlib.sha256("\n".join(program_lines(compiled)).encode()).hexdigest()


def call_digest(compiled: Any) -> int:
    """The first 64 bits of :func:`program_digest`, as a signed int64 (what every call sends)."""
    return int.from_bytes(bytes.fromhex(program_digest(compiled)[:16]), "big", signed=True)


def _hex(digest: int) -> str:
    return f"{digest & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def check_same_program(compiled: Any, digest: int, mesh: Mesh, pg: Any = None) -> None:
    """All-gather ``digest`` (:func:`call_digest` of ``compiled``) over every rank; raise
    PlanMismatchError, on every rank, if any differs.

    Collective over every rank (``pg``: a group of all of them, default the world): every rank
    calls it before each run of a compiled program. The program lines are exchanged (to say
    what differs) only on a mismatch.
    """
    mine = torch.tensor([digest], dtype=torch.int64)
    world = dist.get_world_size()
    every = gather_flat(mine, world, pg, "", "plan check", mesh.axis_names, None).reshape(-1)
    if bool((every == every[0]).all()):
        return
    digests = [_hex(int(d)) for d in every.tolist()]
    lines: list[Any] = [None] * world
    mine_lines = program_lines(compiled)
    call_collective("", "plan check", mesh.axis_names, None,
                    lambda: dist.all_gather_object(lines, mine_lines, group=pg))  # fmt: skip
    raise mismatch_error(dist.get_rank(), digests, lines)


def mismatch_error(rank: int, digests: list[str], lines: list[list[str]]) -> PlanMismatchError:
    """The error for ``rank``, given every rank's digest and program lines."""
    by_digest: dict[str, list[int]] = {}
    for r, d in enumerate(digests):
        by_digest.setdefault(d, []).append(r)
    other = next(r for r, d in enumerate(digests) if d != digests[rank])
    mine, theirs = lines[rank], lines[other]
    first = next(
        (i for i, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y),
        min(len(mine), len(theirs)),
    )

    def line(of: list[str]) -> str:
        return of[first].strip() if first < len(of) else "<end of program>"

    summary = "; ".join(f"ranks {ranks} have plan {d[:12]}" for d, ranks in by_digest.items())
    a, b = line(mine), line(theirs)
    if a.startswith(_INPUT) and b.startswith(_INPUT) and a.split(":")[0] == b.split(":")[0]:
        name, mine_desc = a.split(": ", 1)
        theirs_desc = b.split(": ", 1)[1]
        where = (
            f"The first difference is {name}: this rank ({rank}) has {mine_desc}; rank "
            f"{other} has {theirs_desc}. The collectives would exchange buffers of different "
            f"sizes (an abort) or silently combine shards of different tensors (a wrong "
            f"result)."
        )
        fix = (
            "Every process must pass the same global shapes, dtypes and specs: shapes are "
            "global, not a process's rows; build a global batch from per-process rows with "
            "partita.data.make_global or GlobalBatchLoader, drop (or pad alike) a last batch "
            "that is short on some processes only, and cast on every process alike."
        )
    else:
        where = (
            f"The first difference is at line {first} of the per-device program: this rank "
            f"({rank}) has `{a}`, rank {other} has `{b}`. Running them would deadlock at a "
            f"collective."
        )
        fix = (
            "Every process must run the same code with the same global shapes, dtypes and "
            "specs (check per-rank branches, per-host batch shapes and versions of partita and "
            "torch)."
        )
    return PlanMismatchError(
        f"The processes are about to run different programs in one call: {summary}. {where} {fix}"
    )


# --- replicas --------------------------------------------------------------------------------


def replicated_axes(sharding: Sharding) -> tuple[str, ...]:
    """The mesh axes (of more than one device) over which a value is an equal copy."""
    used = {a for axes in sharding.dim_axes for a in axes} | set(sharding.partial)
    mesh = sharding.mesh
    return tuple(a for a in mesh.axis_names if a not in used and mesh.axis_size(a) > 1)


def tensor_digest(t: torch.Tensor) -> int:
    """A 64-bit digest of ``t``'s dtype, shape and bytes, as a signed int64 (exact: a replica
    that differs in one bit differs here)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.blake2b(f"{t.dtype} {tuple(t.shape)}".encode(), digest_size=8)
    if flat.numel():
        # an ndarray is a buffer (no copy); numpy's stubs declare __buffer__ for Python 3.12+ only
        h.update(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
    return int.from_bytes(h.digest(), "big", signed=True)


def check_replicas(
    compiled: Any,
    local_inputs: Sequence[torch.Tensor],
    checked: Sequence[bool],
    mesh: Mesh,
    pg: Any = None,
) -> None:
    """Raise ReplicaMismatchError, on every rank, if an input replicated over some mesh axes
    differs between the ranks that should hold equal copies of it.

    ``checked[i]``: whether input ``i`` is compared (the user's values; partita's own outputs
    are equal on their replicas by construction). Collective over every rank: one all-gather
    of one int64 per compared input, so that every rank sees every group and all raise alike.
    """
    axes = [
        replicated_axes(s) if c else ()
        for s, c in zip(compiled.input_shardings, checked, strict=True)
    ]
    compared = [i for i, a in enumerate(axes) if a]
    if not compared:
        return
    mine = torch.tensor([tensor_digest(local_inputs[i]) for i in compared], dtype=torch.int64)
    world = dist.get_world_size()
    every = gather_flat(mine, world, pg, "", "replica check", mesh.axis_names, None)
    bad: list[str] = []
    for j, i in enumerate(compared):
        for members in mesh.groups(axes[i]):
            values: dict[int, list[int]] = {}
            for r in members:
                values.setdefault(int(every[r, j]), []).append(r)
            if len(values) > 1:
                bad.append(_replica_line(compiled, i, axes[i], list(values.values())))
                break
    if bad:
        raise replica_error(bad, len(compared))


def input_name(compiled: Any, i: int) -> str:
    """How the user knows input ``i``: its parameter name or argument path, and its index."""
    node = compiled.program.input_nodes[i]
    plan = getattr(compiled, "plan", None)
    names = getattr(plan, "input_names", None) or {}
    paths = input_paths(compiled.program)
    path = paths[i] if i < len(paths) else "a closed-over tensor"
    name = names.get(node.name)
    return f"{name} (input {i})" if name else f"input {i} ({path})"


def _replica_line(compiled: Any, i: int, axes: tuple[str, ...], parts: list[list[int]]) -> str:
    over = "mesh axis" if len(axes) == 1 else "mesh axes"
    held = ", ".join(f"ranks {rs}" for rs in parts)
    return (
        f"{input_name(compiled, i)}, replicated over {over} {', '.join(map(repr, axes))}: "
        f"{held} hold {len(parts)} different values"
    )


def replica_error(bad: list[str], compared: int) -> ReplicaMismatchError:
    shown = "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
    return ReplicaMismatchError(
        f"{len(bad)} of the {compared} replicated input(s) differ between ranks that must hold "
        f"equal copies of them: {shown}. Each rank computes with its own copy, so the copies "
        f"would stay different for the whole run (data-parallel replicas with equal losses "
        f"and different weights). Seed every process alike before building the model "
        f"(torch.manual_seed(0) before model = ...), or broadcast the initial values from "
        f"rank 0 (torch.distributed.broadcast(p.data, src=0) for each parameter), and pass "
        f"replicated arguments equal on every process. The check compares exact bytes at a "
        f"program's first run; CompileOptions(check_replicas=False) or "
        f"PARTITA_CHECK_REPLICAS=0 on every process turns it off."
    )
