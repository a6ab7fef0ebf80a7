"""``partita.jit(..., options={"collectives": "explicit" | "warn"})``: only the collectives the
annotations imply run silently; any other is an error (or a warning) that says where and how to
avoid it."""

from __future__ import annotations

import pytest
import torch

import partita
from partita import Mesh, P
from partita.errors import ExplicitCollectiveError, ImplicitCollectiveWarning, OptionError


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh.create((2, 4), ("d", "m"))


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1) @ w2


def test_contraction_over_a_sharded_dim_is_implied(mesh: Mesh) -> None:
    """Megatron's MLP needs one all_reduce over 'm': the annotations imply it."""
    step = partita.jit(
        mlp,
        mesh=mesh,
        in_specs=(P("d", None), P(None, "m"), P("m", None)),
        options={"collectives": "explicit"},
    )
    x, w1, w2 = torch.randn(8, 4), torch.randn(4, 8), torch.randn(8, 4)
    torch.testing.assert_close(step(x, w1, w2).full(), mlp(x, w1, w2), atol=1e-5, rtol=1e-5)
    assert step.lower(x, w1, w2).counts() == {"all_reduce": 1}


def test_reshard_between_two_annotated_values_is_an_error(mesh: Mesh) -> None:
    step = partita.jit(
        lambda x: x * 2,
        mesh=mesh,
        in_specs=P("d", None),
        out_specs=P(None, "d"),
        options={"collectives": "explicit"},
    )
    with pytest.raises(
        ExplicitCollectiveError,
        match=(
            r"(?s)1 collective\(s\) that the annotations do not imply.*all_to_all over \['d'\] "
            r"of %\w+ float32\[8, 4\] = 128 B/device at test_explicit_mode.py:\d+.*"
            r"fix: annotate %\w+ where it is produced with partita.mark_sharding\(t, mesh, "
            r"P\(None, 'd'\)\), or change the annotation that gives it P\('d', None\)"
        ),
    ):
        step(torch.ones(8, 8))


def test_gathered_operand_is_an_error_and_warn_mode_runs(mesh: Mesh) -> None:
    def scan(x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, 0)  # a cumsum cannot split its scanned dim

    x = torch.randn(8)
    with pytest.raises(ExplicitCollectiveError, match=r"(?s)all_gather over \['m'\].*aten.cumsum"):
        partita.jit(scan, mesh=mesh, in_specs=P("m"), options={"collectives": "explicit"})(x)
    warned = partita.jit(scan, mesh=mesh, in_specs=P("m"), options={"collectives": "warn"})
    with pytest.warns(ImplicitCollectiveWarning, match=r"(?s)collectives='warn'.*all_gather"):
        out = warned(x)
    torch.testing.assert_close(out.full(), torch.cumsum(x, 0))


def test_collectives_written_in_shard_map_are_explicit(mesh: Mesh) -> None:
    region = partita.shard_map(
        lambda b: partita.psum(b.sum(0), "d"), mesh=mesh, in_specs=P("d"), out_specs=P()
    )
    step = partita.jit(region, mesh=mesh, in_specs=P("d"), options={"collectives": "explicit"})
    x = torch.randn(8, 4)
    torch.testing.assert_close(step(x).full(), x.sum(0), atol=1e-5, rtol=1e-5)


def test_unknown_mode_is_an_error(mesh: Mesh) -> None:
    with pytest.raises(OptionError, match=r"collectives='strict'.*'auto', 'explicit', 'warn'"):
        partita.jit(mlp, mesh=mesh, options={"collectives": "strict"})


def test_train_step_takes_the_mode() -> None:
    """dp's gradient all_reduce is implied by the annotations; fsdp's parameter gathers are not."""
    mesh = Mesh.create((2,), ("data",))

    def make(shard: str) -> partita.TrainStep:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = torch.nn.functional.mse_loss
        return partita.train_step(
            model, loss, opt, mesh=mesh, param_specs=shard, options={"collectives": "explicit"}
        )

    batch = (torch.randn(8, 4), torch.randn(8, 2))
    assert make("dp")(batch).ndim == 0
    with pytest.raises(
        ExplicitCollectiveError, match=r"(?s)collectives='explicit'.*all_gather over \['data'\]"
    ):
        make("fsdp")(batch)
    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with pytest.raises(OptionError, match=r"collectives='loud'"):
        partita.train_step(
            lin, torch.nn.functional.mse_loss, opt, mesh=mesh, options={"collectives": "loud"}
        )
