"""Functional training steps: a model, a loss and an optimizer as one pure function.

``make_train_step`` returns ``step(params, buffers, opt_state, batch) -> (loss, new_params,
new_buffers, new_opt_state)``: a function of tensors only (no module state is read or written),
written with the module reparametrized by the given tensors (what ``torch.func.functional_call``
does), ``torch.autograd.grad`` and the optimizer update spelled out with plain tensor ops
(:mod:`partita.training.optim`), so that ``partita.capture.trace`` sees the whole training step
(forward, backward and update) as one graph. ``functional_step`` is the same with the learning
rate as a tensor argument (so a schedule changes data, not the graph), optional gradient
clipping by global norm and optional low-precision compute with fp32 master weights. This is
what ``partita.train_step`` compiles; this module does not shard anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.nn.utils.stateless import _reparametrize_module

from partita.capture.layer_auto import scan_repeated_layers
from partita.errors import TrainInputError
from partita.training import optim
from partita.training.groups import ParamGroups
from partita.training.optim import (
    OPTIMIZERS,
    Hyper,
    OptimizerConfig,
    clip_by_global_norm,
    init_opt_state,  # noqa: F401 - the examples use it
)

__all__ = ["functional_step", "make_train_step"]

Tensors = dict[str, torch.Tensor]
Lr = float | torch.Tensor
StepFn = Callable[
    [Tensors, Tensors, dict[str, Any], Any], tuple[torch.Tensor, Tensors, Tensors, dict[str, Any]]
]
LrStepFn = Callable[
    [Tensors, Tensors, dict[str, Any], torch.Tensor, Any],
    tuple[torch.Tensor, Tensors, Tensors, dict[str, Any]],
]


def _grad_leaf(v: torch.Tensor) -> torch.Tensor:
    """``v.detach().requires_grad_(True)``: a leaf to take gradients against. While tracing,
    a tensor the trace made (a FunctionalTensor) that is a leaf without grad is flagged in
    place instead: capture drops the detach, so the program is the same, without dispatching
    a detach per parameter through functionalization, fake tensors and the fx proxy (about
    2 ms each, 0.3 s of GPT-M's 150). The caller's own tensors are never touched."""
    if isinstance(v, FunctionalTensor) and v.is_leaf and not v.requires_grad:
        return v.requires_grad_(True)
    return v.detach().requires_grad_(True)


def _hook_leaves(model: nn.Module, leaves: dict[str, torch.Tensor]) -> None:
    """Give each leaf the gradient hooks of the parameter it stands for (``p.register_hook``:
    masking or scaling a gradient), which eager runs before ``.grad`` is set; the module's own
    Parameters, which hold them, are not differentiated here. A post-accumulate-grad hook acts
    on ``p.grad`` in place after accumulation (an optimizer step inside the backward): there
    is no ``.grad`` in a traced step, so it is refused."""
    for name, leaf in leaves.items():
        try:
            param = model.get_parameter(name)
        except AttributeError:
            continue
        if getattr(param, "_post_accumulate_grad_hooks", None):
            raise TrainInputError(
                f"parameter {name!r} has a post-accumulate-grad hook "
                f"(register_post_accumulate_grad_hook): it acts on p.grad in place after the "
                f"backward, which a compiled step does not have. Remove the hook; put its work "
                f"in loss_fn (a gradient mask: p.register_hook) or in the optimizer settings."
            )
        for hook in (getattr(param, "_backward_hooks", None) or {}).values():
            leaf.register_hook(hook)


def _accumulated(grad: torch.Tensor | None, leaf: torch.Tensor) -> torch.Tensor | None:
    """``grad`` plus what a nested ``.backward()`` accumulated into ``leaf.grad``: a custom
    autograd Function whose backward recomputes a layer and calls ``.backward()`` on it
    (reversible layers) gives the layer's parameters their gradient that way, which
    ``torch.autograd.grad`` does not return, as eager's ``.grad`` collects both."""
    nested = leaf.grad
    if nested is None:
        return grad
    leaf.grad = None
    return nested if grad is None else grad + nested


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
    cfg: OptimizerConfig | ParamGroups,
    *,
    max_grad_norm: float | None = None,
    compute_dtype: torch.dtype | None = None,
    on_unused: Callable[[bool, frozenset[str]], None] | None = None,
    scan_layers: bool | None = None,
) -> LrStepFn:
    """``step(params, buffers, opt_state, lr, batch) -> (loss, params, buffers, opt_state)``.

    ``batch`` is ``(inputs, targets)``; the loss is ``loss_fn(model(inputs), targets)``
    (``inputs`` a tuple: ``model(*inputs)``; a dict: ``model(**inputs)``). ``lr`` is a 0-d
    tensor (a program input, so a schedule does not recompile) or a float (a constant), or a
    dict of them that also holds the ``beta1``/``beta2`` or ``momentum`` a scheduler moves
    (``optim.Hyper``). With several parameter groups (``cfg`` a :class:`ParamGroups`), each
    tensor holds one value per group and each group is updated with its own hyperparameters.
    ``max_grad_norm`` clips by global norm before the update, like ``clip_grad_norm_``.
    ``compute_dtype`` (e.g. ``torch.bfloat16``) runs forward and backward on copies of the
    parameters (and floating inputs) in that dtype while the parameters, the gradients given
    to the optimizer and the optimizer states stay float32 (the model output is cast to
    float32 before the loss). A parameter that gets no gradient (forward never reads it) is
    skipped by the update like ``torch.optim`` skips a parameter whose ``.grad`` is None: no
    step, no weight decay, its optimizer state unchanged. ``on_unused(training, names)`` is
    called with those names each time the step runs (once per trace under ``partita.jit``).
    ``scan_layers`` marks the model's repeated layers to be traced once (None: the current
    ``scan_layers`` option, :mod:`partita.options`).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> step = functional_step(model, torch.nn.functional.mse_loss, OptimizerConfig("sgd"))
        >>> params = dict(model.named_parameters())
        >>> loss, params, buffers, state = step(params, {}, init_opt_state(params, "sgd"),
        ...     torch.tensor(0.1), (torch.randn(3, 4), torch.randn(3, 2)))
    """
    scan_repeated_layers(
        model, scan_layers
    )  # trace each kind of repeated layer once, checked (layer_auto)

    def step(
        params: Tensors, buffers: Tensors, opt_state: dict[str, Any], lr: Hyper, batch: Any
    ) -> tuple[torch.Tensor, Tensors, Tensors, dict[str, Any]]:
        inputs, targets = batch
        with torch.enable_grad():
            leaves = {k: _grad_leaf(v) for k, v in params.items()}
            _hook_leaves(model, leaves)
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
                grads = [_accumulated(g, v) for g, v in zip(grads, leaves.values(), strict=True)]
        grad_map = {k: g for k, g in zip(leaves, grads, strict=True) if g is not None}
        if on_unused is not None:
            on_unused(model.training, frozenset(leaves) - set(grad_map))
        with torch.no_grad():
            if max_grad_norm is not None:
                grad_map = clip_by_global_norm(grad_map, max_grad_norm)
            # looked up per call (tests wrap optim._adam)
            update = optim._sgd if cfg.kind == "sgd" else optim._adam
            if isinstance(cfg, ParamGroups):
                new_params, new_state = cfg.update(update, params, grad_map, opt_state, lr)
            else:
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
