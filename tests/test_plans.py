"""``partita.presets``: what each preset rule gives a parameter and the reason it reports.

Models from ``transformers`` are in ``test_models.py``; these use plain ``nn`` modules named
like the library layers, so the name tables are checked without the library.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partita import Mesh, P
from partita.presets import (
    StandardPreset,
    explain_param_specs,
    format_param_specs,
    param_specs,
    split_fraction,
)

MESH = Mesh.create((2, 4), ("data", "model"))


def _bert_layer() -> nn.Module:
    """BERT's layer layout: three linears all named ``dense``, told apart by their path."""
    return nn.ModuleDict(
        {
            "attention": nn.ModuleDict(
                {"self": nn.ModuleDict({"query": nn.Linear(8, 8)}), "output": _dense(8, 8)}
            ),
            "intermediate": _dense(8, 16),
            "output": _dense(16, 8),
            "pooler": _dense(8, 8),
        }
    )


def _dense(n_in: int, n_out: int) -> nn.Module:
    return nn.ModuleDict({"dense": nn.Linear(n_in, n_out)})


def test_dense_layers_are_told_apart_by_module_path() -> None:
    specs = param_specs("tp", _bert_layer(), MESH)
    assert specs["attention.self.query.weight"] == P("model", None)
    assert specs["attention.output.dense.weight"] == P(None, "model")  # row parallel
    assert specs["attention.output.dense.bias"] == P(None)
    assert specs["intermediate.dense.weight"] == P("model", None)  # column parallel
    assert specs["intermediate.dense.bias"] == P("model")
    assert specs["output.dense.weight"] == P(None, "model")  # row parallel
    assert specs["pooler.dense.weight"] == P(None, None)  # no rule: replicated


def test_t5_names_and_fused_projections() -> None:
    model = nn.ModuleDict(
        {name: nn.Linear(8, 8, bias=False) for name in ("q", "k", "v", "o", "wi_0", "wi_1", "wo")}
        | {"qkv_proj": nn.Linear(8, 24, bias=False), "gate_up_proj": nn.Linear(8, 32)}
    )
    specs = param_specs("tp", model, MESH)
    for column in ("q", "k", "v", "wi_0", "wi_1", "qkv_proj", "gate_up_proj"):
        assert specs[f"{column}.weight"] == P("model", None), column
    assert specs["o.weight"] == P(None, "model") and specs["wo.weight"] == P(None, "model")
    rows = {r.name: r for r in explain_param_specs("tp", model, MESH)}
    assert rows["qkv_proj.weight"].reason.startswith("fused column-parallel linear (qkv_proj)")


def test_wav2vec2_modernbert_and_funnel_names() -> None:
    """Their feed-forward and attention linears were unnamed (18%, 26% and 0% of the
    parameters split by tp): all replicated."""
    model = nn.ModuleDict(
        {
            "feed_forward": nn.ModuleDict(
                {"intermediate_dense": nn.Linear(8, 16), "output_dense": nn.Linear(16, 8)}
            ),
            "mlp": nn.ModuleDict({"Wi": nn.Linear(8, 32), "Wo": nn.Linear(16, 8)}),
            "attention": nn.ModuleDict(
                {n: nn.Linear(8, 8) for n in ("q_head", "k_head", "v_head", "post_proj")}
            ),
            "ffn": nn.ModuleDict({"linear_1": nn.Linear(8, 16), "linear_2": nn.Linear(16, 8)}),
        }
    )
    specs = param_specs("tp", model, MESH)
    for column in ("feed_forward.intermediate_dense", "mlp.Wi", "attention.q_head",
                   "attention.k_head", "attention.v_head", "ffn.linear_1"):  # fmt: skip
        assert specs[f"{column}.weight"] == P("model", None), column
    for row in ("feed_forward.output_dense", "mlp.Wo", "attention.post_proj", "ffn.linear_2"):
        assert specs[f"{row}.weight"] == P(None, "model"), row
    rows = {r.name: r for r in explain_param_specs("tp", model, MESH)}
    assert rows["mlp.Wi.weight"].reason.startswith("fused column-parallel linear (Wi)")


class _Experts(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(n, 16, 8))
        self.down_proj = nn.Parameter(torch.zeros(n, 8, 8))


def test_expert_weights_split_the_experts_dim() -> None:
    model = nn.ModuleDict({"experts": _Experts(4), "gate": nn.Linear(8, 4, bias=False)})
    specs = param_specs("tp", model, MESH)
    assert specs["experts.gate_up_proj"] == P("model", None, None)
    assert specs["experts.down_proj"] == P("model", None, None)
    assert specs["gate.weight"] == P(None, None)  # the router stays replicated
    both = param_specs("fsdp+tp", model, MESH)
    assert both["experts.gate_up_proj"] == P("model", "data", None)
    rows = explain_param_specs("tp", nn.ModuleDict({"experts": _Experts(6)}), MESH)
    assert rows[0].spec == P(None, None, None)
    assert rows[0].reason == (
        "replicated over model: expert weights (gate_up_proj): experts dim over model, but "
        "model=4 does not divide dim 0 (size 6)"
    )


class _GQA(nn.Module):
    """An attention with 8 query heads and 2 key/value heads of size 4, config as in the library."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"num_attention_heads": 8, "num_key_value_heads": 2})()
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.k_proj = nn.Linear(32, 8, bias=False)
        self.v_proj = nn.Linear(32, 8, bias=False)


def test_grouped_query_keeps_whole_kv_heads() -> None:
    rows = {r.name: r for r in explain_param_specs("tp", _GQA(), MESH)}
    assert rows["q_proj.weight"].spec == P("model", None)
    assert rows["k_proj.weight"].spec == P(None, None)  # 8 rows would split, 2 heads do not
    assert rows["v_proj.weight"].reason == (
        "replicated over model: column-parallel linear (v_proj): output features over model, "
        "but its 2 heads do not split 4 ways (whole heads only)"
    )
    two = Mesh.create((4, 2), ("data", "model"))
    assert param_specs("tp", _GQA(), two)["k_proj.weight"] == P("model", None)


def test_every_row_has_a_reason() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(6))
    rows = explain_param_specs("fsdp+tp", model, MESH)
    reasons = {r.name: r.reason for r in rows}
    assert reasons["0.weight"] == (
        "replicated over model: no tp rule names this parameter; fsdp: dim 0 over 'data'"
    )
    assert reasons["1.weight"].endswith("fsdp: dim 0 over 'data'")
    assert explain_param_specs("dp", model, MESH)[0].reason == "dp: every parameter replicated"
    odd = explain_param_specs("fsdp", nn.Linear(3, 5), MESH)
    assert odd[0].reason == "fsdp: no free dim divisible by data=2"
    preset = {"0.weight": P("model", None)}
    rows = explain_param_specs(preset, model, MESH)
    assert (rows[0].spec, rows[0].reason) == (P("model", None), "preset key '0.weight'")
    assert (rows[1].spec, rows[1].reason) == (P(), "no key matches: replicated")
    rows = explain_param_specs(lambda name, p: None, model, MESH)
    assert rows[0].reason == "the preset callable" and rows[0].spec == P()


def test_format_param_specs_is_a_table() -> None:
    text = format_param_specs(explain_param_specs("tp", _GQA(), MESH))
    lines = text.splitlines()
    assert lines[0].split() == ["parameter", "shape", "spec", "reason"]
    assert any(
        line.split()[:4] == ["q_proj.weight", "[32,", "32]", "P('model',"] for line in lines
    ), text


def test_split_fraction_counts_elements() -> None:
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 24, bias=False))
    specs = {"0.weight": P("model", None), "1.weight": P(("data", "model"), None)}
    assert split_fraction(specs, model, "model") == 1.0
    assert split_fraction({**specs, "1.weight": P("data")}, model, "model") == 64 / 256
    assert split_fraction(param_specs("dp", model, MESH), model, "model") == 0.0


def test_dict_preset_errors_read_the_same_through_explain() -> None:
    with pytest.raises(ValueError, match=r"preset keys \['nope\*'\] match no parameter"):
        explain_param_specs({"nope*": P("data")}, nn.Linear(2, 2), MESH)
    with pytest.raises(ValueError, match=r"parameter 'weight' \(shape \(2, 2\)\).*does not fit"):
        explain_param_specs({"weight": P("x")}, nn.Linear(2, 2), MESH)
    with pytest.raises(ValueError, match="splits parameters over a model mesh axis named 'mp'"):
        explain_param_specs(StandardPreset("tp", model_axis="mp"), nn.Linear(2, 2), MESH)


def test_the_dict_preset_of_docs_models() -> None:
    """The wildcard preset docs/models.md writes for a model the presets do not know."""
    block = nn.ModuleDict(
        {
            "attn": nn.ModuleDict({n: nn.Linear(8, 8) for n in ("Wq", "Wk", "Wv", "Wo")}),
            "ff": nn.ModuleDict({"inner": nn.Linear(8, 16), "outer": nn.Linear(16, 8)}),
        }
    )
    model = nn.ModuleDict({"blocks": nn.ModuleList([block])})
    preset = {
        "*.attn.W[qkv].weight": P("model", None),
        "*.attn.W[qkv].bias": P("model"),
        "*.attn.Wo.weight": P(None, "model"),
        "*.ff.inner.weight": P("model", None),
        "*.ff.outer.weight": P(None, "model"),
    }
    specs = param_specs(preset, model, MESH)
    assert specs["blocks.0.attn.Wk.weight"] == P("model", None)
    assert specs["blocks.0.attn.Wv.bias"] == P("model")
    assert specs["blocks.0.attn.Wo.weight"] == P(None, "model")
    assert specs["blocks.0.attn.Wo.bias"] == P()
    assert specs["blocks.0.ff.outer.weight"] == P(None, "model")
    assert param_specs("tp", model, MESH)["blocks.0.attn.Wq.weight"] == P(None, None)
