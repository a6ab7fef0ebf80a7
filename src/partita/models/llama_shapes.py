"""Published model shapes as named presets, for planning (``python -m partita plan``).

Each preset is a :class:`ModelShape`: the numbers that decide a plan (layers, width, MLP
width, attention heads and key/value heads, vocabulary), and :func:`build_model` makes the
model from them — a ``transformers`` ``LlamaForCausalLM`` for the Llama presets (``transformers``
is imported only then), partita's own :class:`~partita.models.GPT` for ``gpt-s`` / ``gpt-m`` —
on the device asked for (``meta``: shapes only, no memory; how a large model is built before
it is sharded).

The Llama 3 shapes are those of Meta's published model cards and ``config.json`` files
(Llama 3 8B and 70B, Llama 3.1 405B): 8B has 32 layers, width 4096, MLP 14336, 32 heads of
which 8 key/value heads; 70B 80 layers, 8192, 28672, 64/8; 405B 126 layers, 16384, 53248,
128/8; all three a vocabulary of 128256 and untied input and output embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partita.errors import ArgumentError
from partita.models.gpt import GPT, GPTConfig

__all__ = ["MODEL_PRESETS", "ModelShape", "build_model", "load_shape", "param_count"]


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide its plan.

    Attributes:
        name: the preset's name (or the config file's).
        family: ``"llama"`` (``transformers``' ``LlamaForCausalLM``) or ``"gpt"``
            (:class:`partita.models.GPT`).
        layers / d_model / d_ff / heads / kv_heads / vocab: the shapes.
        max_seq: the longest sequence the model takes (GPT's learned positions).
        config: the transformers config's fields as read from a JSON file, if any.
    """

    name: str
    family: str
    layers: int
    d_model: int
    d_ff: int
    heads: int
    kv_heads: int
    vocab: int
    max_seq: int = 8192
    config: tuple[tuple[str, Any], ...] = ()

    def with_layers(self, layers: int) -> ModelShape:
        """The same shape with ``layers`` blocks (a cheap stand-in for tests)."""
        return ModelShape(
            self.name, self.family, layers, self.d_model, self.d_ff, self.heads,
            self.kv_heads, self.vocab, self.max_seq, self.config,
        )  # fmt: skip


def _llama(name: str, layers: int, d: int, ff: int, heads: int) -> ModelShape:
    return ModelShape(name, "llama", layers, d, ff, heads, 8, 128256)


MODEL_PRESETS: dict[str, ModelShape] = {
    "llama-3-8b": _llama("llama-3-8b", 32, 4096, 14336, 32),
    "llama-3-70b": _llama("llama-3-70b", 80, 8192, 28672, 64),
    "llama-3-405b": _llama("llama-3-405b", 126, 16384, 53248, 128),
    # partita's GPT: the GPT-S of the benchmarks, and a medium one
    "gpt-s": ModelShape("gpt-s", "gpt", 4, 256, 1024, 8, 8, 512, 128),
    "gpt-m": ModelShape("gpt-m", "gpt", 12, 768, 3072, 12, 12, 32768, 1024),
}


def load_shape(model: str) -> ModelShape:
    """A preset by name, or a ``transformers`` config JSON file (``config.json`` of a
    Llama-like model: ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``)."""
    if model in MODEL_PRESETS:
        return MODEL_PRESETS[model]
    path = Path(model)
    if not path.suffix == ".json":
        raise ArgumentError(
            f"unknown model preset {model!r}; the presets are {', '.join(MODEL_PRESETS)}, or "
            f"give the path of a transformers config.json."
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ArgumentError(
            f"cannot read the model config {model!r}: {e}. Give the path of a transformers "
            f"config.json, or a preset: {', '.join(MODEL_PRESETS)}."
        ) from None
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    missing = [k for k in (*keys, "vocab_size") if k not in cfg]
    if missing:
        raise ArgumentError(
            f"the model config {model!r} lacks {missing}: the planner reads a Llama-like "
            f"decoder config (LlamaConfig's fields {list(keys)}, vocab_size)."
        )
    return ModelShape(
        name=path.stem,
        family="llama",
        layers=int(cfg["num_hidden_layers"]),
        d_model=int(cfg["hidden_size"]),
        d_ff=int(cfg["intermediate_size"]),
        heads=int(cfg["num_attention_heads"]),
        kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        vocab=int(cfg["vocab_size"]),
        max_seq=int(cfg.get("max_position_embeddings", 8192)),
        config=tuple(sorted((k, v) for k, v in cfg.items() if not isinstance(v, (dict, list)))),
    )


def param_count(shape: ModelShape) -> int:
    """Parameters of the model :func:`build_model` makes, counted from the shape alone.

    >>> param_count(MODEL_PRESETS["llama-3-8b"])
    8030261248
    """
    d, ff, v = shape.d_model, shape.d_ff, shape.vocab
    if shape.family == "gpt":  # biases and LayerNorms with bias, learned positions
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d)
        return v * d + shape.max_seq * d + shape.layers * block + 2 * d + d * v + v
    head_dim = d // shape.heads
    attn = d * d + 2 * d * shape.kv_heads * head_dim + d * d
    block = attn + 3 * d * ff + 2 * d  # q k v o, gate up down, two RMSNorms
    return 2 * v * d + shape.layers * block + d  # embeddings, lm head, the final norm


def build_model(
    shape: ModelShape, *, device: str | torch.device = "meta", checkpointing: bool = False
) -> nn.Module:
    """The model of ``shape`` on ``device`` (``"meta"``: no memory), in float32, in training
    mode; ``checkpointing`` recomputes each block's activations in the backward
    (``torch.utils.checkpoint``)."""
    with torch.device(device):
        if shape.family == "gpt":
            return GPT(
                GPTConfig(
                    n_layer=shape.layers, n_head=shape.heads, d_model=shape.d_model,
                    vocab_size=shape.vocab, seq_len=shape.max_seq, checkpoint=checkpointing,
                )
            )  # fmt: skip
        from transformers import LlamaConfig, LlamaForCausalLM

        fields = dict(shape.config)
        longest = max(shape.max_seq, int(fields.get("max_position_embeddings", 0)))
        fields.update(
            num_hidden_layers=shape.layers, hidden_size=shape.d_model,
            intermediate_size=shape.d_ff, num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
            max_position_embeddings=longest, tie_word_embeddings=False, use_cache=False,
        )  # fmt: skip
        for key in ("architectures", "transformers_version", "model_type"):
            fields.pop(key, None)
        model = LlamaForCausalLM(LlamaConfig(**fields))
    model.train()
    if checkpointing:  # transformers 5 renamed it (and its keyword)
        options = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    return model
