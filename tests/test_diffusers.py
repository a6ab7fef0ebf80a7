"""Models from ``diffusers``, unmodified: an ``AutoencoderKL`` trains and UNets run under jit.

Each model is built from a tiny config with random weights (nothing is downloaded:
``HF_HUB_OFFLINE=1``; ``diffusers`` is a test-only dependency, ``pip install -e .[dev]``) on
the simulated 2x4 mesh, every op with a rule (``replicate_unsupported=False``, the default):

* ``AutoencoderKL`` (two down and up blocks of 8 and 16 channels, the mid-block attention,
  GroupNorm of 4 groups, 4 latent channels) trains 2 AdamW steps under ``dp`` and ``fsdp``
  (``tp`` and ``fsdp+tp`` give it the same specs, so their cases skip) on its default
  forward (``sample_posterior=False``: the posterior's mode), the reconstruction loss of
  ``.sample``; the losses and every final parameter equal the same
  model trained by ``torch.optim.AdamW`` (``rtol = atol = 1e-5``);
* the posterior sampled (``latent_dist.sample()``: ``randn_tensor`` with ``generator=None``,
  ``torch.randn(shape, generator=None)``, the ``randn.generator`` overload) plus its KL term:
  partita draws every random tensor with its global shape from the global generator
  (docs/rules.md), so with the same ``torch.manual_seed`` before each step the sampled steps
  equal eager ones too;
* ``UNet2DModel`` (a down block with attention) and ``UNet2DConditionModel`` (cross-attention
  to 5 text tokens) under ``partita.jit`` with their default ``return_dict=True``: the output
  is the library's output dataclass, equal to the eager one (the conditional one with an
  ``encoder_attention_mask``). ``UNet2DConditionModel`` also trains 2 steps under ``fsdp+tp``;
* the DDPM noise-prediction loss (``randn_like`` noise, ``randint`` timesteps,
  ``DDPMScheduler.add_noise``, the ``UNet2DModel``) under jit equals eager's for the same seed.

The default run trains the VAE under ``fsdp`` and its sampled form under ``fsdp+tp``; the other
presets and the UNet's training are marked slow (the UNet's: 25 s on a quiet 2-core machine).

AdamW runs with ``lr=1e-3, eps=1e-5``: the traced convolutions' gradients differ from eager
ones in the last bits (another summation order over the batch split), and AdamW turns such
noise in elements whose gradient is near zero into updates up to ``lr`` (docs/training.md,
"Numbers equal torch.optim"); at ``lr=1e-2`` one element in a thousand of a conv weight
differs by 2e-5 after two steps, under every preset alike.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"  # never download: every model is built from a config
diffusers = pytest.importorskip("diffusers")

import partita  # noqa: E402
from partita import Mesh, P  # noqa: E402
from partita.presets import param_specs  # noqa: E402
from partita.training import train_step  # noqa: E402

MESH = Mesh.create((2, 4), ("data", "model"))
BATCH, STEPS = 8, 2
RTOL = ATOL = 1e-5
SMALL = dict(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, sample_size=16)


def _vae() -> nn.Module:
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        **SMALL,
    )


def _unet() -> nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=4,
        **SMALL,
    )


def _cond_unet() -> nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8,
        attention_head_dim=4,
        **SMALL,
    )


class _SampledVAE(nn.Module):
    """The VAE's training forward: a sampled latent (not the mode) and the posterior's KL."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        posterior = self.vae.encode(x).latent_dist
        return self.vae.decode(posterior.sample()).sample, posterior.kl().mean()


def _recon_loss(out: Any, x: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.sample, x)


def _vae_loss(out: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out[0], x) + 1e-3 * out[1]


def _images() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(BATCH, 3, 16, 16, generator=g) for _ in range(STEPS)]
    return [(x, x) for x in xs]


def _assert_trains_like_torch_optim(
    model: nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    batches: list[tuple[Any, torch.Tensor]],
    plan: str,
) -> None:
    """``model`` trained by ``train_step`` under ``plan`` and by torch.optim: the same losses
    and final parameters. ``torch.manual_seed(10 + i)`` before step ``i`` in both."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-5)
    want = []
    for i, (inputs, target) in enumerate(batches):
        torch.manual_seed(10 + i)
        opt.zero_grad()
        loss = loss_fn(ref(*inputs) if isinstance(inputs, tuple) else ref(inputs), target)
        loss.backward()
        opt.step()
        want.append(loss.item())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    step = train_step(model, loss_fn, opt, mesh=MESH, param_specs=plan)
    got = []
    for i, batch in enumerate(batches):
        torch.manual_seed(10 + i)
        got.append(float(step(batch)))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    full = step.full_parameters()
    for name, value in ref.named_parameters():
        torch.testing.assert_close(
            full[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param("dp", marks=pytest.mark.slow),
        "fsdp",
        pytest.param("tp", marks=pytest.mark.slow),
        pytest.param("fsdp+tp", marks=pytest.mark.slow),
    ],
)
def test_autoencoder_kl_trains_like_torch_optim(plan: str) -> None:
    """A plan whose parameter specs equal an earlier plan's on the VAE compiles the same
    program (every standard preset puts the batch on ``data``): it is skipped, naming the case
    that trains it. Today ``tp`` splits no VAE name (``test_tp_presets_know_few_diffusers_names``),
    so ``tp`` is ``dp`` and ``fsdp+tp`` is ``fsdp``; once the presets learn a VAE name, its
    case trains again."""
    vae = _vae()
    specs = param_specs(plan, vae, MESH)
    plans = ("dp", "fsdp", "tp", "fsdp+tp")
    for earlier in plans[: plans.index(plan)]:
        if param_specs(earlier, vae, MESH) == specs:
            pytest.skip(
                f"{plan}'s parameter specs on the VAE are {earlier}'s: "
                f"test_autoencoder_kl_trains_like_torch_optim[{earlier}] trains the same program"
            )
    _assert_trains_like_torch_optim(vae, _recon_loss, _images(), plan)


def test_autoencoder_kl_sampled_posterior_trains_like_eager() -> None:
    """``latent_dist.sample()`` draws ``randn(shape, generator=None)``: the same numbers as
    eagerly for the same seed, so the sampled steps (and the KL term) equal eager ones."""
    _assert_trains_like_torch_optim(_SampledVAE(_vae()), _vae_loss, _images(), "fsdp+tp")


def test_autoencoder_kl_sampled_posterior_draws_anew_each_call() -> None:
    """Under jit the draw is a real one: another seed, another latent (and the same seed, the
    same one), as eagerly."""
    vae = _vae()
    x = _images()[0][0]
    f = partita.jit(
        lambda x: vae(x, sample_posterior=True).sample, mesh=MESH, in_specs=(P("data"),)
    )
    torch.manual_seed(5)
    a = f(x).full()
    torch.manual_seed(5)
    torch.testing.assert_close(a, vae(x, sample_posterior=True).sample, rtol=RTOL, atol=ATOL)
    torch.manual_seed(5)
    torch.testing.assert_close(f(x).full(), a, rtol=0, atol=0)
    assert not torch.allclose(f(x).full(), a, atol=1e-3)  # the generator moved on


def test_unet2d_jit_with_return_dict() -> None:
    unet = _unet()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, 3, 16, 16, generator=g)
    t = torch.randint(0, 1000, (BATCH,), generator=g)
    out = partita.jit(unet, mesh=MESH, in_specs=(P("data"), P("data")))(x, t)
    assert isinstance(out, diffusers.models.unets.unet_2d.UNet2DOutput)
    torch.testing.assert_close(out.sample.full(), unet(x, t).sample, rtol=RTOL, atol=ATOL)


def test_unet2d_condition_jit_with_return_dict() -> None:
    """Cross-attention to text states, the last two tokens masked out
    (``encoder_attention_mask``: a boolean mask turned into an additive bias); the timestep a
    Python int (one for the whole batch)."""
    unet = _cond_unet()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, 4, 16, 16, generator=g)
    text = torch.randn(BATCH, 5, 8, generator=g)
    mask = torch.tensor([True, True, True, False, False]).expand(BATCH, 5)

    def fn(x: torch.Tensor, text: torch.Tensor, mask: torch.Tensor) -> Any:
        return unet(x, 10, text, encoder_attention_mask=mask)

    out = partita.jit(fn, mesh=MESH, in_specs=(P("data"), P("data"), P("data")))(x, text, mask)
    assert isinstance(out, diffusers.models.unets.unet_2d_condition.UNet2DConditionOutput)
    torch.testing.assert_close(out.sample.full(), fn(x, text, mask).sample, rtol=RTOL, atol=ATOL)


def test_ddpm_noise_prediction_loss_draws_like_eager() -> None:
    """The usual diffusion training loss, its draws inside the program: ``randn_like`` noise,
    ``randint`` timesteps, ``DDPMScheduler.add_noise`` (the scheduler's ``alphas_cumprod``
    indexed by the timesteps), the UNet's prediction against the noise. For the same seed the
    sharded loss is eager's."""
    unet = _unet()
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000)

    def ddpm_loss(x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn_like(x)
        t = torch.randint(0, 1000, (x.shape[0],))
        pred = unet(scheduler.add_noise(x, noise, t), t).sample
        return F.mse_loss(pred, noise)

    x = _images()[0][0]
    f = partita.jit(ddpm_loss, mesh=MESH, in_specs=(P("data"),))
    torch.manual_seed(6)
    got = f(x).full()
    torch.manual_seed(6)
    with torch.no_grad():
        want = ddpm_loss(x)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_unet2d_condition_trains_like_torch_optim() -> None:
    """Noise prediction: the UNet's ``.sample`` against a target noise, under ``fsdp+tp``."""
    g = torch.Generator().manual_seed(4)
    batches = [
        (
            (
                torch.randn(BATCH, 4, 16, 16, generator=g),
                torch.randint(0, 1000, (BATCH,), generator=g),
                torch.randn(BATCH, 5, 8, generator=g),
            ),
            torch.randn(BATCH, 4, 16, 16, generator=g),
        )
        for _ in range(STEPS)
    ]
    _assert_trains_like_torch_optim(_cond_unet(), _recon_loss, batches, "fsdp+tp")


def test_tp_presets_know_few_diffusers_names() -> None:
    """docs/models.md, "Diffusion models": ``tp`` splits nothing in the VAE and, in the
    conditional UNet, only GEGLU's ``ff.net.0.proj`` (as a row linear: ``proj``); the attention's
    ``to_q``/``to_k``/``to_v``/``to_out.0`` stay whole. When the presets learn these names, this
    test and that paragraph change together."""
    assert all(spec == P(*[None] * len(spec)) for spec in param_specs("tp", _vae(), MESH).values())
    split = {n: s for n, s in param_specs("tp", _cond_unet(), MESH).items() if any(s)}
    assert split and all(n.endswith("ff.net.0.proj.weight") for n in split), split
    assert all(s == P(None, "model") for s in split.values())
