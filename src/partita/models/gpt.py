"""A small GPT (decoder-only transformer) written as ordinary single-device PyTorch.

Pre-norm blocks: LayerNorm, causal self-attention through ``F.scaled_dot_product_attention``
with a fused qkv projection, LayerNorm, a GELU MLP. The fused projection's output features are
``[q | k | v]`` (GPT-2's order, ``qkv_layout="blocks"``) or, with ``qkv_layout="heads"``, head by
head ``[q0 k0 v0 | q1 k1 v1 | ...]`` (the order Megatron-LM and GPT-NeoX store): there a
contiguous split of the output features over a tensor-parallel axis gives each device whole
heads of q, k and v, where GPT-2's order makes the devices exchange rows every layer. Token
and learned position embeddings, a final LayerNorm and an untied lm head. ``checkpoint=True``
recomputes each block's activations in the backward (``torch.utils.checkpoint``). ``blocks``
may be replaced by one module that runs the whole stack (``partita.pipeline``). No partita
code, no weight tying, no generation loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from torch import nn
from torch.utils.checkpoint import checkpoint

from partita.errors import ArgumentError

__all__ = ["GPT", "QKV_LAYOUTS", "GPTConfig"]

#: The orders of the fused qkv projection's output features (``GPTConfig.qkv_layout``).
QKV_LAYOUTS = ("blocks", "heads")


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPT`. ``d_model`` must be divisible by ``n_head``."""

    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32
    vocab_size: int = 64
    seq_len: int = 16
    dropout: float = 0.0
    bias: bool = True  # biases in the attention and MLP linears (GPT-2 has them, Llama not)
    checkpoint: bool = False  # recompute each block in the backward (torch.utils.checkpoint)
    #: the fused qkv projection's output order: "blocks" [q | k | v] (GPT-2), "heads"
    #: [q0 k0 v0 | q1 k1 v1 | ...] (Megatron-LM, GPT-NeoX: tensor-parallel without moving rows)
    qkv_layout: str = "blocks"


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ArgumentError(
                f"GPTConfig d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}."
            )
        if cfg.qkv_layout not in QKV_LAYOUTS:
            raise ArgumentError(
                f"GPTConfig qkv_layout={cfg.qkv_layout!r}: use one of {QKV_LAYOUTS} ('blocks': "
                f"[q | k | v] as GPT-2; 'heads': [q0 k0 v0 | q1 k1 v1 | ...] as Megatron-LM)."
            )
        self.n_head = cfg.n_head
        self.heads_major = cfg.qkv_layout == "heads"
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        if self.heads_major:
            # [b, t, heads * 3 * hd] -> q, k, v as [b, heads, t, hd]; the heads counted from
            # the projection's width, so a module that holds some heads only (DTensor's
            # ColwiseParallel with local outputs) runs the same code
            qkv = self.qkv(x).reshape(b, t, -1, 3, d // self.n_head)
            q, k, v = (z.transpose(1, 2) for z in qkv.unbind(3))
        else:
            q, k, v = self.qkv(x).split(d, dim=2)
            # [b, t, d] -> [b, heads, t, d / heads]
            q = q.reshape(b, t, self.n_head, d // self.n_head).transpose(1, 2)
            k = k.reshape(b, t, self.n_head, d // self.n_head).transpose(1, 2)
            v = v.reshape(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``forward(ids: [batch, seq] int64) -> logits [batch, seq, vocab]``.

    Example:
        >>> model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, vocab_size=32, seq_len=8))
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 32])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.cfg.seq_len:
            raise ArgumentError(f"GPT got a sequence of {t} tokens; seq_len is {self.cfg.seq_len}.")
        pos = torch.arange(t, device=ids.device)
        x = self.drop(self.tok_emb(ids) + self.pos_emb(pos))
        # a module in place of the list runs the whole stack (``partita.pipeline``)
        blocks = self.blocks if isinstance(self.blocks, nn.ModuleList) else [self.blocks]
        for block in blocks:
            if self.cfg.checkpoint and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))
