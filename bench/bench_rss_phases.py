"""Where a rank's resident memory goes, phase by phase: partita FSDP beside PyTorch FSDP2.

Run: ``.venv/bin/python bench/bench_rss_phases.py [--layers 4] [--steps 8] [--only partita]``
(4 worker processes on 127.0.0.1 per configuration, through ``partita.runtime.launch.spawn``;
``OMP_NUM_THREADS=1`` each; rank 0's report is printed). Linux and glibc only.

The step is ``bench_distributed.py``'s: ``partita fsdp (4,)`` and ``torch FSDP2 (4,)`` (GPT,
width 256, 8 heads, vocabulary 512, sequence 128, global batch 16, AdamW). After each phase
(imports and joining, the model with its sharded parameters and AdamW state, partita's compile,
each step; the first step of partita is its first run) a row gives:

* ``RSS``: ``VmRSS`` at the phase's end (``anon``: of it, anonymous memory, ``RssAnon``: the
  heap, arenas, mmapped blocks; the rest is mapped files, the libraries' code and data), and
  ``phase HWM``: the high-water mark of the phase alone (``VmHWM``, reset through
  ``/proc/self/clear_refs`` after each row);
* ``malloc``: glibc's bytes in use (``mallinfo2``: ``uordblks + hblkhd``) and ``heap``: what
  malloc has taken from the system (``arena + hblkhd``; what of it was trimmed is not
  resident, the rest is);
* ``pymalloc``: the bytes of Python's small-object allocator in use (its own arenas, not in
  malloc's numbers; ``sys._debugmallocstats``);
* ``CPU``: the phase's process CPU time (a step's, for the steps).

``partita`` compiles in a forked child process that hands the per-device program back (the
default under torch.distributed): the training process never imports or holds the compiler;
``partita-here`` is the same step compiled in the training process (``PARTITA_COMPILE_IN_CHILD=0``).

Then the new tensor storages one later step allocates, by size (a ``TorchDispatchMode`` over
the step's ops, views and in-place results left out: count and MB of each class; Gloo's own
buffers are not seen). The load average is printed
before and after: numbers are comparable only under a similar load.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_distributed as bd

import partita.distributed as pd
from partita import Mesh

CONFIGS = ("partita", "partita-here", "torch")
#: Upper bounds of the size classes of the allocation table, bytes.
SIZES = (128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 1 << 62)


class _MallInfo(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
        "keepcost".split()
    ]


_LIBC = ctypes.CDLL(None)
_LIBC.mallinfo2.restype = _MallInfo


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith(key + ":"))
    return float(line.split()[1]) / 1024  # MB (kB / 1024)


def _pymalloc() -> float:
    """Bytes in use in pymalloc's blocks, MB (``sys._debugmallocstats`` writes to fd 2)."""
    with tempfile.TemporaryFile("w+") as out:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        line = next(ln for ln in out if ln.startswith("# bytes in allocated blocks"))
    return int(line.split("=")[-1].strip().replace(",", "")) / 2**20


ROWS: list[dict[str, Any]] = []
_CPU = [0.0]


def mark(phase: str) -> None:
    """Record a row for the phase that just ended and reset the high-water mark."""
    info = _LIBC.mallinfo2()
    now = time.process_time()
    ROWS.append({
        "phase": phase, "rss": _status("VmRSS"), "anon": _status("RssAnon"),
        "hwm": _status("VmHWM"),
        "malloc": (info.uordblks + info.hblkhd) / 2**20, "heap": (info.arena + info.hblkhd) / 2**20,
        "pymalloc": _pymalloc(), "cpu": now - _CPU[0],
    })  # fmt: skip
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    _CPU[0] = time.process_time()


def _storage(t: Any) -> int:
    """The address of a tensor's storage (0 for anything else, or a storage without data:
    FSDP2 frees its unsharded parameters' by resizing them to 0)."""
    if not isinstance(t, torch.Tensor):
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return 0


class _Sizes(TorchDispatchMode):
    """The bytes of every new storage an op returns (not views of its inputs), by size."""

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[int] = collections.Counter()
        self.nbytes: collections.Counter[int] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # a view or an in-place op returns an input's storage: only new storages count
        ins = {_storage(t) for t in pytree.tree_leaves((args, kwargs)) if _storage(t)}
        for t in pytree.tree_leaves(out):
            if _storage(t) and _storage(t) not in ins:
                ins.add(_storage(t))  # several outputs of one storage count once
                size = t.untyped_storage().nbytes()
                bound = next(b for b in SIZES if size < b)
                self.count[bound] += 1
                self.nbytes[bound] += size
        return out


def _steps(one: Callable[[], Any], steps: int, first: str) -> dict[str, list[float]]:
    """Run ``steps`` steps, a row after each (the first named ``first``); then one more step
    under :class:`_Sizes`: its allocations by size class, ``{class: [count, MB]}``."""
    for k in range(steps):
        dist.barrier()
        _CPU[0] = time.process_time()
        one()
        mark(first if k == 0 else f"step {k}")
    sizes = _Sizes()
    with sizes:
        one()
    names = [f"< {b >> 10} KiB" for b in SIZES[:-1]] + [f">= {SIZES[-2] >> 10} KiB"]
    return {n: [sizes.count[b], sizes.nbytes[b] / 2**20] for n, b in zip(names, SIZES, strict=True)}


def worker(which: str, layers: int, steps: int) -> None:
    bd.CFG = bd.gpt_config(layers)
    pd.initialize()
    mark("imports, join")
    sizes: dict[str, list[float]] = {}
    if which.startswith("partita"):
        run = bd.PartitaStep(Mesh.create((4,), ("data",)))
        mark("model")
        run.lower()
        mark("compile")
        sizes = _steps(run.one, steps, "first run")
    else:  # bench_distributed's FSDP2 step, stepped here instead of timed there

        def median(one: Callable[[], Any], repeat: int) -> float:
            mark("model")
            sizes.update(_steps(one, steps, "step 0"))
            return 0.0

        bd._median, bd._step_heap = median, lambda fn, repeat=3: 0.0
        bd.bench_torch(False, steps)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"rows": ROWS, "sizes": sizes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns.worker, ns.layers, ns.steps)
        return
    from partita.runtime.launch import spawn

    print(f"# {' '.join(['.venv/bin/python', *sys.argv])}")
    print(bd._load())
    for which in ns.only:
        argv = [__file__, "--worker", which, "--layers", str(ns.layers), "--steps", str(ns.steps)]
        env = {"PARTITA_COMPILE_IN_CHILD": "0"} if which == "partita-here" else {}
        results = spawn(argv, 4, env=env, timeout=1800)  # OMP_NUM_THREADS=1 unless set
        lines = [ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT ")]
        if any(r.returncode for r in results) or not lines:
            bad = next((r for r in results if r.returncode), results[0])
            print(f"{which}: failed (rank {bad.rank}): {bad.stderr.strip()[-500:]}")
            continue
        out = json.loads(lines[-1].removeprefix("RESULT "))
        print(f"\n## {which}, rank 0, MB")
        print(f"{'phase':<14} {'RSS':>7} {'anon':>7} {'phase HWM':>9} {'malloc':>7} {'heap':>7} "
              f"{'pymalloc':>8} {'CPU':>8}")  # fmt: skip
        for r in out["rows"]:
            print(f"{r['phase']:<14} {r['rss']:7.1f} {r['anon']:7.1f} {r['hwm']:9.1f} "
                  f"{r['malloc']:7.1f} "
                  f"{r['heap']:7.1f} {r['pymalloc']:8.1f} {r['cpu'] * 1e3:6.0f} ms")  # fmt: skip
        classes = [f"{k}: {int(c)} ({mb:.0f} MB)" for k, (c, mb) in out["sizes"].items() if c]
        print("tensors one step allocates, by size: " + ", ".join(classes))
    print(bd._load())


if __name__ == "__main__":
    main()
