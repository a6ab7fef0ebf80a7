"""Plan.memory_breakdown(): the peak by role (parameters, gradients, optimizer state,
activations), with and without activation checkpointing, and the state against its analytic
count (parameters x 4 bytes / shards x (1 + 1 + 2))."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita.models import GPT, GPTConfig
from partita.models.llama_shapes import MODEL_PRESETS, ModelShape, build_model, param_count
from partita.partition.memory_split import ROLES, analytic_state, input_roles
from partita.values.mesh import Mesh


def _gpt_plan(preset: str, shape: tuple[int, ...], *, checkpoint: bool = False) -> tuple:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=32, vocab_size=64, seq_len=16,
                    checkpoint=checkpoint)  # fmt: skip
    model = GPT(cfg)
    step = partita.train_step(
        model,
        lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()),
        torch.optim.AdamW(model.parameters()),
        mesh=Mesh.create(shape, ("data", "model")[: len(shape)]),
        param_specs=preset,
    )
    ids = torch.randint(0, 64, (8, 16))
    return step.lower((ids, ids)), step


@pytest.mark.parametrize(("preset", "shape"), [("dp", (4,)), ("fsdp", (4,)), ("fsdp+tp", (2, 2))])
def test_the_roles_add_up_to_the_peak_and_the_state_is_counted(
    preset: str, shape: tuple[int, ...]
) -> None:
    plan, step = _gpt_plan(preset, shape)
    b = plan.memory_breakdown()
    assert set(b.at_peak) == set(ROLES)
    assert sum(b.at_peak.values()) == b.peak == plan.memory().peak
    # every gradient the optimizer reads is sharded like its parameter
    assert b.gradients == b.parameters
    assert b.optimizer == 2 * b.parameters + 4  # two moments and the float32 step counter
    # the TrainStep's own count of the shards it holds (TrainStep.memory)
    held = step.memory()
    assert b.parameters == held["parameters"][0]
    assert b.optimizer == held["optimizer"][0]
    assert b.at_peak["parameters"] == b.parameters  # inputs are held throughout
    if preset != "dp":
        assert b.at_peak["gathered"] > 0  # FSDP gathers parameters before using them
    assert "gradients" in str(b)


def test_dp_gradients_are_full_size_and_live_before_the_update() -> None:
    plan, step = _gpt_plan("dp", (4,))
    n = sum(p.numel() for p in step.model.parameters())
    b = plan.memory_breakdown()
    assert b.gradients == 4 * n
    assert b.at_peak["gradients"] == 4 * n  # the peak is in the update: every gradient is live


def test_activation_checkpointing_holds_fewer_activations() -> None:
    plain, _ = _gpt_plan("fsdp+tp", (2, 2))
    ckpt, _ = _gpt_plan("fsdp+tp", (2, 2), checkpoint=True)
    a, b = plain.memory_breakdown(), ckpt.memory_breakdown()
    assert b.activations < a.activations
    assert b.peak < a.peak
    assert b.state == a.state  # the same parameters, gradients and optimizer state
    assert ckpt.estimate().flops > plain.estimate().flops  # the forward runs again


def test_input_roles_by_name() -> None:
    roles = input_roles(
        {"a": "parameter 'fc.weight'", "b": "opt_state['step']", "c": "lr['lr']", "d": "x"}
    )
    assert roles == {"a": "parameters", "b": "optimizer", "c": "hyper", "d": "data"}


def _llama_plan(shape: ModelShape, mesh: Mesh, device: str) -> partita.Plan:
    from partita.cli.plan import lower_step

    return lower_step(shape, mesh, "fsdp+tp", 2 * mesh.axis_size("data"), 16, device=device)


def _analytic(shape: ModelShape, mesh: Mesh) -> float:
    """16 bytes (4 per copy: parameter, gradient, two moments) per parameter element,
    divided by the shards of that parameter's spec under fsdp+tp."""
    from partita.cli.plan import param_shards

    return analytic_state(param_shards(build_model(shape, device="meta"), "fsdp+tp", mesh))


def test_state_per_device_is_the_analytic_count_small_llama() -> None:
    """parameters + gradients + AdamW moments = P x 4 bytes / shards x (1 + 1 + 2), within
    1 %, on a small Llama of the 8B's proportions (GQA 8/2)."""
    shape = ModelShape("small", "llama", 2, 256, 896, 8, 2, 2048, 64)
    mesh = Mesh.create((2, 2), ("data", "model"))
    plan = _llama_plan(shape, mesh, "cpu")
    b = plan.memory_breakdown()
    assert b.state == pytest.approx(_analytic(shape, mesh), rel=0.01)
    # the embeddings and the head are split over 'data' only: more than P x 16 / devices
    assert b.state > analytic_state([(param_count(shape), mesh.size)])


_BIG = pytest.mark.skipif(
    not os.environ.get("PARTITA_BIG_PLANS"), reason="80 s each: set PARTITA_BIG_PLANS=1"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "llama-3-8b",
        pytest.param("llama-3-70b", marks=_BIG),
        pytest.param("llama-3-405b", marks=_BIG),
    ],
)
def test_state_per_device_is_the_analytic_count_llama_3(name: str) -> None:
    """The check at full size, on meta-device models (70B and 405B on demand: 80 s each)."""
    shape = MODEL_PRESETS[name]
    mesh = Mesh.create((128, 8), ("data", "model"))  # TP 8 divides every head count
    b = _llama_plan(shape, mesh, "meta").memory_breakdown()
    assert b.state == pytest.approx(_analytic(shape, mesh), rel=0.01)


def test_param_count_matches_the_built_models() -> None:
    for name in ("gpt-s", "llama-3-8b"):
        shape = MODEL_PRESETS[name].with_layers(1)
        model = build_model(shape, device="meta")
        assert sum(p.numel() for p in model.parameters()) == param_count(shape)
    assert param_count(MODEL_PRESETS["llama-3-70b"]) == 70_553_706_496
    assert param_count(MODEL_PRESETS["llama-3-405b"]) == 405_853_388_800


def test_a_checkpointed_llama_holds_fewer_activations() -> None:
    from partita.cli.plan import lower_step

    shape = ModelShape("small", "llama", 2, 64, 128, 4, 2, 256, 64)
    mesh = Mesh.create((2, 2), ("data", "model"))
    plain, ckpt = (
        lower_step(shape, mesh, "fsdp+tp", 4, 32, device="cpu", checkpointing=c).memory_breakdown()
        for c in (False, True)
    )
    assert ckpt.activations < plain.activations and ckpt.state == plain.state
