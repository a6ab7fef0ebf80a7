"""``python -m partita demo``: train a GPT sharded over 8 simulated devices, beside torch.optim.

The demo builds :class:`partita.models.GPT`, a synthetic next-token task generated on the fly
(each sequence counts upward mod the vocabulary from a random start with a random stride of
1-4, so after two tokens the next one is determined and the loss visibly falls), and trains it
twice from the same initial weights on the same batches: once with :func:`partita.train_step`
on the simulated mesh and once unsharded with ``torch.optim.AdamW``. One screen shows the mesh,
the plan (parameter specs, collectives per step, memory per device), a progress bar with the
loss, both loss curves with their largest difference, and the time per step of both.

This module only drives and prints; the training step is :mod:`partita.training.train`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from partita.models import GPT, GPTConfig
from partita.partition.plan import format_bytes
from partita.presets import PRESETS
from partita.training.train import TrainStep, train_step
from partita.values.mesh import Mesh

__all__ = ["add_arguments", "run", "synthetic_batch"]

SPARK = "▁▂▃▄▅▆▇█"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (``python -m partita demo --help``)."""
    parser.add_argument(
        "--mesh", type=mesh_arg, default="2x4", help="mesh shape: 2x4 (data x model) or 8 (data)"
    )
    parser.add_argument(
        "--shard", "--plan", dest="shard", default="fsdp+tp", choices=PRESETS,
        help="parameter sharding preset (--plan is its old name)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=80, help="training steps")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=32, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--vocab", type=int, default=32, help="vocabulary size")
    parser.add_argument("--seq", type=int, default=16, help="sequence length")
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--html", metavar="PATH", help="also write the plan as one HTML page (Plan.to_html)"
    )


def mesh_arg(text: str) -> Mesh:
    """``--mesh 2x4`` -> ``Mesh(data=2, model=4)``; ``--mesh 8`` -> ``Mesh(data=8)``."""
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected sizes joined by 'x', e.g. 2x4 or 8"
        ) from None
    if len(shape) not in (1, 2):
        raise argparse.ArgumentTypeError(f"{text!r}: the demo takes a 1-D or 2-D mesh")
    return Mesh.create(shape, ("data", "model")[: len(shape)])


def synthetic_batch(
    gen: torch.Generator, batch: int, seq: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, targets)`` of counting sequences: ``start + stride * t (mod vocab)``.

    Example:
        >>> ids, targets = synthetic_batch(torch.Generator().manual_seed(0), 2, 8, 32)
        >>> bool((targets[:, :-1] == ids[:, 1:]).all())
        True
    """
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 5, (batch, 1), generator=gen)
    seq_ids = (start + stride * torch.arange(seq + 1)) % vocab
    return seq_ids[:, :-1], seq_ids[:, 1:]


def _sparkline(values: list[float], lo: float, hi: float, width: int = 40) -> str:
    if len(values) > width:  # evenly spaced samples, first and last included
        values = [values[round(i * (len(values) - 1) / (width - 1))] for i in range(width)]
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def _table(*columns: str, title: str) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    return table


def _spec_rows(step: TrainStep) -> list[tuple[str, str, str]]:
    """One row per (module pattern, shape, spec): ``blocks.*.ln1.{weight,bias}``."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for name, p in step.model.named_parameters():
        parts = ["*" if part.isdigit() else part for part in name.split(".")]
        module, leaf = ".".join(parts[:-1]), parts[-1]
        key = (module, str(tuple(p.shape)) if p.ndim > 1 else "", str(step.param_specs[name]))
        if leaf not in groups.setdefault(key, []):
            groups[key].append(leaf)
    rows = []
    for (module, shape, spec), leaves in groups.items():
        leaf = leaves[0] if len(leaves) == 1 else "{" + ",".join(leaves) + "}"
        rows.append((f"{module}.{leaf}" if module else leaf, shape, spec))
    return rows


def _plan_tables(step: TrainStep, n_params: int) -> Group:
    plan = step.plan
    assert plan is not None  # lowered before this is called
    specs = _table("parameter", "shape", "spec", title="parameter specs (all that is annotated)")
    for row in _spec_rows(step):
        specs.add_row(*row)
    coll = _table("kind", "n", "bytes", title="collectives per step")
    by_kind: dict[str, list[Any]] = {}
    for c in plan.collectives:
        by_kind.setdefault(c.kind, []).append(c)
    for kind, recs in sorted(by_kind.items()):
        coll.add_row(kind, str(len(recs)), format_bytes(sum(r.bytes for r in recs)))
    coll.add_row("total", str(len(plan.collectives)), format_bytes(plan.bytes_per_device))
    mem = _table("state", "device", "unsharded", title=f"memory, {n_params:,} params")
    for key, (local, total) in step.memory().items():
        if total:
            mem.add_row(key, format_bytes(local), format_bytes(total))
    side = Table.grid(padding=(0, 2))
    side.add_row(coll, mem)
    return Group(specs, side)


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Train sharded and unsharded side by side and print one screen; returns 0."""
    console = console or Console()
    mesh = args.mesh
    torch.manual_seed(args.seed)
    cfg = GPTConfig(
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
        vocab_size=args.vocab,
        seq_len=args.seq,
        bias=False,  # see docs/training.md: a zero-gradient key bias makes AdamW amplify noise
    )
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    n_params = sum(p.numel() for p in model.parameters())

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    step = train_step(model, loss_fn, opt, mesh=mesh, param_specs=args.shard)
    console.print(
        f"[bold]partita demo[/]: a {args.layers}-layer GPT (d_model {args.d_model}, "
        f"{args.heads} heads, vocab {args.vocab}, seq {args.seq}) learns to continue counting "
        f"sequences; batch {args.batch}, AdamW lr {args.lr}, {args.steps} steps"
    )
    console.print(
        f"mesh: {mesh!r} = {mesh.size} simulated devices, ids {mesh.devices.tolist()}; "
        f"plan {args.shard!r}, batch {step.batch_spec}"  # tests/test_cli.py reads this text
    )
    gen = torch.Generator().manual_seed(args.seed)
    batches = [synthetic_batch(gen, args.batch, args.seq, args.vocab) for _ in range(args.steps)]

    t0 = time.perf_counter()
    step.lower(batches[0])
    compile_s = time.perf_counter() - t0
    console.print(
        Panel(_plan_tables(step, n_params), title=f"the plan (compiled in {compile_s:.1f} s)")
    )
    if getattr(args, "html", None):
        assert step.plan is not None  # lowered above
        page = step.plan.to_html(args.html, title=f"partita demo: {mesh!r}, {args.shard}")
        console.print(f"the plan as a page: {page} (open it in a browser)")

    losses: list[float] = []
    ref_losses: list[float] = []
    times: list[float] = []
    ref_times: list[float] = []
    columns = (
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=args.steps, loss="-")
        for batch in batches:
            t = time.perf_counter()
            losses.append(float(step(batch)))
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            ref_opt.zero_grad()
            ref_loss = loss_fn(reference(batch[0]), batch[1])
            ref_loss.backward()
            ref_opt.step()
            ref_losses.append(ref_loss.item())
            ref_times.append(time.perf_counter() - t)
            progress.update(task, advance=1, loss=f"{losses[-1]:.4f}")

    console.print(_curves(losses, ref_losses))
    full = step.full_parameters()
    param_diff = max((full[k] - v).abs().max().item() for k, v in reference.named_parameters())
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    # medians: the first runs also trace the executor's flat graph; the machine may be busy
    median = statistics.median(times)
    ref_median = statistics.median(ref_times)
    console.print(
        f"largest |loss difference| over {args.steps} steps: {loss_diff:.2e}; largest "
        f"|parameter difference| at the end: {param_diff:.2e}"
    )
    console.print(
        f"time per step (median): partita {1e3 * median:.0f} ms for all {mesh.size} simulated "
        f"devices in one process, unsharded torch {1e3 * ref_median:.0f} ms"
    )
    # Sharded sums run in another order; float32 training then drifts slowly, as it would
    # with another BLAS. "match" means the losses agree to 1e-3 of their own scale.
    tolerance = 1e-3 * max(abs(v) for v in ref_losses)
    verdict = "match" if loss_diff <= tolerance else "DIFFER"
    console.print(
        f"sharded and unsharded training {verdict} (loss tolerance {tolerance:.1e}; float32 "
        "sums run in a different order when sharded, so long runs drift slowly)."
    )
    return 0 if verdict == "match" else 1


def _curves(losses: list[float], ref_losses: list[float]) -> Group:
    lo = min(losses + ref_losses)
    hi = max(losses + ref_losses)
    curves = Table.grid(padding=(0, 2))
    for name, values in (("partita", losses), ("torch.optim", ref_losses)):
        trend = f"{values[0]:.4f} -> {values[-1]:.4f}"
        curves.add_row(name, _sparkline(values, lo, hi), trend)
    every = max(1, len(losses) // 8)
    rows = sorted({*range(0, len(losses), every), len(losses) - 1})
    detail = _table("step", "partita", "torch.optim", "|diff|", title="")
    detail.title = None
    for i in rows:
        diff = abs(losses[i] - ref_losses[i])
        detail.add_row(str(i + 1), f"{losses[i]:.6f}", f"{ref_losses[i]:.6f}", f"{diff:.1e}")
    return Group("loss per step (same initial weights, same batches):", curves, detail)
