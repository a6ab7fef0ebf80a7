"""Which parameter a tensor-parallel preset splits, and along which dim: roles by module name.

The ``tp`` and ``fsdp+tp`` presets of :mod:`partita.presets` ask one question of a model: for
each parameter, which dim goes over the model mesh axis, and why? This module answers it from
module types (``nn.Linear``, GPT-2's ``Conv1D``) and names: the last part of a module's path
(:data:`COLUMN_NAMES`, :data:`ROW_NAMES`, :data:`FUSED_NAMES`), whole paths for layers a leaf
name cannot classify (:data:`PATH_ROLES`: BERT's three ``dense``), 3-D weights of an
``experts`` module (:data:`EXPERT_NAMES`), and, with ``vocab_parallel``, the token embedding
and the output head (:data:`HEAD_NAMES`). It reads ``model.config`` for the key/value head
count of grouped-query models so that their heads stay whole.

It does not decide whether a mesh axis divides a dim, nor anything about ``data``: the preset
does (:meth:`partita.presets.StandardPreset.explain`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

__all__ = [
    "COLUMN_NAMES",
    "EXPERT_NAMES",
    "FUSED_NAMES",
    "HEAD_NAMES",
    "KV_NAMES",
    "PATH_ROLES",
    "ROW_NAMES",
    "TPRole",
    "expert_roles",
    "tp_roles",
    "vocab_roles",
]

COLUMN_NAMES = frozenset(
    {
        "qkv", "c_attn", "q_proj", "k_proj", "v_proj", "query", "key", "value", "in_proj",
        "query_key_value", "Wqkv", "qkv_proj", "fc", "fc1", "c_fc", "fc_in", "up_proj",
        "gate_proj", "gate_up_proj", "w1", "w3", "wi", "wi_0", "wi_1", "q", "k", "v",
        "dense_h_to_4h", "q_lin", "k_lin", "v_lin", "lin1", "query_proj", "key_proj",
        "value_proj", "ffn", "pwconv1", "intermediate_dense", "Wi", "q_head", "k_head",
        "v_head",
    }
)  # fmt: skip
ROW_NAMES = frozenset(
    {
        "proj", "out_proj", "o_proj", "c_proj", "down_proj", "fc2", "fc_out", "w2", "wo", "o",
        "dense_4h_to_h", "out_lin", "lin2", "ffn_output", "pwconv2", "output_dense", "Wo",
        "post_proj",
    }
)  # fmt: skip
# Column linears whose output features are several tensors side by side (q|k|v, gate|up).
FUSED_NAMES = frozenset(
    {"qkv", "c_attn", "qkv_proj", "query_key_value", "Wqkv", "in_proj", "gate_up_proj", "Wi"}
)
# Linears a leaf name cannot classify (BERT's and Phi's "dense"): fnmatch patterns on the whole
# module path, first match wins. BERT: attention.output.dense (row), intermediate.dense
# (column), output.dense (row); Phi-1/2 and GPT-NeoX: the attention's dense (row); Funnel's
# position-wise feed-forward (linear_1, linear_2: names too common to match alone).
PATH_ROLES: tuple[tuple[str, str], ...] = (
    ("*attention.output.dense", "row"),
    ("*intermediate.dense", "column"),
    ("*output.dense", "row"),
    ("*self_attn.dense", "row"),
    ("*attention.dense", "row"),
    ("*ffn.linear_1", "column"),  # Funnel
    ("*ffn.linear_2", "row"),
)
# 3-D expert weights [experts, ., .] of a module named "experts" (Mixtral, Qwen-MoE): dim 0.
EXPERT_NAMES = frozenset({"gate_up_proj", "up_proj", "gate_proj", "down_proj", "w1", "w2", "w3"})
KV_NAMES = frozenset({"k_proj", "v_proj", "key", "value", "k", "v"})


HEAD_NAMES = frozenset({"head", "lm_head", "output", "embed_out"})


@dataclass(frozen=True)
class TPRole:
    """A parameter's tensor-parallel role: the dim to split and the reason, for the report."""

    dim: int | None  # the dim split over the model mesh axis; None: replicated on purpose
    reason: str
    heads: int | None = None  # attention heads in the split dim (keep them whole)


def _linear_role(module_name: str) -> str | None:
    """``"column"``, ``"row"`` or None, from the module's path (patterns) or leaf name."""
    for pattern, role in PATH_ROLES:
        if fnmatch.fnmatchcase(module_name, pattern):
            return role
    leaf = module_name.rsplit(".", 1)[-1]
    if leaf in COLUMN_NAMES:
        return "column"
    if leaf in ROW_NAMES:
        return "row"
    return None


def _kv_heads(model: nn.Module) -> int | None:
    """Key/value heads of a grouped-query model (``config.num_key_value_heads``), if fewer
    than the query heads; None otherwise."""
    config = getattr(model, "config", None)
    kv = getattr(config, "num_key_value_heads", None)
    heads = getattr(config, "num_attention_heads", None)
    return kv if isinstance(kv, int) and isinstance(heads, int) and kv < heads else None


def tp_roles(model: nn.Module) -> dict[str, TPRole]:
    """``{parameter name: role}`` for column / row linears and 3-D expert weights."""
    roles: dict[str, TPRole] = {}
    kv_heads = _kv_heads(model)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        leaf = module_name.rsplit(".", 1)[-1]
        if leaf == "experts":
            roles.update(_expert_roles(prefix, module))
            continue
        role = _linear_role(module_name)
        if role is None:
            continue
        if isinstance(module, nn.Linear):
            out_dim, in_dim = 0, 1  # weight [out, in]
        elif type(module).__name__ == "Conv1D":  # GPT-2 style: weight [in, out]
            out_dim, in_dim = 1, 0
        else:
            continue
        if role == "row":
            why = f"row-parallel linear ({leaf}): input features over model"
            roles[prefix + "weight"] = TPRole(in_dim, why)
            # added after the all-reduce: replicated
            roles[prefix + "bias"] = TPRole(None, "row-parallel bias: added once, replicated")
            continue
        if leaf in FUSED_NAMES:
            why = f"fused column-parallel linear ({leaf}): output features over model, contiguous blocks (docs/models.md)"  # noqa: E501
        else:
            why = f"column-parallel linear ({leaf}): output features over model"
        heads = kv_heads if leaf in KV_NAMES else None
        roles[prefix + "weight"] = TPRole(out_dim, why, heads)
        roles[prefix + "bias"] = TPRole(0, why, heads)  # split like the output features
    return roles


def _expert_roles(prefix: str, experts: nn.Module) -> dict[str, TPRole]:
    """3-D expert weights ``[experts, ., .]``: the experts dim over model (expert parallel)."""
    return {
        prefix + name: TPRole(0, f"expert weights ({name}): experts dim over model")
        for name, p in experts.named_parameters(recurse=False)
        if p.ndim == 3 and name in EXPERT_NAMES
    }


def expert_roles(model: nn.Module, axis: str = "model") -> dict[str, TPRole]:
    """``{parameter name: role}`` of the 3-D expert weights only (the ``ep`` presets): the
    experts dim over ``axis``, each expert's matrices whole."""
    roles: dict[str, TPRole] = {}
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1] == "experts":
            prefix = f"{module_name}." if module_name else ""
            for name, p in module.named_parameters(recurse=False):
                if p.ndim == 3 and name in EXPERT_NAMES:
                    why = f"ep: expert weights ({name}), whole experts over {axis!r}"
                    roles[prefix + name] = TPRole(0, why)
    return roles


def vocab_roles(model: nn.Module) -> dict[str, TPRole]:
    """The token embedding (the largest ``nn.Embedding``) and the output head: vocab dim 0."""
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    roles: dict[str, TPRole] = {}
    if embeddings:
        name, _ = max(embeddings, key=lambda nm: nm[1].num_embeddings)
        why = "vocab parallel: token embedding rows over model"
        roles[f"{name}.weight" if name else "weight"] = TPRole(0, why)
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1] in HEAD_NAMES and isinstance(module, nn.Linear):
            why = "vocab parallel: output head, logits split by vocabulary"  # column parallel
            roles[f"{module_name}.weight"] = TPRole(0, why)
            roles[f"{module_name}.bias"] = TPRole(0, why)
    return roles
