"""``partita.train_step``: an nn.Module, a loss and a torch.optim optimizer as one sharded program.

:func:`train_step` builds a :class:`TrainStep`. It reads the module's parameters and buffers and
the optimizer's hyperparameters once, resolves the sharding preset (``param_specs=``, see
:mod:`partita.presets`) to one spec per parameter, and from then on *owns* the training state as
ShardedTensors: the parameters, the buffers (batch-norm running statistics are program inputs
and outputs, replicated), the optimizer states (sharded like their parameters) and the step
counter. ``step(batch)`` runs forward, backward, optional gradient clipping and the update as
one program compiled by ``partita.jit`` from :func:`partita.training.functional_step`, and
returns the loss.

Each parameter group's ``lr``, ``weight_decay``, and ``betas`` or ``momentum`` are read from
``optimizer.param_groups[i]`` at every call and passed as data (:mod:`partita.training.groups`),
so ``torch.optim.lr_scheduler`` schedulers work unchanged (call ``scheduler.step()``; never
``optimizer.step()``). Everything else is fixed when the step is built; a change made later is
an error (``training.snapshot``).

Vocabulary (see docs/concepts.md): ``param_specs=`` is how parameters are split (a preset, a
dict or a callable, as ``partita.jit``'s); ``step.plan`` is the report of the compiled program
(:class:`partita.Plan`). This module ties the pieces together; the sharding decisions are the
preset's and propagation's, the update math is ``partita.training``', the checks of each batch
``partita.training.checks``', the state's sizes ``partita.training.memory``' and the checkpoint
layout (tied names, optimizer indices, atomic loading) ``partita.training.state``'.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice
from typing import Any

import torch
from torch import nn

from partita import options as options_module
from partita.auto import AutoReport
from partita.capture.threads import serialized
from partita.capture.uncompile import uncompiled
from partita.errors import ArgumentError, ArgumentTypeError
from partita.frontend.jit import JitStats, Jitted, OptionsLike, jit
from partita.partition import Plan
from partita.partition.resharding import naming_spec_knobs
from partita.presets import PresetLike, default_batch_spec
from partita.presets import param_specs as preset_param_specs
from partita.runtime.executor import check_has_data
from partita.runtime.flat_trace import repeated
from partita.training.auto_step import auto_fixed_specs, choose_step_specs, is_auto
from partita.training.checks import (
    check_optimizer_params,
    check_step_arguments,
    compute_dtype,
    model_argument,
)
from partita.training.groups import RESTORED_KEYS, group_hyper_values, read_param_groups
from partita.training.memory import full_values, state_memory
from partita.training.optim import init_opt_state, optimizer_config
from partita.training.per_call import BatchChecks, HyperTensors, full_loss
from partita.training.snapshot import BuildSnapshot
from partita.training.state import LoadResult, StateLayout, load_state, to_state_dict
from partita.training.step import functional_step
from partita.values.mesh import Mesh
from partita.values.spec import P, PartitionSpec
from partita.values.tensor import ShardedTensor

__all__ = ["LoadResult", "TrainStep", "train_step"]

#: The knobs a RematerializationWarning tells a training step's user to change.
_KNOBS = "param_specs/batch_spec"

Tensors = dict[str, torch.Tensor]


@serialized("__call__", "lower")  # calls from several threads run in turn
class TrainStep:
    """A compiled sharded training step; see :func:`train_step`.

    Attributes:
        mesh: the mesh.
        param_specs: ``{parameter name: PartitionSpec}`` the preset chose.
        batch_spec: the spec every tensor of the batch gets.
        params / buffers / opt_state: the sharded training state (ShardedTensors).
        plan: the Plan of the last compiled step (None before the first call or ``lower``).

    Run a step by calling it, ``step(batch)``, like an ``nn.Module``; read the trainable
    parameters from ``params`` (like ``optimizer.state``).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        mesh: Mesh,
        param_specs: PresetLike = "fsdp",
        batch_spec: Any = None,
        max_grad_norm: float | None = None,
        mixed_precision: str | torch.dtype | None = None,
        options: OptionsLike = None,
    ) -> None:
        scan_layers = options_module.resolve(options).scan_layers  # also checks ``options``
        model, loss_fn = model_argument(model), uncompiled(loss_fn, "partita.train_step")
        check_step_arguments(optimizer, mesh, max_grad_norm)
        self.model = model
        self.mesh = mesh
        self.optimizer = optimizer
        self.config = optimizer_config(optimizer)
        self.compute_dtype = compute_dtype(mixed_precision)
        named = dict(model.named_parameters())  # a tied parameter once, by its first name
        trainable = {k: v for k, v in named.items() if v.requires_grad}
        check_optimizer_params(optimizer, model, trainable)
        self._layout = StateLayout.of(model, optimizer, self.config.kind)
        for name, p in trainable.items():
            if p.dtype != torch.float32:
                raise ArgumentError(
                    f"parameter {name!r} is {p.dtype}; train_step keeps float32 parameters "
                    "(master weights). Leave the model in float32 and pass "
                    "mixed_precision='bf16' for low-precision compute."
                )
        #: auto-sharding (param_specs="auto"): the user's fixed specs until the first compile
        self._auto = is_auto(param_specs)
        self._auto_fixed = auto_fixed_specs(param_specs, list(named)) if self._auto else {}
        self._auto_batch = self._auto and batch_spec is None
        self.auto: AutoReport | None = None
        if self._auto:  # replicated until the first compile chooses (solve_step_specs)
            self.param_specs = {k: self._auto_fixed.get(k, P()) for k in named}
            default = P()
        else:
            self.param_specs = preset_param_specs(param_specs, model, mesh)
            default = default_batch_spec(param_specs, mesh)
        self.batch_spec = default if batch_spec is None else batch_spec
        self._trainable = list(trainable)
        # frozen parameters travel with the buffers: inputs and outputs, never updated (also
        # when the optimizer holds them: torch.optim skips a parameter whose grad is None)
        self._frozen = [k for k in named if k not in trainable]
        # parameters forward() never reads, per train/eval mode (filled when tracing), and
        # the ones updated so far: torch.optim has state only for those
        self._unused: dict[bool, frozenset[str]] = {}
        self._stepped: frozenset[str] = frozenset()

        def put(t: torch.Tensor, spec: PartitionSpec) -> ShardedTensor:
            return ShardedTensor.from_global(t.detach().clone(), spec.to_sharding(mesh, t.ndim))

        self.params = {k: put(v, self.param_specs[k]) for k, v in trainable.items()}
        self.buffers = {
            k: put(v, self.param_specs[k]) for k, v in named.items() if k in self._frozen
        }
        self.buffers.update({k: put(v, P()) for k, v in model.named_buffers()})
        by_id = {id(p): k for k, p in named.items()}
        groups = read_param_groups(optimizer, by_id, set(trainable))
        update_config = groups if len(groups.configs) > 1 else self.config
        state = init_opt_state({k: v.detach() for k, v in trainable.items()}, self.config.kind)
        self.opt_state: dict[str, Any] = {  # "step"; each moment: {parameter: ShardedTensor}
            key: put(value, P())
            if key == "step"
            else {k: put(v, self.param_specs[k]) for k, v in value.items()}
            for key, value in state.items()
        }
        fn = functional_step(
            model,
            loss_fn,
            update_config,
            max_grad_norm=max_grad_norm,
            compute_dtype=self.compute_dtype,
            on_unused=self._unused.__setitem__,
            scan_layers=scan_layers,
        )
        self._fn = fn
        #: As given (``jit``'s ``options=``): resolved over the current options at each call.
        self.options = options
        self._jitted: dict[bool, Jitted] = {}
        self.plan: Plan | None = None
        self._snapshot = BuildSnapshot.of(model, optimizer)
        self._batches, self._hyper = BatchChecks(), HyperTensors()  # per call (per_call)

    # --- compiling -------------------------------------------------------------------------

    def _specs(self) -> tuple[Any, Any, Any]:
        pspecs = {k: self.param_specs[k] for k in self._trainable}
        bspecs = {k: s.spec for k, s in self.buffers.items()}
        sspecs = {k: P() if k == "step" else pspecs for k in self.opt_state}
        return pspecs, bspecs, sspecs

    def _get_jitted(self) -> Jitted:
        training = self.model.training  # train / eval mode is part of the traced program
        jitted = self._jitted.get(training)
        if jitted is None:
            pspecs, bspecs, sspecs = self._specs()
            jitted = jit(
                self._fn,
                mesh=self.mesh,
                in_specs=(pspecs, bspecs, sspecs, P(), self.batch_spec),
                out_specs=(P(), pspecs, bspecs, sspecs),
                options=self.options,
            )
            if self.auto is not None:  # the solver's per-op shardings, not only its specs
                jitted.rewrite = self.auto.rewrite
            self._jitted[training] = jitted
        return jitted

    def _lr(self) -> dict[str, torch.Tensor]:
        return self._hyper.now(group_hyper_values(self.optimizer, self.config.kind))

    def _args(self, batch: Any, run: bool = False) -> tuple[Any, ...]:
        if not (isinstance(batch, tuple | list) and len(batch) == 2):
            raise ArgumentTypeError(
                f"a training step takes batch = (inputs, targets), got {type(batch).__name__}"
                f"{f' of length {len(batch)}' if isinstance(batch, tuple | list) else ''}. "
                "The loss is loss_fn(model(inputs), targets); pass a tuple or dict as inputs "
                "for several model arguments."
            )
        float_dtype = None if self.compute_dtype is not None else torch.float32
        # to run: the batch and the first parameter have data, by name (a model is built on
        # meta whole; the jit call checks every input again, by position)
        first = {f"parameter {k!r}": v for k, v in islice(self.params.items(), 1)} if run else None
        # the batch: once per batch signature (per_call.BatchChecks)
        if not self._batches.check(batch, self.batch_spec, self.mesh, float_dtype, first) and first:
            check_has_data(list(first.values()), "partita.train_step", list(first))
        return (self.params, self.buffers, self.opt_state, self._lr(), batch)

    def _choose_auto(self, batch: Any) -> None:
        """``param_specs="auto"``: choose the specs on this batch, then shard the state so."""
        if self._auto and self.auto is None:
            choose_step_specs(self, self._args(batch), batch)

    def _with_auto(self, plan: Plan) -> Plan:
        if self.auto is not None:
            plan.auto = self.auto
        return plan

    def lower(self, batch: Any) -> Plan:
        """The Plan of one step on ``batch`` (compiles, does not run or change the state)."""
        self._choose_auto(batch)
        with naming_spec_knobs(_KNOBS):
            self.plan = plan = self._with_auto(self._get_jitted().lower(*self._args(batch)))
        return plan

    # --- running ---------------------------------------------------------------------------

    def __call__(self, batch: Any) -> torch.Tensor:
        """Run one training step on ``batch = (inputs, targets)``; returns the loss (0-d)."""
        self._snapshot.check(self.model, self.optimizer)
        self._choose_auto(batch)
        jitted, args = self._get_jitted(), self._args(batch, run=True)
        # a compile's advice names this step's own knobs; a loop: the LocalMesh traces early
        with naming_spec_knobs(_KNOBS), repeated():
            loss, params, buffers, opt_state = jitted(*args)
        self.params, self.buffers, self.opt_state = params, buffers, opt_state
        unused = self._unused.get(self.model.training, frozenset())
        self._stepped = self._stepped | (frozenset(self._trainable) - unused)
        # This call *is* the optimizer's step: tell torch.optim.lr_scheduler so (it warns when
        # scheduler.step() comes before any optimizer.step(), reading this attribute).
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        if self.plan is None:
            with naming_spec_knobs(_KNOBS):
                self.plan = self._with_auto(jitted.lower(*args))
        return full_loss(loss)

    # --- reading the state back ------------------------------------------------------------

    @property
    def stats(self) -> JitStats:
        """Compile costs of the step in the model's current mode (``partita.jit``'s
        ``Jitted.stats``): partita's compile and, under ``inductor``, Inductor's."""
        return self._get_jitted().stats

    def full_parameters(self) -> Tensors:
        """Every parameter (trainable and frozen) as a full tensor, by name (a tied
        parameter once, under the name ``model.named_parameters()`` gives it)."""
        full = {**full_values(self.params), **{k: self.buffers[k].full() for k in self._frozen}}
        return {k: full[k] for k, _ in self.model.named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` with full tensors.

        ``"model"`` has the keys of ``model.state_dict()`` (a tied parameter under each of its
        names; load it into the module with ``model.load_state_dict``); ``"optimizer"`` has
        the layout of ``optimizer.state_dict()``: states indexed by the parameter's position
        in the optimizer, only for parameters updated so far (as torch.optim), and the group.
        """
        values = {**full_values(self.params), **full_values(self.buffers)}
        moments = {k: full_values(v) for k, v in self.opt_state.items() if k != "step"}
        step = self.opt_state["step"].full()
        groups = self.optimizer.param_groups
        return to_state_dict(self._layout, values, step, moments, self._stepped, groups)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> LoadResult:
        """Load what :meth:`state_dict` returned (full tensors are re-sharded); atomic.

        Everything is checked before anything changes: a StateDictError names the key, its
        shape and dtype and the expected ones. ``strict=False`` loads the keys that match and
        returns the missing and unexpected ones, like ``nn.Module.load_state_dict``. Without
        an ``"optimizer"`` entry only the model is loaded. Floating-point tensors are cast to
        the state's dtype; other dtype changes are refused (see ``partita.training.state``). Each
        parameter group's ``lr``, ``betas``, ``momentum``, ``weight_decay`` (what the step reads
        per call) and a scheduler's ``initial_lr`` are restored into the optimizer, as
        ``torch.optim`` does; the other hyperparameters are the compiled step's and stay.
        """
        current = {**self.params, **self.buffers}
        moments = {k: v for k, v in self.opt_state.items() if k != "step"}
        new = load_state(self._layout, state_dict, current, moments, strict=strict)
        loaded_groups = (state_dict.get("optimizer") or {}).get("param_groups", ())
        for group, loaded in zip(self.optimizer.param_groups, loaded_groups, strict=False):
            group.update({k: loaded[k] for k in RESTORED_KEYS if k in loaded and k in group})

        def put(old: ShardedTensor, value: torch.Tensor | None) -> ShardedTensor:
            return old if value is None else ShardedTensor.from_global(value, old.sharding)

        self.params = {k: put(v, new.values.get(k)) for k, v in self.params.items()}
        self.buffers = {k: put(v, new.values.get(k)) for k, v in self.buffers.items()}
        if new.stepped is not None:
            # the same key order as before (the step function's state keeps one structure)
            self.opt_state = {
                k: put(v, new.step)
                if k == "step"
                else {n: put(t, new.moments[k].get(n)) for n, t in v.items()}
                for k, v in self.opt_state.items()
            }
            self._stepped = new.stepped
        return new.result

    def sync_to_module(self) -> nn.Module:
        """Copy the full parameters and buffers into the original module; returns it."""
        self.model.load_state_dict(self.state_dict()["model"])
        self._snapshot = BuildSnapshot.of(self.model, self.optimizer)  # the step's own write
        return self.model

    # --- memory ----------------------------------------------------------------------------

    def memory(self) -> dict[str, tuple[int, int]]:
        """``{"parameters" | "buffers" | "optimizer": (bytes per device, unsharded bytes)}``;
        per-device bytes include ceil padding, "optimizer" counts the moments and the step."""
        return state_memory(self.params, self.buffers, self.opt_state)


def train_step(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    mesh: Mesh,
    param_specs: PresetLike = "fsdp",
    batch_spec: Any = None,
    max_grad_norm: float | None = None,
    mixed_precision: str | torch.dtype | None = None,
    options: OptionsLike = None,
) -> TrainStep:
    """Turn a module, a loss function and an optimizer into one sharded training step.

    Args:
        model: an ordinary ``nn.Module`` (float32 parameters). It is read once; the step owns
            the training state afterwards (``sync_to_module()`` writes it back).
        loss_fn: ``loss_fn(model(inputs), targets) -> 0-d tensor``.
        optimizer: a ``torch.optim.AdamW``, ``Adam`` or ``SGD`` over ``model.parameters()``,
            in one or several parameter groups (each with its own hyperparameters). Each
            group's ``lr`` is re-read every step (schedulers work).
        mesh: the device mesh.
        param_specs: how to split the parameters (as ``partita.jit``'s ``param_specs``), a
            preset (:mod:`partita.presets`): ``"dp"``,
            ``"fsdp"``, ``"tp"``, ``"fsdp+tp"``, a dict ``{name or pattern: spec}`` or a
            callable ``(name, param) -> spec``; or ``"auto"`` (a dict: ``"*": "auto"``):
            chosen by auto-sharding at the first step (docs/auto.md, ``step.plan.auto``).
        batch_spec: the spec of every batch tensor, or a pytree prefix of the batch;
            default ``P('data')`` when the mesh has a ``data`` axis, else replicated.
        max_grad_norm: clip gradients by global 2-norm like ``clip_grad_norm_``.
        mixed_precision: ``"bf16"`` (or ``"fp16"``): forward and backward in that dtype on
            copies of the float32 master weights; the update stays float32.
        options: the compiler's and runtime's knobs, as in ``partita.jit`` (docs/options.md):
            a :class:`~partita.CompileOptions`, a dict of changes to the current options
            (``{"strict": True, "collectives": "explicit", "regather": True}``) or None;
            resolved at each step, part of the compile cache key. ``scan_layers`` is read
            when the step is built.

    Example:
        >>> from partita.models import GPT, GPTConfig
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> model = GPT(GPTConfig())
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> def loss_fn(logits, targets):
        ...     return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        >>> step = partita.train_step(model, loss_fn, opt, mesh=mesh, param_specs="fsdp+tp")
        >>> ids = torch.randint(0, 64, (8, 16))
        >>> loss = step((ids, ids.roll(-1, 1)))          # ids, targets: [batch, seq]
        >>> loss.shape, sorted(step.full_parameters())[0]
        (torch.Size([]), 'blocks.0.attn.proj.bias')
    """
    return TrainStep(
        model,
        loss_fn,
        optimizer,
        mesh=mesh,
        param_specs=param_specs,
        batch_spec=batch_spec,
        max_grad_norm=max_grad_norm,
        mixed_precision=mixed_precision,
        options=options,
    )
