"""The scripts' shared train step: a model's AdamW step under a preset, compiled with
``partita.jit`` (parameters, hyperparameters, optimizer state and an ``(x, y)`` batch split over
``data``), with its parameters and fresh optimizer state."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.presets import param_specs
from partita.training import init_opt_state, make_train_step


def adamw_step(
    model: torch.nn.Module, mesh: Mesh, plan: str = "fsdp"
) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """``(step, params, state)``; call ``step(params, {}, state, batch)`` and keep the new
    params and state (its outputs 1 and 3)."""
    step_fn = make_train_step(model, F.mse_loss, "adamw", lr=1e-2)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = init_opt_state(params)
    pspecs = param_specs(plan, model, mesh)
    step = partita.jit(
        step_fn, mesh=mesh,
        in_specs=(pspecs, {}, {"step": P(), "exp_avg": pspecs, "exp_avg_sq": pspecs},
                  (P("data"), P("data"))),
    )  # fmt: skip
    return step, params, state
