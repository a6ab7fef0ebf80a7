"""Functional training steps: a model, a loss and an optimizer as one pure function.

``make_train_step`` returns ``step(params, buffers, opt_state, batch) -> (loss, new_params,
new_buffers, new_opt_state)``: a function of tensors only (no module state is read or written),
written with ``torch.func.functional_call`` and ``torch.autograd.grad`` and the optimizer update
spelled out with plain tensor ops, so that ``partita.capture.trace`` sees the whole training
step (forward, backward and update) as one graph.

The updates match ``torch.optim.AdamW`` and ``torch.optim.SGD`` (momentum, dampening 0) step
for step when run eagerly. The step counter lives in ``opt_state["step"]`` as a float32 scalar
tensor (a Python int would be baked into the traced graph). This module does not shard
anything, does not support parameter groups, and does not scale or clip gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["OPTIMIZERS", "init_opt_state", "make_train_step"]

OPTIMIZERS = ("adamw", "sgd")

Tensors = dict[str, torch.Tensor]
StepFn = Callable[
    [Tensors, Tensors, dict[str, Any], Any], tuple[torch.Tensor, Tensors, Tensors, dict[str, Any]]
]


def _check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}.")


def init_opt_state(params: Tensors, optimizer: str = "adamw") -> dict[str, Any]:
    """The initial optimizer state for ``params``.

    AdamW: ``{"step": tensor(0.), "exp_avg": {...zeros}, "exp_avg_sq": {...zeros}}``;
    SGD: ``{"step": tensor(0.), "momentum_buffer": {...zeros}}``.

    Example:
        >>> state = init_opt_state({"w": torch.ones(2)}, "sgd")
        >>> sorted(state)
        ['momentum_buffer', 'step']
    """
    _check_optimizer(optimizer)
    zeros = lambda: {k: torch.zeros_like(v) for k, v in params.items()}  # noqa: E731
    first = next(iter(params.values()), torch.zeros(()))
    step = torch.zeros((), dtype=torch.float32, device=first.device)
    if optimizer == "adamw":
        return {"step": step, "exp_avg": zeros(), "exp_avg_sq": zeros()}
    return {"step": step, "momentum_buffer": zeros()}


def _adamw(
    params: Tensors,
    grads: Tensors,
    state: dict[str, Any],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> tuple[Tensors, dict[str, Any]]:
    beta1, beta2 = betas
    step = state["step"] + 1
    # Bias corrections as tensors (the step count is data, not a constant of the graph),
    # in float64 like torch.optim's Python-float arithmetic.
    step64 = step.to(torch.float64)
    step_size = (lr / (1 - torch.pow(beta1, step64))).to(torch.float32)
    bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, step64)).to(torch.float32)
    new_params: Tensors = {}
    new_m: Tensors = {}
    new_v: Tensors = {}
    for name, p in params.items():
        g = grads[name]
        p = p * (1 - lr * weight_decay)  # decoupled weight decay
        m = state["exp_avg"][name]
        m = m + (1 - beta1) * (g - m)  # torch.lerp(m, g, 1 - beta1) for a weight < 0.5
        v = state["exp_avg_sq"][name] * beta2 + (1 - beta2) * g * g
        denom = torch.sqrt(v) / bias2_sqrt + eps
        new_params[name] = p - step_size * (m / denom)
        new_m[name] = m
        new_v[name] = v
    return new_params, {"step": step, "exp_avg": new_m, "exp_avg_sq": new_v}


def _sgd(
    params: Tensors,
    grads: Tensors,
    state: dict[str, Any],
    lr: float,
    momentum: float,
    weight_decay: float,
) -> tuple[Tensors, dict[str, Any]]:
    new_params: Tensors = {}
    new_buf: Tensors = {}
    for name, p in params.items():
        g = grads[name]
        if weight_decay:
            g = g + weight_decay * p
        # torch.optim.SGD starts the buffer at g; with dampening 0, momentum * 0 + g is the same.
        buf = state["momentum_buffer"][name] * momentum + g
        new_params[name] = p - lr * buf
        new_buf[name] = buf
    return new_params, {"step": state["step"] + 1, "momentum_buffer": new_buf}


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
    """A pure training step for ``model``.

    ``batch`` is ``(inputs, targets)``; the loss is ``loss_fn(model(inputs), targets)``. The
    model runs in whatever mode it is in (``model.train()`` for batch-norm statistics updates;
    they are returned in ``new_buffers``).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> step = make_train_step(model, torch.nn.functional.mse_loss, "sgd", lr=0.1)
        >>> params = dict(model.named_parameters())
        >>> loss, params, buffers, state = step(params, {}, init_opt_state(params, "sgd"),
        ...                                     (torch.randn(3, 4), torch.randn(3, 2)))
    """
    _check_optimizer(optimizer)

    def step(
        params: Tensors, buffers: Tensors, opt_state: dict[str, Any], batch: Any
    ) -> tuple[torch.Tensor, Tensors, Tensors, dict[str, Any]]:
        inputs, targets = batch
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            # Buffers are updated in place by the forward (batch-norm statistics): copy them
            # so the caller's tensors are untouched and the updated copies are the result.
            new_buffers = {k: v.clone() for k, v in buffers.items()}
            out = torch.func.functional_call(model, (leaves, new_buffers), (inputs,))
            loss = loss_fn(out, targets)
            grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=False)
        grad_map = dict(zip(leaves, grads, strict=True))
        with torch.no_grad():
            if optimizer == "adamw":
                new_params, new_state = _adamw(
                    params, grad_map, opt_state, lr, betas, eps, weight_decay
                )
            else:
                new_params, new_state = _sgd(
                    params, grad_map, opt_state, lr, momentum, weight_decay
                )
        return loss.detach(), new_params, new_buffers, new_state

    return step
