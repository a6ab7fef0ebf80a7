"""``train_step(..., param_specs="auto")``: the step's parameter and batch specs chosen by
auto-sharding (``partita.auto``, docs/auto.md) at the first compile.

``param_specs`` is ``"auto"`` (every parameter is the solver's), or a dict whose values are
specs or ``"auto"``: a parameter a spec key matches (name or fnmatch pattern) keeps that spec,
the others are the solver's. A parameter and its optimizer states are one choice, and the
step's updated state must come out as it went in. The batch is the solver's when
``batch_spec`` is None. The four presets that apply to the mesh are scored beside the
solver's answer; the cheapest is kept (``step.plan.auto`` says which and why).
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch.utils import _pytree as pytree

from partita.errors import PartitaError
from partita.frontend.jit import Jitted
from partita.frontend.pipeline import compile_auto
from partita.options import CompileOptions
from partita.presets import default_batch_spec
from partita.presets import param_specs as preset_param_specs
from partita.training.checks import batch_leaf_specs
from partita.values.spec import P, PartitionSpec
from partita.values.tensor import ShardedTensor

__all__ = ["AUTO", "auto_fixed_specs", "choose_step_specs", "is_auto", "solve_step_specs"]

AUTO = "auto"
PRESETS = ("dp", "fsdp", "tp", "fsdp+tp")


def is_auto(param_specs: Any) -> bool:
    """``param_specs`` asks for auto-sharding (``"auto"``, or a dict with an ``"auto"`` value)."""
    if isinstance(param_specs, str):
        return param_specs == AUTO
    return isinstance(param_specs, dict) and any(v == AUTO for v in param_specs.values())


def auto_fixed_specs(param_specs: Any, names: list[str]) -> dict[str, PartitionSpec]:
    """The parameters the user fixed: ``{name: spec}`` for names a non-``"auto"`` key matches
    (the first matching key wins, as for a preset dict)."""
    if not isinstance(param_specs, dict):
        return {}
    out: dict[str, PartitionSpec] = {}
    for name in names:
        for key, spec in param_specs.items():
            if spec == AUTO:
                continue
            if key == name or fnmatch.fnmatchcase(name, key):
                out[name] = spec if isinstance(spec, PartitionSpec) else P(*spec)
                break
    return out


def solve_step_specs(
    step: Any,
    args: tuple[Any, ...],
    fixed: dict[str, PartitionSpec],
    batch_open: bool,
    options: CompileOptions,
) -> tuple[dict[str, PartitionSpec], list[PartitionSpec | None], Any]:
    """Choose the step's specs: ``({parameter: spec}, [spec per batch leaf], plan.auto)``."""
    params, buffers, opt_state, _lr, _batch = args
    paths, _ = pytree.tree_flatten_with_path((args, {}))
    n_state = len(pytree.tree_leaves((params, buffers, opt_state)))
    n_lead = len(pytree.tree_leaves((params, buffers, opt_state, _lr)))
    names: dict[int, str] = {}
    param_of: dict[int, str] = {}
    specs: list[PartitionSpec | None] = []
    for i, (path, leaf) in enumerate(paths):
        keys = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
        what = ("param", "buffer", "state", "lr", "batch")[int(keys[1] or 0)]
        names[i] = ".".join([what, *(str(k) for k in keys[2:])])
        spec: PartitionSpec | None = None
        if i < n_state and keys[1] in (0, 2) and keys[-1] in step.params:
            param_of[i] = str(keys[-1])
        if i in param_of:
            spec = fixed.get(param_of[i])
        elif i < n_state:
            spec = getattr(leaf, "spec", None) or P()
        elif i >= n_lead and not batch_open:
            spec = None  # filled below from batch_spec
        specs.append(spec)
    if not batch_open:
        for j, s in enumerate(batch_leaf_specs(_batch, step.batch_spec) or []):
            specs[n_lead + j] = s
    batch_leaves = list(range(n_lead, len(paths)))
    open_leaves = {i for i, name in param_of.items() if name not in fixed}
    if batch_open:
        open_leaves.update(batch_leaves)
    groups: dict[str, list[int]] = {}
    for i, name in param_of.items():
        groups.setdefault(name, []).append(i)
    presets: dict[str, list[PartitionSpec | None]] = {}
    for kind in PRESETS:
        try:
            pspecs = preset_param_specs(kind, step.model, step.mesh)
        except PartitaError:
            continue  # the preset needs a mesh axis this mesh does not have
        batch = default_batch_spec(kind, step.mesh)
        cand = list(specs)
        for i, name in param_of.items():
            cand[i] = fixed.get(name, pspecs[name])
        if batch_open:
            for i in batch_leaves:
                cand[i] = _batch_spec(batch, paths[i][1])
        presets[kind] = cand

    def out_specs_of(leaf_specs: list[PartitionSpec | None]) -> Any:
        state = pytree.tree_unflatten(
            [s or P() for s in leaf_specs[:n_state]],
            pytree.tree_structure((params, buffers, opt_state)),
        )
        return (P(), *state)

    ties = [(1 + i, i) for i in range(n_state)]
    compiled = compile_auto(
        step._fn, args, {}, mesh=step.mesh, specs=specs, open_leaves=open_leaves,
        options=options, presets=presets, out_specs_of=out_specs_of, names=names,
        groups=list(groups.values()), ties=ties,
    )  # fmt: skip
    prog = compiled.program
    chosen: dict[int, PartitionSpec] = {
        leaf: s.spec for leaf, s in zip(prog.tensor_leaves, compiled.input_shardings, strict=False)
    }
    pspecs_out = {name: chosen[i] for i, name in param_of.items() if i < len(paths)}
    batch_specs: list[PartitionSpec | None] = [chosen.get(i, P()) for i in batch_leaves]
    return pspecs_out, batch_specs, getattr(compiled.plan, "auto", None)


def _batch_spec(spec: PartitionSpec, leaf: Any) -> PartitionSpec:
    """The preset's batch spec where the leaf's dim 0 takes it, else replicated."""
    shape = getattr(leaf, "shape", None)
    if not shape or not spec or spec[0] is None:
        return P()
    return spec


def choose_step_specs(step: Any, args: tuple[Any, ...], batch: Any) -> None:
    """Choose a ``TrainStep``'s open specs on ``args`` (its first call's), then re-shard its
    parameters and optimizer state to them (``step.auto`` holds the solver's report)."""
    options = Jitted(step._fn, mesh=step.mesh, options=step.options).options_now()
    pspecs, batch_specs, step.auto = solve_step_specs(
        step, args, step._auto_fixed, step._auto_batch, options
    )
    step.param_specs.update(pspecs)
    if step._auto_batch:
        step.batch_spec = pytree.tree_unflatten(batch_specs, pytree.tree_structure(batch))

    def put(t: ShardedTensor, spec: PartitionSpec) -> ShardedTensor:
        return ShardedTensor.from_global(t.full(), spec.to_sharding(step.mesh, t.ndim))

    step.params = {k: put(v, step.param_specs[k]) for k, v in step.params.items()}
    step.opt_state = {
        key: value if key == "step" else {k: put(v, step.param_specs[k]) for k, v in value.items()}
        for key, value in step.opt_state.items()
    }
