"""The ``partita`` command line: ``python -m partita demo`` (and ``partita demo``).

One function per subcommand; :func:`main` parses the arguments and dispatches. ``demo`` trains
a GPT sharded over 8 simulated devices beside the same model trained with torch.optim
(:mod:`partita.cli.demo`); ``tour`` is a short printed tour of meshes, specs and sharded tensors;
``plan`` prints a model's memory per device, bytes per mesh axis and step time on a mesh
(:mod:`partita.cli.plan`).
This module only prints; it has no logic of its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch
from rich.console import Console

from partita.report.visualize import visualize_sharding
from partita.values.mesh import Mesh
from partita.values.spec import P
from partita.values.tensor import mark_sharding

__all__ = ["main"]


def _heading(console: Console, text: str) -> None:
    console.print()
    if console.is_terminal:
        console.rule(text, style="cyan")
    else:
        console.rule(text, characters="-", style="")


def demo(args: argparse.Namespace) -> int:
    """Train a GPT sharded and unsharded side by side (see :mod:`partita.cli.demo`)."""
    from partita.cli.demo import run  # imports the models and the compiler: only when asked

    return run(args)


def tour(args: argparse.Namespace) -> int:
    """A tour: a mesh, a sharded tensor, its local shards and table, and an uneven shape."""
    console = Console()

    _heading(console, "A mesh: 8 devices folded into 2 x 4, one name per mesh axis")
    mesh = Mesh.create((2, 4), ("data", "model"))
    console.print(f"mesh = Mesh.create((2, 4), ('data', 'model'))  ->  {mesh!r}")
    console.print(f"device ids by mesh coordinate: {mesh.devices.tolist()}")

    _heading(console, "A sharded tensor: rows split over 'data', columns over 'model'")
    x = mark_sharding(torch.arange(64.0).reshape(8, 8), mesh, P("data", "model"))
    console.print("x = mark_sharding(torch.arange(64.0).reshape(8, 8), mesh, P('data', 'model'))")
    console.print(
        f"x.sharding = {x.sharding}, global shape {tuple(x.shape)}, local {x.local_shape}"
    )
    for shard in x.local_shards:
        index = ", ".join(f"{s.start}:{s.stop}" for s in shard.index)
        console.print(
            f"  device {shard.device}: index [{index}], local shape "
            f"{tuple(shard.data.shape)}, replica id {shard.replica_id}",
            markup=False,
        )
    visualize_sharding(x, console=console)

    _heading(console, "Replication: mesh axes a spec does not use hold copies")
    w = mark_sharding(torch.zeros(8, 8), mesh, P("data", None))
    console.print("w = mark_sharding(torch.zeros(8, 8), mesh, P('data', None))")
    visualize_sharding(w, console=console)

    _heading(console, "Uneven shapes: ceil padding, trailing devices may hold only padding")
    line = Mesh.create((4,), ("x",))
    u = mark_sharding(torch.arange(60.0).reshape(10, 6), line, P("x", None))
    console.print(
        "u = mark_sharding(torch.arange(60.0).reshape(10, 6), Mesh.create((4,), ('x',)), "
        f"P('x', None)): every local shard is {u.local_shape}; device 3 holds one real row and "
        f"two rows of padding",
        markup=False,
    )
    visualize_sharding(u, console=console)
    v = mark_sharding(torch.arange(9.0), Mesh.create((8,), ("x",)), P("x"))
    console.print("9 rows on 8 devices: ceil(9 / 8) = 2 rows each; devices 5, 6, 7 hold padding")
    visualize_sharding(v, console=console)
    console.print(repr(v), markup=False)
    console.print(
        "u.full() gives the original back exactly:",
        bool((u.full() == torch.arange(60.0).reshape(10, 6)).all()),
    )
    return 0


def plan(args: argparse.Namespace) -> int:
    """Plan a model's training step on a mesh (see :mod:`partita.cli.plan`)."""
    from partita.cli.plan import run  # imports the models and the compiler: only when asked

    return run(args)


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "demo": (demo, "train a GPT on 8 simulated devices beside the same model unsharded"),
    "tour": (tour, "a short printed tour of meshes, specs and sharded tensors"),
    "plan": (plan, "memory per device, bytes per mesh axis and step time of a model's plan"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partita",
        description="partita: whole-program SPMD sharding for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == "demo":
            from partita.cli.demo import add_arguments

            add_arguments(command)
        if name == "plan":
            from partita.cli.plan import add_arguments as plan_arguments

            plan_arguments(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Example:
        >>> main(["tour"])  # prints the tour  # doctest: +SKIP
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help and usage errors: return their code instead of exiting
        return int(e.code or 0)
    command, _ = COMMANDS[args.command]
    return command(args)
