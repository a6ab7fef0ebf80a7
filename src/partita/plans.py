"""Deprecated alias of :mod:`partita.presets` (the parameter presets).

"Plan" now means one thing in partita: the report of what a compiled program communicates,
:class:`partita.Plan`. The parameter presets (``"fsdp"``, ``StandardPlan``, ``param_specs``)
live in :mod:`partita.presets`, and ``train_step`` takes them as ``shard=``. Importing this
module warns once with a DeprecationWarning; its names are the new module's, under their old
names too (``StandardPlan`` is ``StandardPreset``, ``PlanLike`` is ``PresetLike``, ``PLANS``
is ``PRESETS``).
"""

from __future__ import annotations

import warnings

from partita.presets import (
    COLUMN_NAMES,
    EXPERT_NAMES,
    FUSED_NAMES,
    HEAD_NAMES,
    PATH_ROLES,
    PRESETS,
    ROW_NAMES,
    ParamRow,
    PresetLike,
    StandardPreset,
    default_batch_spec,
    explain_param_specs,
    format_param_specs,
    param_specs,
    split_fraction,
)

__all__ = [
    "COLUMN_NAMES",
    "EXPERT_NAMES",
    "FUSED_NAMES",
    "HEAD_NAMES",
    "PATH_ROLES",
    "PLANS",
    "PRESETS",
    "ROW_NAMES",
    "ParamRow",
    "PlanLike",
    "PresetLike",
    "StandardPlan",
    "StandardPreset",
    "default_batch_spec",
    "explain_param_specs",
    "format_param_specs",
    "param_specs",
    "split_fraction",
]

StandardPlan = StandardPreset
PlanLike = PresetLike
PLANS = PRESETS

warnings.warn(
    "partita.plans is now partita.presets (StandardPlan -> StandardPreset, PlanLike -> "
    "PresetLike, PLANS -> PRESETS); 'plan' names only the collective report, partita.Plan.",
    DeprecationWarning,
    stacklevel=2,
)
