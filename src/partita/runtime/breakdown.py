"""Where a step's time goes: a measured breakdown by category, against the unsharded step.

The work a step must do is the unsharded step's compute plus its bytes on the wire; the rest
is the executor's own cost. :func:`measure` times a step (median process CPU and wall time of
some unprofiled runs) and then runs it under ``torch.profiler`` (CPU events only, no shapes
or stacks) to split that CPU time into

- ``collectives``: every op inside a mesh op's range (``runtime.ranges``: the LocalMesh's
  stacked implementation of a collective, or a DistributedMesh's launch with its flat copies
  and its Gloo/NCCL call; a wait's range is not here, see ``idle``);
- ``local compute``: the other ops, except
- ``copies/layout``: ops that only copy or re-view memory (``copy_``, ``clone``, ``cat``,
  ``reshape``, ``permute``, ...), wherever they run outside a collective;
- ``Python/dispatch``: the step's CPU time less the three above: the interpreter, the
  executors' Python per op and per step, and the profiler-invisible glue;
- ``idle``: wall time less CPU time (waiting for other ranks' bytes or for a core), not
  part of the CPU time.

Only top-level ops are summed (an op's nested ops are inside its duration), so nothing counts
twice. Each op category is its share of the profiled runs' wall time (the profiler's
durations: wall clock inside each op) applied to the unprofiled CPU time, so the profiler's own
cost and other processes' load fall on every part alike; under heavy load a short step is
preempted at random and its split is noisy, its total is not. ``bench/bench_partition.py``
and ``bench/bench_distributed.py`` print it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CATEGORIES", "Breakdown", "categorize", "measure"]

CATEGORIES = ("collectives", "local compute", "copies/layout", "Python/dispatch", "idle")

#: Ops that only copy or re-view memory (the aten names, without the namespace).
_LAYOUT_OPS = frozenset(
    """copy_ clone contiguous cat stack _to_copy to empty_like zeros_like new_zeros
    reshape view _unsafe_view _reshape_alias permute transpose t expand expand_as as_strided
    select slice narrow split split_with_sizes chunk unbind unsqueeze squeeze flatten
    unflatten movedim alias detach index_select gather""".split()
)
#: The mesh op kinds a range can be named after (``runtime.ranges``: ``partita.<kind>...``).
_MESH_KINDS = frozenset(
    """all_gather all_reduce reduce_scatter all_to_all collective_permute axis_index
    shard_slice all_gather_bucket all_reduce_bucket reduce_scatter_bucket""".split()
)


@dataclass
class Breakdown:
    """Seconds per step: ``cpu`` (process CPU, median), ``wall`` (median), and ``parts``
    (one entry per :data:`CATEGORIES`; the first four add up to ``cpu``)."""

    cpu: float
    wall: float
    parts: dict[str, float] = field(default_factory=dict)

    def row(self, floor_cpu: float | None = None) -> str:
        """``CPU 12.3 ms (1.42x floor): collectives 1.0, local compute 8.1, ...`` in ms."""
        ratio = f" ({self.cpu / floor_cpu:.2f}x floor)" if floor_cpu else ""
        parts = ", ".join(f"{k} {1e3 * self.parts.get(k, 0.0):.1f}" for k in CATEGORIES)
        return f"CPU {1e3 * self.cpu:.1f} ms{ratio}: {parts} (ms)"


def _kind(range_name: str) -> str:
    """``partita.all_gather[model] 1536 B #3 @ ...`` -> ``all_gather``."""
    rest = range_name.removeprefix("partita.")
    for stop in " [":
        rest = rest.split(stop, 1)[0]
    return rest


def categorize(events: Iterable[Any]) -> dict[str, float]:
    """Seconds by category of the top-level ops in ``events`` (``torch.profiler``'s
    ``FunctionEvent`` list): ``collectives``, ``local compute``, ``copies/layout`` and the
    seconds inside collective waits (``wait``)."""
    out = {"collectives": 0.0, "local compute": 0.0, "copies/layout": 0.0, "wait": 0.0}
    for e in events:
        name = e.name
        if "::" not in name and not name.startswith(("gloo:", "nccl:")):
            continue  # a range (record_function), not an op
        kind, parent, nested = "", e.cpu_parent, False
        while parent is not None:
            pname = parent.name
            if "::" in pname:
                nested = True  # inside another op: counted in that op's time
                break
            if pname.startswith("partita.") and not kind:
                k = _kind(pname)
                if k in _MESH_KINDS or k == "wait":
                    kind = k
            parent = parent.cpu_parent
        if nested:
            continue
        seconds = e.time_range.elapsed_us() * 1e-6
        if kind == "wait":
            out["wait"] += seconds
        elif kind or name.startswith(("partita::", "c10d::", "gloo:", "nccl:")):
            out["collectives"] += seconds
        elif name.split("::", 1)[1].split(".")[0] in _LAYOUT_OPS:
            out["copies/layout"] += seconds
        else:
            out["local compute"] += seconds
    return out


def measure(step: Callable[[], Any], repeat: int = 5, profiled: int = 2) -> Breakdown:
    """Time ``step()`` (already warmed up): the median CPU and wall seconds of ``repeat``
    runs, split by category from ``profiled`` runs under the profiler (their mean)."""
    cpus, walls = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        step()
        cpus.append(time.process_time() - c)
        walls.append(time.perf_counter() - w)
    cpu, wall = statistics.median(cpus), statistics.median(walls)
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts, record_shapes=False) as prof:
        w = time.perf_counter()
        for _ in range(profiled):
            step()
        profiled_wall = time.perf_counter() - w
    # Each category's share of the profiled steps' wall time, applied to the unprofiled CPU
    # time: the profiler's own cost and other processes' load fall on every part alike.
    seconds = categorize(prof.events())
    seconds.pop("wait")
    parts = {k: cpu * v / profiled_wall for k, v in seconds.items()}
    parts["Python/dispatch"] = max(0.0, cpu - sum(parts.values()))
    parts["idle"] = max(0.0, wall - cpu)
    return Breakdown(cpu, wall, parts)
