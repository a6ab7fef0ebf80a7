"""Train models from the ``transformers`` library, unmodified, under a preset.

    pip install transformers     # not a partita dependency
    python examples/train_transformers.py [gpt2|llama|phi3|mixtral] [dp|fsdp|tp|fsdp+tp]

Built from a small config with random weights: nothing is downloaded. Prints the specs the
preset gave (and why), then trains 5 steps on 8 simulated devices beside the same model trained
unsharded with torch.optim; the losses agree to ~1e-6 (docs/models.md).
"""

from __future__ import annotations

import copy
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: the models come from configs

import torch
import torch.nn.functional as F  # noqa: N812
import transformers

from partita import Mesh
from partita.presets import explain_param_specs, format_param_specs
from partita.training import train_step

LM = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=32,
)  # fmt: skip


def build(name: str) -> torch.nn.Module:
    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LM))
    elif name == "phi3":  # fused qkv_proj and gate_up_proj
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**LM, pad_token_id=0))
    elif name == "mixtral":  # 4 experts; batched_mm: the eager expert loop cannot be traced
        cfg = transformers.MixtralConfig(
            **LM, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            experts_implementation="batched_mm",
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False  # training: no KV cache objects in the traced step
    return model


def loss_fn(out: object, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())  # type: ignore[attr-defined]


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    preset = sys.argv[2] if len(sys.argv) > 2 else "fsdp+tp"
    torch.manual_seed(0)
    model = build(name)
    reference = copy.deepcopy(model)
    mesh = Mesh.create((2, 4), ("data", "model"))
    print(format_param_specs(explain_param_specs(preset, model, mesh)[:12]))
    # eps=1e-5: GPT-2's attention key bias has a zero gradient (docs/training.md)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-5)
    step = train_step(model, loss_fn, opt, mesh=mesh, param_specs=preset)
    gen = torch.Generator().manual_seed(0)
    for i in range(5):
        ids = torch.randint(0, 64, (8, 16), generator=gen)
        targets = torch.roll(ids, -1, 1)
        loss = step((ids, targets))
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(ids), targets)
        ref_loss.backward()
        ref_opt.step()
        print(f"step {i + 1}  loss {loss.item():.6f}  unsharded {ref_loss.item():.6f}")
    print(step.plan.summary())


if __name__ == "__main__":
    main()
