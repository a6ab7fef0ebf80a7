"""``torch.save`` / ``torch.load`` of partita values with torch's default ``weights_only=True``."""

from __future__ import annotations

import io

import pytest
import torch

import partita
from partita import Mesh, P, ShardedTensor


def _round_trip(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(buf) == []
    buf.seek(0)
    return torch.load(buf)  # weights_only=True, the default


@pytest.mark.parametrize("spec", [P("data", None), P(None, "model"), P(("data", "model"), None)])
def test_sharded_tensor_loads_with_weights_only(spec: P) -> None:
    mesh = Mesh.create((2, 2), ("data", "model"))
    x = torch.randn(7, 6)  # 7 rows: uneven along data
    st = partita.mark_sharding(x, mesh, spec)
    out = _round_trip({"w": st, "step": 3})
    assert isinstance(out, dict) and out["step"] == 3
    w = out["w"]
    assert isinstance(w, ShardedTensor)
    assert w.sharding == st.sharding and w.mesh == mesh and w.shape == x.shape
    assert torch.equal(w.full(), x)


def test_held_sharded_tensor_loads_with_weights_only() -> None:
    """A value held once per tile (as jit returns ones replicated along some axes) round-trips
    without being expanded to every device first."""
    mesh = Mesh.create((2, 4), ("data", "model"))
    sharding = P(None, "model").to_sharding(mesh, 2)
    tiles = torch.arange(24.0).reshape(4, 3, 2)  # one [3, 2] tile per model position
    st = ShardedTensor.from_held(tiles, (False, True), sharding, (3, 8))
    w = _round_trip(st)
    assert isinstance(w, ShardedTensor)
    assert torch.equal(w.full(), st.full())
