"""Tests of capture's fake inputs: the fakes made from metadata are those ``from_tensor`` makes,
and a trace from them is the trace from converted inputs."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from partita.capture.fake_inputs import fake_inputs

trace_module = importlib.import_module("partita.capture.trace")  # the module, not the function


def _inputs() -> list[torch.Tensor]:
    base = torch.randn(6, 4)
    return [
        torch.randn(3, 4),  # made directly
        torch.randn(3, 4).requires_grad_(),  # made directly, a leaf that requires grad
        torch.randn(2, 3).bfloat16(),  # made directly
        torch.randn(5, 2).t(),  # a view: converted
        base,  # shares its storage with the next: converted
        base[1:],
        torch.tensor(2.0),  # 0-d: converted
        torch.arange(5),
        torch.empty(0, 3),  # no storage: converted
        torch.nn.Parameter(torch.randn(2)),  # a subclass: converted
    ]


def _metadata(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        type(t),
        t.shape,
        t.stride(),
        t.dtype,
        t.device,
        t.requires_grad,
        t.is_leaf,
        t.storage_offset(),
        t.is_contiguous(),
        str(torch._C._dispatch_keys(t)),
    )


def test_fakes_made_from_metadata_are_those_from_tensor_makes() -> None:
    tensors = _inputs()
    fakes = fake_inputs(tensors)
    mode = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True)
    for t, fake in zip(tensors, fakes, strict=True):
        assert isinstance(fake, FakeTensor)
        assert _metadata(fake) == _metadata(mode.from_tensor(t)), t
    converter = fakes[0].fake_mode.fake_tensor_converter
    assert converter.from_real_tensor(fakes[0].fake_mode, tensors[0]) is fakes[0]  # memoised
    # the two views of one storage stay views of one storage
    assert fakes[4].untyped_storage()._cdata == fakes[5].untyped_storage()._cdata
    assert fake_inputs(fakes) is fakes  # already fake: make_fx uses their mode


def test_a_trace_from_fakes_made_from_metadata_is_the_trace_from_converted_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tensors = _inputs()
    closed_over = tensors[0]

    def fn(*ts: torch.Tensor) -> Any:
        a, g, h, t, base, view, s, i, e, p = ts
        view.mul_(2)  # an in-place update of an input that aliases another
        base.add_(1)
        loss = (a * closed_over + g).sum() * s + h.float().mean() + t.sum() + p.sum()
        return loss, torch.autograd.grad(loss, g)[0], i + 1, e.sum(0), base * 2

    def traced() -> tuple[str, tuple[int, ...], int]:
        program = trace_module.trace(fn, tensors)  # fake: the tensors stay as they are
        return program.graph_module.code, program.mutated_inputs, len(program.constants)

    direct = traced()
    monkeypatch.setattr(trace_module, "fake_inputs", lambda tensors: tensors)
    assert traced() == direct
    assert direct[1:] == ((4, 5), 1)  # base and its view updated; closed_over lifted, as before
