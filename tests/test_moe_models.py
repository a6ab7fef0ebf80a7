"""Mixtures of experts from ``transformers`` with their *default* experts implementation (no
``experts_implementation=`` given): they train under every preset with no opt-in
(``replicate_unsupported`` stays False), equal to ``torch.optim`` (1e-5), as
``tests/test_models.py`` checks its models.

Traced, a ``transformers`` experts module takes its compile path and calls the library's op
``transformers::grouped_mm_fallback`` (``rules/grouped.py``); eagerly it calls
``F.grouped_mm``. Tiny configs, random weights, nothing downloaded. One model x plan runs by
default (Mixtral under ``fsdp+tp``); the rest are ``slow``. With ``replicate_unsupported=False``
an op without a rule (or whose rule raises) is an ``UnsupportedOpError``, exactly where
``replicate_unsupported=True`` would warn with ``ReplicatedOpWarning`` (``propagate/rules.py``):
so Mixtral's case also shows that its default experts need no replicated op (a separate run
under ``replicate_unsupported=True`` in ``tests/test_models.py`` checked that, and less).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from test_models import LM, PLANS, ModelCase, assert_trains_like_torch_optim, transformers  # isort: skip

T = transformers


def _lm(cls: str, config: str, **kw: Any) -> ModelCase:
    return ModelCase(lambda: getattr(T, cls)(getattr(T, config)(**{**LM, **kw})))


MOE_MODELS: dict[str, ModelCase] = {
    "mixtral": _lm(
        "MixtralForCausalLM",
        "MixtralConfig",
        intermediate_size=32,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": _lm(
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        intermediate_size=32,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
    ),
    "qwen3_moe": _lm(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    ),
    "deepseek_v2": _lm(
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_shared_experts=1,
    ),
}


def build_moe(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MOE_MODELS[name].build()
    model.config.use_cache = False
    return model


def _cases() -> list[Any]:
    return [
        pytest.param(
            name,
            plan,
            id=f"{name}-{plan}",
            marks=[] if (name, plan) == ("mixtral", "fsdp+tp") else [pytest.mark.slow],
        )
        for name in MOE_MODELS
        for plan in PLANS
    ] + [  # the expert-parallel presets on a library MoE (its grouped op gathers the experts)
        pytest.param("mixtral", plan, id=f"mixtral-{plan}", marks=[pytest.mark.slow])
        for plan in ("ep", "fsdp+ep")
    ]


def test_the_default_experts_implementation_is_the_grouped_one() -> None:
    model = build_moe("mixtral")
    assert model.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize(("name", "plan"), _cases())
def test_default_experts_train_like_torch_optim(name: str, plan: str) -> None:
    assert_trains_like_torch_optim(build_moe(name), MOE_MODELS[name], plan, key=("moe", name))
