"""Fake tensors for a trace's inputs, made from their metadata where that is all they carry.

``make_fx(tracing_mode="fake")`` converts every real input with ``FakeTensorMode.from_tensor``,
which describes the tensor in full (about 60 properties, views, storages, autograd state)
before it builds a meta tensor: about 0.3 ms per input, 0.12 s for the 451 inputs of a GPT-M
training step (parameters, gradients' optimizer state, batch). Most inputs are plain
contiguous tensors that own their storage; their fake tensor is a meta tensor of the same
shape, strides, dtype and ``requires_grad`` on the input's device, which :func:`fake_inputs`
builds directly (about 0.05 ms) in a fake mode made as ``make_fx`` makes its own, and records
in that mode's converter so that converting the real tensor again (a closed-over input) gives
the same fake. Every other input (a view, a tensor sharing its storage with another input, a
0-d tensor, a subclass, a non-leaf, a non-CPU tensor...) is converted by ``from_tensor`` as
``make_fx`` would. ``make_fx`` then finds the mode on the inputs and uses it.

A plain *meta* input (a model built under ``torch.device("meta")``, a meta batch: shapes
without data) is faked as a CPU tensor, so that a meta model traces to exactly the program of
the same model on the CPU: every constant the program or the partitioner makes is on the CPU
too, and lowering, the Plan and ``Plan.memory()`` never meet two devices. Running it is refused
before any kernel runs (``runtime.executor.check_has_data``).
"""

from __future__ import annotations

from collections import Counter
from typing import cast

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["fake_inputs"]


def _made_directly(t: torch.Tensor, shared: Counter[int]) -> bool:
    """Whether the fake of ``t`` is a meta tensor of its shape, strides and dtype: a plain
    leaf CPU tensor that owns its storage whole, shared with no other input."""
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.device.type != "cpu":
        return False
    if t.dim() == 0 or t.is_quantized or t.is_conj() or t.is_neg() or not t.is_leaf:
        return False  # 0-d: from_tensor may memoise its value for item()
    if t._base is not None or t.storage_offset() != 0 or not t.is_contiguous():
        return False
    storage = t.untyped_storage()
    if storage.nbytes() != t.numel() * t.element_size() or shared[storage.data_ptr()] != 1:
        return False
    return storage.data_ptr() != 0 and (not t.requires_grad or t.grad_dtype in (None, t.dtype))


def _meta_leaf(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain meta tensor (a parameter of a model built under
    ``torch.device("meta")``, a meta batch): shapes without data, traced as a CPU tensor."""
    if type(t) is not torch.Tensor or t.layout is not torch.strided or not t.is_meta:
        return False
    return t._base is None and not t.is_conj() and not t.is_neg()


def fake_inputs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as fake tensors of one new fake mode (the one ``make_fx`` would make), or
    ``tensors`` unchanged when a fake mode is already active or on them (``make_fx`` then
    uses that mode)."""
    if detect_fake_mode(tensors) is not None:
        return tensors
    # Imported here, as make_fx does: torch._dynamo costs about 1 s to import.
    import torch._functorch.config as functorch_config
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        mode = FakeTensorMode(
            allow_fallback_kernels=True,
            allow_non_fake_inputs=True,
            shape_env=ShapeEnv(),
            static_shapes=True,
        )
    converter = mode.fake_tensor_converter
    shared = Counter(
        t.untyped_storage().data_ptr()
        for t in tensors
        if type(t) is torch.Tensor and t.layout is torch.strided and t.device.type == "cpu"
    )
    fakes: list[torch.Tensor] = []
    for i, t in enumerate(tensors):
        meta = _meta_leaf(t)
        if not meta and not _made_directly(t, shared):
            fakes.append(mode.from_tensor(t, source=ConstantSource(f"input{i}")))
            continue
        with torch._C._DisableTorchDispatch():
            empty = torch.empty_strided(
                t.shape, t.stride(), dtype=t.dtype, device="meta", requires_grad=t.requires_grad
            )
            # a meta input stands for a CPU tensor: the program, its constants and the
            # partitioner's are all on the CPU, the Plan is the real model's
            fake = FakeTensor(mode, empty, torch.device("cpu") if meta else t.device)
        converter.set_tensor_memo(t, fake)
        fakes.append(fake)
    for made in fakes:  # make_fx converts its inputs again: each is its own fake
        converter.set_tensor_memo(made, cast(FakeTensor, made))  # every entry is a FakeTensor
    return fakes
