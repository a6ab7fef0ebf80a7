"""Statements of the docs that no code block runs, checked against the code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.models import GPT, GPTConfig
from partita.presets import StandardPreset, param_specs

MESH = Mesh.create((2, 4), ("data", "model"))


def _llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def test_fsdp_tp_keeps_a_llama_embedding_off_the_model_axis() -> None:
    """training.md: the "fsdp+tp" preset splits the token embedding and the output head over
    `data` only; the vocabulary goes over `model` with StandardPreset(..., vocab_parallel=True)."""
    model = _llama()
    names = ("model.embed_tokens.weight", "lm_head.weight")
    plain = param_specs("fsdp+tp", model, MESH)
    assert [plain[n] for n in names] == [P("data", None)] * 2
    assert [param_specs("tp", model, MESH)[n] for n in names] == [P(None, None)] * 2
    vocab = param_specs(StandardPreset("fsdp+tp", vocab_parallel=True), model, MESH)
    assert [vocab[n] for n in names] == [P("model", "data")] * 2
    vocab_tp = param_specs(StandardPreset("tp", vocab_parallel=True), model, MESH)
    assert [vocab_tp[n] for n in names] == [P("model", None)] * 2


def test_a_train_step_loss_is_a_plain_tensor_read_with_item() -> None:
    """multi-host.md: a train_step's loss is a 0-d torch.Tensor (already gathered), read with
    `loss.item()`; it has no `.full()`."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, vocab_size=32, seq_len=8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = partita.train_step(
        model, lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()), opt,
        mesh=MESH, param_specs="fsdp",
    )  # fmt: skip
    ids = torch.randint(0, 32, (4, 8))
    loss = step((ids, ids.roll(-1, 1)))
    assert type(loss) is torch.Tensor and loss.dim() == 0
    assert not hasattr(loss, "full")
    assert isinstance(loss.item(), float)
