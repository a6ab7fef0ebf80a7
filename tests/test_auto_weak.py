"""Where the presets are weak, auto-sharding is strictly better (``bench/bench_auto.py`` runs the
full-size cases ``cnn-b2`` and ``vocab`` beside every preset).

* A CNN at batch 2 on 8 devices: dp and fsdp split a batch of 2 over 8 devices (or cannot)
  and still reduce every gradient.
* A GPT whose vocabulary head dominates: dp and fsdp reduce (or gather) the head's weight or
  its gradient every step.

Each asserts that the solver's plan is kept, sends at most 0.8x the best preset's wire bytes
on its real Plan and models no slower (on these small sizes the solver keeps most weights
whole: its plans send almost nothing); the CNN's step also trains like eager PyTorch. These
held before the test was written: they guard the result, they did not find a bug.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh
from partita.models import GPT, GPTConfig, SmallCNN

pytest.importorskip("scipy")

MESH = Mesh.create((8,), ("data",))


def _check(report: partita.auto.AutoReport) -> None:
    presets = [c for c in report.candidates if not c.name.startswith("auto")]
    mine = next(c for c in report.candidates if c.name == "auto")
    assert report.chosen == "auto"
    assert mine.wire_bytes <= 0.8 * min(c.wire_bytes for c in presets)
    assert mine.seconds <= min(c.seconds for c in presets)


def test_a_cnn_at_batch_2_on_8_devices_sends_less_than_any_preset() -> None:
    torch.manual_seed(0)
    model = SmallCNN(in_channels=3, num_classes=10, size=32, width=16).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = partita.train_step(model, F.cross_entropy, opt, mesh=MESH, param_specs="auto")
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g))
    _check(step.lower(batch).auto)
    torch.manual_seed(0)
    ref = SmallCNN(in_channels=3, num_classes=10, size=32, width=16).train()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        loss = step(batch)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(batch[0]), batch[1])
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)


def test_a_gpt_with_a_large_vocabulary_sends_less_than_any_preset() -> None:
    cfg = GPTConfig(n_layer=1, n_head=2, d_model=32, vocab_size=4096, seq_len=16, bias=False)
    with torch.device("meta"):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.zeros(8, cfg.seq_len, dtype=torch.long)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    step = partita.train_step(model, loss, opt, mesh=MESH, param_specs="auto")
    _check(step.lower((ids, ids)).auto)
