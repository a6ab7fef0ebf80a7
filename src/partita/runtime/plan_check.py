"""Plan agreement: before a compiled program first runs, every rank checks that all compiled it.

Processes that run different per-device programs deadlock at a collective, or worse: if the
programs differ only in their inputs' shapes, the collectives still match and every rank
silently computes a wrong result; if they differ in dtypes, the collectives exchange buffers of
different sizes and Gloo aborts the process. So the ranks compare a sha256 over
:func:`program_lines` (fixed size: 32 bytes on every rank, a collective that cannot mismatch)
and raise :class:`~partita.errors.PlanMismatchError` before any collective of the program:

- every input's global shape, dtype and sharding, with the argument it comes from;
- the mesh, every node of the per-device graph, the output shardings and shapes;
- the torch version.

The error names the ranks of each plan and the first line that differs: this rank's line and
the other rank's, spelled out for an input (``args[0]``: shape, dtype, sharding on each).

This module does not run programs; it only compares them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from partita.errors import PlanMismatchError
from partita.mesh import Mesh
from partita.runtime.comm import call_collective, gather_flat

__all__ = ["program_digest", "program_lines", "verify_same_program"]

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


def verify_same_program(compiled: Any, mesh: Mesh, pg: Any = None) -> str:
    """Compare the program's digest across every rank; raise PlanMismatchError if they differ.

    Collective over every rank (``pg``: a group of all of them, default the world): every rank
    calls it before first running ``compiled``.
    """
    digest = program_digest(compiled)
    mine = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8)
    world = dist.get_world_size()
    every = gather_flat(mine, world, pg, "", "plan check", mesh.axis_names, None)
    digests = [bytes(row.tolist()).hex() for row in every]
    if len(set(digests)) == 1:
        return digest
    lines: list[Any] = [None] * len(digests)
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
            "partita.data.make_global or GlobalBatchLoader, and cast on every process alike."
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
        f"The processes compiled different programs for one jit call: {summary}. {where} {fix}"
    )
