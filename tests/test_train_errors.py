"""A training step refuses bad input with a typed error that says what, where, why and the fix.

Batches are checked before anything is traced; checkpoints before anything is loaded (a failed
``load_state_dict`` leaves the whole state as it was). Each case here failed before with an
error from deep inside (a KeyError, a CaptureError wrapping a ZeroDivisionError, a dtype error
from the generated program) or loaded half a checkpoint.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from partita import Mesh, P
from partita.errors import StateDictError, TrainInputError
from partita.training import TrainStep, train_step

MESH = Mesh.create((2,), ("data",))


def batch(rows: int = 8, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 4, generator=g, dtype=dtype), torch.randn(rows, 8, generator=g)


def build(loss_fn: Any = F.mse_loss, seed: int = 0, **kw: Any) -> TrainStep:
    torch.manual_seed(seed)
    model = nn.Linear(4, 8)
    return train_step(
        model, loss_fn, torch.optim.AdamW(model.parameters(), lr=0.1), mesh=MESH, **kw
    )


@functools.cache
def checkpoint() -> dict[str, Any]:
    """A checkpoint after two steps (so the optimizer has state); built once."""
    step = build(seed=1)
    step(batch())
    step(batch(6))
    return step.state_dict()


def snapshot(step: TrainStep) -> list[torch.Tensor]:
    sd = step.state_dict()
    return [*sd["model"].values(), step.opt_state["step"].full()] + [
        step.opt_state[k][n].full() for k in ("exp_avg", "exp_avg_sq") for n in step.params
    ]


def assert_unchanged(step: TrainStep, before: list[torch.Tensor]) -> None:
    for a, b in zip(snapshot(step), before, strict=True):
        assert torch.equal(a, b)


# --- batches -------------------------------------------------------------------------------------


def test_zero_row_batch() -> None:
    with pytest.raises(
        TrainInputError,
        match=r"batch leaf inputs has shape \(0, 4\): 0 rows.*at least one example.*NaN",
    ):
        build()(batch(0))


def test_float64_batch_into_float32_model() -> None:
    with pytest.raises(
        TrainInputError,
        match=r"batch leaf inputs is torch\.float64 \(shape \(8, 4\)\) but the model's "
        r"parameters are torch\.float32.*inputs\.float\(\)",
    ):
        build()(batch(dtype=torch.float64))


def test_float64_batch_under_mixed_precision_is_cast() -> None:
    """With mixed precision the inputs are cast to the compute dtype anyway: no error."""
    step = build(mixed_precision="bf16")
    inputs, targets = batch(dtype=torch.float64)
    assert torch.isfinite(step((inputs, targets)))


def test_batch_spec_structure_names_batch_spec_and_the_batch() -> None:
    step = build(batch_spec=(P("data"), P("data"), P()))
    with pytest.raises(
        TrainInputError,
        match=r"batch_spec \(P\('data'\), P\('data'\), P\(\)\) does not match the batch "
        r"\(Tensor\[8, 4\] float32, Tensor\[8, 8\] float32\)",
    ):
        step(batch())


def test_batch_spec_that_does_not_fit_a_leaf() -> None:
    step = build(batch_spec=(P(None, None, "data"), P("data")))
    with pytest.raises(
        TrainInputError,
        match=r"batch_spec gives batch leaf inputs \(shape \(8, 4\)\) the spec "
        r"P\(None, None, 'data'\).*has 3 entries but the tensor has rank 2",
    ):
        step(batch())
    with pytest.raises(TrainInputError, match=r"targets .*mesh axis 'nope'"):
        build(batch_spec=(P("data"), P("nope")))(batch())


# --- the loss ------------------------------------------------------------------------------------


def float_loss(out: torch.Tensor, targets: torch.Tensor) -> float:
    return F.mse_loss(out, targets).item()


def test_loss_fn_returning_a_float() -> None:
    with pytest.raises(
        TrainInputError,
        match=r"loss_fn 'float_loss' returned a Python number instead of a tensor.*item",
    ):
        build(float_loss)(batch())


def test_loss_fn_returning_a_vector() -> None:
    loss = functools.partial(F.mse_loss, reduction="none")
    with pytest.raises(TrainInputError, match=r"shape \(8, 8\).*one number.*\.mean\(\)"):
        build(loss)(batch())


def test_loss_fn_without_gradient() -> None:
    with pytest.raises(TrainInputError, match="does not depend on any trainable parameter"):
        build(lambda out, targets: targets.sum())(batch())


# --- loading checkpoints -------------------------------------------------------------------------


def test_bare_model_state_dict() -> None:
    step = build()
    with pytest.raises(
        StateDictError,
        match=r"keys \['weight', 'bias'\] \(a model\.state_dict\(\)\?\); it expects "
        r"\{'model': \.\.\., 'optimizer': \.\.\.\}.*pass \{'model': model_state_dict\}",
    ):
        step.load_state_dict(nn.Linear(4, 8).state_dict())


def test_model_weights_only() -> None:
    """{'model': sd} loads the weights and keeps the optimizer state."""
    step = build()
    step(batch())
    moments = step.state_dict()["optimizer"]
    step.load_state_dict({"model": checkpoint()["model"]})
    sd = step.state_dict()
    assert torch.equal(sd["model"]["weight"], checkpoint()["model"]["weight"])
    assert torch.equal(sd["optimizer"]["state"][0]["exp_avg"], moments["state"][0]["exp_avg"])


def test_bad_optimizer_part_changes_nothing() -> None:
    """A missing moment used to replace the parameters, then fail with KeyError 'exp_avg_sq'."""
    step = build()
    step(batch())
    before = snapshot(step)
    bad = checkpoint()
    bad = {
        "model": bad["model"],
        "optimizer": {
            **bad["optimizer"],
            "state": {
                0: {k: v for k, v in bad["optimizer"]["state"][0].items() if k != "exp_avg_sq"},
                1: bad["optimizer"]["state"][1],
            },
        },
    }
    with pytest.raises(
        StateDictError, match=r"missing keys \['optimizer\.state\.0\.exp_avg_sq'\].*strict=False"
    ):
        step.load_state_dict(bad)
    assert_unchanged(step, before)


def test_wrong_moment_shape_is_named() -> None:
    step = build()
    before = snapshot(step)
    bad = checkpoint()
    state = {
        **bad["optimizer"]["state"],
        1: {**bad["optimizer"]["state"][1], "exp_avg": torch.zeros(2, 2)},
    }
    with pytest.raises(
        StateDictError,
        match=r"\['state'\]\[1\]\['exp_avg'\] \(parameter 'bias'\) has shape \(2, 2\) "
        r"\(torch\.float32\), which does not match \(8,\) \(torch\.float32\)",
    ):
        step.load_state_dict(
            {"model": bad["model"], "optimizer": {**bad["optimizer"], "state": state}}
        )
    assert_unchanged(step, before)


def test_integer_weights_are_refused_floats_are_cast() -> None:
    step = build()
    before = snapshot(step)
    model = {**checkpoint()["model"], "weight": torch.ones(8, 4, dtype=torch.int64)}
    with pytest.raises(
        StateDictError,
        match=r"model\['weight'\] is torch\.int64 \(shape \(8, 4\)\) but this model keeps it "
        r"as torch\.float32.*\.to\(torch\.float32\)",
    ):
        step.load_state_dict({"model": model})
    assert_unchanged(step, before)
    halves = {k: v.to(torch.float64) for k, v in checkpoint()["model"].items()}
    step.load_state_dict({"model": halves})
    got = step.state_dict()["model"]["weight"]
    assert got.dtype == torch.float32 and torch.equal(got, checkpoint()["model"]["weight"])


def test_unexpected_and_missing_keys_strict_and_not() -> None:
    step = build()
    before = snapshot(step)
    sd = checkpoint()
    extra = {**sd, "model": {**sd["model"], "scale": torch.ones(())}, "epoch": 3}
    with pytest.raises(
        StateDictError, match=r"unexpected keys \['model\.scale', 'epoch'\].*strict=False"
    ):
        step.load_state_dict(extra)
    assert_unchanged(step, before)
    partial = {"model": {"weight": sd["model"]["weight"], "other": torch.zeros(1)}}
    result = step.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["model.bias"] and result.unexpected_keys == ["model.other"]
    full = step.state_dict()["model"]
    assert torch.equal(full["weight"], sd["model"]["weight"])
    assert torch.equal(full["bias"], before[1])  # missing: kept


def test_optimizer_of_another_size_and_uneven_steps() -> None:
    step = build()
    sd = checkpoint()
    groups = [{**sd["optimizer"]["param_groups"][0], "params": [0, 1, 2]}]
    with pytest.raises(
        StateDictError, match=r"groups of sizes \[3\], this step's optimizer groups of sizes \[2\]"
    ):
        step.load_state_dict({**sd, "optimizer": {**sd["optimizer"], "param_groups": groups}})
    state = {
        **sd["optimizer"]["state"],
        1: {**sd["optimizer"]["state"][1], "step": torch.tensor(5.0)},
    }
    with pytest.raises(StateDictError, match=r"different step counts per parameter.*one counter"):
        step.load_state_dict({**sd, "optimizer": {**sd["optimizer"], "state": state}})


def test_entries_of_the_wrong_type() -> None:
    step = build()
    sd = checkpoint()
    with pytest.raises(StateDictError, match=r"state_dict\['model'\] is a list, expected"):
        step.load_state_dict({"model": list(sd["model"].values())})
    state = {**sd["optimizer"]["state"], 0: torch.zeros(8, 4)}
    with pytest.raises(
        StateDictError,
        match=r"\['state'\]\[0\] \(parameter 'weight'\) is a Tensor, expected a dict of its "
        r"states \(step, exp_avg, exp_avg_sq\)",
    ):
        step.load_state_dict({**sd, "optimizer": {**sd["optimizer"], "state": state}})
    with pytest.raises(
        StateDictError,
        match=r"model\['weight'\] is a str \('w.pt'\), expected a tensor of shape \(8, 4\)",
    ):
        step.load_state_dict({"model": {**sd["model"], "weight": "w.pt"}})
    with pytest.raises(StateDictError, match=r"state_dict\['optimizer'\] is list, expected"):
        step.load_state_dict({**sd, "optimizer": []})
