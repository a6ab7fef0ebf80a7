"""One injected fault in a 2-process run: ``faults.py MODE``; every survivor must fail typed.

Each rank runs a small step for ``STEPS`` steps (a matmul whose rows are split over the mesh
axis ``data``, summed: every step all-reduces a scalar over the mesh-axis group, a group of its
own created by ``new_group``); rank 1 misbehaves as MODE says:

===============  =====================================================================
stall            stalls before step 2: sleeps until rank 0 is gone, at most ``FAULT_STALL``
                 seconds (default 45; see ``stall``)
kill             SIGKILLs itself before step 2
raise            raises a plain Python error before step 2
mismatch         four mistakes, each a typed error on every rank, then a matching call:
                 ``shapes`` (rank 1 passes a global input of shape (10, 4), rank 0
                 (8, 4)), ``dtypes`` (float64 against float32), ``programs`` (a branch),
                 ``prints`` (each rank prints a different sharded value)
calls            after warm-up (every rank compiled every variant), the ranks call different
                 ones: ``shapes`` (f on (8, 4) / (10, 4)), ``functions`` (two jit functions),
                 ``dtypes`` (float32 / float64), ``short_batch`` (a train step whose last batch
                 is short on rank 1 only, first compiled there), ``replicas`` (a module built
                 unseeded on each rank, its parameters replicated), ``unchecked_first`` (the
                 first run of a program under check_calls=False); each a typed error on every
                 rank; then every variant on both ranks, checked against one process
fewer_steps      stops after 2 steps, calls ``shutdown()`` and checks that partita let go of
                 its process groups, then exits cleanly; the others run 4
main_only_print  (rank 0 misbehaves) prints a sharded value alone; rank 1 compiles on
ckpt_paths       each rank passes ``checkpoint.save`` its own path (``FAULT_DIR/rank<r>``);
                 then rank 1 alone passes a non-tensor; then all save to ``FAULT_DIR/c``;
                 then rank 1 loads from ``FAULT_DIR/d``
ckpt_one_rank    (rank 0 misbehaves) calls ``checkpoint.save`` alone; rank 1 sleeps until
                 rank 0 is gone, at most ``FAULT_STALL`` seconds, and exits 0
ckpt_crash       both save checkpoint A to ``FAULT_DIR/c`` (unless ``FAULT_FIRST_SAVE=0``),
                 then B; rank 0 calls ``os._exit(CRASH_EXIT)`` at the save's crash point
                 ``FAULT_CRASH_AT`` (``partita.checkpoint.directory.CRASH_POINTS``)
ckpt_rank_dies   both save A to ``FAULT_DIR/c``, then B; rank 1 ``os._exit``s inside DCP's
                 write of B
===============  =====================================================================

The faulty rank prints ``fault MODE at <time.time()>`` when it misbehaves. A PartitaError is printed
as ``PARTITA <type> [case=<case>] at <time.time()>: <message>`` on stderr; an uncaught one
exits with status 17, so the test can tell a typed partita error from a crash (1, a signal).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import partita
import partita.checkpoint as ckpt
import partita.distributed as pd
import partita.options
from partita import Mesh, P, ShardedTensor
from partita.checkpoint import directory
from partita.errors import CheckpointError, DistributedError, PartitaError, PlanMismatchError
from partita.runtime.distributed import distributed_executor

PARTITA_EXIT = 17
CRASH_EXIT = 3  # ckpt_crash: rank 0 stopped at the crash point
STEPS = 4
MISMATCHES = ("shapes", "dtypes", "programs")


def stall() -> None:
    """Sleep until rank 0 has exited, at most ``FAULT_STALL`` seconds. Rank 0 hosts the
    rendezvous store, which stops answering when it exits: by then its typed error is out (it
    exits after printing it), so the stall outlasted its collective timeout, and this rank
    wakes to a dead peer at once instead of after a fixed sleep."""
    store = torch.distributed.distributed_c10d._get_default_store()
    end = time.monotonic() + float(os.environ.get("FAULT_STALL", "45"))
    while time.monotonic() < end:
        try:
            store.check(["stall"])
        except Exception:  # the store's host (rank 0) is gone
            return
        time.sleep(0.2)


def report(e: PartitaError, case: str = "") -> None:
    label = f" case={case}" if case else ""
    print(f"PARTITA {type(e).__name__}{label} at {time.time():.3f}: {e}", file=sys.stderr)
    sys.stderr.flush()


def inputs(mode: str, faulty: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = 10 if mode == "shapes" and faulty else 8
    dtype = torch.float64 if mode == "dtypes" and faulty else torch.float32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 4, generator=gen).to(dtype)
    w = torch.randn(4, 3, generator=gen).to(dtype)
    return x, w


def mismatches(mesh: Mesh, faulty: bool) -> None:
    """Each mismatch in turn, each an error on both ranks; then the run still works.

    The plan check (and the check of ``full()``) runs before any collective that could
    mismatch, so after the error every rank is still in step with the others: a matching call
    afterwards must run normally.
    """
    for case in MISMATCHES:

        def step_fn(x: torch.Tensor, w: torch.Tensor, case: str = case) -> torch.Tensor:
            if case == "programs" and faulty:  # a per-rank branch
                return (x @ w).amax()
            return (x @ w).sum()

        step = partita.jit(step_fn, mesh=mesh, in_specs=(P("data", None), P()))
        try:
            step(*inputs(case, faulty)).full()
        except PlanMismatchError as e:
            report(e, case)
        else:
            print(f"case={case} ran", flush=True)
    double = partita.jit(lambda x: x * 2, mesh=mesh, in_specs=P("data", None))
    x, _ = inputs("", False)
    y, z = double(x), double(x[:6])
    try:
        print(z if faulty else y, flush=True)  # WRONG: two different gathers
    except DistributedError as e:
        report(e, "prints")
    step = partita.jit(lambda x, w: (x @ w).sum(), mesh=mesh, in_specs=(P("data", None), P()))
    print(f"after mismatches loss={step(*inputs('', False)).full().item():.6f}", flush=True)


def calls(mesh: Mesh, faulty: bool) -> None:
    """Mistakes a check of a program's first run alone cannot see (docstring table)."""
    from partita.errors import ReplicaMismatchError

    quarter = partita.jit(lambda x: x.sum() / 4, mesh=mesh, in_specs=P("data", None))
    double = partita.jit(lambda x: (x * 2).sum(), mesh=mesh, in_specs=P("data", None))
    triple = partita.jit(lambda x: (x * 3).sum(), mesh=mesh, in_specs=P("data", None))
    eight, ten = torch.ones(8, 4), torch.ones(10, 4)
    wide = torch.ones(8, 4, dtype=torch.float64)
    for fn, x in ((quarter, eight), (quarter, ten), (quarter, wide), (double, eight),
                  (triple, eight)):  # fmt: skip
        fn(x).full()  # warm-up: every rank compiled and ran every variant
    gen = torch.Generator().manual_seed(0)
    w, x, short = torch.randn(4, 3, generator=gen), torch.randn(8, 4, generator=gen), None
    short = x[:6]
    train = partita.jit(
        lambda w, x: (w - 0.1 * (x @ w).tanh().mean() * w, ((x @ w) ** 2).mean()),
        mesh=mesh,
        in_specs=(P(), P("data", None)),
    )
    w = train(w, x)[0]  # a full step on both ranks
    cases = {
        "shapes": lambda: quarter(ten if faulty else eight),
        "functions": lambda: (triple if faulty else double)(eight),
        "dtypes": lambda: quarter(wide if faulty else eight),
        "short_batch": lambda: train(w, short if faulty else x)[1],
    }
    for case, run in cases.items():
        try:
            value = run().full().item()
        except PlanMismatchError as e:
            report(e, case)
        else:
            print(f"case={case} ran {value}", flush=True)
    with partita.options.using(check_calls=False):  # still checked: a program's first run
        half = partita.jit(lambda x: x.sum() / 2, mesh=mesh, in_specs=P("data", None))
        try:
            print(f"case=unchecked_first ran {half(ten if faulty else eight).full()}", flush=True)
        except PlanMismatchError as e:
            report(e, "unchecked_first")
    torch.manual_seed(1000 + pd.process_index())  # WRONG: unseeded, a different init per rank
    model = torch.nn.Linear(4, 3)
    forward = partita.jit(model, mesh=mesh, in_specs=(P("data", None),))
    try:
        print(f"case=replicas ran {forward(x).full().sum().item()}", flush=True)
    except ReplicaMismatchError as e:
        report(e, "replicas")
    torch.manual_seed(0)  # the fix: the same seed on every process
    model = torch.nn.Linear(4, 3)
    forward = partita.jit(model, mesh=mesh, in_specs=(P("data", None),))
    results = {
        "quarter8": quarter(eight), "quarter10": quarter(ten), "quarter64": quarter(wide),
        "double": double(eight), "triple": triple(eight), "loss": train(w, x)[1],
        "short": train(w, short)[1], "forward": forward(x).full().sum(),
    }  # fmt: skip
    for name, value in results.items():
        v = value.full() if hasattr(value, "full") else value
        print(f"after {name}={float(v):.6f}", flush=True)


def main_only_print(mesh: Mesh) -> None:
    """Rank 0 prints a sharded value alone (a gather), rank 1 goes on to compile a new step.

    The classic mistake ``if is_main_process(): print(x)``: rank 0 waits in the gather, rank 1
    in the new program's plan check. Both must time out typed, not meet in one collective.
    """
    double = partita.jit(lambda x: x * 2, mesh=mesh, in_specs=P("data", None))
    x, w = inputs("", False)
    y = double(x)
    print(f"fault main_only_print at {time.time():.3f}", flush=True)
    if pd.is_main_process():  # WRONG: printing gathers, a collective on one process only
        print(y, flush=True)
    step = partita.jit(lambda x, w: (x @ w).sum(), mesh=mesh, in_specs=(P("data", None), P()))
    print(f"step loss={step(x, w).full().item():.6f}", flush=True)


def checkpoint_state(mesh: Mesh, offset: float) -> dict[str, torch.Tensor]:
    """Checkpoint A is ``checkpoint_state(mesh, 0.0)``, B ``(mesh, 100.0)``."""
    w = torch.arange(8.0).reshape(4, 2) + offset
    return {
        "w": ShardedTensor.from_global(w, P("data", None).to_sharding(mesh, 2)),
        "b": torch.arange(3.0) + offset,
    }


def checkpoint_faults(mode: str, mesh: Mesh, rank: int) -> None:
    base = Path(os.environ["FAULT_DIR"])
    if mode == "ckpt_paths":  # WRONG: a path per rank, to save and then to load
        print(f"fault {mode} at {time.time():.3f}", flush=True)
        try:
            ckpt.save(checkpoint_state(mesh, 0.0), base / f"rank{rank}")
        except CheckpointError as e:
            report(e, "save")
        state = checkpoint_state(mesh, 0.0)
        try:  # a mistake on one rank only (a value that is not a tensor)
            ckpt.save({**state, "note": "hi"} if rank == 1 else state, base / "c")
        except CheckpointError as e:
            report(e, "one")
        ckpt.save(state, base / "c")  # right: one path
        try:
            ckpt.load(checkpoint_state(mesh, 0.0), base / ("c" if rank == 0 else "d"))
        except CheckpointError as e:
            report(e, "load")
    elif mode == "ckpt_one_rank":
        print(f"fault {mode} at {time.time():.3f}", flush=True)
        if rank == 0:  # WRONG: save is collective
            ckpt.save(checkpoint_state(mesh, 0.0), base / "c")
        else:
            stall()
    elif mode == "ckpt_crash":
        point = os.environ["FAULT_CRASH_AT"]
        if os.environ.get("FAULT_FIRST_SAVE", "1") == "1":
            ckpt.save(checkpoint_state(mesh, 0.0), base / "c")

        def crash(reached: str) -> None:
            if reached == point:
                print(f"fault {mode} at {time.time():.3f}", flush=True)
                os._exit(CRASH_EXIT)

        if rank == 0:
            directory.step_done = crash
        ckpt.save(checkpoint_state(mesh, 100.0), base / "c")
    elif mode == "ckpt_rank_dies":
        ckpt.save(checkpoint_state(mesh, 0.0), base / "c")
        if rank == 1:  # dies inside DCP's write, while rank 0 waits in DCP's collective
            write = dcp.FileSystemWriter.write_data

            def die(*args: object, **kwargs: object) -> None:
                write(*args, **kwargs)
                print(f"fault {mode} at {time.time():.3f}", flush=True)
                os._exit(CRASH_EXIT)

            dcp.FileSystemWriter.write_data = die  # type: ignore[method-assign]
        ckpt.save(checkpoint_state(mesh, 100.0), base / "c")
    print(f"{mode} returned", flush=True)


def main(mode: str) -> None:
    pd.initialize()
    rank = pd.process_index()
    mesh = Mesh.create((pd.process_count(),), ("data",))
    faulty = rank == 1
    if mode.startswith("ckpt_"):
        return checkpoint_faults(mode, mesh, rank)
    if mode == "mismatch":
        return mismatches(mesh, faulty)
    if mode == "main_only_print":
        return main_only_print(mesh)
    if mode == "calls":
        return calls(mesh, faulty)
    step = partita.jit(lambda x, w: (x @ w).sum(), mesh=mesh, in_specs=(P("data", None), P()))
    x, w = inputs(mode, faulty)
    steps = 2 if mode == "fewer_steps" and faulty else STEPS
    for i in range(steps):
        if i == 2 and faulty:
            print(f"fault {mode} at {time.time():.3f}", flush=True)
            if mode == "stall":
                stall()
            elif mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif mode == "raise":
                raise RuntimeError("injected failure on rank 1")
        loss = step(x, w).full()
        print(f"step {i} loss={loss.item():.6f}", flush=True)
    if mode == "fewer_steps" and faulty:
        released(mesh)


def released(mesh: Mesh) -> None:
    """After ``shutdown()`` no executor still holds a process group (a closed one raises)."""
    executor = distributed_executor(mesh)
    assert executor is not None
    pd.shutdown()
    assert not pd.is_initialized() and distributed_executor(mesh) is None
    try:
        executor.group(("data",))
    except DistributedError as e:
        assert "closed by partita.distributed.shutdown()" in str(e), e
    else:
        raise AssertionError("a closed executor still hands out its process group")
    print("shutdown released the process groups", flush=True)


if __name__ == "__main__":
    faulthandler.enable()  # a native abort prints the Python stack that led to it
    try:
        main(sys.argv[1])
    except PartitaError as e:
        report(e)
        sys.exit(PARTITA_EXIT)
