# ruff: noqa: E501 - the canonical table reads best one case per line
"""Shared test programs: the reference training steps, a small MLP and the canonical cases.

Every helper returns plain data (functions and real float32 tensors) so that any stage's tests
can trace, propagate, partition or run them. The 25 canonical programs are those of
``docs/canonical-cases.md`` (T01-T25) on ``MESH = Mesh.create((2, 4), ("x", "y"))``; the
``ann(v, spec)`` of that table is :func:`partita.capture.annotate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from partita import Mesh, P
from partita.capture import annotate
from partita.models import GPT, GPTConfig, SmallCNN
from partita.training import init_opt_state, make_train_step

MESH = Mesh.create((2, 4), ("x", "y"))


@dataclass
class Case:
    """A program with example inputs and its fixed input/output specs."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    in_specs: Any = None
    out_specs: Any = None
    note: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g)


def ann(t: torch.Tensor, spec: P) -> torch.Tensor:
    return annotate(t, MESH, spec)


# --- training steps ------------------------------------------------------------------------


def gpt_step(
    cfg: GPTConfig | None = None, batch: int = 2, optimizer: str = "adamw", seed: int = 0
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``(step, (params, buffers, opt_state, (ids, targets)))`` for a tiny GPT."""
    torch.manual_seed(seed)
    cfg = cfg or GPTConfig(n_layer=2, n_head=2, d_model=16, vocab_size=32, seq_len=8)
    model = GPT(cfg)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))

    step = make_train_step(model, loss_fn, optimizer, lr=1e-2)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    return step, (params, buffers, init_opt_state(params, optimizer), (ids, targets))


def cnn_step(
    batch: int = 4, size: int = 8, optimizer: str = "sgd", seed: int = 0
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``(step, (params, buffers, opt_state, (images, labels)))`` for SmallCNN (train mode)."""
    torch.manual_seed(seed)
    model = SmallCNN(in_channels=3, num_classes=10, size=size, width=4).train()
    step = make_train_step(model, F.cross_entropy, optimizer, lr=0.1)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return step, (params, buffers, init_opt_state(params, optimizer), (x, y))


def mlp() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A 2-layer MLP forward: ``fn(x, w1, b1, w2, b2)``."""

    def fn(
        x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
    ) -> torch.Tensor:
        return torch.relu(x @ w1 + b1) @ w2 + b2

    return fn, (_rand(8, 16), _rand(16, 32), _rand(32), _rand(32, 4), _rand(4))


# --- canonical programs ----------------------------------------------------------------------


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def _identity(a: torch.Tensor) -> torch.Tensor:
    return a


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def _t09(a: torch.Tensor) -> torch.Tensor:
    return ann(a[:10], P("y", None))


def _t10(a: torch.Tensor) -> torch.Tensor:
    return a.sum(1)


def _t11(a: torch.Tensor) -> torch.Tensor:
    return ann(a[:, :30], P(None, "y")).amax(1)


def _t12(a: torch.Tensor) -> torch.Tensor:
    return a.softmax(1)


def _t13(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b)


def _t20(a: torch.Tensor) -> torch.Tensor:
    return a.reshape(64, 32)


def _t21(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a, b], 1)


def _t22(a: torch.Tensor) -> torch.Tensor:
    return F.pad(a, (4, 4))


def _t23(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1)


def _t24(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table)


def _t25(a: torch.Tensor) -> torch.Tensor:
    return torch.sort(a, 1).values


def canonical_cases() -> list[Case]:
    """T01-T25 with fresh inputs (seeded)."""
    a16 = _rand(16, 32)
    b16 = _rand(16, 32, seed=1)
    ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(0))
    return [
        Case("T01", _add, (a16, b16), (P("x", "y"), P("x", "y")), P("x", "y")),
        Case("T02", _add, (a16, b16), (P("x", "y"), P("y", "x")), P("x", "y")),
        Case("T03", _identity, (a16,), (P("y", None),), P(None, "y")),
        Case("T04", _identity, (a16,), (P("x", "y"),), P()),
        Case("T05", _identity, (a16,), (P(),), P("x", "y")),
        Case("T06", _identity, (a16,), (P("x", "y"),), P("x", None)),
        Case("T07", _identity, (a16,), (P(("x", "y"), None),), P(("y", "x"), None)),
        Case("T08", _identity, (_rand(16, 16, 16),), (P("y", None, "x"),), P(None, ("x", "y"), None)),
        Case("T09", _t09, (a16,), (P("y", None),), P(), note="uneven"),
        Case("T10", _t10, (a16,), (P("x", "y"),), P("x")),
        Case("T11", _t11, (a16,), (P(None, "y"),), P(), note="uneven"),
        Case("T12", _t12, (a16,), (P("x", "y"),), P("x", "y")),
        Case("T13", _t13, (_rand(8, 16, 32), _rand(8, 32, 24)), (P("x", None, None), P("x", None, None)), P("x", None, None)),
        Case("T14", _matmul, (a16, _rand(32, 24)), (P(None, "y"), P("y", None)), P()),
        Case("T15", _matmul, (a16, _rand(32, 24)), (P(None, "y"), P("y", None)), P("y", None)),
        Case("T16", _matmul, (_rand(64, 128), _rand(128, 32)), (P("x", "y"), P("y", None)), P("x", None)),
        Case("T17", _matmul, (a16, _rand(32, 64)), (P("x", None), P(None, "y")), P("x", "y")),
        Case("T18", _matmul, (a16, _rand(32, 64)), (P("x", None), P("y", None)), P("x", None)),
        Case("T19", _matmul, (_rand(16, 32), _rand(32, 24)), (P("y", None), P(None, "y")), P("y", None)),
        Case("T20", _t20, (_rand(8, 8, 32),), (P(None, "y", None),), P("y", None)),
        Case("T21", _t21, (a16, b16), (P(None, "y"), P(None, "y")), P(None, "y")),
        Case("T22", _t22, (a16,), (P(None, "y"),), P(None, "y")),
        Case("T23", _t23, (_rand(8, 4, 32, 32), _rand(8, 4, 3, 3)), (P("x", None, "y", None), P()), P("x", None, "y", None)),
        Case("T24", _t24, (_rand(64, 16), ids), (P("y", None), P("x")), P("x", None)),
        Case("T25", _t25, (a16,), (P(None, "y"),), P(None, "y")),
    ]  # fmt: skip
