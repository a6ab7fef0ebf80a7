"""Which FactorRule an op of a captured program gets, and the errors propagation raises.

``apply_rule`` looks the op up in the rule registry and turns every way that can fail (no rule,
a rule that raises on these arguments) into a typed error naming the op, the node and the
user's source line, or, under ``replicate_unsupported=True``, into the replicate rule.
``compiler_error`` wraps an unexpected exception of propagation or partitioning on one node.

This module does not propagate anything (``partita.propagate`` does).
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from partita.errors import (
    CompilerError,
    PartitaError,
    ReplicatedOpWarning,
    RuleError,
    UnsupportedOpError,
    warn,
)
from partita.ir import node_meta
from partita.rules import FactorRule, OpInfo, get_rule
from partita.rules.opinfo import is_tensor, replicate_rule, source_of
from partita.rules.registry import facts_of

__all__ = ["apply_rule", "compiler_error"]


def compiler_error(node: fx.Node, stage: str, e: BaseException) -> CompilerError:
    """The CompilerError for an unexpected exception ``e`` while ``stage`` handled ``node``:
    what failed (op, node, source line), the operand shapes, and what to do."""
    shapes = [
        f"{a.name}: {tuple(a.meta['val'].shape)} {a.meta['val'].dtype}"
        for a in node.all_input_nodes
        if is_tensor(a.meta.get("val"))
    ]
    first = (str(e).strip().splitlines() or [""])[0]
    return CompilerError(
        f"{stage} failed on {node.target} at node {node.name} "
        f"({source_of(node) or 'source line unknown'}), operands [{', '.join(shapes)}]: "
        f"{type(e).__name__}: {first}. This is a bug in partita, not in your program; "
        f"{CompilerError.WORKAROUND}"
    )


def _draws_from_a_generator(node: fx.Node) -> bool:
    """Whether ``node`` passes a ``torch.Generator`` to its op (``torch.rand(generator=g)``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for i, arg in enumerate(schema.arguments):
        if "Generator" in str(arg.type):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value is not None
    return False


def _generator_message(node: fx.Node, where: str) -> str:
    """Why an op given its own generator cannot be sharded, and the ways around it."""
    return (
        f"{node.target} at {where} draws from an explicit torch.Generator "
        f"(generator=...). partita's random ops draw from the default generator, so "
        f"that each device draws its own part of one global tensor and the result "
        f"equals the unsharded program's for the same seed; a generator object inside "
        f"the program has no sharding rule. Seed with torch.manual_seed(...) before "
        f"the call and drop generator=, or draw the tensor outside and pass it in as "
        f"an input."
    )


def apply_rule(node: fx.Node, info: OpInfo, *, replicate_unsupported: bool) -> FactorRule:
    """The FactorRule of ``node`` (whose arguments ``info`` describes) from the registry.

    Every failure is a partita error: an op without a rule, or a rule that raises on these
    arguments (whatever it raises), is an :class:`UnsupportedOpError` that names the op, the
    node and the source line; under ``replicate_unsupported=True`` both get the replicate rule
    instead (a rule that raised also warns with :class:`ReplicatedOpWarning`), and
    ``node_meta.replicated_reason(node)`` says why, for the Plan.
    """
    fn = get_rule(node.target)
    where = f"node {node.name} ({source_of(node) or 'source line unknown'})"
    # A rule (randn.generator's) covers generator=None only; replicating cannot help either.
    if _draws_from_a_generator(node):
        raise UnsupportedOpError(_generator_message(node, where))
    if fn is None:
        if replicate_unsupported:
            # One warning per op and source line (repeated layers share theirs).
            warn(
                ReplicatedOpWarning(
                    f"{node.target} has no sharding rule: its call at "
                    f"{source_of(node) or 'an unknown source line'} runs on gathered "
                    f"(replicated) inputs, as replicate_unsupported=True asks; the Plan records "
                    f"the gathers. To keep it sharded, give the op a rule with "
                    f"@partita.register_rule (docs/models.md)."
                )
            )
            return _replicated(node, info, "it has no sharding rule")
        raise UnsupportedOpError(
            f"No sharding rule for {node.target} at {where}. partita does not know how "
            f"this op behaves when its inputs are split across devices. Three ways forward: "
            f"(1) give it a rule: @partita.register_rule({node.target}) on a function "
            f"returning partita.einsum_rule(...) (docs/models.md, 'A rule for your own op'); "
            f"(2) annotate around it — mark its inputs and output replicated with "
            f"partita.mark_sharding(t, mesh, P()) so the op runs on whole tensors; "
            f"(3) opt in to replicating every op without a rule with the option "
            f"replicate_unsupported=True (options={{'replicate_unsupported': True}} or "
            f"PARTITA_REPLICATE_UNSUPPORTED=1; correct, but it gathers the inputs)."
        )
    try:
        return fn(info)
    except PartitaError as e:
        if not isinstance(e, (UnsupportedOpError, RuleError)):
            raise
        cause: Exception = e
    except Exception as e:  # a rule that cannot handle these arguments, whatever it raises
        cause = e
    why = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
    if replicate_unsupported:
        warn(
            ReplicatedOpWarning(
                f"{node.target} at {where} runs on gathered (replicated) inputs: its "
                f"sharding rule cannot handle this call ({why}). The Plan records the "
                f"gathers with this reason."
            )
        )
        return _replicated(node, info, f"its sharding rule raised {why}")
    raise UnsupportedOpError(
        f"The sharding rule of {node.target} cannot handle the call at {where} "
        f"(operands {[m.shape for m in info.operands]}): {why}. Two ways forward: annotate "
        f"around it (mark its inputs and output replicated with "
        f"partita.mark_sharding(t, mesh, P())), or set the option replicate_unsupported=True; "
        f"if the call is valid PyTorch, please report it."
    ) from cause


def _replicated(node: fx.Node, info: OpInfo, reason: str) -> FactorRule:
    """The replicate rule, with the reason the partitioner records for its gathers."""
    node_meta.set_replicated_reason(node, reason)
    return dataclasses.replace(replicate_rule(info), facts=facts_of(node.target))
