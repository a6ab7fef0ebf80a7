"""partita on 4 Gloo processes beside PyTorch FSDP2 and TP + FSDP2, same GPT step, same run.

Run: ``.venv/bin/python bench/bench_distributed.py [--layers 4 8 12] [--repeat 5]
[--unfused] [--threads] [--in-process]`` (``--threads``: also each row's CPU per step by kind
of thread, summed over the ranks: the step's own thread and Gloo's; each
configuration starts its own 4 worker processes on 127.0.0.1 through
``partita.runtime.launch.spawn``, so every process high-water mark belongs to one
configuration; rank 0's report is printed).

The step: GPT (``--layers``, width 256, 8 heads, vocabulary 512, sequence 128, global batch 16),
cross entropy, AdamW. For each configuration: the median wall time of a training step after two
warm-ups (max over ranks), the process CPU time of a step (median, summed over the ranks: what
the step costs the machine's cores), the bytes each rank moves per step, the collective calls
per step, and memory per rank: the process high-water mark (``ru_maxrss``, max over ranks; it
includes the Python interpreter and torch, about the same for every configuration; read after
the timed steps, before ``step heap``'s dispatch mode, which imports ``torch._dynamo``, and
before partita's communication floor is replayed), split in
two: ``setup RSS``, the high-water mark before the first step (imports, model, partita's
compile) and ``step RSS``, the high-water mark of the timed steps alone (``VmHWM`` reset after
the warm-ups through ``/proc/self/clear_refs``, the same for partita and torch), and, for
partita, the Plan's estimate of the tensors live at the peak (``Plan.memory()``); ``step heap``
measures what a step holds for partita and eager torch alike (``_HeapPeak``: malloc's bytes in
use at the step's peak op boundary, above its start, median of 3 steps; the caller's
parameters and optimizer state excluded, so it compares with the Plan peak minus its
``inputs``).

* ``partita fsdp (4,)``: parameters ``P("data")``, batch ``P("data")``; bytes from the Plan
  (per-device bytes as XLA reports them: output of all_gather / all_reduce / all_to_all, input
  of reduce_scatter); ``unfused`` is the same with bucketing and overlap off
  (``PARTITA_BUCKET_BYTES=0 PARTITA_OVERLAP_BYTES=0``), the program as partitioned before
  (only with ``--unfused``); ``regather`` frees the gathered parameters after the forward and
  gathers them again for the backward (``PARTITA_REGATHER=1``, FSDP2's
  ``reshard_after_forward=True``);
* the partita rows compile in a forked child process that hands the per-device program back
  (``partita.frontend.child_compile``, the default under torch.distributed): the training
  process never imports or holds the compiler; ``... in process`` (only with ``--in-process``
  or ``--only``): the same step compiled in the training process (``PARTITA_COMPILE_IN_CHILD=0``);
* ``partita 2-D (2, 2)``: FSDP over ``data`` and Megatron TP over ``model``; ``MLP TP``: TP on
  the MLP only, attention FSDP only: the ``torch TP + FSDP2`` row's sharding before session
  37 (fewer collectives on the critical path, unsharded attention activations);
* ``torch FSDP2 (4,)``: ``fully_shard`` on every block and the model, ``torch.optim.AdamW``;
  ``compiled``: the same model under ``torch.compile`` (Inductor, C++ on the CPU; its compile
  time is spent in the warm-ups, not in the median);
* ``torch unsharded 1 x 2 threads``: the compute floor: the same step, unsharded, in ONE
  process using both cores (``OMP_NUM_THREADS=2``, the whole batch, ``torch.optim.AdamW``, no
  collectives). The 4 processes of the other rows share the same 2 cores and together compute
  at least this step (FSDP: every rank runs the full-width model on a quarter of the batch), so
  a 4-process step cannot be much faster than this row; ``1 x 1 thread``: the same on one
  thread (its CPU/step is the step's compute with no thread spinning: half of it is the
  floor on 2 cores);
* ``torch TP + FSDP2 (2, 2)``: ``parallelize_module`` on each block's MLP (fc colwise, proj
  rowwise) and attention (qkv colwise, proj rowwise: the GPT's head-major qkv, ``gpt_config``,
  gives each rank whole heads) over ``tp``, and ``fully_shard`` over ``dp``: the sharding of
  ``partita 2-D``. (Before session 37 the GPT's qkv was GPT-2's ``[q | k | v]``, which
  DTensor's colwise plan cannot split into heads, and this row split the MLP only.)

After the table of each layer count, ``floor and breakdown``: each configuration's CPU per
step (summed over the ranks) over ``torch unsharded 1 x 1 thread``'s (the step's compute on
one thread: the floor; ``--only`` without it prints no ratio), and where that CPU goes
(``partita.runtime.breakdown.measure`` on every rank after the timed steps, summed over the
ranks; every column but idle is CPU time and they add up to ``CPU/step``: the step's thread
in collectives (launch, copies, Gloo call and wait), in local compute, in copies/layout, the
rest of it (``other``: Python, dispatch), and the process's other ``threads`` (Gloo's event
loops and workers); ``idle (wall)`` is wall time less the step's thread's CPU, summed over the
ranks).

``torch eager quarter batch (4,)``: what each rank of an FSDP step computes, in eager torch
with no collectives, on 4 processes: the whole model's forward and backward on a quarter of
the batch and AdamW on a quarter (``chunk`` of dim 0) of every parameter. ``torch eager 2-D
rank (2, 2)``: the same for a rank of the ``partita 2-D`` step: half the batch, the
tensor-parallel halves of attention (half the heads) and of the MLP (half the hidden width),
the embeddings, layer norms, residual adds, lm-head and loss whole on both ranks of a
``model`` pair (as ``param_spec`` leaves them), AdamW on the rank's tile of every parameter
(a quarter of the split layers', half of the others').

Then ``communication floor``: each partita row's collectives replayed alone on its own 4
processes right after its timed steps (``bench/comm_floor.py``: the Plan's calls, buckets as
one call, in program order, each launched and waited for at once on preallocated buffers, no
compute): their CPU per step summed over the ranks (of it, Gloo's threads), their wall time,
and the row's CPU over ``floor`` = the unsharded step's CPU (``1 x 1 thread``) plus the
collectives' and, for FSDP rows, over ``eager floor`` = ``torch eager quarter batch``'s CPU
plus the collectives' (for the 2-D rows, ``torch eager 2-D rank``'s).

torch bytes are counted with the same convention by wrapping ``torch.distributed``'s
collective functions (FSDP2) and a TorchDispatchMode over ``_c10d_functional`` ops (DTensor).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import partita
import partita.distributed as pd
from partita import Mesh, P
from partita.data import make_global, process_slice
from partita.models import GPT, GPTConfig
from partita.runtime.breakdown import CATEGORIES, measure
from partita.training import init_opt_state, make_train_step

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from train_gpt import COLUMN, ROW, param_spec  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from comm_floor import replay  # noqa: E402


def gpt_config(layers: int) -> GPTConfig:
    """The benches' GPT: width 256, 8 heads, vocabulary 512, sequence 128, and its fused qkv
    projection head-major (``qkv_layout="heads"``, Megatron-LM's order: a tensor-parallel
    split gives each device whole heads; GPT-2's ``[q | k | v]`` order makes the 2-D step
    exchange rows every layer, docs/performance.md "A head-major q|k|v")."""
    return GPTConfig(layers, n_head=8, d_model=256, vocab_size=512, seq_len=128, qkv_layout="heads")


CFG = gpt_config(4)
BATCH = 16
#: The environment of the "unfused" runs: the program as partitioned before bucketing and overlap.
UNFUSED = {"PARTITA_BUCKET_BYTES": "0", "PARTITA_OVERLAP_BYTES": "0"}
#: The compute-floor row: one process, both cores (the others run 4 processes of 1 thread).
FLOOR = "torch unsharded 1 x 2 threads"
#: The same on one thread: its CPU/step is the step's compute alone, with no thread waiting.
FLOOR1 = "torch unsharded 1 x 1 thread"
#: Each rank's compute of an FSDP step in eager torch, no collectives (4 processes).
EAGER = "torch eager quarter batch (4,)"
#: Each rank's compute of a 2-D (data x model) step in eager torch, no collectives.
EAGER2D = "torch eager 2-D rank (2, 2)"
#: The environment of the "regather" runs: gathered parameters freed after the forward.
REGATHER = {"PARTITA_REGATHER": "1"}
#: The environment of the "in process" runs: compiled in the training process (the default
#: under torch.distributed compiles in a forked child process).
HERE = {"PARTITA_COMPILE_IN_CHILD": "0"}


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(
        0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=torch.Generator().manual_seed(seed)
    )
    return ids, torch.roll(ids, -1, dims=1)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))


#: Process CPU seconds per step (median), summed over the ranks: set by ``_median``.
CPU = [0.0]
#: The step ``_median`` timed last (the worker measures its breakdown after the row's own).
STEP: list[Callable[[], Any]] = []


#: Process memory around the steps (bytes, this rank), set by ``_median``: ``setup`` the
#: high-water mark before the first step (imports, model, and for partita the compile),
#: ``maxrss`` the whole-process ``ru_maxrss`` before the high-water mark is reset, ``steps``
#: the high-water mark of the timed steps alone (reset after the warm-ups; 0 off Linux).
MEM = {"setup": 0.0, "maxrss": 0.0, "steps": 0.0, "peak": 0.0}


def _hwm() -> float:
    """This process's resident high-water mark (``VmHWM``), bytes; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            line = next(ln for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0.0
    return float(line.split()[1]) * 1024


def _reset_hwm() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5). It also lowers what
    ``ru_maxrss`` reports afterwards: ``MEM["maxrss"]`` keeps the earlier whole-process peak."""
    MEM["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _median(fn: Callable[[], Any], repeat: int) -> float:
    STEP[:] = [fn]
    MEM["setup"] = _hwm()
    fn()
    fn()
    reset = _reset_hwm()
    times, cpu = [], []
    for _ in range(repeat):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    MEM["steps"] = _hwm() if reset else 0.0
    # the whole process up to here: before ``step heap``'s dispatch mode, whose first op
    # imports ``torch._dynamo`` (torch wraps a mode's handling in ``_disable_dynamo``): an
    # instrument's memory, not the step's, and not imported yet in a process that compiled in
    # a child process
    MEM["peak"] = max(MEM["maxrss"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0)
    # the slowest rank decides a step: take the max over ranks of each median
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    # the CPU the step costs the machine: every rank's (all its threads), summed
    c = torch.tensor([statistics.median(cpu)])
    dist.all_reduce(c, op=dist.ReduceOp.SUM)
    CPU[0] = float(c)
    return float(t)


#: ``--profile``: rank 0 prints cProfile's top functions (main thread CPU time) of 3 steps
#: after the timed ones.
PROFILE = [False]


def _profile(fn: Callable[[], Any]) -> None:
    import cProfile
    import io
    import pstats

    # the main thread's CPU time, not wall time: 4 processes share the cores, so wall time
    # would charge a wait with the time the other ranks were scheduled
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for _ in range(3):
        fn()
    prof.disable()
    if dist.get_rank() == 0:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print("\n".join("PROFILE " + line for line in out.getvalue().splitlines()))


# --- byte counting for torch ---------------------------------------------------------------------

_BYTES = [0]
_CALLS = [0]


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _wrap_dist() -> None:
    """Count FSDP2's collectives: output bytes of gathers, input bytes of reduce-scatters."""
    table = {
        "all_gather_into_tensor": lambda a, k: _nbytes(k.get("output_tensor", a[0] if a else None)),
        "reduce_scatter_tensor": lambda a, k: _nbytes(k.get("input", a[1] if len(a) > 1 else None)),
        "all_reduce": lambda a, k: _nbytes(k.get("tensor", a[0] if a else None)),
        "all_gather_single": lambda a, k: _nbytes(k.get("output_tensor", a[0] if a else None)),
        "reduce_scatter_single": lambda a, k: _nbytes(k.get("input", a[1] if len(a) > 1 else None)),
    }
    for name, size in table.items():
        original = getattr(dist, name)

        def wrapped(*a: Any, _o: Any = original, _s: Any = size, **k: Any) -> Any:
            _BYTES[0] += _s(a, k)
            _CALLS[0] += 1
            return _o(*a, **k)

        setattr(dist, name, wrapped)


class _CountFunctional(TorchDispatchMode):
    """Count DTensor's functional collectives with the same convention."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if "_c10d_functional" in name and "wait_tensor" not in name:
            _BYTES[0] += _nbytes(args[0]) if "reduce_scatter" in name else _nbytes(out)
            _CALLS[0] += 1
        return out


class _HeapPeak(TorchDispatchMode):
    """The most bytes malloc holds in use (glibc ``mallinfo2``: heap + mmapped chunks) at any
    op boundary of a step, above what it held when the step began: the memory the step itself
    holds at its peak, measured the same way for partita and torch (tensors, and the Python
    objects and collective buffers malloc serves). Linux/glibc only."""

    def __init__(self) -> None:
        super().__init__()
        import ctypes

        class _Info(ctypes.Structure):
            _fields_ = [
                (n, ctypes.c_size_t)
                for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                "keepcost".split()
            ]

        self._libc = ctypes.CDLL(None)
        self._libc.mallinfo2.restype = _Info
        self.start = self.peak = self.in_use()

    def in_use(self) -> int:
        info = self._libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.peak = max(self.peak, self.in_use())
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


def _step_heap(fn: Callable[[], Any], repeat: int = 3) -> float:
    """``_HeapPeak`` of a step of ``fn``: the median of ``repeat`` steps (when a collective's
    temporary buffers are freed depends on the other ranks, so one step varies by a bucket),
    max over ranks (0 where mallinfo2 is missing)."""
    peaks = []
    for _ in range(repeat):
        try:
            mode = _HeapPeak()
        except (OSError, AttributeError):
            return 0.0
        with mode:
            fn()
        peaks.append(float(mode.peak - mode.start))
    t = torch.tensor([statistics.median(peaks)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# --- configurations ------------------------------------------------------------------------------


def mlp_param_spec(name: str, p: torch.Tensor, mesh: Mesh) -> P:
    """``param_spec`` with tensor parallelism on the MLP only (attention FSDP only), the
    ``torch TP + FSDP2`` row's sharding before session 37."""
    if "attn." in name and name.endswith(COLUMN + ROW):
        return P("data") if p.shape[0] % mesh.axis_size("data") == 0 else P()
    return param_spec(name, p, mesh)


class PartitaStep:
    """partita's FSDP (or 2-D) training step of the GPT, as the benches run it: each process
    holds its tiles of the weights and of the AdamW state (as FSDP2's ``fully_shard`` keeps),
    and its rows of one batch; :meth:`one` runs a step."""

    def __init__(
        self, mesh: Mesh, spec: Callable[[str, torch.Tensor, Mesh], P] = param_spec
    ) -> None:
        torch.manual_seed(0)
        model = GPT(CFG)
        pspecs = {k: spec(k, v, mesh) for k, v in model.named_parameters()}

        def shard(t: torch.Tensor, spec: Any) -> Any:
            tile = t[process_slice(t.shape, mesh, spec)].clone()
            return make_global(tile, mesh, spec, global_shape=t.shape)

        params = {k: shard(v.detach(), pspecs[k]) for k, v in model.named_parameters()}
        state = init_opt_state({"one": torch.zeros(())})
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = {k: shard(torch.zeros(v.shape), pspecs[k]) for k, v in params.items()}
        state["step"] = shard(state["step"], P())
        # The step takes the weights as arguments and never reads the module's own: free them,
        # as fully_shard frees the unsharded parameters (a tied weight stays one Parameter).
        for p in model.parameters():
            p.data = torch.empty(0)
        self.step = partita.jit(
            make_train_step(model, _loss, "adamw"),
            mesh=mesh,
            in_specs=(pspecs, {}, {"step": P(), "exp_avg": pspecs, "exp_avg_sq": pspecs},
                      (P("data"), P("data"))),
        )  # fmt: skip
        ids, targets = _batch(0)
        rows = process_slice(ids.shape, mesh, P("data"))
        self.batch = tuple(
            make_global(t[rows], mesh, P("data"), global_shape=t.shape) for t in (ids, targets)
        )
        self.params, self.state = params, state

    def lower(self) -> Any:
        return self.step.lower(self.params, {}, self.state, self.batch)

    def one(self) -> None:
        _, self.params, _, self.state = self.step(self.params, {}, self.state, self.batch)


def bench_partita(
    mesh: Mesh, repeat: int, spec: Callable[[str, torch.Tensor, Mesh], P] = param_spec
) -> dict[str, Any]:
    run = PartitaStep(mesh, spec)
    one = run.one
    start = time.perf_counter()
    plan = run.lower()
    compile_s = time.perf_counter() - start
    seconds = _median(one, repeat)
    heap = _step_heap(one)
    if PROFILE[0]:
        _profile(one)
    return {
        # run by the worker after the peak RSS is read: the replay holds a buffer for every
        # call of the step at once and adds process groups, which are not the step's memory
        "comm": lambda: replay(plan, repeat),
        "heap": heap,
        "step": seconds,
        "bytes": plan.bytes_per_device,
        "calls": sum(plan.call_counts().values()),
        # after the peak RSS too: it runs fake tensors, which a process that compiled in a
        # child has not imported yet
        "estimate": lambda: plan.memory().peak,
        "compile": compile_s,
    }


def bench_unsharded_step() -> Callable[[], None]:
    """The unsharded step: the whole batch in this process, ``torch.optim.AdamW``."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, targets = _batch(0)

    def one() -> None:
        loss = _loss(model(ids), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return one


def bench_unsharded(repeat: int) -> dict[str, Any]:
    """The compute floor: the whole step in this one process (run with 2 threads), no sharding."""
    one = bench_unsharded_step()
    return {"step": _median(one, repeat), "heap": _step_heap(one), "bytes": 0.0, "calls": 0}


def _eager_rank(model: nn.Module, index: int, count: int, repeat: int) -> dict[str, Any]:
    """The eager step of a rank that holds block ``index`` of ``count`` of the batch's rows
    and of every parameter (``chunk`` along dim 0): forward and backward of ``model`` on its
    rows, AdamW on its tiles, no collectives."""
    params = list(model.parameters())
    tiles = [p.detach().chunk(count)[index].clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(tiles, lr=1e-3)
    ids, targets = _batch(0)
    rows = BATCH // count
    ids, targets = (t[index * rows : (index + 1) * rows] for t in (ids, targets))

    def one() -> None:
        _loss(model(ids), targets).backward()
        for tile, p in zip(tiles, params, strict=True):
            tile.grad = p.grad.chunk(count)[index]
        opt.step()
        model.zero_grad()

    return {"step": _median(one, repeat), "heap": _step_heap(one), "bytes": 0.0, "calls": 0}


def bench_eager_quarter(repeat: int) -> dict[str, Any]:
    """What each rank of an FSDP step must compute, in eager torch with no collectives: the
    whole model's forward and backward on its quarter of the batch, and AdamW on its quarter
    (rows, ``chunk`` along dim 0) of every parameter."""
    torch.manual_seed(0)
    return _eager_rank(GPT(CFG), dist.get_rank(), dist.get_world_size(), repeat)


class _HalfHeads(nn.Module):
    """A tensor-parallel rank's attention: ``heads`` of the model's heads (q|k|v columns and
    the output projection's rows of those heads), its output the rank's partial sum."""

    def __init__(self, d: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(d, 3 * heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            z.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
            for z in self.qkv(x).split(self.heads * self.head_dim, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def bench_eager_2d(repeat: int) -> dict[str, Any]:
    """What each rank of the 2-D step must compute, in eager torch with no collectives: the
    model with half the heads and half the MLP width per block on half the batch, the other
    layers whole, AdamW on the rank's tile of every parameter (split again over ``data``)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    d, heads = CFG.d_model, CFG.n_head
    for block in model.blocks:
        block.attn = _HalfHeads(d, heads // 2, d // heads)
        block.mlp.fc = nn.Linear(d, 2 * d)
        block.mlp.proj = nn.Linear(2 * d, d)
    # mesh (2, 2) data x model: ranks 2i and 2i + 1 hold the same rows, tile i over data
    return _eager_rank(model, dist.get_rank() // 2, 2, repeat)


def bench_torch(tp: bool, repeat: int, compiled: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    if tp:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:  # Megatron: column-parallel in, row-parallel out
            plan = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
            parallelize_module(block.mlp, mesh["tp"], plan)
            # the head-major qkv (gpt_config): a rank's column block holds whole heads
            parallelize_module(
                block.attn, mesh["tp"], {"qkv": ColwiseParallel(), "proj": RowwiseParallel()}
            )
        dp_mesh = mesh["dp"]
        rows = BATCH // 2
        first = (dist.get_rank() // 2) * rows
    else:
        dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        rows = BATCH // 4
        first = dist.get_rank() * rows
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, targets = _batch(0)
    ids, targets = ids[first : first + rows], targets[first : first + rows]
    forward = torch.compile(model) if compiled else model

    def one() -> None:
        loss = _loss(forward(ids), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()

    seconds = _median(one, repeat)
    # under a dispatch mode the compiled model would run another way: no heap for it
    heap = None if compiled else _step_heap(one)
    _BYTES[0] = _CALLS[0] = 0
    with _CountFunctional():
        one()
    return {"step": seconds, "heap": heap, "bytes": float(_BYTES[0]), "calls": _CALLS[0]}


CONFIGS: dict[str, tuple[Callable[[int], dict[str, Any]], dict[str, str]]] = {
    "partita fsdp (4,)": (lambda r: bench_partita(Mesh.create((4,), ("data",)), r), {}),
    "partita fsdp (4,) unfused": (
        lambda r: bench_partita(Mesh.create((4,), ("data",)), r), UNFUSED),
    "partita fsdp (4,) regather": (
        lambda r: bench_partita(Mesh.create((4,), ("data",)), r), REGATHER),
    "torch FSDP2 (4,)": (lambda r: bench_torch(False, r), {}),
    "torch FSDP2 (4,) compiled": (lambda r: bench_torch(False, r, compiled=True), {}),
    "partita 2-D (2, 2)": (
        lambda r: bench_partita(Mesh.create((2, 2), ("data", "model")), r), {}),
    "partita 2-D (2, 2) MLP TP": (
        lambda r: bench_partita(Mesh.create((2, 2), ("data", "model")), r, mlp_param_spec), {}),
    "partita 2-D (2, 2) unfused": (
        lambda r: bench_partita(Mesh.create((2, 2), ("data", "model")), r), UNFUSED),
    "torch TP + FSDP2 (2, 2)": (lambda r: bench_torch(True, r), {}),
    "partita fsdp (4,) in process": (
        lambda r: bench_partita(Mesh.create((4,), ("data",)), r), HERE),
    "partita fsdp (4,) regather in process": (
        lambda r: bench_partita(Mesh.create((4,), ("data",)), r), {**REGATHER, **HERE}),
    "partita 2-D (2, 2) in process": (
        lambda r: bench_partita(Mesh.create((2, 2), ("data", "model")), r), HERE),
    FLOOR: (bench_unsharded, {"OMP_NUM_THREADS": "2"}),
    FLOOR1: (bench_unsharded, {"OMP_NUM_THREADS": "1"}),
    EAGER: (bench_eager_quarter, {}),
    EAGER2D: (bench_eager_2d, {}),
}  # fmt: skip


def worker(ns: argparse.Namespace) -> None:
    global CFG
    CFG = gpt_config(ns.layers[0])
    PROFILE[0] = ns.profile
    pd.initialize()
    _wrap_dist()
    run, _ = CONFIGS[ns.worker]
    row = run(ns.repeat)
    row["cpu"] = CPU[0]
    # the whole process up to the end of the timed steps (``_median``)
    peak = torch.tensor([MEM["peak"], MEM["setup"], MEM["steps"]])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    row["rss"], row["setup_rss"], row["step_rss"] = (float(v) for v in peak)
    for key in ("estimate", "comm"):  # partita's Plan estimate and communication floor
        if callable(row.get(key)):
            row[key] = row[key]()
    dist.barrier()
    split = measure(STEP[0], ns.repeat)
    parts = torch.tensor([split.parts[k] for k in CATEGORIES] + [split.cpu])
    dist.all_reduce(parts, op=dist.ReduceOp.SUM)  # the machine's CPU: every rank's
    row["parts"] = dict(zip([*CATEGORIES, "cpu"], parts.tolist(), strict=True))
    if ns.threads:
        row["threads"] = _thread_cpu(STEP[0], ns.repeat)
    if pd.is_main_process():
        print("RESULT " + json.dumps(row))


def _thread_cpu(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    """``--threads``: CPU ms per step of each kind of thread (``/proc/self/task/*/stat``,
    by thread name; the main thread as ``main``), summed over the ranks: where the CPU goes
    besides the step's own thread (Gloo's ``gloo_tcp_loop`` event loop and
    ``pt_gloo_runloop`` workers). Linux only (empty elsewhere)."""

    def sample() -> dict[str, tuple[str, float]]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            name = "main" if tid == str(os.getpid()) else name
            fields = text[text.rindex(")") + 2 :].split()
            out[tid] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        return out

    if not os.path.isdir("/proc/self/task"):
        return {}
    dist.barrier()
    before = sample()
    for _ in range(repeat):
        fn()
    after = sample()
    kinds: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        kinds[name] = kinds.get(name, 0.0) + (cpu - before.get(tid, (name, 0.0))[1]) / repeat
    names = sorted(kinds)
    all_names: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(all_names, names)
    union = sorted({n for ns in all_names for n in ns})
    t = torch.tensor([1e3 * kinds.get(n, 0.0) for n in union], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return {n: float(v) for n, v in zip(union, t.tolist(), strict=True) if v > 0}


def _row(name: str, r: dict[str, Any]) -> str:
    est = f"{r['estimate'] / 1e6:7.1f} MB" if "estimate" in r else f"{'-':>10}"
    heap = f"{r['heap'] / 1e6:7.1f} MB" if r.get("heap") is not None else f"{'-':>10}"
    return (
        f"{name:<30} {r['step']:7.3f} s {r['cpu']:7.3f} s {r['bytes'] / 1e6:8.1f} MB "
        f"{r['calls']:6d} {r['rss'] / 1e6:8.1f} MB {r['setup_rss'] / 1e6:8.1f} MB "
        f"{r['step_rss'] / 1e6:8.1f} MB {heap} {est}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--unfused", action="store_true", help="also bucketing and overlap off")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), help="these configurations")
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0 of partita's steps")
    parser.add_argument("--threads", action="store_true", help="CPU per step of each thread kind")
    parser.add_argument("--in-process", action="store_true",
                        help="also the rows compiled in the training process")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns)
        return
    from partita.runtime.launch import spawn

    print(f"# {' '.join(['.venv/bin/python', *sys.argv])}")
    print(f"# GPT d_model={CFG.d_model} heads={CFG.n_head} vocab={CFG.vocab_size} "
          f"seq={CFG.seq_len} batch={BATCH}, AdamW; 4 Gloo processes per configuration "
          f"(OMP_NUM_THREADS=1 each), torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"median of {ns.repeat} steps after 2 warm-ups (max over ranks)")  # fmt: skip
    print(_load())
    for layers in ns.layers:
        print(f"\n## {layers} layers")
        print(f"{'configuration':<30} {'step':>9} {'CPU/step':>9} {'bytes/rank':>11} {'calls':>6} "
              f"{'peak RSS':>11} {'setup RSS':>11} {'step RSS':>11} {'step heap':>10} "
              f"{'Plan peak':>10}")  # fmt: skip
        rows: dict[str, dict[str, Any]] = {}
        for name, (_, env) in CONFIGS.items():
            if (ns.only and name not in ns.only) or (env is UNFUSED and not ns.unfused):
                continue
            if name.endswith(" in process") and not (ns.in_process or ns.only):
                continue
            argv = [__file__, "--worker", name, "--repeat", str(ns.repeat), "--layers", str(layers)]
            argv += ["--profile"] if ns.profile else []
            argv += ["--threads"] if ns.threads else []
            results = spawn(argv, 1 if name in (FLOOR, FLOOR1) else 4, env=env, timeout=1800)
            lines = [ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT ")]
            if any(r.returncode for r in results) or not lines:
                bad = next((r for r in results if r.returncode), results[0])
                print(f"{name:<30} failed (rank {bad.rank}): {bad.stderr.strip()[-300:]}")
                continue
            rows[name] = json.loads(lines[-1].removeprefix("RESULT "))
            print(_row(name, rows[name]), flush=True)
            if "threads" in rows[name]:
                print(
                    "    CPU/step by thread, ms, summed over ranks: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in rows[name]["threads"].items())
                )
            for line in results[0].stdout.splitlines():
                if line.startswith("PROFILE "):
                    print("    " + line.removeprefix("PROFILE "))
        print(_load())
        _print_breakdown(rows)


def _print_breakdown(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's CPU/step over the floor (``FLOOR1``) and its split by category, in ms."""
    floor = rows.get(FLOOR1, {}).get("cpu")
    print(f"floor and breakdown: CPU/step summed over ranks, x {FLOOR1!r}'s; ms per step")
    print(f"{'configuration':<30} {'CPU/step':>9} {'x floor':>8} "
          + " ".join(f"{'idle (wall)' if k == 'idle' else k:>15}" for k in CATEGORIES))  # fmt: skip
    for name, r in rows.items():
        parts = r.get("parts", {})
        ratio = f"{r['cpu'] / floor:8.2f}" if floor else f"{'-':>8}"
        cells = " ".join(f"{1e3 * parts.get(k, 0.0):15.1f}" for k in CATEGORIES)
        print(f"{name:<30} {r['cpu']:7.3f} s {ratio} {cells}", flush=True)
    _print_comm_floor(rows, floor)


def _print_comm_floor(rows: dict[str, dict[str, Any]], floor: float | None) -> None:
    """Each partita row's collectives replayed alone (``comm_floor.replay``) and its CPU
    over the floor with them: ``FLOOR1``'s CPU plus the collectives' (and, for FSDP rows,
    over ``EAGER``'s CPU plus the collectives', for the 2-D rows over ``EAGER2D``'s: each
    rank's own compute on 4 processes)."""
    eagers = {"fsdp": rows.get(EAGER, {}).get("cpu"), "2-D": rows.get(EAGER2D, {}).get("cpu")}
    print(f"communication floor: each partita row's collectives alone on its processes, no "
          f"compute (CPU per step summed over ranks; Gloo's threads part of it); floor = "
          f"{FLOOR1!r} + collectives, eager floor = {EAGER!r} (FSDP rows) or {EAGER2D!r} "
          f"(2-D rows) + collectives")  # fmt: skip
    print(f"{'configuration':<30} {'calls':>6} {'comm CPU':>9} {'threads':>9} {'comm wall':>10} "
          f"{'CPU/step':>9} {'x unsharded':>12} {'x floor':>8} {'x eager floor':>14}")  # fmt: skip
    for name, r in rows.items():
        comm = r.get("comm")
        if comm is None:
            continue
        unsharded = f"{r['cpu'] / floor:12.2f}" if floor else f"{'-':>12}"
        with_comm = f"{r['cpu'] / (floor + comm['cpu']):8.2f}" if floor else f"{'-':>8}"
        # the MLP-TP row computes another split than the eager 2-D rank's
        kind = "fsdp" if "fsdp" in name else "2-D" if "MLP TP" not in name else None
        eager = eagers.get(kind) if kind else None
        with_eager = f"{r['cpu'] / (eager + comm['cpu']):14.2f}" if eager else f"{'-':>14}"
        print(f"{name:<30} {comm['calls']:6d} {comm['cpu']:7.3f} s {comm['threads']:7.3f} s "
              f"{comm['wall']:8.3f} s {r['cpu']:7.3f} s {unsharded} {with_comm} {with_eager}",
              flush=True)  # fmt: skip


def _load() -> str:
    """The machine's load average: the rows are only comparable under a similar load."""
    one, five, fifteen = os.getloadavg()
    return f"# load average {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


if __name__ == "__main__":
    main()
