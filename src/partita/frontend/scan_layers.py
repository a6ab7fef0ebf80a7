"""``partita.scan_layers``: trace N identical layers once instead of N times.

Compile time of a deep model is mostly tracing, and tracing grows with depth: every layer's
forward and backward ops are dispatched one by one. ``scan_layers(model.blocks)`` marks the
layers; from then on every trace that calls them (``partita.jit``, ``partita.train_step``)
traces each *distinct* layer once, forward and backward, and copies that graph for the other
identical layers. The compiled program is the unrolled one (the same ops, shardings and
results); only the time to build it changes. The machinery is
:mod:`partita.capture.layers`, which says exactly when a layer counts as identical and when it
falls back (with a PartitaWarning naming the reason). Training steps (``train_step``,
``make_train_step``, ``jit`` of a module) already do this for a model's repeated blocks by
default, after checking that two of them trace alike (:mod:`partita.capture.layer_auto`;
``PARTITA_SCAN_LAYERS=0`` turns it off); ``scan_layers`` marks layers explicitly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from torch import nn

from partita.capture.layer_loop_keys import LOOPED, LoopGroup
from partita.capture.layer_stack import stack_parameters
from partita.capture.layers import mark_layers
from partita.errors import ArgumentTypeError

__all__ = ["scan_layers"]

Layers = TypeVar("Layers", bound=Iterable[nn.Module])


def scan_layers(layers: Layers, *, loop: bool = False) -> Layers:
    """Trace each distinct layer of ``layers`` once per program; returns ``layers``.

    ``loop=True``: a chain of identical layers, each reading the previous one's result,
    becomes one ``scan`` over the layers' stacked parameters (``capture/layer_loop.py``): the
    program holds the layer once, propagated and partitioned once, whatever the depth (a
    training step's backward chain becomes a second scan). The call stacks each parameter and
    buffer name over the layers once, and makes every layer's parameter a view of its slice
    (``p.data = stacked[i]``: the same Parameter, updated in place as before), so a compiled
    function reads one tensor per name (``capture/layer_stack.py``).

    Layers are identical when they have the same class and Python attributes (submodules
    included), the same parameter and buffer names, shapes, dtypes and ``requires_grad``, and
    are called with arguments of the same shapes and the same static values. Layers that
    differ are traced once per kind (a warning names a differing attribute). A layer that
    updates a buffer in place, has hooks, or returns non-tensors is traced as ordinary code
    (with a warning). Outside a trace the layers run unchanged.

    Raises:
        TypeError: ``layers`` is not an iterable of ``nn.Module`` (e.g. the model itself).

    Example:
        >>> model = partita.models.GPT(partita.models.GPTConfig(n_layer=4))
        >>> partita.scan_layers(model.blocks)  # doctest: +ELLIPSIS
        ModuleList(...)
    """
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise ArgumentTypeError(
            f"scan_layers takes the repeated layers (an nn.ModuleList such as model.blocks), "
            f"got the {type(layers).__name__} module itself. Pass its list of layers."
        )
    modules = list(layers)
    bad = [m for m in modules if not isinstance(m, nn.Module)]
    if bad or not modules:
        what = f"a {type(bad[0]).__name__}" if bad else "nothing"
        raise ArgumentTypeError(
            f"scan_layers takes an iterable of nn.Module layers (model.blocks), but it holds "
            f"{what}. Pass the nn.ModuleList of the repeated blocks."
        )
    mark_layers(modules)
    if loop:
        group = LoopGroup(modules)
        for m in modules:
            LOOPED[m] = group
        stack_parameters(group)  # the parameters become views of one tensor per name
    return layers
