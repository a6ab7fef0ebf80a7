"""Find a model's repeated layers, so a training step traces each kind of layer once by default.

Why. Tracing is most of compile time, and a transformer's blocks trace to the same ops block
after block; :mod:`partita.capture.layers` traces one and copies it (``partita.scan_layers``).
The copies are the unrolled program op for op (same ops, order, shapes and source lines), but
reuse rests on a block's ops depending only on its signature (class, Python attributes,
parameter shapes, arguments). So layers found here are marked with ``verify=True``: the first
layer of each signature is traced alone, the second is traced alone too and compared with it,
and only if those two traced alike do the others reuse the trace; otherwise the rest are
traced as ordinary code. (A layer that has no twin, no other found layer with its class and
Python attributes, such as a per-layer index, is traced as ordinary code first.)

Which layers: the children of every ``nn.ModuleList`` or ``nn.Sequential`` that have
submodules of their own and share their class with at least :data:`MIN_REPEATS` - 1 siblings
(``model.blocks``, ``model.layers``, ``encoder.layer``...). The check costs: a layer traced
alone costs more than an ordinary trace (a shape probe, the split into forward and backward),
so reuse only pays from about five layers on (measured on the GPT training step when the
first layer ran as ordinary code and two more were traced alone: 4 blocks traced 0.5 s slower
with reuse than without, 12 blocks 1.5 s faster). A leaf such as ``nn.Linear`` is left alone
for the same reason. The ``scan_layers`` option (:mod:`partita.options`;
``PARTITA_SCAN_LAYERS=0``) turns this off (layers the user
marked with ``scan_layers`` are still traced once). This module decides nothing about a
trace; ``layers`` does the tracing.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from partita import options
from partita.capture.layers import mark_layers

__all__ = ["MIN_REPEATS", "repeated_layers", "scan_repeated_layers"]

#: Same-class layers a module list needs before its layers are traced once (see the doc).
MIN_REPEATS = 6


def repeated_layers(model: nn.Module) -> list[nn.Module]:
    """The children of ``model``'s module lists that have submodules and share their class
    with at least ``MIN_REPEATS - 1`` siblings.

    Example:
        >>> block = lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> model = nn.Sequential(*[block() for _ in range(6)], *[nn.Linear(2, 2)] * 6)
        >>> [type(m).__name__ for m in repeated_layers(model)][:2]
        ['Sequential', 'Sequential']
        >>> len(repeated_layers(model))
        6
    """
    out: list[nn.Module] = []
    seen: set[int] = set()
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        kinds = Counter(type(c) for c in children)
        for child in children:
            composite = next(child.children(), None) is not None
            if composite and kinds[type(child)] >= MIN_REPEATS and id(child) not in seen:
                seen.add(id(child))
                out.append(child)
    return out


def scan_repeated_layers(model: nn.Module, enabled: bool | None = None) -> None:
    """Mark ``model``'s repeated layers to be traced once, checked (see the module doc), if
    ``enabled`` (None: the current ``scan_layers`` option)."""
    if options.current().scan_layers if enabled is None else enabled:
        mark_layers(repeated_layers(model), verify=True)
