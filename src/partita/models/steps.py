"""Functional training steps: a model, a loss and an optimizer as one pure function.

``make_train_step`` returns ``step(params, buffers, opt_state, batch) -> (loss, new_params,
new_buffers, new_opt_state)``: a function of tensors only (no module state is read or written),
written with the module reparametrized by the given tensors (what ``torch.func.functional_call``
does), ``torch.autograd.grad`` and the optimizer update spelled out with plain tensor ops, so
that ``partita.capture.trace`` sees the whole training step (forward, backward and update) as
one graph. ``functional_step`` is the same with the learning rate as a tensor argument (so a
schedule changes data, not the graph), optional gradient clipping by global norm and optional
low-precision compute with fp32 master weights.

The updates match ``torch.optim.AdamW``, ``torch.optim.Adam`` and ``torch.optim.SGD`` step for
step when run eagerly (:func:`optimizer_config` reads their hyperparameters and rejects the
ones not implemented). The step counter lives in ``opt_state["step"]`` as a float32 0-d tensor
(a Python int would be baked into the traced graph). This module does not shard anything and
does not support several parameter groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from partita.errors import TrainInputError

__all__ = [
    "OPTIMIZERS",
    "OptimizerConfig",
    "functional_step",
    "init_opt_state",
    "make_train_step",
    "optimizer_config",
]

OPTIMIZERS = ("adamw", "adam", "sgd")

Tensors = dict[str, torch.Tensor]
Lr = float | torch.Tensor
StepFn = Callable[
    [Tensors, Tensors, dict[str, Any], Any], tuple[torch.Tensor, Tensors, Tensors, dict[str, Any]]
]
LrStepFn = Callable[
    [Tensors, Tensors, dict[str, Any], torch.Tensor, Any],
    tuple[torch.Tensor, Tensors, Tensors, dict[str, Any]],
]


@dataclass(frozen=True)
class OptimizerConfig:
    """The hyperparameters of one optimizer update (the learning rate is passed per step).

    ``kind`` is ``"adamw"`` (decoupled weight decay), ``"adam"`` (L2 weight decay added to
    the gradient) or ``"sgd"``.
    """

    kind: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.kind!r}.")


def _unsupported(name: str, key: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"{name} with {key}={value!r} is not supported by partita's update; {fix}.")


def optimizer_config(optimizer: torch.optim.Optimizer) -> OptimizerConfig:
    """Read a ``torch.optim`` optimizer's hyperparameters (its one parameter group).

    Supported: ``AdamW``, ``Adam`` (``amsgrad=False``) and ``SGD``; ``maximize`` for all.
    ``foreach``/``fused``/``capturable`` only change how torch runs the same math and are
    ignored. Anything else raises a ValueError that names the setting.

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
        >>> optimizer_config(opt).momentum
        0.9
    """
    name = type(optimizer).__name__
    if len(optimizer.param_groups) != 1:
        raise ValueError(
            f"{name} has {len(optimizer.param_groups)} parameter groups; partita's training "
            "step supports one. Put every parameter in one group (per-group weight decay is "
            "not implemented yet)."
        )
    group = optimizer.param_groups[0]
    for key in ("lr", "weight_decay"):
        if isinstance(group.get(key), torch.Tensor):
            group_value = group[key]
            raise _unsupported(name, key, group_value, "pass a Python float")
    maximize = bool(group.get("maximize", False))
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is a subclass of Adam
        if group.get("amsgrad"):
            raise _unsupported(name, "amsgrad", True, "use amsgrad=False")
        decoupled = isinstance(optimizer, torch.optim.AdamW) or group.get(
            "decoupled_weight_decay", False
        )
        beta1, beta2 = (float(b) for b in group["betas"])
        return OptimizerConfig(
            kind="adamw" if decoupled else "adam",
            betas=(beta1, beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            maximize=maximize,
        )
    if isinstance(optimizer, torch.optim.SGD):
        return OptimizerConfig(
            kind="sgd",
            weight_decay=float(group["weight_decay"]),
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            nesterov=bool(group["nesterov"]),
            maximize=maximize,
        )
    raise ValueError(
        f"partita's training step implements torch.optim.AdamW, Adam and SGD, not {name}. "
        "Use one of those, or write the update in your own step function and use partita.jit."
    )


def init_opt_state(params: Tensors, optimizer: str = "adamw") -> dict[str, Any]:
    """The initial optimizer state for ``params``.

    AdamW/Adam: ``{"step": tensor(0.), "exp_avg": {...zeros}, "exp_avg_sq": {...zeros}}``;
    SGD: ``{"step": tensor(0.), "momentum_buffer": {...zeros}}``.

    Example:
        >>> state = init_opt_state({"w": torch.ones(2)}, "sgd")
        >>> sorted(state)
        ['momentum_buffer', 'step']
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}.")
    zeros = lambda: {k: torch.zeros_like(v) for k, v in params.items()}  # noqa: E731
    first = next(iter(params.values()), torch.zeros(()))
    step = torch.zeros((), dtype=torch.float32, device=first.device)
    if optimizer in ("adamw", "adam"):
        return {"step": step, "exp_avg": zeros(), "exp_avg_sq": zeros()}
    return {"step": step, "momentum_buffer": zeros()}


def _f32(x: float | torch.Tensor) -> float | torch.Tensor:
    return x.to(torch.float32) if isinstance(x, torch.Tensor) else x


def _adam(
    params: Tensors, grads: Tensors, state: dict[str, Any], lr: Lr, cfg: OptimizerConfig
) -> tuple[Tensors, dict[str, Any]]:
    beta1, beta2 = cfg.betas
    step = state["step"] + 1
    # Scalars in float64 like torch.optim's Python-float arithmetic, then rounded once.
    step64 = step.to(torch.float64)
    lr64 = lr.to(torch.float64) if isinstance(lr, torch.Tensor) else lr
    step_size = (lr64 / (1 - torch.pow(beta1, step64))).to(torch.float32)
    bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, step64)).to(torch.float32)
    decay = _f32(1 - lr64 * cfg.weight_decay)
    new_params: Tensors = {}
    new_m: Tensors = {}
    new_v: Tensors = {}
    for name, p in params.items():
        if name not in grads:  # no gradient (unused by forward): torch.optim skips it too
            new_params[name] = p
            new_m[name] = state["exp_avg"][name]
            new_v[name] = state["exp_avg_sq"][name]
            continue
        g = -grads[name] if cfg.maximize else grads[name]
        if cfg.kind == "adamw":
            p = p * decay  # decoupled weight decay
        elif cfg.weight_decay:
            g = g + cfg.weight_decay * p  # Adam: L2 penalty in the gradient
        m = state["exp_avg"][name]
        m = m + (1 - beta1) * (g - m)  # torch.lerp(m, g, 1 - beta1) for a weight < 0.5
        v = state["exp_avg_sq"][name] * beta2 + (1 - beta2) * g * g
        denom = torch.sqrt(v) / bias2_sqrt + cfg.eps
        new_params[name] = p - step_size * (m / denom)
        new_m[name] = m
        new_v[name] = v
    return new_params, {"step": step, "exp_avg": new_m, "exp_avg_sq": new_v}


def _sgd(
    params: Tensors, grads: Tensors, state: dict[str, Any], lr: Lr, cfg: OptimizerConfig
) -> tuple[Tensors, dict[str, Any]]:
    lr32 = _f32(lr)
    first = state["step"] == 0
    new_params: Tensors = {}
    new_buf: Tensors = {}
    for name, p in params.items():
        if name not in grads:  # no gradient (unused by forward): torch.optim skips it too
            new_params[name] = p
            new_buf[name] = state["momentum_buffer"][name]
            continue
        g = -grads[name] if cfg.maximize else grads[name]
        if cfg.weight_decay:
            g = g + cfg.weight_decay * p
        buf = state["momentum_buffer"][name]
        if cfg.momentum:
            # torch.optim.SGD starts the buffer at g, then buf * momentum + (1 - dampening) * g
            if cfg.dampening:
                buf = torch.where(first, g, buf * cfg.momentum + (1 - cfg.dampening) * g)
            else:
                buf = buf * cfg.momentum + g  # 0 * momentum + g == g on the first step
            g = g + cfg.momentum * buf if cfg.nesterov else buf
        new_params[name] = p - lr32 * g
        new_buf[name] = buf
    return new_params, {"step": state["step"] + 1, "momentum_buffer": new_buf}


def clip_by_global_norm(grads: Tensors, max_norm: float) -> Tensors:
    """Scale ``grads`` like ``torch.nn.utils.clip_grad_norm_(..., max_norm)`` (2-norm).

    The norm is the square root of the sum of squares over *all* gradients: traced into a
    sharded program it is a sum over every shard, so the clipping is the unsharded one.
    """
    total = torch.sqrt(sum((g.float() * g.float()).sum() for g in grads.values()))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {k: g * coef.to(g.dtype) for k, g in grads.items()}


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, tuple | list) else model(inputs)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return torch.utils._pytree.tree_map_only(torch.Tensor, cast, tree)


def _check_loss(loss: Any, loss_fn: Callable[..., Any]) -> torch.Tensor:
    """``loss`` as a 0-d tensor, or a TrainInputError that says what ``loss_fn`` returned."""
    name = getattr(loss_fn, "__qualname__", None) or repr(loss_fn)
    if not isinstance(loss, torch.Tensor):
        # under tracing, loss.item() is a SymFloat: still a Python number to the user
        number = isinstance(loss, int | float | torch.SymInt | torch.SymFloat)
        what = "a Python number" if number else f"{type(loss).__name__} {loss!r:.60}"
        raise TrainInputError(
            f"loss_fn {name!r} returned {what} instead of a tensor. "
            "The step differentiates the loss, so loss_fn(model(inputs), targets) must return "
            "a 0-d tensor computed from the model output: return the tensor itself, not "
            "loss.item() or float(loss)."
        )
    if loss.numel() != 1:
        raise TrainInputError(
            f"loss_fn {name!r} returned a tensor of shape {tuple(loss.shape)}; a training step "
            "needs one number to differentiate. Reduce it in loss_fn, e.g. .mean() or .sum() "
            "(the torch.nn.functional losses do this with reduction='mean')."
        )
    if not loss.requires_grad:
        raise TrainInputError(
            f"loss_fn {name!r} returned a loss that does not depend on any trainable "
            "parameter (it has no gradient), so there is nothing to train. Compute it from "
            "the model output passed as loss_fn's first argument."
        )
    return loss.reshape(())


def functional_step(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    cfg: OptimizerConfig,
    *,
    max_grad_norm: float | None = None,
    compute_dtype: torch.dtype | None = None,
    on_unused: Callable[[bool, frozenset[str]], None] | None = None,
) -> LrStepFn:
    """``step(params, buffers, opt_state, lr, batch) -> (loss, params, buffers, opt_state)``.

    ``batch`` is ``(inputs, targets)``; the loss is ``loss_fn(model(inputs), targets)``
    (``inputs`` a tuple: ``model(*inputs)``; a dict: ``model(**inputs)``). ``lr`` is a 0-d
    tensor (a program input, so a schedule does not recompile) or a float (a constant).
    ``max_grad_norm`` clips by global norm before the update, like ``clip_grad_norm_``.
    ``compute_dtype`` (e.g. ``torch.bfloat16``) runs forward and backward on copies of the
    parameters (and floating inputs) in that dtype while the parameters, the gradients given
    to the optimizer and the optimizer states stay float32 (the model output is cast to
    float32 before the loss). A parameter that gets no gradient (forward never reads it) is
    skipped by the update like ``torch.optim`` skips a parameter whose ``.grad`` is None: no
    step, no weight decay, its optimizer state unchanged. ``on_unused(training, names)`` is
    called with those names each time the step runs (once per trace under ``partita.jit``).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> step = functional_step(model, torch.nn.functional.mse_loss, OptimizerConfig("sgd"))
        >>> params = dict(model.named_parameters())
        >>> loss, params, buffers, state = step(params, {}, init_opt_state(params, "sgd"),
        ...     torch.tensor(0.1), (torch.randn(3, 4), torch.randn(3, 2)))
    """

    def step(
        params: Tensors, buffers: Tensors, opt_state: dict[str, Any], lr: Lr, batch: Any
    ) -> tuple[torch.Tensor, Tensors, Tensors, dict[str, Any]]:
        inputs, targets = batch
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            compute = leaves
            if compute_dtype is not None:
                compute = {k: v.to(compute_dtype) for k, v in leaves.items()}
                inputs = _cast_floats(inputs, compute_dtype)
            # Buffers are updated in place by the forward (batch-norm statistics): copy them
            # so the caller's tensors are untouched and the updated copies are the result.
            new_buffers = {k: v.clone() for k, v in buffers.items()}
            # The backward runs inside the reparametrization too (unlike functional_call):
            # activation checkpointing recomputes the forward *during* autograd.grad, and must
            # see these parameters, not the module's own.
            with _reparametrize_module(model, {**compute, **new_buffers}, tie_weights=True):
                out = _call(model, inputs)
                if compute_dtype is not None:
                    out = _cast_floats(out, torch.float32)
                loss = _check_loss(loss_fn(out, targets), loss_fn)
                # allow_unused: a parameter forward() never reads gets no gradient (None), as
                # its .grad stays None in eager PyTorch; the update then leaves it alone.
                grads = torch.autograd.grad(
                    loss, list(leaves.values()), create_graph=False, allow_unused=True
                )
        grad_map = {k: g for k, g in zip(leaves, grads, strict=True) if g is not None}
        if on_unused is not None:
            on_unused(model.training, frozenset(leaves) - set(grad_map))
        with torch.no_grad():
            if max_grad_norm is not None:
                grad_map = clip_by_global_norm(grad_map, max_grad_norm)
            update = _sgd if cfg.kind == "sgd" else _adam  # looked up per call (tests wrap it)
            new_params, new_state = update(params, grad_map, opt_state, lr, cfg)
        return loss.detach(), new_params, new_buffers, new_state

    return step


def make_train_step(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: str = "adamw",
    *,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    momentum: float = 0.9,
) -> StepFn:
    """A pure training step for ``model`` with a fixed learning rate.

    ``batch`` is ``(inputs, targets)``; the loss is ``loss_fn(model(inputs), targets)``. The
    model runs in whatever mode it is in (``model.train()`` for batch-norm statistics updates;
    they are returned in ``new_buffers``). SGD here uses ``weight_decay`` as given (0.01 by
    default, like AdamW), dampening 0, no Nesterov.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> step = make_train_step(model, torch.nn.functional.mse_loss, "sgd", lr=0.1)
        >>> params = dict(model.named_parameters())
        >>> loss, params, buffers, state = step(params, {}, init_opt_state(params, "sgd"),
        ...                                     (torch.randn(3, 4), torch.randn(3, 2)))
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}.")
    cfg = OptimizerConfig(
        kind=optimizer, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum
    )
    inner = functional_step(model, loss_fn, cfg)

    def step(
        params: Tensors, buffers: Tensors, opt_state: dict[str, Any], batch: Any
    ) -> tuple[torch.Tensor, Tensors, Tensors, dict[str, Any]]:
        return inner(params, buffers, opt_state, lr, batch)

    return step
