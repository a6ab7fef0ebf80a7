"""A zoo of 32 more ``transformers`` models under every preset, run on demand.

``PARTITA_MODEL_ZOO=1 .venv/bin/python -m pytest tests/test_model_zoo.py`` trains each model
(Qwen3, Gemma2, GPT-NeoX, Falcon, OPT, BLOOM, GPT-J, StableLM, Qwen2-MoE, DistilBERT, RoBERTa,
ALBERT, DeBERTa-v2, BART, CLIP vision, ConvNeXt, Swin, ResNet; then Mamba, Mamba-2, RWKV,
DeepSeek-V3, GPT-OSS, Qwen3-Next, GPT-BigCode, Llama sequence classification, BERT token
classification, ModernBERT, FNet, SegFormer, Wav2Vec2, Whisper; tiny configs, random weights,
nothing downloaded) 3 AdamW steps under ``dp``, ``fsdp``, ``tp`` and ``fsdp+tp`` on the 2x4
mesh and compares it with ``torch.optim``, as ``tests/test_models.py`` does for its models.
About 30 s per model and preset on 2 cores: 128 cases are too many for every CI run, so they
run on demand (before a release, after a change to the rules or the presets); the results are
the tables of docs/models.md, "More models, checked on demand" and "More families, checked by
hand". Without the variable every case is skipped with that reason. 32 more families (newer
decoder LMs and their mixtures of experts, Pegasus, Marian, mT5, T5Gemma, SigLIP, DINOv2, CLIP
and SigLIP with their contrastive loss ...) are in ``tests/test_model_zoo_more.py``, run the same
way.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from test_models import (  # isort: skip
    BATCH,
    LM,
    PLANS,
    SEQ,
    STEPS,
    VOCAB,
    Batch,
    ModelCase,
    _logits,
    assert_trains_like_torch_optim,
    build,
    class_loss,
    seq2seq_batches,
    transformers,
)

ENC = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=40,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)


def _images16(g: torch.Generator) -> list[Batch]:
    return [
        (torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


class _ClipVisionClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        cfg = transformers.CLIPVisionConfig(**VISION, image_size=16, patch_size=4)
        self.vision = transformers.CLIPVisionModel(cfg)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> Any:
        return self.head(self.vision(pixel_values=x).pooler_output)


T = transformers
ZOO: dict[str, ModelCase] = {
    "qwen3": ModelCase(
        lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**LM, num_key_value_heads=2, head_dim=8))
    ),
    "gemma2": ModelCase(
        lambda: T.Gemma2ForCausalLM(
            T.Gemma2Config(
                **LM,
                num_key_value_heads=2,
                head_dim=8,
                sliding_window=8,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
            )
        )
    ),
    "gpt_neox": ModelCase(
        lambda: T.GPTNeoXForCausalLM(
            T.GPTNeoXConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                max_position_embeddings=32,
                rotary_pct=0.25,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            )
        )
    ),
    "falcon": ModelCase(
        lambda: T.FalconForCausalLM(
            T.FalconConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=4,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            )
        )
    ),
    "opt": ModelCase(
        lambda: T.OPTForCausalLM(
            T.OPTConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                max_position_embeddings=32,
                word_embed_proj_dim=32,
                dropout=0.0,
                attention_dropout=0.0,
            )
        )
    ),
    "bloom": ModelCase(
        lambda: T.BloomForCausalLM(
            T.BloomConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                n_layer=1,
                n_head=4,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            )
        )
    ),
    "gptj": ModelCase(
        lambda: T.GPTJForCausalLM(
            T.GPTJConfig(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=1,
                n_head=4,
                n_positions=32,
                rotary_dim=4,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    ),
    "stablelm": ModelCase(
        lambda: T.StableLmForCausalLM(
            T.StableLmConfig(**LM, num_key_value_heads=4, partial_rotary_factor=0.25)
        )
    ),
    "qwen2_moe": ModelCase(
        lambda: T.Qwen2MoeForCausalLM(
            T.Qwen2MoeConfig(
                **{**LM, "intermediate_size": 32},
                num_key_value_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                experts_implementation="batched_mm",
            )
        )
    ),
    "distilbert": ModelCase(
        lambda: T.DistilBertForMaskedLM(
            T.DistilBertConfig(
                vocab_size=VOCAB,
                dim=32,
                n_layers=1,
                n_heads=4,
                hidden_dim=64,
                max_position_embeddings=32,
                dropout=0.0,
                attention_dropout=0.0,
            )
        )
    ),
    "roberta": ModelCase(lambda: T.RobertaForMaskedLM(T.RobertaConfig(**ENC, pad_token_id=1))),
    "albert": ModelCase(
        lambda: T.AlbertForMaskedLM(
            T.AlbertConfig(
                **{**ENC, "num_hidden_layers": 2}, embedding_size=16, classifier_dropout_prob=0.0
            )
        )
    ),
    "deberta_v2": ModelCase(
        lambda: T.DebertaV2ForMaskedLM(
            T.DebertaV2Config(
                **ENC, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]
            )
        )
    ),
    "bart": ModelCase(
        lambda: T.BartForConditionalGeneration(
            T.BartConfig(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=32,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=2,
            )
        ),
        seq2seq_batches,
    ),
    "clip_vision": ModelCase(_ClipVisionClassifier, _images16, _logits),
    "convnext": ModelCase(
        lambda: T.ConvNextForImageClassification(
            T.ConvNextConfig(
                num_channels=3,
                hidden_sizes=[8, 16],
                depths=[1, 1],
                num_stages=2,
                patch_size=2,
                image_size=16,
                num_labels=10,
                drop_path_rate=0.0,
            )
        ),
        _images16,
        class_loss,
    ),
    "swin": ModelCase(
        lambda: T.SwinForImageClassification(
            T.SwinConfig(
                image_size=16,
                patch_size=2,
                num_channels=3,
                embed_dim=16,
                depths=[1, 1],
                num_heads=[2, 4],
                window_size=4,
                mlp_ratio=2.0,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                drop_path_rate=0.0,
                num_labels=10,
            )
        ),
        _images16,
        class_loss,
    ),
    "resnet": ModelCase(
        lambda: T.ResNetForImageClassification(
            T.ResNetConfig(
                num_channels=3,
                embedding_size=8,
                hidden_sizes=[8, 16],
                depths=[1, 1],
                layer_type="basic",
                num_labels=10,
            )
        ),
        _images16,
        class_loss,
    ),
}


def _padded_class_ids(g: torch.Generator) -> list[Batch]:
    """Sequence classification: the head reads each row's last non-pad token (id 0) by index;
    one row ends in padding."""
    out = []
    for _ in range(STEPS):
        ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        ids[0, -3:] = 0
        out.append((ids, torch.randint(0, 3, (BATCH,), generator=g)))
    return out


def _token_labels(g: torch.Generator) -> list[Batch]:
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, 5, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _segment_maps(g: torch.Generator) -> list[Batch]:  # 32x32 images, a label per 2x2 pixel
    return [
        (
            torch.randn(BATCH, 3, 32, 32, generator=g),
            torch.randint(0, 4, (BATCH, 16, 16), generator=g),
        )
        for _ in range(STEPS)
    ]


def _waveforms(g: torch.Generator) -> list[Batch]:  # 400 samples -> 39 frames
    return [
        (torch.randn(BATCH, 400, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def _mel_batches(g: torch.Generator) -> list[Batch]:  # Whisper: 16 mel bins x 32 frames
    out = []
    for _ in range(STEPS):
        tgt = torch.randint(0, VOCAB, (BATCH, 8), generator=g)
        inputs = {
            "input_features": torch.randn(BATCH, 16, 32, generator=g),
            "decoder_input_ids": tgt,
        }
        out.append((inputs, torch.roll(tgt, -1, 1)))
    return out


def _per_token_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _pixel_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, targets)


AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    intermediate_size=64,
    conv_dim=(16, 16),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=8,
    num_conv_pos_embedding_groups=4,
    num_labels=10,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    feat_proj_dropout=0.0,
    final_dropout=0.0,
    layerdrop=0.0,
    mask_time_prob=0.0,
)
MOE = dict(experts_implementation="batched_mm")

ZOO.update(
    {
        "mamba": ModelCase(
            lambda: T.MambaForCausalLM(
                T.MambaConfig(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    state_size=4,
                    num_hidden_layers=1,
                    expand=2,
                    conv_kernel=4,
                    use_mambapy=False,
                )
            )
        ),
        "mamba2": ModelCase(
            lambda: T.Mamba2ForCausalLM(
                T.Mamba2Config(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    state_size=8,
                    num_hidden_layers=1,
                    expand=2,
                    conv_kernel=4,
                    num_heads=8,
                    head_dim=8,
                    n_groups=1,
                    chunk_size=4,
                )
            )
        ),
        "rwkv": ModelCase(
            lambda: T.RwkvForCausalLM(
                T.RwkvConfig(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    num_hidden_layers=2,
                    attention_hidden_size=32,
                    intermediate_size=64,
                    context_length=32,
                )
            )
        ),
        "deepseek_v3": ModelCase(
            lambda: T.DeepseekV3ForCausalLM(
                T.DeepseekV3Config(
                    **{**LM, "num_hidden_layers": 2},
                    num_key_value_heads=4,
                    n_routed_experts=4,
                    num_experts_per_tok=2,
                    n_group=2,
                    topk_group=1,
                    moe_intermediate_size=16,
                    first_k_dense_replace=1,
                    kv_lora_rank=16,
                    q_lora_rank=16,
                    qk_rope_head_dim=4,
                    qk_nope_head_dim=4,
                    v_head_dim=8,
                    n_shared_experts=1,
                    **MOE,
                )
            )
        ),
        "gpt_oss": ModelCase(
            lambda: T.GptOssForCausalLM(
                T.GptOssConfig(
                    **{**LM, "num_hidden_layers": 2},
                    num_key_value_heads=2,
                    head_dim=8,
                    num_local_experts=4,
                    num_experts_per_tok=2,
                    sliding_window=8,
                    **MOE,
                )
            )
        ),
        "qwen3_next": ModelCase(
            lambda: T.Qwen3NextForCausalLM(
                T.Qwen3NextConfig(
                    **{**LM, "num_hidden_layers": 2},
                    num_key_value_heads=2,
                    head_dim=8,
                    linear_num_value_heads=4,
                    linear_num_key_heads=2,
                    linear_key_head_dim=8,
                    linear_value_head_dim=8,
                    linear_conv_kernel_dim=4,
                    num_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=16,
                    shared_expert_intermediate_size=16,
                    layer_types=["linear_attention", "full_attention"],
                    **MOE,
                )
            )
        ),
        "gpt_bigcode": ModelCase(
            lambda: T.GPTBigCodeForCausalLM(
                T.GPTBigCodeConfig(
                    vocab_size=VOCAB,
                    n_embd=32,
                    n_layer=1,
                    n_head=4,
                    n_positions=32,
                    multi_query=True,
                    resid_pdrop=0.0,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                )
            )
        ),
        "llama_seq_cls": ModelCase(
            lambda: T.LlamaForSequenceClassification(
                T.LlamaConfig(**LM, num_key_value_heads=4, num_labels=3, pad_token_id=0)
            ),
            _padded_class_ids,
            class_loss,
        ),
        "bert_token_cls": ModelCase(
            lambda: T.BertForTokenClassification(T.BertConfig(**ENC, num_labels=5)),
            _token_labels,
            _per_token_loss,
        ),
        "modernbert": ModelCase(
            lambda: T.ModernBertForMaskedLM(
                T.ModernBertConfig(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    global_attn_every_n_layers=2,
                    local_attention=4,
                    max_position_embeddings=32,
                    pad_token_id=0,
                    bos_token_id=1,
                    eos_token_id=2,
                    sep_token_id=2,
                    cls_token_id=1,
                )
            )
        ),
        "fnet": ModelCase(
            lambda: T.FNetForMaskedLM(
                T.FNetConfig(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    num_hidden_layers=1,
                    intermediate_size=64,
                    max_position_embeddings=32,
                    hidden_dropout_prob=0.0,
                    use_tpu_fourier_optimizations=False,
                )
            )
        ),
        "segformer": ModelCase(
            lambda: T.SegformerForSemanticSegmentation(
                T.SegformerConfig(
                    num_channels=3,
                    num_encoder_blocks=2,
                    depths=[1, 1],
                    sr_ratios=[2, 1],
                    hidden_sizes=[8, 16],
                    patch_sizes=[3, 3],
                    strides=[2, 2],
                    num_attention_heads=[1, 2],
                    mlp_ratios=[2, 2],
                    decoder_hidden_size=16,
                    num_labels=4,
                    drop_path_rate=0.0,
                    classifier_dropout_prob=0.0,
                    hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0,
                )
            ),
            _segment_maps,
            _pixel_loss,
        ),
        "wav2vec2": ModelCase(
            lambda: T.Wav2Vec2ForSequenceClassification(T.Wav2Vec2Config(**AUDIO)),
            _waveforms,
            class_loss,
        ),
        "whisper": ModelCase(
            lambda: T.WhisperForConditionalGeneration(
                T.WhisperConfig(
                    vocab_size=VOCAB,
                    num_mel_bins=16,
                    d_model=32,
                    encoder_layers=1,
                    decoder_layers=1,
                    encoder_attention_heads=4,
                    decoder_attention_heads=4,
                    encoder_ffn_dim=64,
                    decoder_ffn_dim=64,
                    max_source_positions=16,
                    max_target_positions=16,
                    pad_token_id=0,
                    bos_token_id=0,
                    eos_token_id=0,
                    decoder_start_token_id=0,
                    dropout=0.0,
                    attention_dropout=0.0,
                    activation_dropout=0.0,
                )
            ),
            _mel_batches,
        ),
    }
)


ZOO_XFAIL: dict[tuple[str, str], str] = {}


def _zoo_cases() -> list[Any]:
    out = []
    for name in ZOO:
        for plan in PLANS:
            reason = ZOO_XFAIL.get((name, plan))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(name, plan, id=f"{name}-{plan}", marks=marks))
    return out


@pytest.mark.skipif(not os.environ.get("PARTITA_MODEL_ZOO"), reason="set PARTITA_MODEL_ZOO=1")
@pytest.mark.parametrize(("name", "plan"), _zoo_cases())
def test_zoo_trains_like_torch_optim(name: str, plan: str) -> None:
    assert_trains_like_torch_optim(build(name, ZOO), ZOO[name], plan)
