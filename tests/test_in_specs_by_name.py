"""``in_specs`` by parameter name: keyword arguments get specs too (jit_signature.by_name)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import partita
from partita import Mesh, P
from partita.errors import CaptureError, PartitaWarning

MESH = Mesh.create((4,), ("data",))


class Scorer(nn.Module):
    """A forward called by keyword, as transformers models are."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        h = self.emb(input_ids) * attention_mask[..., None]
        return self.out(h)


def test_keyword_batch_is_split_as_named_and_equals_eager() -> None:
    torch.manual_seed(0)
    model = Scorer()
    ids, mask = torch.randint(0, 16, (8, 5)), (torch.rand(8, 5) > 0.3).float()
    fwd = partita.jit(model, mesh=MESH, param_specs="fsdp",
                      in_specs={"input_ids": P("data"), "attention_mask": P("data")})  # fmt: skip
    plan = fwd.lower(input_ids=ids, attention_mask=mask)
    assert re.search(r"\n  input_ids +P\('data', None\)\n", plan.explain())  # not replicated
    assert {c.kind for c in plan.collectives} == {"all_gather"}, plan.explain()  # FSDP only
    want = model(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(fwd(input_ids=ids, attention_mask=mask).full(), want)
    torch.testing.assert_close(fwd(ids, attention_mask=mask).full(), want)  # mixed


def test_a_function_keyword_spec_and_an_unknown_name() -> None:
    step = partita.jit(lambda x, *, scale: x * scale, mesh=MESH,
                       in_specs={"x": P("data"), "scale": P()})  # fmt: skip
    out = step(torch.ones(8, 2), scale=torch.tensor(3.0))
    assert out.sharding.spec == P("data", None) and torch.equal(out.full(), torch.full((8, 2), 3.0))
    with pytest.raises(CaptureError, match=r"in_specs names \['y'\].*its parameters: \['x'\]"):
        partita.jit(lambda x: x, mesh=MESH, in_specs={"y": P("data")})(torch.ones(8))


def test_a_module_batch_left_replicated_over_data_warns_once() -> None:
    torch.manual_seed(0)
    model = Scorer()
    ids, mask = torch.randint(0, 16, (8, 5)), torch.ones(8, 5)
    fwd = partita.jit(model, mesh=MESH, param_specs="fsdp")
    said = r"input_ids, attention_mask got no in_specs, so they are replicated over 'data'"
    with pytest.warns(PartitaWarning, match=said + r".*in_specs=\{'input_ids': P\('data'\)"):
        fwd(input_ids=ids, attention_mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fwd(input_ids=ids[:4], attention_mask=mask[:4])  # another signature: said once
        named = partita.jit(model, mesh=MESH, param_specs="fsdp", in_specs={"input_ids": P()})
        named(input_ids=ids, attention_mask=mask)  # in_specs given: the layout is chosen


def test_a_name_only_kwargs_could_take_must_be_passed() -> None:
    """fn(batch, **kw) with in_specs={'input_ids': ...} meant for the batch dict: an error, not
    a spec that silently applies to nothing."""

    def fn(batch, **kw):
        return batch["input_ids"] * 2

    step = partita.jit(fn, mesh=MESH, in_specs={"input_ids": P("data")})
    with pytest.raises(CaptureError, match=r"in_specs names \['input_ids'\]"):
        step({"input_ids": torch.ones(8)})
    out = step({"input_ids": torch.ones(8)}, input_ids=torch.ones(8))  # a keyword of **kw
    assert out.sharding.spec == P(None)
