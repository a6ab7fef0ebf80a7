"""Random draws while capturing: the user's generator is untouched, and a draw that replays an
earlier one (the generator state restored, as ``torch.utils.checkpoint`` does for its
recomputation) is that draw again, or an error when partita cannot repeat it.
tests/test_special_handlers.py checks dropout inside ``checkpoint`` end to end."""

from __future__ import annotations

import pytest
import torch

import partita
from partita import Mesh, P
from partita.capture import trace
from partita.errors import CaptureError

MESH = Mesh.create((2,), ("x",))


def test_capturing_leaves_the_generator_where_it_was() -> None:
    step = partita.jit(lambda a: torch.nn.functional.dropout(a, 0.5), mesh=MESH, in_specs=P("x"))
    torch.manual_seed(0)
    step.lower(torch.ones(8))
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))


def _restored(a: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    state = torch.get_rng_state()
    first = torch.rand(4) + a
    torch.set_rng_state(state)
    return first, torch.rand(n) + a.sum()  # the same draw again when n == 4


def test_a_restored_generator_repeats_the_draw() -> None:
    program = trace(_restored, (torch.zeros(4), 4))
    draws = [n for n in program.graph_module.graph.nodes if n.target == torch.ops.aten.rand.default]
    assert len(draws) == 1  # the second draw reads the first
    first, again = program(torch.zeros(4), 4)
    assert torch.equal(first, again)


def test_a_replay_partita_cannot_repeat_is_an_error() -> None:
    why = r"draws again with the generator state of an earlier draw.*replays the draw of "
    with pytest.raises(CaptureError, match=why + r"aten.rand.default with other arguments"):
        trace(_restored, (torch.zeros(4), 5))
