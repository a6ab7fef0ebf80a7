"""The optimizer updates of ``partita.train_step``, written as plain tensor ops.

The updates match ``torch.optim.AdamW``, ``torch.optim.Adam`` and ``torch.optim.SGD`` step for
step when run eagerly (:func:`optimizer_config` reads their hyperparameters and rejects the
ones not implemented). The step counter lives in ``opt_state["step"]`` as a float32 0-d tensor
(a Python int would be baked into the traced graph). The update of one parameter is a
function of that parameter's tensors only, traced once per rank and dtype inside a capture
(:func:`partita.capture.layers.trace_once` with ``any_sizes=True``: its code never reads a
size, and other sizes reuse the trace with recomputed shapes), so a model's hundreds of
parameters cost a few traces, not one per parameter, and one placeholder op stands for all
the updates until the traced parts are copied in, parameter by parameter.
This module does not shard anything (several parameter groups: :mod:`partita.training.groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from partita.capture.layers import trace_once

__all__ = [
    "OPTIMIZERS",
    "OptimizerConfig",
    "clip_by_global_norm",
    "group_config",
    "init_opt_state",
    "optimizer_config",
    "scheduled",
]

OPTIMIZERS = ("adamw", "adam", "sgd")

Tensors = dict[str, torch.Tensor]
Lr = float | torch.Tensor
#: The hyperparameters read at every call: ``lr``, ``weight_decay`` and ``beta1``/``beta2``
#: (Adam) or ``momentum`` (SGD), floats or float64 0-d tensors in a dict; a bare ``Lr`` is the
#: learning rate alone, the rest coming from the config.
Hyper = Lr | dict[str, Lr]


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
    """Read a ``torch.optim`` optimizer's hyperparameters: its first parameter group's, after
    checking every group (``partita.training.groups`` reads each group's).

    Supported: ``AdamW``, ``Adam`` (``amsgrad=False``) and ``SGD``; ``maximize`` for all.
    ``foreach``/``fused``/``capturable`` only change how torch runs the same math and are
    ignored. Anything else raises a ValueError that names the setting.

    Example:
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
        >>> optimizer_config(opt).momentum
        0.9
    """
    configs = [group_config(optimizer, group) for group in optimizer.param_groups]
    return configs[0]


def group_config(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> OptimizerConfig:
    """The hyperparameters of one of ``optimizer``'s parameter groups (see optimizer_config)."""
    name = type(optimizer).__name__
    for key in ("lr", "weight_decay"):
        if isinstance(group.get(key), torch.Tensor):
            group_value = group[key]
            raise _unsupported(name, key, group_value, "pass a Python float")
    maximize = bool(group.get("maximize", False))
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is a subclass of Adam
        if group.get("amsgrad"):
            raise _unsupported(
                name, "amsgrad", True, "use amsgrad=False, or the virtual device (partita.use_spmd)"
            )
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
        "Use one of those; or keep your torch.optim loop on the virtual device "
        "(partita.use_spmd), which runs every torch.optim optimizer; or write the update in "
        "your own step function and use partita.jit."
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


def scheduled(hyper: Hyper, cfg: OptimizerConfig) -> tuple[Lr, Lr, Lr, Lr, Lr]:
    """``(lr, beta1, beta2, momentum, weight_decay)`` now: from ``hyper`` where it has them (a
    scheduler such as OneCycleLR moves ``betas`` or ``momentum`` every step; DINO-style loops
    set ``weight_decay``), else the config's."""
    if not isinstance(hyper, dict):
        return hyper, cfg.betas[0], cfg.betas[1], cfg.momentum, cfg.weight_decay
    beta1, beta2 = hyper.get("beta1", cfg.betas[0]), hyper.get("beta2", cfg.betas[1])
    momentum, decay = (
        hyper.get("momentum", cfg.momentum),
        hyper.get("weight_decay", cfg.weight_decay),
    )
    return hyper["lr"], beta1, beta2, momentum, decay


@trace_once(any_sizes=True)
def _adam_param(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step_size: torch.Tensor,
    bias2_sqrt: torch.Tensor,
    decay: float | torch.Tensor,
    scalars: tuple[Lr, Lr, Lr, Lr],
    cfg: OptimizerConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One parameter's Adam(W) update: ``(new p, new exp_avg, new exp_avg_sq)``; ``scalars``
    is ``(1 - beta1, beta2, 1 - beta2, weight_decay)`` in float32."""
    one_minus_beta1, beta2, one_minus_beta2, weight_decay = scalars
    g = -g if cfg.maximize else g
    if cfg.kind == "adamw":
        p = p * decay  # decoupled weight decay
    elif cfg.weight_decay:  # nonzero when the step was built (training.snapshot keeps it so)
        g = g + weight_decay * p  # Adam: L2 penalty in the gradient
    m = m + one_minus_beta1 * (g - m)  # torch.lerp(m, g, 1 - beta1) for a weight < 0.5
    v = v * beta2 + one_minus_beta2 * g * g
    denom = torch.sqrt(v) / bias2_sqrt + cfg.eps
    return p - step_size * (m / denom), m, v


def _adam(
    params: Tensors, grads: Tensors, state: dict[str, Any], hyper: Hyper, cfg: OptimizerConfig
) -> tuple[Tensors, dict[str, Any]]:
    lr, beta1, beta2, _, weight_decay = scheduled(hyper, cfg)
    step = state["step"] + 1
    # Scalars in float64 like torch.optim's Python-float arithmetic, then rounded once.
    step64 = step.to(torch.float64)
    lr64 = lr.to(torch.float64) if isinstance(lr, torch.Tensor) else lr
    step_size = (lr64 / (1 - torch.pow(beta1, step64))).to(torch.float32)
    bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, step64)).to(torch.float32)
    decay = _f32(1 - lr64 * weight_decay)
    # Rounded to float32 once, as torch.optim's kernels round these Python floats.
    scalars = (_f32(1 - beta1), _f32(beta2), _f32(1 - beta2), _f32(weight_decay))
    # A parameter without a gradient (unused by forward) keeps its values: torch.optim skips
    # it too. The others are updated by one placeholder (trace_once's each).
    new_params = dict(params)
    new_m = {name: state["exp_avg"][name] for name in params}
    new_v = {name: state["exp_avg_sq"][name] for name in params}
    updated = [name for name in params if name in grads]
    news = _adam_param.each(  # type: ignore[attr-defined]
        [
            (params[n], grads[n], new_m[n], new_v[n], step_size, bias2_sqrt, decay, scalars, cfg)
            for n in updated
        ]
    )
    for name, (p, m, v) in zip(updated, news, strict=True):
        new_params[name], new_m[name], new_v[name] = p, m, v
    return new_params, {"step": step, "exp_avg": new_m, "exp_avg_sq": new_v}


@trace_once(any_sizes=True)
def _sgd_param(
    p: torch.Tensor,
    g: torch.Tensor,
    buf: torch.Tensor,
    first: torch.Tensor,
    lr32: float | torch.Tensor,
    momentum: float | torch.Tensor,
    weight_decay: float | torch.Tensor,
    cfg: OptimizerConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One parameter's SGD update: ``(new p, new momentum_buffer)``."""
    g = -g if cfg.maximize else g
    if cfg.weight_decay:  # nonzero when the step was built (training.snapshot keeps it so)
        g = g + weight_decay * p
    if cfg.momentum:
        # torch.optim.SGD starts the buffer at g, then buf * momentum + (1 - dampening) * g
        if cfg.dampening:
            buf = torch.where(first, g, buf * momentum + (1 - cfg.dampening) * g)
        else:
            buf = buf * momentum + g  # 0 * momentum + g == g on the first step
        g = g + momentum * buf if cfg.nesterov else buf
    return p - lr32 * g, buf


def _sgd(
    params: Tensors, grads: Tensors, state: dict[str, Any], hyper: Hyper, cfg: OptimizerConfig
) -> tuple[Tensors, dict[str, Any]]:
    lr, _, _, momentum, weight_decay = scheduled(hyper, cfg)
    lr32, momentum, weight_decay = _f32(lr), _f32(momentum), _f32(weight_decay)
    first = state["step"] == 0
    new_params = dict(params)
    new_buf = {name: state["momentum_buffer"][name] for name in params}
    updated = [name for name in params if name in grads]  # as in _adam
    news = _sgd_param.each(  # type: ignore[attr-defined]
        [
            (params[n], grads[n], new_buf[n], first, lr32, momentum, weight_decay, cfg)
            for n in updated
        ]
    )
    for name, (p, buf) in zip(updated, news, strict=True):
        new_params[name], new_buf[name] = p, buf
    return new_params, {"step": state["step"] + 1, "momentum_buffer": new_buf}


def clip_by_global_norm(grads: Tensors, max_norm: float) -> Tensors:
    """Scale ``grads`` like ``torch.nn.utils.clip_grad_norm_(..., max_norm)`` (2-norm).

    The norm is the square root of the sum of squares over *all* gradients: traced into a
    sharded program it is a sum over every shard, so the clipping is the unsharded one.
    """
    total = torch.sqrt(sum((g.float() * g.float()).sum() for g in grads.values()))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {k: g * coef.to(g.dtype) for k, g in grads.items()}
