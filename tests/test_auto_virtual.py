"""``partita.use_spmd(mesh, auto=True)``: the seed's unchanged loop, no ``mark_sharding``, its
steps laid out by auto-sharding, trains a transformers Llama like eager; a ``mark_sharding``
annotation is kept."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.virtual import recording
from partita.virtual import state as virtual_state

from adamw_parity import AdamWParity  # isort: skip

pytest.importorskip("scipy")
transformers = pytest.importorskip("transformers")

MESH = Mesh.create((2, 4), ("data", "model"))


@pytest.fixture
def auto_dev() -> Iterator[torch.device]:
    dev = partita.use_spmd(MESH, auto=True)
    virtual_state.get().programs.clear()
    recording.forget_guides()
    yield dev
    partita.use_spmd(MESH)  # back to the default for the other tests of this process


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (8, 8), generator=g) for _ in range(n)]


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def test_the_seed_loop_trains_a_llama_like_eager(auto_dev: torch.device) -> None:
    model = _llama()
    ref = copy.deepcopy(model)
    model = model.to(auto_dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    # AdamW's moments every step, then the parameters give or take what the moments'
    # difference makes of the updates (tests/adamw_parity.py): a few of the Llama's gradient
    # elements are ~2e-8, near eps, where an update follows the gradient's rounding
    parity = AdamWParity(ref_opt, [n for n, _ in ref.named_parameters()], rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", partita.RematerializationWarning)
        for ids in _batches(3):
            loss = _loss(model, ids.to(auto_dev))
            loss.backward()
            opt.step()
            opt.zero_grad()
            partita.sync()
            ref_loss = _loss(ref, ids)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-5, atol=1e-5)
            state = opt.state_dict()["state"]
            parity.after_step({i: {k: v.cpu() for k, v in s.items()} for i, s in state.items()})
    parity.check_parameters({name: p.cpu() for name, p in model.named_parameters()})
    report = partita.last_plan().auto
    assert report is not None and report.chosen
    assert report.best().seconds <= min(
        c.seconds for c in report.candidates if not c.name.startswith("auto")
    )


def test_mark_sharding_is_kept(auto_dev: torch.device) -> None:
    w = torch.randn(16, 32)
    x = torch.randn(8, 16)
    wd = w.to(auto_dev)
    partita.mark_sharding(wd, MESH, P(None, "model"))
    out = torch.relu(x.to(auto_dev) @ wd).sum(0)
    torch.testing.assert_close(out.cpu(), torch.relu(x @ w).sum(0), rtol=1e-5, atol=1e-5)
    assert wd.spec == P(None, "model")
    plan = partita.last_plan()
    assert P(None, "model") in [s.spec for s in plan.input_shardings]
