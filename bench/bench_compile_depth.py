"""Compile time of a GPT training step against its depth, with and without ``scan_layers``.

Run: ``.venv/bin/python bench/bench_compile_depth.py [--layers 2 6 12 24] [--repeat 3] [--gpt-m]``

Every layer is propagated and partitioned on its own, and, unless its trace is reused
(``auto`` and ``scan`` below), traced on its own too, so compiling a step costs time roughly
proportional to the number of layers. Each depth is compiled three ways: ``unrolled`` (every
block traced: ``PARTITA_SCAN_LAYERS=0``), ``auto`` (the default: ``train_step`` finds the
repeated blocks, traces two alone (the second to compare with the first), and copies the
graph for the others) and ``scan`` (``partita.scan_layers(model.blocks)``: one block traced,
its graph copied). This builds
``partita.train_step`` for ``partita.models.GPT`` (width 256, 4 heads, vocabulary 512,
sequence 64, global batch 8, AdamW; ``--gpt-m``: width 768, 12 heads, vocabulary 8192,
sequence 256, batch 8) under the ``fsdp`` plan on a 2x4 ``data x model`` mesh
and times ``step.lower(batch)``, which compiles the whole step (forward, backward, update)
without running it. The three stages are timed as ``partita.jit`` calls them
(``capture.trace``, ``propagate``, ``partition``), by wrapping those functions for the
duration of the run; ``total`` is the wall time of ``lower`` and also includes building the
step's inputs and formatting the program text. Every repeat builds a new model and a new step,
so nothing is served from the compile cache. Medians of ``--repeat``. ``cpu`` is the process
CPU time of ``lower`` (both cores' worth if torch used them), and the ``<stage> cpu`` columns
that of each stage: on a loaded machine they vary less than the wall times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.models import GPT, GPTConfig

WIDTH, HEADS, VOCAB, SEQ, BATCH = 256, 4, 512, 64, 8
STAGES = ("trace", "propagate", "partition")
# partita/__init__ binds the name partita.jit to the function: fetch the module itself.
jit_module = sys.modules["partita.frontend.jit"]


@contextmanager
def timed_stages(times: dict[str, float]) -> Iterator[None]:
    """Add the wall time of each compile stage jit runs to ``times`` while inside."""
    originals: dict[str, tuple[Any, str, Callable[..., Any]]] = {
        "trace": (jit_module.capture, "trace", jit_module.capture.trace),
        "propagate": (jit_module, "propagate", jit_module.propagate),
        "partition": (jit_module, "partition", jit_module.partition),
    }

    def wrap(stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                times[stage] = times.get(stage, 0.0) + time.perf_counter() - t0
                cpu = f"{stage} cpu"
                times[cpu] = times.get(cpu, 0.0) + time.process_time() - c0

        return timed

    for stage, (owner, attr, fn) in originals.items():
        setattr(owner, attr, wrap(stage, fn))
    try:
        yield
    finally:
        for owner, attr, fn in originals.values():
            setattr(owner, attr, fn)


def compile_once(
    n_layer: int, mesh: Mesh, mode: str, size: argparse.Namespace
) -> tuple[dict[str, float], int]:
    """Times of one fresh compile of an ``n_layer`` step, and its number of values."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=size.heads, d_model=size.width,
                          vocab_size=size.vocab, seq_len=size.seq))  # fmt: skip
    if mode == "scan":
        partita.scan_layers(model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # train_step finds the repeated blocks itself unless PARTITA_SCAN_LAYERS=0 (layer_auto)
    old = os.environ.get("PARTITA_SCAN_LAYERS")
    os.environ["PARTITA_SCAN_LAYERS"] = "0" if mode == "unrolled" else "1"
    try:
        step = partita.train_step(
            model, loss_fn, opt, mesh=mesh, param_specs="fsdp", batch_spec=P("data")
        )
    finally:
        if old is None:
            del os.environ["PARTITA_SCAN_LAYERS"]
        else:
            os.environ["PARTITA_SCAN_LAYERS"] = old
    ids = torch.randint(0, size.vocab, (size.batch, size.seq))
    times: dict[str, float] = {}
    with timed_stages(times):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = step.lower((ids, torch.roll(ids, -1, dims=1)))
        times["total"] = time.perf_counter() - t0
        times["cpu"] = time.process_time() - c0
    # The program text has a title line, then one line per value of the global program.
    return times, len(plan.program_text.splitlines()) - 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 6, 12, 24])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument(
        "--gpt-m", action="store_true",
        help="GPT-M sizes: width 768, 12 heads, vocabulary 8192, sequence 256, batch 8",
    )  # fmt: skip
    ns = parser.parse_args(argv)
    if ns.gpt_m:
        ns.width, ns.heads, ns.vocab, ns.seq, ns.batch = 768, 12, 8192, 256, 8
    mesh = Mesh.create((2, 4), ("data", "model"))
    print(f"# {' '.join([sys.executable, *sys.argv])}")
    print(
        f"# partita.train_step(GPT d_model={ns.width} heads={ns.heads} vocab={ns.vocab} "
        f"seq={ns.seq} batch={ns.batch}, AdamW, param_specs='fsdp') on {mesh!r}; torch "
        f"{torch.__version__}; {torch.get_num_threads()} threads; median of {ns.repeat} fresh "
        f"compiles (seconds); load average {os.getloadavg()[0]:.1f} at the start"
    )
    header = (
        ("layers", 6), ("mode", 8), ("values", 7), *((s, 9) for s in STAGES), ("total", 8),
        ("s/layer", 8), ("cpu", 8), *((f"{s} cpu", 13) for s in STAGES),
    )  # fmt: skip
    print(" ".join(f"{c:>{w}}" for c, w in header))
    keys = (*STAGES, "total", "cpu", *(f"{s} cpu" for s in STAGES))
    for n in ns.layers:
        for mode in ("unrolled", "auto", "scan"):
            runs = [compile_once(n, mesh, mode, ns) for _ in range(ns.repeat)]
            med = {k: statistics.median(r[0][k] for r in runs) for k in keys}
            stages = " ".join(f"{med[s]:>9.2f}" for s in STAGES)
            cpus = " ".join(f"{med[f'{s} cpu']:>13.2f}" for s in STAGES)
            print(
                f"{n:>6} {mode:>8} {runs[0][1]:>7} {stages} {med['total']:>8.2f} "
                f"{med['total'] / n:>8.2f} {med['cpu']:>8.2f} {cpus}",
                flush=True,
            )
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
