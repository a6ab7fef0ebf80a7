"""Pipeline parallelism on a mesh axis (``partita.pipeline``), against unsharded torch.

The timetable is checked by simulating it in Python (every micro-batch meets every layer once,
in order); an 8-layer GPT whose blocks are the pipeline trains 3 steps on mesh (stage=4,
data=2) equal to plain torch (losses and every parameter, 1e-5), under the GPipe and the
circular schedule, on the LocalMesh and (``slow``) on 4 Gloo processes; the Plan's permutes
carry 2 x activation bytes x micro-batches across each boundary; the stacked parameters take
1/S per device. This file is about ``partita.pipeline``; ``test_pipeline.py`` is about the
compile pipeline.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import partita
from partita import Mesh, P
from partita.errors import PipelineError
from partita.pipeline import Schedule
from partita.presets import StandardPreset
from partita.runtime.launch import spawn

SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))

import pipeline_gpt as gpt  # noqa: E402

MESH = Mesh.create((4, 2), ("stage", "data"))


# --- the timetable -----------------------------------------------------------------------------


def _simulate(s: Schedule) -> dict[int, list[int]]:
    """Run the timetable on labels: ``{micro-batch: the layers it met, in order}``."""
    met: dict[int, list[int]] = {m: [] for m in range(s.microbatches)}
    slots: list[int | None] = [None] * s.stages  # the micro-batch each stage holds
    sent: list[list[int | None]] = []
    for t in range(s.iterations):
        kind, at = s.source(t)
        prev = sent[t - 1] if t else [None] * s.stages
        slots = list(prev)
        slots[0] = at if kind == "input" else sent[at][0] if kind == "wrap" else None
        for stage, m in enumerate(slots):
            work = s.work(t, stage)
            assert (m is None) == (work is None), (t, stage, m, work)
            if m is not None and work is not None:
                assert work[0] == m
                met[m] += [s.layer(stage, work[1], j) for j in range(s.layers_per_chunk)]
        if s.output(t) is not None:
            assert slots[-1] == s.output(t)
        out: list[int | None] = [None] * s.stages
        for a, b in s.pairs(t):
            out[b] = slots[a]
        sent.append(out)
    return met


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 3), st.integers(1, 2), st.booleans())
def test_every_micro_batch_meets_every_layer_in_order(
    stages: int, microbatches: int, rounds: int, k: int, circular: bool
) -> None:
    if circular and microbatches < stages:
        microbatches = stages
    s = Schedule(
        "circular" if circular else "gpipe", stages, microbatches, rounds if circular else 1, k
    )
    met = _simulate(s)
    assert all(layers == list(range(s.layers)) for layers in met.values()), met
    assert sorted(s.storage_order()) == list(range(s.layers))
    # each boundary carries each micro-batch once per round (the wrap one round less)
    for (a, b), n in s.transfers().items():
        assert n == s.microbatches * (s.rounds - (a == s.stages - 1 and b == 0))
    assert s.bubble_fraction == pytest.approx((stages - 1) / (s.rounds * microbatches + stages - 1))


def test_storage_order_gives_each_stage_its_chunks() -> None:
    s = Schedule("circular", stages=4, microbatches=4, rounds=2, layers_per_chunk=1)
    # stage 0 holds layers 0 and 4, stage 1 layers 1 and 5, ...
    assert s.storage_order() == [0, 4, 1, 5, 2, 6, 3, 7]
    g = Schedule("gpipe", stages=4, microbatches=4, rounds=1, layers_per_chunk=2)
    assert g.storage_order() == list(range(8))


# --- training equals unsharded torch -----------------------------------------------------------


#: The unsharded run, made once per file: every test that trains the GPT compares with it.
_reference = functools.cache(gpt.reference)


def _assert_equal_to_torch(losses: list[float], params: dict[str, torch.Tensor]) -> None:
    want_losses, want = _reference()
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-5
    )
    assert params.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(
            params[k], v, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}"
        )


def test_gpipe_gpt_trains_like_torch_on_stage_and_data() -> None:
    """8 blocks over stage=4 (2 per stage), 4 micro-batches, split over data=2; the rest
    replicated (dp). Losses and every parameter after 3 steps equal torch's."""
    losses, params, step, pipe = gpt.train(MESH, "dp", schedule="gpipe")
    _assert_equal_to_torch(losses, params)
    assert step.plan is not None
    report = partita.pipeline_report(pipe, step.plan)
    # one micro-batch's activation block on one device: [16 / 4 / 2 rows, 8, 32] float32
    act = (gpt.BATCH // 4 // 2) * gpt.CFG.seq_len * gpt.CFG.d_model * 4
    for s in range(3):
        assert report.boundary(s, s + 1) == 2 * act * 4, report.explain()
        assert report.boundary_bytes[(s, s + 1)] == report.boundary_bytes[(s + 1, s)] == act * 4
    assert set(report.boundary_bytes) == {(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)}
    assert report.permutes == 2 * 6  # M + S - 2 iterations send, forward and backward
    # input and output split over the stages by micro-batch (M / S = 1 each): stage o's input
    # goes o -> 0 and the last stage's result o goes 3 -> o, forward, and back; no all_reduce
    io = {(o, 0): act for o in (1, 2)} | {(0, o): act for o in (1, 2)}
    io |= {(3, o): act for o in (1, 2)} | {(o, 3): act for o in (1, 2)}
    io |= {(3, 0): 2 * act, (0, 3): 2 * act}
    assert report.io_bytes == io and report.io_permutes == 4 * 3
    assert report.stage_all_reduce_bytes == 0
    assert report.bubble_fraction == pytest.approx(3 / 7)
    assert "bubble fraction (S-1)/(V*M+S-1) = 0.429" in report.explain()


def test_circular_gpt_trains_like_torch_with_the_rest_sharded_over_stage() -> None:
    """2 rounds of 1 layer per stage, 8 micro-batches (each waits 4 iterations on stage 0 for
    its next round); embeddings and head FSDP-sharded over the stage axis."""
    preset = StandardPreset("fsdp", data_axis="stage")
    losses, params, step, pipe = gpt.train(MESH, preset, microbatches=8, schedule="circular")
    _assert_equal_to_torch(losses, params)
    assert step.plan is not None
    report = partita.pipeline_report(pipe, step.plan)
    assert (report.rounds, report.layers_per_chunk, report.iterations) == (2, 1, 19)
    act = (gpt.BATCH // 8 // 2) * gpt.CFG.seq_len * gpt.CFG.d_model * 4
    for s in range(3):
        assert report.boundary(s, s + 1) == 2 * act * 8 * 2  # both rounds cross it
    assert report.boundary(3, 0) == 2 * act * 8  # the wrap: once, into round 2
    # input and output moved in groups of M / S = 2 micro-batches: 3 permutes in, 3 out, and
    # their gradients back (the all_reduces over the stage axis here are FSDP's)
    assert report.io_permutes == 12 and sum(report.io_bytes.values()) == 12 * 2 * act


def test_parameter_memory_is_a_stage_share() -> None:
    """The stacked blocks take 1/S per device; with the rest FSDP over the stage axis the
    whole model does."""
    model, _, pipe = gpt.models(MESH)
    step = partita.train_step(
        model,
        gpt.loss_fn,
        gpt.optimizer(model.parameters()),
        mesh=MESH,
        param_specs=StandardPreset("fsdp", data_axis="stage"),
    )
    local, total = step.memory()["parameters"]
    assert local * 4 == total
    for n in pipe.names:
        stacked = step.params[f"blocks.stack.{n}"]
        assert stacked.sharding == P("stage").to_sharding(MESH, stacked.ndim)
        assert stacked.local_shape[0] * 4 == stacked.shape[0] == 8


@pytest.mark.slow
def test_tensor_parallel_layers_inside_the_pipeline() -> None:
    """Mesh (stage=2, data=2, model=2): 4 blocks per stage, each Megatron-split over 'model'
    (``layer_specs=StandardPreset("tp")``), micro-batch rows over 'data'; equal to torch."""
    mesh = Mesh.create((2, 2, 2), ("stage", "data", "model"))
    losses, params, step, pipe = gpt.train(mesh, "dp", layer_specs=StandardPreset("tp"))
    _assert_equal_to_torch(losses, params)
    qkv = step.params["blocks.stack.attn.qkv.weight"]
    assert qkv.sharding == P("stage", "model", None).to_sharding(mesh, 3)
    assert qkv.local_shape == (4, 48, 32)
    assert step.plan is not None
    assert any(c.mesh_axes == ("model",) for c in step.plan.collectives)  # TP's all_reduces
    assert partita.pipeline_report(pipe, step.plan).boundary(0, 1) == 2 * 4 * (2 * 8 * 32 * 4)


@pytest.mark.parametrize("remat", [True, False])
def test_pipeline_in_jit_values_and_gradients(remat: bool) -> None:
    """A function of the pipeline under jit, with its gradient, equals the layers in turn;
    remat=True recomputes each chunk in the backward (more forward ops in the program)."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]
    mesh = Mesh.create((2, 2), ("stage", "data"))
    pipe = partita.pipeline(layers, mesh=mesh, microbatches=2, remat=remat)
    x = torch.randn(8, 8)

    def loss_and_grads(w: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = {k: v.detach().requires_grad_() for k, v in w.items()}
        x = x.detach().requires_grad_()
        y = torch.func.functional_call(pipe, {f"stack.{k}": v for k, v in w.items()}, (x,))
        loss = (y * torch.cos(y)).sum()
        return (loss, *torch.autograd.grad(loss, [*w.values(), x]))

    weights = {n: p.detach() for n, p in pipe.stack.named_parameters()}
    jitted = partita.jit(
        loss_and_grads, mesh=mesh, in_specs=({n: P("stage") for n in weights}, P("data"))
    )
    got = jitted(weights, x)
    want = loss_and_grads(weights, x)  # eager: the layers one after another
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.full(), b, rtol=1e-5, atol=1e-5)
    # eager (not traced) the module is the layers in turn
    seq = x
    for layer in layers:
        seq = layer(seq)
    torch.testing.assert_close(pipe(x), seq)
    plan = jitted.lower(weights, x)
    report = partita.pipeline_report(pipe, plan)
    assert report.boundary(0, 1) == 2 * (2 * 8 * 4) * 2  # [8/2/2 rows, 8] per micro-batch


def test_input_and_output_are_split_over_the_stages_by_micro_batch() -> None:
    """The output leaves the pipeline split over the stage axis under the batch axes' split
    (each stage holds the results of M / S micro-batches, rows contiguous): nothing sums it
    over the stages. Stage 0 gets the other stages' input micro-batches and the last stage
    hands each stage its results, one permute of M / S slots per stage and direction."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]
    mesh = Mesh.create((2, 2), ("stage", "data"))
    pipe = partita.pipeline(layers, mesh=mesh, microbatches=4)
    x = torch.randn(16, 8)
    jitted = partita.jit(pipe, mesh=mesh, in_specs=(P("data"),))
    y = jitted(x)
    want = x
    for layer in layers:
        want = layer(want)
    torch.testing.assert_close(y.full(), want, rtol=1e-5, atol=1e-5)
    assert y.spec == P(("data", "stage"), None)
    plan = jitted.lower(x)
    assert plan.counts() == {"collective_permute": 6}  # no all_reduce
    report = partita.pipeline_report(pipe, plan)
    slot = (16 // 4 // 2) * 8 * 4  # one micro-batch's rows on one device, float32
    assert report.permutes == 4 and report.boundary_bytes == {(0, 1): slot * 4}
    # the input's micro-batches 2, 3 go 1 -> 0; the results 0, 1 go 1 -> 0
    assert report.io_permutes == 2 and report.io_bytes == {(1, 0): 2 * slot * 2}


# --- errors ------------------------------------------------------------------------------------


def _layers(n: int = 4) -> list[nn.Module]:
    return [nn.Linear(4, 4) for _ in range(n)]


SETUP_ERRORS = [
    ({"schedule": "1f1b"}, r"unknown schedule '1f1b'; the schedules are \['gpipe', 'circ"),
    ({"stage_axis": "pp"}, r"stage_axis='pp' is not an axis of Mesh\(stage=4, data=2\)"),
    ({"layers": 6}, r"6 layers cannot be split evenly into 4 stages: 6 is not a multiple"),
    ({"schedule": "circular", "rounds": 3}, r"4 layers cannot be split .* 4 stages of 3 rounds"),
    (
        {"layers": 8, "schedule": "circular", "microbatches": 2},
        r"as many micro-batches as stages, got microbatches=2 for 4 stages",
    ),
    ({"microbatches": 0}, r"microbatches=0; it must be at least 1"),
    ({"microbatches": 6}, r"microbatches=6 is not a multiple of the 4 stages of 'stage'"),
    ({"batch_axes": ("stage",)}, r"batch_axes=\('stage',\) names \['stage'\]"),
    (
        {"layer_specs": {"weight": P("data", None)}},
        r"layer_specs gives parameter 'weight' the spec P\('data', None\), which uses \['data'\]",
    ),
]


@pytest.mark.parametrize(("kwargs", "match"), SETUP_ERRORS)
def test_setup_errors(kwargs: dict, match: str) -> None:
    layers = _layers(kwargs.pop("layers", 4))
    kwargs.setdefault("microbatches", 4)
    with pytest.raises(PipelineError, match=match):
        partita.pipeline(layers, mesh=MESH, **kwargs)


def test_gpipe_with_rounds_is_an_error() -> None:
    with pytest.raises(PipelineError, match=r"schedule='gpipe' runs one round, got rounds=2"):
        Schedule("gpipe", stages=2, microbatches=2, rounds=2, layers_per_chunk=1)


def test_layers_must_be_alike() -> None:
    with pytest.raises(PipelineError, match=r"layer 2 \(Linear\) is not like layer 0"):
        partita.pipeline([*_layers(2), nn.Linear(4, 5), nn.Linear(4, 4)], mesh=MESH, microbatches=4)
    with pytest.raises(PipelineError, match=r"has buffers \['running_mean'"):
        partita.pipeline([nn.BatchNorm1d(4) for _ in range(4)], mesh=MESH, microbatches=4)
    with pytest.raises(PipelineError, match=r"no layers given"):
        partita.pipeline([], mesh=MESH, microbatches=4)


def test_a_batch_the_micro_batches_do_not_divide() -> None:
    pipe = partita.pipeline(_layers(), mesh=MESH, microbatches=4)
    jitted = partita.jit(pipe, mesh=MESH)
    with pytest.raises(
        PipelineError,
        match=r"a batch of 12 rows cannot be cut into microbatches=4 .* not a multiple of 8",
    ):
        jitted(torch.randn(12, 4))


# --- 4 Gloo processes --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("rank_zygote")  # ranks forked from a pre-imported process
def test_four_gloo_processes_train_like_torch(tmp_path: Path) -> None:
    """Both schedules, one after the other in the same 4 processes (one launch: each process
    imports torch and joins the group once)."""
    out = tmp_path / "pipeline.pt"
    results = spawn(
        [str(SCRIPTS / "pipeline_gpt.py"), str(out), "gpipe", "circular"], 4, timeout=300
    )
    assert all(r.returncode == 0 for r in results), "\n".join(
        f"--- rank {r.rank}: {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}"
        for r in results
    )
    per_schedule = torch.load(out)
    assert sorted(per_schedule) == ["circular", "gpipe"]
    for losses, params in per_schedule.values():
        _assert_equal_to_torch(losses, params)
