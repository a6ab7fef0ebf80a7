"""Models from ``transformers``, unmodified, train under every preset like torch.optim.

Each model is built from a tiny config with random weights (nothing is downloaded:
``HF_HUB_OFFLINE=1``), trained 3 AdamW steps with ``partita.train_step`` on a simulated 2x4
mesh under ``dp``, ``fsdp``, ``tp`` and ``fsdp+tp`` with ``replicate_unsupported=False`` (every
op must have a sharding rule), and compared with the same model trained unsharded by
``torch.optim.AdamW``: the loss at every step and every final parameter, float32,
``rtol = atol = 1e-5``.

AdamW runs with ``eps=1e-5`` for every model: several of them (GPT-2, BERT, ViT, Qwen2) have
an attention key bias, whose gradient is zero in exact arithmetic (softmax is shift
invariant); with the default ``eps=1e-8`` AdamW turns the rounding noise of that gradient into
updates of size ``lr`` and random sign (docs/training.md, "Numbers equal torch.optim").

The default run trains six models, one per layout the presets know, under ``fsdp+tp`` (the
plan that exercises the most: both mesh axes, every preset rule); the rest of the model x plan
matrix is marked slow.
Combinations that do not work yet are ``xfail(strict=True)`` with the root cause: the op, the
stage, and why.

Hand-written layers whose ops stopped user programs before their rules train one fsdp+tp step
on a 2x2 mesh in the default run. 18 more library models under every preset are the on-demand
zoo of ``tests/test_model_zoo.py``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"  # never download: every model is built from a config
transformers = pytest.importorskip("transformers")

import partita  # noqa: E402
from partita import Mesh, P  # noqa: E402
from partita.presets import param_specs  # noqa: E402
from partita.training import TrainStep, train_step  # noqa: E402

RTOL = ATOL = 1e-5
STEPS = 3
BATCH, SEQ, VOCAB = 8, 16, 64
MESH = Mesh.create((2, 4), ("data", "model"))
PLANS = ("dp", "fsdp", "tp", "fsdp+tp")

Batch = tuple[Any, torch.Tensor]


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def class_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, targets)


def lm_batches(g: torch.Generator) -> list[Batch]:
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((ids, torch.roll(ids, -1, 1)))
    return out


def seq2seq_batches(g: torch.Generator) -> list[Batch]:
    out = []
    for _ in range(STEPS):
        src = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        tgt = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append(({"input_ids": src, "decoder_input_ids": tgt}, torch.roll(tgt, -1, 1)))
    return out


def image_batches(g: torch.Generator) -> list[Batch]:
    return [
        (torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


@dataclass(frozen=True)
class ModelCase:
    """A tiny library model, its batches and its loss."""

    build: Callable[[], nn.Module]
    batches: Callable[[torch.Generator], list[Batch]] = lm_batches
    loss: Callable[[Any, torch.Tensor], torch.Tensor] = lm_loss


# Decoder-only LMs share sizes: hidden 32, 4 heads of 8, intermediate 64, one layer.
LM = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, max_position_embeddings=32,
)  # fmt: skip


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LM, num_key_value_heads=4))


def _qwen2() -> nn.Module:  # grouped-query attention (2 kv heads), q/k/v biases
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LM, num_key_value_heads=2))


def _mistral() -> nn.Module:  # grouped-query attention (2 kv heads)
    cfg = transformers.MistralConfig(**LM, num_key_value_heads=2, head_dim=8)
    return transformers.MistralForCausalLM(cfg)


def _gemma() -> nn.Module:  # multi-query attention, tied embeddings, scaled embeddings
    cfg = transformers.GemmaConfig(**LM, num_key_value_heads=1, head_dim=8)
    return transformers.GemmaForCausalLM(cfg)


def _phi3() -> nn.Module:  # fused qkv_proj and gate_up_proj
    cfg = transformers.Phi3Config(**LM, num_key_value_heads=4, pad_token_id=0)
    return transformers.Phi3ForCausalLM(cfg)


def _mixtral() -> nn.Module:  # 4 experts as 3-D weights, top-2 routing
    cfg = transformers.MixtralConfig(
        **{**LM, "intermediate_size": 32}, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, experts_implementation="batched_mm",
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(cfg)


def _t5() -> nn.Module:
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, use_cache=False,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def _vit() -> nn.Module:
    cfg = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTForImageClassification(cfg)


MODELS: dict[str, ModelCase] = {
    "llama": ModelCase(_llama),
    "qwen2": ModelCase(_qwen2),
    "mistral": ModelCase(_mistral),
    "gemma": ModelCase(_gemma),
    "phi3": ModelCase(_phi3),
    "mixtral": ModelCase(_mixtral),
    "gpt2": ModelCase(_gpt2),
    "bert": ModelCase(_bert),
    "t5": ModelCase(_t5, seq2seq_batches),
    "vit": ModelCase(_vit, image_batches, class_loss),
}

# The default run: fsdp+tp on one model per layout (rotary MHA, grouped-query, fused
# projections, experts, Conv1D, BERT's dense paths); the rest of the matrix is slow.
FAST = frozenset({"llama", "mistral", "phi3", "mixtral", "gpt2", "bert"})

# (model, plan) -> the root cause of a failure, one line; "*" as plan: every plan.
XFAIL: dict[tuple[str, str], str] = {}


def build(name: str, models: dict[str, ModelCase] | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = (models or MODELS)[name].build()
    if hasattr(model, "config"):
        model.config.use_cache = False  # training builds no KV cache (T5 reads it at forward)
    return model


def reference(model: nn.Module, case: ModelCase, batches: list[Batch]) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    losses = []
    for inputs, targets in batches:
        opt.zero_grad()
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        loss = case.loss(out, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def sharded(model: nn.Module, case: ModelCase, plan: str) -> TrainStep:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    return train_step(model, case.loss, opt, mesh=MESH, param_specs=plan)


def _cases() -> list[Any]:
    out = []
    for name in MODELS:
        for plan in PLANS:
            reason = XFAIL.get((name, plan)) or XFAIL.get((name, "*"))
            fast = plan == "fsdp+tp" and name in FAST
            marks = [] if fast else [pytest.mark.slow]
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            out.append(pytest.param(name, plan, id=f"{name}-{plan}", marks=marks))
    return out


@pytest.mark.parametrize(("name", "plan"), _cases())
def test_trains_like_torch_optim(name: str, plan: str) -> None:
    assert_trains_like_torch_optim(build(name), MODELS[name], plan, key=("models", name))


#: The torch.optim run of a model, made once per process for every plan that trains it:
#: key -> (the losses, the final parameters).
_REFERENCES: dict[Hashable, tuple[list[float], dict[str, torch.Tensor]]] = {}


def assert_trains_like_torch_optim(
    model: nn.Module,
    case: ModelCase,
    plan: str,
    param_atol: float = ATOL,
    key: Hashable | None = None,
) -> None:
    """``model`` trained by ``train_step`` under ``plan`` and by torch.optim: the same losses
    and final parameters (to ``param_atol``). ``key`` names the model as ``build`` makes it
    (seeded: the same weights every time) with ``case``: its torch.optim run is made by the
    first test with that key and read by the others."""
    batches = case.batches(torch.Generator().manual_seed(0))
    if key is None or key not in _REFERENCES:
        ref = copy.deepcopy(model)
        losses = reference(ref, case, batches)
        params = {n: v.detach().clone() for n, v in ref.named_parameters()}
        if key is not None:
            _REFERENCES[key] = (losses, params)
    else:
        losses, params = _REFERENCES[key]
    want = list(losses)
    step = sharded(model, case, plan)
    got = [float(step(batch)) for batch in batches]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    full = step.full_parameters()
    for pname, value in params.items():
        torch.testing.assert_close(
            full[pname], value, rtol=RTOL, atol=param_atol, msg=lambda m, n=pname: f"{n}: {m}"
        )


# --- what the presets recognise in each library model ----------------------------------------

TP_SPECS: dict[str, dict[str, Any]] = {
    "phi3": {
        "model.layers.0.self_attn.qkv_proj.weight": ("model", None),  # fused q|k|v
        "model.layers.0.mlp.gate_up_proj.weight": ("model", None),  # fused gate|up
        "model.layers.0.mlp.down_proj.weight": (None, "model"),
    },
    "bert": {
        "bert.encoder.layer.0.attention.output.dense.weight": (None, "model"),
        "bert.encoder.layer.0.intermediate.dense.weight": ("model", None),
        "bert.encoder.layer.0.output.dense.weight": (None, "model"),
        "cls.predictions.transform.dense.weight": (None, None),
    },
    "t5": {
        "encoder.block.0.layer.0.SelfAttention.q.weight": ("model", None),
        "encoder.block.0.layer.0.SelfAttention.o.weight": (None, "model"),
        "decoder.block.0.layer.1.EncDecAttention.v.weight": ("model", None),
        "decoder.block.0.layer.2.DenseReluDense.wi.weight": ("model", None),
    },
    "mixtral": {
        "model.layers.0.mlp.experts.gate_up_proj": ("model", None, None),
        "model.layers.0.mlp.experts.down_proj": ("model", None, None),
        "model.layers.0.self_attn.k_proj.weight": (None, None),  # 2 kv heads: kept whole
    },
    "qwen2": {
        "model.layers.0.self_attn.q_proj.bias": ("model",),
        "model.layers.0.self_attn.k_proj.bias": (None,),  # 2 kv heads: kept whole
    },
    "gpt2": {
        "transformer.h.0.attn.c_attn.weight": (None, "model"),  # Conv1D [in, out]
        "transformer.h.0.mlp.c_proj.weight": ("model", None),
    },
}


@pytest.mark.parametrize("name", sorted(TP_SPECS))
def test_tp_preset_recognises_the_layout(name: str) -> None:
    model = build(name)
    specs = param_specs("tp", model, MESH)
    for pname, want in TP_SPECS[name].items():
        assert specs[pname] == P(*want), pname


def test_t5_gated_feed_forward() -> None:
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        feed_forward_proj="gated-gelu",
    )  # fmt: skip
    specs = param_specs("tp", transformers.T5ForConditionalGeneration(cfg), MESH)
    ff = "encoder.block.0.layer.1.DenseReluDense"
    assert specs[f"{ff}.wi_0.weight"] == P("model", None)
    assert specs[f"{ff}.wi_1.weight"] == P("model", None)
    assert specs[f"{ff}.wo.weight"] == P(None, "model")


# --- layers users write by hand: the ops their training steps need ----------------------------


class _VisionLayers(nn.Module):
    """A U-Net-style block (replicate padding, nearest and bilinear upsampling, pooling), then
    Swin's head: the pixels as tokens [B, L, C], pooled by AdaptiveAvgPool1d after a transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, padding=1, padding_mode="replicate")
        self.up = nn.Conv2d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> Any:
        h = F.max_pool2d(F.relu(self.down(x)), 2)
        h = F.interpolate(h, scale_factor=2, mode="nearest")
        h = F.interpolate(self.up(h), size=(6, 6), mode="bilinear", align_corners=False)
        tokens = self.norm(h.flatten(2).transpose(1, 2))
        return self.head(self.pool(tokens.transpose(1, 2)).flatten(1))


class _TextLayers(nn.Module):
    """fastText's mean of word embeddings (nn.EmbeddingBag) beside Meta-Llama's complex rotary
    (q as complex pairs times unit complex frequencies)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 32, mode="mean")
        self.emb = nn.Embedding(VOCAB, 32)
        self.q_proj = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)
        angles = torch.outer(torch.arange(SEQ, dtype=torch.float32), torch.rand(16))
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))

    def forward(self, ids: torch.Tensor) -> Any:
        q = self.q_proj(self.emb(ids))
        qc = torch.view_as_complex(q.reshape(*q.shape[:-1], 16, 2))
        q = torch.view_as_real(qc * self.freqs).flatten(2)
        return self.head(q.mean(1) + self.bag(ids))


def _class_ids(g: torch.Generator) -> list[Batch]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return [(ids, torch.randint(0, 10, (BATCH,), generator=g))]


def _logits(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, targets)


LAYERS: dict[str, ModelCase] = {
    "vision": ModelCase(_VisionLayers, lambda g: image_batches(g)[:1], _logits),
    "text": ModelCase(_TextLayers, _class_ids, _logits),
}


SMALL_MESH = Mesh.create((2, 2), ("data", "model"))  # one step, 4 devices: quick to compile


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_hand_written_layers_train_like_torch_optim(name: str) -> None:
    """One step under fsdp+tp. Each layer failed before its fix: the nearest-upsampling and
    replication-pad backwards and _embedding_bag had no rule; Swin's pooler traced an
    as_strided; the complex rotary's backward ran view_as_complex on a stride-0 tile."""
    case = LAYERS[name]
    torch.manual_seed(0)
    model = case.build()
    ref = copy.deepcopy(model)
    batches = case.batches(torch.Generator().manual_seed(0))
    want = reference(ref, case, batches)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    step = train_step(model, case.loss, opt, mesh=SMALL_MESH, param_specs="fsdp+tp")
    got = [float(step(b)) for b in batches]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
    full = step.full_parameters()
    for pname, value in ref.named_parameters():
        torch.testing.assert_close(full[pname], value, rtol=RTOL, atol=ATOL)


class _PerHeadNorm(nn.Module):
    """Qwen3's q_norm / k_norm in small: a weight over the head dim scales every head."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.k_proj = nn.Linear(32, 32, bias=False)
        self.q_norm = nn.Parameter(torch.ones(8))
        self.k_norm = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> Any:
        q = self.q_proj(x).unflatten(-1, (4, 8)) * self.q_norm
        k = self.k_proj(x).unflatten(-1, (4, 8)) * self.k_norm
        return (q * k).sum(-1)


def test_per_head_norm_weights_fsdp_tp_on_a_2x2_mesh() -> None:
    """A per-head weight (Qwen3's q_norm) under fsdp+tp on 2x2: its gradient's reduce_scatter
    over data feeds an all_reduce over model, and bucketing the all_reduces read the position
    of a node the reduce_scatters' bucket had just made (a KeyError)."""
    torch.manual_seed(0)
    model = _PerHeadNorm()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 6, 32), torch.randn(4, 6, 4)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss = F.mse_loss(ref(x), y)
    loss.backward()
    opt.step()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = train_step(model, F.mse_loss, opt, mesh=SMALL_MESH, param_specs="fsdp+tp")
    torch.testing.assert_close(float(step((x, y))), loss.item(), rtol=RTOL, atol=ATOL)
    for name, value in step.full_parameters().items():
        torch.testing.assert_close(value, dict(ref.named_parameters())[name], rtol=RTOL, atol=ATOL)


# --- nn modules whose kernels have no rule: inference under partita.jit ------------------------


def _encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=True).eval()


def test_transformer_encoder_inference_fast_path() -> None:
    """nn.TransformerEncoderLayer in eval mode without grad calls its fused kernel
    aten._transformer_encoder_layer_fwd, which had no rule (UnsupportedOpError); capture
    rewrites it to the layer's ordinary ops. With a key padding mask eager's fast path also
    packs a nested tensor and writes 0 at the padded positions, which no other path does: the
    valid positions equal it, every position equals eager's ordinary (fast path off) run.
    Without a mask the kernel is the same rewrite (``test_transformer_encoder_kernel_...``)."""
    enc, mesh = _encoder(), SMALL_MESH
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[0, 4:], pad[2, 3:] = True, True
    masked = partita.jit(
        lambda x, m: enc(x, src_key_padding_mask=m), mesh=mesh, in_specs=(P("data"), P("data"))
    )
    with torch.no_grad():
        got, fast = masked(x, pad).full(), enc(x, src_key_padding_mask=pad)
        torch.testing.assert_close(got[~pad], fast[~pad], rtol=RTOL, atol=ATOL)
        assert not fast[pad].any()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            slow = enc(x, src_key_padding_mask=pad)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    torch.testing.assert_close(got, slow, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("masks", "norm_first"),
    [("none", False), ("attn", True), ("padding", False), ("both", True), ("float", False)],
)
def test_transformer_encoder_kernel_decomposition(masks: str, norm_first: bool) -> None:
    """The rewrite of aten._transformer_encoder_layer_fwd equals the kernel on every mask type
    it takes (0: [L, S], 1: [B, S], 2: [B, H, L, S]; a float mask counts as boolean, nonzero
    masked, as in the kernel; a query with every key masked gives NaN in both)."""
    from partita.capture.decompositions import NN_KERNEL_OPS

    torch.manual_seed(0)
    act = "gelu" if norm_first else "relu"
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, norm_first=norm_first,
                                       activation=act, dropout=0.0).eval()  # fmt: skip
    x = torch.randn(3, 5, 16)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:], pad[1, :] = True, True  # row 1: every key masked
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    attn = {"attn": causal, "both": causal}.get(masks)
    key = {"padding": pad, "both": pad, "float": pad.float() * 0.5}.get(masks)
    sa = layer.self_attn
    mask, mask_type = sa.merge_masks(attn, key, x)
    args = (
        x, 16, 4, sa.in_proj_weight, sa.in_proj_bias, sa.out_proj.weight, sa.out_proj.bias,
        act == "gelu", norm_first, layer.norm1.eps, layer.norm1.weight, layer.norm1.bias,
        layer.norm2.weight, layer.norm2.bias, layer.linear1.weight, layer.linear1.bias,
        layer.linear2.weight, layer.linear2.bias, mask, mask_type,
    )  # fmt: skip
    op = torch.ops.aten._transformer_encoder_layer_fwd.default
    with torch.no_grad():
        want, got = op(*args), NN_KERNEL_OPS[op](*args)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, equal_nan=True)


def test_embedding_max_norm_renormalises_the_rows_it_reads() -> None:
    """nn.Embedding(max_norm=...) renormalises, in place, the rows its ids name
    (aten.embedding_renorm, no rule before: UnsupportedOpError). Capture rewrites it to a
    scatter, a norm and a where: the table stays split over model (10 rows on 4 devices:
    padded tiles), and the module's weight is updated as in eager."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 8, max_norm=1.0)
    ref, before = copy.deepcopy(emb), emb.weight.detach().clone()
    ids = torch.randint(0, 10, (4, 7), generator=torch.Generator().manual_seed(0))
    step = partita.jit(emb, mesh=MESH, in_specs=(P("data"),), param_specs={"weight": P("model")})
    with torch.no_grad():
        got, want = step(ids), ref(ids)
    torch.testing.assert_close(got.full(), want, rtol=RTOL, atol=ATOL)
    assert not torch.equal(ref.weight, before)  # eager renormalised some rows
    torch.testing.assert_close(emb.weight, ref.weight, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dim", [0, 2])
def test_weight_norm_backward_decomposition(dim: int) -> None:
    """The rewrite of aten._weight_norm_interface_backward equals the kernel (which takes the
    first or the last dim), float64."""
    from partita.capture.decompositions import NN_KERNEL_OPS

    g64 = torch.Generator().manual_seed(0)
    v = torch.randn(6, 5, 3, dtype=torch.float64, generator=g64)
    g = torch.randn([v.shape[d] if d == dim else 1 for d in range(3)], dtype=torch.float64)
    w, norms = torch.ops.aten._weight_norm_interface(v, g, dim)
    grad_w = torch.randn(w.shape, dtype=torch.float64, generator=g64)
    op = torch.ops.aten._weight_norm_interface_backward.default
    want, got = op(grad_w, v, g, norms, dim), NN_KERNEL_OPS[op](grad_w, v, g, norms, dim)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_weight_norm_gradients_like_eager() -> None:
    """torch.nn.utils.parametrizations.weight_norm: its backward kernel had no rule
    (UnsupportedOpError); the gradients of g and v, the batch and the output rows split,
    equal eager's."""
    torch.manual_seed(0)
    lin = nn.utils.parametrizations.weight_norm(nn.Linear(16, 8))
    g, v = lin.parametrizations.weight.original0, lin.parametrizations.weight.original1
    x = torch.randn(8, 16)

    def grads(x: torch.Tensor) -> Any:
        return torch.autograd.grad(lin(x).square().sum(), (g, v))

    step = partita.jit(grads, mesh=SMALL_MESH, in_specs=(P("data"),))
    for got, want in zip(step(x), grads(x), strict=True):
        torch.testing.assert_close(got.full(), want, rtol=RTOL, atol=ATOL)
