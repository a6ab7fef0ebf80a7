"""pytest set-up shared by the test suite and the docstring examples of ``src/partita``
(``--doctest-modules``): every ``>>>`` example sees ``torch``, ``nn``, ``F``, ``partita``, ``Mesh``,
``P`` and ``aten`` without importing them, as the docs' examples assume."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import partita
from partita import Mesh, P

# The virtual device is registered by the first use_spmd, which must come before a process's
# first backward() (PyTorch sizes its autograd queues then); in a test session other tests'
# backward() often runs first, so the session registers it before any test or example runs.
partita.virtual.register_device()


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict[str, Any]) -> None:
    doctest_namespace.update(
        torch=torch, nn=torch.nn, F=torch.nn.functional, partita=partita, Mesh=Mesh, P=P,
        aten=torch.ops.aten,
    )  # fmt: skip
