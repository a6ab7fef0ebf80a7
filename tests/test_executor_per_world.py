"""``partita.jit`` keeps one DistributedMesh per mesh for the process group it was made in
(``runtime.distributed.distributed_executor``): a world destroyed and initialised again gets
its own, even when CPython gives the new world group the old one's address."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from partita import Mesh
from partita.runtime import distributed


def test_a_new_world_at_the_old_ones_address_gets_its_own_executor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[object] = []

    def executor(mesh: Mesh) -> object:
        made.append(SimpleNamespace(mesh=mesh, close=lambda: None))
        return made[-1]

    fake = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True)
    monkeypatch.setattr(distributed, "dist", fake)
    monkeypatch.setattr(distributed, "DistributedMesh", executor)
    monkeypatch.setattr(distributed, "_EXECUTORS", {})
    mesh = Mesh.create((2,), ("data",))
    fake.group = SimpleNamespace(WORLD=object())
    first = distributed.distributed_executor(mesh)
    assert distributed.distributed_executor(mesh) is first  # the same world: kept
    # The world destroyed and a new one made: when nothing else holds the old group, CPython
    # gives the new one its address at once (keyed by that id alone, the old executor was
    # returned); partita holds the group it made the executor for.
    fake.group.WORLD = None
    fake.group.WORLD = object()
    assert distributed.distributed_executor(mesh) is not first
    assert len(made) == 2
