"""The held-out style sweep: tiny models of many families, steady step on 8 simulated devices
against the same step unsharded, under every preset (issue 32).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sweep.py [--repeat 7] [--only NAME ...]``

The families of ``tests/test_model_zoo_more.py`` (34 ``transformers`` models, tiny configs),
plus ``partita.models.SmallCNN``, a ``diffusers`` ``UNet2DModel`` (the tiny one of
``tests/test_diffusers.py``) and an LSTM language model (``bench/bench_lstm.py``'s). Each model
trains with AdamW through ``partita.train_step`` under ``dp``, ``fsdp``, ``tp`` and ``fsdp+tp``
on the 2x4 mesh (``tests/test_models.py``'s), 3 warm-up steps first (the LocalMesh traces its
segments at the second and the whole step at the third), then ``--repeat`` steps of partita
and of the same model stepped by ``torch.optim.AdamW`` in turn, on the first batch. Prints
each step's median process CPU time over the unsharded step's, per model and preset, and per
preset the median and the largest ratio over the models (goal: median <= 2x under every
preset). One thread; CPU time, so other processes' load changes little.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from partita import train_step
from partita.models import SmallCNN
from test_model_zoo_more import MORE
from test_models import MESH, PLANS, Batch, ModelCase, build


class LSTMLM(nn.Module):
    """``bench/bench_lstm.py``'s model at a tiny size."""

    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, batch_first=True)
        self.out = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x))
        return self.out(h)


def _tokens(g: torch.Generator) -> list[Batch]:
    ids = torch.randint(0, 64, (16, 8), generator=g)
    return [(ids, torch.roll(ids, -1, dims=1))]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _images(g: torch.Generator) -> list[Batch]:
    return [(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g))]


def _unet() -> nn.Module:
    import diffusers

    return diffusers.UNet2DModel(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=4,
        sample_size=8,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
    )


def _noisy(g: torch.Generator) -> list[Batch]:
    x = torch.randn(8, 3, 8, 8, generator=g)
    return [({"sample": x, "timestep": torch.randint(0, 100, (8,), generator=g)}, x * 0.5)]


def _denoise_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.sample, targets)


EXTRA: dict[str, ModelCase] = {
    "small_cnn": ModelCase(
        lambda: SmallCNN(in_channels=3, num_classes=10, size=8, width=4),
        _images,
        F.cross_entropy,
    ),
    "unet2d": ModelCase(_unet, _noisy, _denoise_loss),
    "lstm": ModelCase(LSTMLM, _tokens, _lm_loss),
}
MODELS: dict[str, ModelCase] = {**MORE, **EXTRA}


def _run(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def measure(name: str, plan: str, repeat: int) -> tuple[float, float]:
    """Median process CPU seconds per step: (partita, unsharded torch)."""
    case = MODELS[name]
    model = build(name, MODELS)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-5)
    step = train_step(
        model,
        case.loss,
        torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5),
        mesh=MESH,
        param_specs=plan,
    )
    inputs, targets = case.batches(torch.Generator().manual_seed(0))[0]

    def eager() -> None:
        opt.zero_grad()
        case.loss(_run(ref, inputs), targets).backward()
        opt.step()

    for _ in range(3):
        step((inputs, targets))
        eager()
    ours, theirs = [], []
    for _ in range(repeat):
        start = time.process_time()
        step((inputs, targets))
        ours.append(time.process_time() - start)
        start = time.process_time()
        eager()
        theirs.append(time.process_time() - start)
    return statistics.median(ours), statistics.median(theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--only", nargs="+", choices=sorted(MODELS), help="these models only")
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sweep.py {' '.join(sys.argv[1:])}")
    print(f"# torch {torch.__version__}, 1 thread, mesh {MESH!r}; median CPU of {args.repeat}")
    print(f"# start: load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    ratios: dict[str, list[float]] = {p: [] for p in args.plans}
    print(f"{'model':<16}" + "".join(f"{p:>22}" for p in args.plans))
    for name in args.only or MODELS:
        row = f"{name:<16}"
        for plan in args.plans:
            try:
                ours, theirs = measure(name, plan, args.repeat)
            except Exception as e:  # a model that does not run: named, not hidden
                row += f"{'error ' + type(e).__name__:>22}"
                continue
            ratios[plan].append(ours / theirs)
            row += f"{f'{1e3 * ours:.1f}/{1e3 * theirs:.1f} ms {ours / theirs:.2f}x':>22}"
        print(row, flush=True)
    print("per preset: median (largest) of partita's CPU per step over unsharded's")
    for plan, rs in ratios.items():
        if rs:
            print(
                f"  {plan:<8} {statistics.median(rs):.2f}x ({max(rs):.2f}x) over {len(rs)} models"
            )
    print(f"# end: load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
