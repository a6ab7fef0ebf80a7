"""``partita.jit``: compile a function once per input signature, run it sharded.

``jit(fn, mesh=, in_specs=, out_specs=, options=)`` returns a :class:`Jitted` callable.
Calling it with ShardedTensors or plain tensors compiles ``fn`` for that input signature with
:func:`partita.frontend.pipeline.compile_function` (trace, propagate, partition) and runs the
per-device
program on the simulated mesh (``partita.runtime.local``) or on this process's devices
(``runtime.distributed``). ``.lower(*args)`` stops before running and returns the
:class:`~partita.partition.Plan`. The options (:mod:`partita.options`) are resolved at each call
(so a ``partita.options.using(...)`` block around a call applies) and are part of the key.

Input shardings: a ShardedTensor argument keeps its own sharding; a plain tensor is sharded as
``in_specs`` says, and is *replicated* when ``in_specs`` gives it no spec (so a plain tensor and a
replicated ShardedTensor are the same input signature and share one compiled program).

This module turns a call into leaves, specs and a cache key; it holds no sharding logic.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree

from partita import options as options_module
from partita.capture.layer_auto import scan_repeated_layers
from partita.capture.module import ModuleInputs
from partita.capture.threads import serialized
from partita.capture.trace import input_path
from partita.capture.uncompile import uncompiled
from partita.errors import JitArgumentError, PartitaWarning, RecompileWarning, warn
from partita.frontend.auto_inputs import auto_compile
from partita.frontend.child_compile import compiled_where
from partita.frontend.last_call import LastCall
from partita.frontend.pipeline import Compiled, compile_function
from partita.frontend.recompile import RECOMPILE_WARNING_AT, recompile_message
from partita.frontend.reshard import write_back
from partita.frontend.signature import (
    Signatures,
    by_name,
    placeholder_names,
    readable_name,
    replicated_batch,
)
from partita.options import KNOBS, CompileOptions
from partita.partition import Plan
from partita.presets import PresetLike as PlanLike
from partita.runtime.compiled import stats_for
from partita.runtime.executor import check_has_data, executor_for
from partita.values.mesh import Mesh
from partita.values.tensor import ShardedTensor

__all__ = [
    "DEFAULT_CACHE_LIMIT",
    "RECOMPILE_WARNING_AT",
    "Compiled",
    "JitStats",
    "Jitted",
    "jit",
]

#: How many compiled signatures a jitted function keeps (least recently used evicted first).
DEFAULT_CACHE_LIMIT = 64

#: What ``options=`` takes: a full value, changes to the current options by name, or None.
OptionsLike = CompileOptions | Mapping[str, Any] | None


@dataclass(frozen=True)
class JitStats:
    """Compile costs over the cached signatures: ``partition_seconds`` is partita's (trace,
    propagate, partition), ``inductor_*`` Inductor's on the per-device programs' regions under
    the ``inductor`` option (0 before the first run); ``skipped``: regions left uncompiled."""

    signatures: int
    partition_seconds: float
    inductor_seconds: float
    inductor_regions: int
    skipped: tuple[str, ...]


@serialized("__call__", "lower")  # calls from several threads compile and run in turn
class Jitted:
    """A function (or ``nn.Module``) compiled for a mesh; see :func:`jit`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        mesh: Mesh,
        in_specs: Any = None,
        out_specs: Any = None,
        param_specs: PlanLike | None = None,
        cache_limit: int = DEFAULT_CACHE_LIMIT,
        options: OptionsLike = None,
        auto: bool = False,
    ) -> None:
        options_module.resolve(options)  # a bad value or name fails here, not at the call
        if not isinstance(mesh, Mesh):
            raise JitArgumentError(f"partita.jit needs mesh=Mesh(...), got {mesh!r}")
        if not isinstance(cache_limit, int) or cache_limit < 1:
            raise JitArgumentError(
                f"partita.jit(cache_limit={cache_limit!r}): the number of compiled signatures "
                f"to keep must be an int >= 1 (default {DEFAULT_CACHE_LIMIT})."
            )
        self.fn = fn = uncompiled(fn, "partita.jit")
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        #: As given: resolved over the current options at each call (:meth:`options_now`).
        self.options = options
        self._resolved: tuple[CompileOptions | None, CompileOptions | None] = (None, None)
        self.cache_limit = cache_limit
        self._cache: OrderedDict[Hashable, Compiled] = OrderedDict()
        self._recent: deque[tuple[Hashable, list[str]]] = deque(maxlen=RECOMPILE_WARNING_AT)
        self._compiles = 0
        self._last: LastCall | None = None  # the last call's signature (frontend.last_call)
        self._module = ModuleInputs(fn, mesh, param_specs) if isinstance(fn, nn.Module) else None
        if isinstance(fn, nn.Module):
            # its repeated layers traced once, checked (layer_auto); read when wrapped
            scan_repeated_layers(fn, options_module.resolve(options).scan_layers)
        self._signatures = Signatures(mesh, _name(fn))
        if param_specs is not None and self._module is None:
            raise JitArgumentError(
                f"partita.jit(param_specs=...) shards the weights of an nn.Module, but "
                f"{_name(fn)!r} is a {type(fn).__name__}. Pass the module itself to jit, or "
                f"give the weights as arguments with in_specs."
            )
        if auto and self._module is not None:
            raise JitArgumentError(
                f"partita.jit(auto=True) chooses the specs of a function's tensor arguments, "
                f"but {_name(fn)!r} is an nn.Module. Train it with "
                f"partita.train_step(..., param_specs='auto'), or jit a function taking its "
                f"weights as arguments."
            )
        #: auto-sharding (docs/auto.md): arguments without an in_specs entry are the solver's
        self.auto = auto
        #: called on each propagated program before partitioning (``train_step``'s
        #: auto-sharding writes the solver's per-op shardings there)
        self.rewrite: Callable[[Any], None] | None = None
        functools.update_wrapper(self, fn, updated=())

    # --- signatures ------------------------------------------------------------------------

    def _program_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Callable[..., Any], tuple[Any, ...], Callable[[], Any]]:
        """The function to trace, its positional arguments and (a thunk of) their in_specs
        prefix (for a module: its parameters and buffers come first) and the keyword specs."""
        if (module := self._module) is None:
            return self.fn, args, lambda: by_name(self.in_specs, self.fn, args, kwargs)
        user, kw = by_name(self.in_specs, cast(nn.Module, self.fn).forward, args, kwargs)
        return module.call, module.args(args), lambda: (module.in_specs(user, args), kw)

    def _running_options(self) -> contextlib.AbstractContextManager[Any]:
        """The options the executors read while the program runs (those outside the cache key:
        ``trace_flat_at``, ``check_calls``, ``check_replicas``, the timeouts) come from
        ``options=`` too, not only from the current options."""
        if self.options is None:
            return contextlib.nullcontext()
        now = self.options_now()
        return options_module.using(**{k.name: getattr(now, k.name) for k in KNOBS if not k.keyed})

    def options_now(self) -> CompileOptions:
        """The options of a call now: ``options=`` over :func:`partita.options.current`."""
        if isinstance(self.options, CompileOptions):
            return self.options
        base = options_module.current()
        if self.options is None:
            return base
        last_base, resolved = self._resolved
        if last_base is not base or resolved is None:
            resolved = base.replace(**self.options)
            self._resolved = (base, resolved)
        return resolved

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Compiled, list[Any]]:
        fn, args, in_specs = self._program_inputs(args, kwargs)
        options = self.options_now()
        options_key = options.key()
        mode = self._module.mode() if self._module is not None else None
        last = self._last
        if last is not None:  # the last call's signature again: its program, no key built
            same = last.match((args, kwargs), self.in_specs, options_key, mode)
            if same is not None:
                return last.compiled, same
        # A module's in_specs derive from self.in_specs and the argument structure (the key).
        leaves, shardings, key = self._signatures.key(args, kwargs, self.in_specs, in_specs)
        key = (*cast(tuple[Any, ...], key), ("options", options_key))
        if self._module is not None:
            key = (*key, ("mode", mode))
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self._last = LastCall.of(
                key[0], leaves, shardings, self.in_specs, options_key, mode, compiled
            )
            return compiled, leaves
        self._note_recompile(key, args, kwargs)
        tree = pytree.tree_structure((args, kwargs))
        specs = self._signatures.leaf_specs(tree, self.in_specs, in_specs, args, leaves, shardings)
        before = self._module.mode() if self._module is not None else None

        def build() -> Compiled:
            if self.auto:
                done = auto_compile(fn, args, kwargs, self.mesh, self.in_specs, specs, leaves,
                                    self.out_specs, options)  # fmt: skip
            else:
                done = compile_function(fn, args, kwargs, mesh=self.mesh, specs=specs,
                                        out_specs=self.out_specs, options=options,
                                        rewrite=self.rewrite)  # fmt: skip
            done.plan.input_names = placeholder_names(done.program, self.fn, self._module)
            return done

        changed = (lambda: self._module.mode() != before) if before is not None else bool  # type: ignore[union-attr]
        compiled = compiled_where(options, build, changed)  # here, or in a child process
        plan = compiled.plan
        if not self._cache and (text := replicated_batch(plan, self._module, self.in_specs)):
            warn(text, PartitaWarning)  # once: at the first compile
        self._cache[key] = compiled
        if self._module is not None and before is not None and self._module.mode() != before:
            self._note_mutation(key, before, compiled)
        if len(self._cache) > self.cache_limit:
            self._cache.popitem(last=False)  # the least recently used signature
        self._last = LastCall.of(
            key[0], leaves, shardings, self.in_specs, options_key, mode, compiled
        )
        return compiled, leaves

    def _note_mutation(self, key: Hashable, before: tuple[Any, ...], compiled: Compiled) -> None:
        """The traced forward changed Python attributes of the module: warn, naming them; the
        program also answers their new values (a lazy initialisation costs no second compile)."""
        assert self._module is not None
        changed = self._module.mutated(before)
        warn(
            f"partita.jit({_name(self.fn)}): the forward changed Python attribute(s) while "
            f"it was traced: {'; '.join(changed[:4])}. The compiled program ran that Python "
            f"once and keeps the values it read, so later calls neither change the attributes "
            f"again nor see new values they would compute. Keep state that must change per "
            f"call in a buffer (module.register_buffer) or pass it as an argument.",
            PartitaWarning,
        )
        self._cache[tuple([*cast(tuple, key)[:-1], ("mode", self._module.mode())])] = compiled

    def _note_recompile(self, key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Count compilations; warn once when the signature keeps changing."""
        self._compiles += 1
        paths, _ = pytree.tree_flatten_with_path((args, kwargs))
        names = [self._leaf_name(path) for path, _ in paths]
        self._recent.append((key, names))
        if self._compiles == RECOMPILE_WARNING_AT:
            warn(
                recompile_message(_name(self.fn), list(self._recent), self.cache_limit),
                RecompileWarning,
            )

    def _leaf_name(self, path: Any) -> str:
        return readable_name(input_path(path), self.fn, self._module)

    # --- public ----------------------------------------------------------------------------

    def lower(self, *args: Any, **kwargs: Any) -> Plan:
        """Compile for these arguments and return the Plan, without running anything."""
        return self._compile(args, kwargs)[0].plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled, leaves = self._compile(args, kwargs)
        program = compiled.program
        # The lifted constants (closed-over tensors, literals) are the trailing inputs.
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor | ShardedTensor)]
        tensors += program.constants
        check_has_data(tensors, f"partita.jit({_name(self.fn)})")
        # The program holds its own backward: running it must not record autograd history
        # over an argument that requires grad (ops without complex autograd refused to run).
        with torch.no_grad(), self._running_options():
            results = executor_for(self.mesh).run_compiled(compiled, tensors)
        for i, new in program.input_updates(results):
            write_back(tensors[i], new)
        return program.unflatten_outputs(results)

    @property
    def stats(self) -> JitStats:
        """Compile costs so far, partita's and Inductor's apart (see :class:`JitStats`)."""
        records = [stats_for(c.local) for c in self._cache.values()]
        return JitStats(
            signatures=len(self._cache),
            partition_seconds=sum(c.partition_seconds for c in self._cache.values()),
            inductor_seconds=sum(r.seconds for r in records),
            inductor_regions=sum(r.regions for r in records),
            skipped=tuple(s for r in records for s in r.skipped),
        )

    @property
    def cache_size(self) -> int:
        """How many compiled signatures are cached now (at most ``cache_limit``)."""
        return len(self._cache)


def _name(fn: Any) -> str:
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return getattr(fn, "__name__", None) or type(fn).__name__


def jit(
    fn: Callable[..., Any] | None = None,
    *,
    mesh: Mesh,
    in_specs: Any = None,
    out_specs: Any = None,
    param_specs: PlanLike | None = None,
    cache_limit: int = DEFAULT_CACHE_LIMIT,
    options: OptionsLike = None,
    auto: bool = False,
) -> Any:
    """Compile ``fn`` for ``mesh``: annotate a few inputs, get every collective it needs.

    ``fn`` may close over tensors and create tensor literals: they become replicated program
    inputs, read when the program runs. In-place updates of its tensor arguments
    (``x.add_(1)``, ``x[0] = 5``) take effect in the caller's tensor (a ShardedTensor keeps its
    sharding), as under ``torch.compile``. Code that needs a tensor's value (``.item()``, an
    ``if`` on a tensor) cannot be compiled: a CaptureError names the line.

    An ``nn.Module`` can be compiled directly: ``partita.jit(model, mesh=, in_specs=)(x)``
    computes ``model(x)``. Its parameters and buffers are inputs of the program, fetched on
    every call (an updated weight is seen without recompiling; a weight whose shape or dtype
    changed recompiles), replicated unless ``param_specs`` shards them, and buffer updates
    (``running_mean``) are written back into the module. This runs the module's forward (for
    inference); to train a module sharded, use :func:`partita.train_step`.

    Args:
        fn: a function of tensors (pytrees of them; other arguments are static), or an
            ``nn.Module``.
        mesh: the device mesh.
        in_specs: a P (or None) per positional argument, or a matching pytree prefix. Plain
            tensors without a spec are replicated; ShardedTensors keep their sharding.
            Broadcast once per argument structure: to change it, assign a new object to
            ``.in_specs`` (an in-place edit of the same dict is not seen).
        out_specs: the same for the results (None lets propagation decide).
        param_specs: for a module: how to shard its parameters, any plan
            :func:`partita.presets.param_specs` takes: ``{"0.weight": P("model", None)}``
            (names or fnmatch patterns, unmatched parameters replicated), a preset name
            (``"fsdp"``, ``"tp"``, ...) or ``fn(name, param) -> P | None``.
        auto: choose the specs of the positional arguments ``in_specs`` leaves unset (None, or
            no in_specs) with auto-sharding (docs/auto.md): a solver over the program's
            shardings, scored beside replicating them and splitting their dim 0; given specs
            and ShardedTensor arguments are kept. ``lower(...).auto.explain()`` says why.
        cache_limit: how many compiled input signatures to keep (default 64); the least
            recently used is dropped first. At the 8th compilation a
            :class:`~partita.RecompileWarning` says which argument keeps changing.
        options: the compiler's and runtime's knobs (docs/options.md): a
            :class:`~partita.CompileOptions` (taken as is), a dict of changes to the current
            options (``{"strict": True, "collectives": "explicit"}``), or None (the current
            options: defaults, ``PARTITA_*`` variables, ``partita.options.using`` blocks). A
            dict or None is resolved at each call; the options are part of the cache key.
            ``strict`` raises instead of warning on an involuntary full rematerialization,
            ``replicate_unsupported`` runs ops without a sharding rule on gathered inputs,
            ``collectives="explicit"`` makes each collective the annotations do not imply an
            error (docs/manual.md), ``regather`` gathers FSDP parameters again for the
            backward, ``inductor`` runs the per-device program's local ops compiled by
            Inductor (``.stats`` reports the cost; docs/performance.md says when it pays).

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> step = partita.jit(lambda x, w: x @ w, mesh=mesh,
        ...                    in_specs=(P("data", None), P(None, "model")))
        >>> out = step(torch.randn(8, 16), torch.randn(16, 32))   # a ShardedTensor
        >>> out.sharding
        P('data', 'model')
        >>> plan = step.lower(torch.randn(8, 16), torch.randn(16, 32))   # nothing runs
        >>> plan.counts()   # collectives by kind: this matmul needs none
        {}
        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        >>> fwd = partita.jit(model, mesh=mesh, in_specs=(P("data", None),),
        ...                   param_specs={"0.weight": P("model", None)})
        >>> torch.allclose(fwd(torch.ones(8, 16)).full(), model(torch.ones(8, 16)))
        True
    """

    def wrap(f: Callable[..., Any]) -> Jitted:
        return Jitted(
            f,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            param_specs=param_specs,
            cache_limit=cache_limit,
            options=options,
            auto=auto,
        )

    return wrap if fn is None else wrap(fn)
