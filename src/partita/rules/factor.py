"""The FactorRule: an op's sharding behaviour as data, einsum-style.

A rule names a *factor* for every dim of every tensor operand and result. ``mm`` is
``"m k, k n -> m n"``: ``m`` and ``n`` pass through, ``k`` is summed away. A dim may carry
several factors, major first — a *compound* dim, written in parentheses: the reshape
``[12, 5] -> [3, 4, 5]`` is ``"(i j) k -> i j k"``. A dim that no factor can shard (a size-1
broadcast dim, say) is written ``1``.

Factor kinds (``FactorKind``):

* pass-through — free to shard; every tensor that has the factor gets the same mesh axes;
* reduction — in operands, not in results; sharding it makes the results *partial* over its
  mesh axes (``reduce_op`` says sum, max or min);
* need-replication — cannot be split (the dim of a sort or a cumsum): operands are gathered;
* windowed — a conv or pooling spatial dim: sharded with a halo exchange by the partitioner.

A factor that appears in operands but not in results must be declared reduction or
need-replication: a rule never guesses. Factors of size 1 are never sharded.

This module defines the data type, its parser and :class:`OpInfo` (what a rule function is
given). It holds no per-op knowledge (that is in the family modules) and no propagation logic.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from partita.errors import CompilerError, RuleError, UnsupportedOpError
from partita.rules.facts import NO_FACTS, OpFacts
from partita.rules.handler_names import check_handler_name

__all__ = ["FactorKind", "FactorRule", "OpInfo", "TensorMeta", "einsum_rule", "parse_einsum"]

DimFactors = tuple[str, ...]  # the factors of one dim, major first; () = not shardable
TensorFactors = tuple[DimFactors, ...]
Factors = Sequence[TensorFactors | None]  # each tensor's factors (None: a whole tensor)


class FactorKind(enum.Enum):
    PASS_THROUGH = "pass-through"
    REDUCTION = "reduction"
    NEED_REPLICATION = "need-replication"
    WINDOWED = "windowed"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of a tensor argument, as a rule function sees it."""

    shape: tuple[int, ...]
    dtype: Any = None

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What a rule function receives for one op call.

    Attributes:
        target: the aten (or partita) op overload.
        args, kwargs: the call's arguments with every tensor replaced by its :class:`TensorMeta`.
        operands: the tensor operands in pytree-flattened order of ``(args, kwargs)`` — the
            order of ``FactorRule.operands``.
        results: the op's outputs in flattened order; ``None`` where an output is not a tensor.
    """

    target: Any
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    operands: tuple[TensorMeta, ...]
    results: tuple[TensorMeta | None, ...]

    def arg(self, name: str, default: Any = None) -> Any:
        """The call's argument ``name`` (its name in the op's schema), passed positionally or
        by keyword, else ``default``: the one way a rule reads an argument. A name the schema
        lacks raises :class:`~partita.errors.CompilerError` (it would read as ``default``);
        :meth:`has_arg` asks first when one rule serves overloads with different arguments.

        Example:
            >>> x = TensorMeta((4, 8))
            >>> info = OpInfo(torch.ops.aten.sum.dim_IntList, (x,), {"dim": [1]}, (x,), (x,))
            >>> info.arg("dim"), info.arg("keepdim", False)
            ([1], False)
        """
        index = self._position(name)
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[index] if index < len(self.args) else default

    def result(self, i: int = 0) -> TensorMeta:
        """Result ``i``, which the rule reads as a tensor (an unsupported op when it is not)."""
        if (found := self.results[i]) is None:
            raise UnsupportedOpError(f"{self.target}: result {i} is not a tensor ({self.results})")
        return found

    def positional(self, index: int) -> Any:
        """A higher-order op's argument ``index`` (control flow ops have no schema to name)."""
        return self.args[index]

    def has_arg(self, name: str) -> bool:
        """Whether the op's schema has an argument ``name`` (one rule, several overloads)."""
        return name in _schema_names(self.target)

    def _position(self, name: str) -> int:
        names = _schema_names(self.target)
        if name not in names:
            raise CompilerError(
                f"A sharding rule of {self.target} read its argument {name!r}, which the op's "
                f"schema does not have (its arguments: {', '.join(names) or 'none'}). A "
                f"misspelt name would read as the default and the rule would be silently "
                f"wrong, so this is refused. Fix the name in the rule (partita/rules/), or ask "
                f"OpInfo.has_arg first when the rule serves overloads with different "
                f"arguments; {CompilerError.WORKAROUND}"
            )
        return names.index(name)


#: The attribute an op overload keeps its argument names in (see :func:`_schema_names`).
_NAMES_ATTRIBUTE = "_partita_arg_names"


def _schema_names(target: Any) -> tuple[str, ...]:
    """The argument names of an op overload's schema, in order (none for a non-op target)."""
    names = getattr(target, _NAMES_ATTRIBUTE, None)
    if names is None:
        schema = getattr(target, "_schema", None)
        names = tuple(a.name for a in schema.arguments) if schema is not None else ()
        # kept on the op: reading the schema builds its Argument objects anew each time
        with contextlib.suppress(AttributeError, TypeError):  # an op that takes no attributes
            setattr(target, _NAMES_ATTRIBUTE, names)
    return names


@dataclass(frozen=True, slots=True, eq=False)
class FactorRule:
    """Factors per dim of each operand and result, with sizes and kinds.

    ``operands[i]`` is ``None`` for an operand the rule cannot shard at all (it is gathered);
    ``results[j]`` is ``None`` for a non-tensor output. ``handler`` names a special lowering
    that the partitioner applies (halo exchange, masked embedding lookup, ...): a
    :class:`~partita.rules.handler_names.HandlerName` or its string value, stored as the string
    (an unknown name raises :class:`~partita.errors.CompilerError` here); propagation ignores
    it. ``result_reductions`` maps a result index to the pass-through factors that
    result lacks but sums over (a backward op's weight gradient sums over the batch factor that
    its input gradient keeps): when such a factor is sharded, that result alone is partial over
    its mesh axes (``reduce_op`` applies). ``facts``: what the stages know of the op's local
    call (:class:`~partita.rules.facts.OpFacts`, declared next to the rule).
    """

    operands: tuple[TensorFactors | None, ...]
    results: tuple[TensorFactors | None, ...]
    sizes: Mapping[str, int]
    kinds: Mapping[str, FactorKind] = field(default_factory=dict)
    reduce_op: str = "sum"
    handler: str | None = None
    result_reductions: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    facts: OpFacts = NO_FACTS
    _factors: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _reductions: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A misspelt handler would otherwise lose the op's sharded factors without a word.
        where = f"The factor rule {_einsum_text(self.operands, self.results)!r}"
        object.__setattr__(self, "handler", check_handler_name(self.handler, where))
        # Derived once: propagation asks for these for every op visit.
        seen: dict[str, None] = {}
        for t in (*self.operands, *self.results):
            for dim in t or ():
                for f in dim:
                    seen.setdefault(f, None)
        object.__setattr__(self, "_factors", tuple(seen))
        reductions = tuple(f for f in seen if self.kind(f) is FactorKind.REDUCTION)
        object.__setattr__(self, "_reductions", reductions)

    def kind(self, factor: str) -> FactorKind:
        return self.kinds.get(factor, FactorKind.PASS_THROUGH)

    @property
    def factors(self) -> tuple[str, ...]:
        """Every factor in first-appearance order (operands, then results)."""
        return self._factors

    @property
    def reduction_factors(self) -> tuple[str, ...]:
        return self._reductions

    def partial_factors(self, result: int) -> tuple[str, ...]:
        """The factors whose mesh axes make result ``result`` partial: the reduction factors
        and the result's own ``result_reductions``."""
        return self.reduction_factors + tuple(self.result_reductions.get(result, ()))

    @property
    def summed_factors(self) -> tuple[str, ...]:
        """Every factor some result sums over (their padding must be masked when sharded)."""
        extra = [f for fs in self.result_reductions.values() for f in fs]
        return tuple(dict.fromkeys((*self.reduction_factors, *extra)))

    @property
    def is_pass_through(self) -> bool:
        """Every tensor carries every factor on its own dim, all pass-through (elementwise on
        equal shapes, transpose, annotations): such ops propagate first."""
        every = set(self.factors)
        for t in (*self.operands, *self.results):
            if t is None:
                return False
            if not t:  # a 0-d tensor (a scalar step size, say) has no dims to pass through
                continue
            if any(len(dim) > 1 for dim in t) or {f for dim in t for f in dim} != every:
                return False
        return all(self.kind(f) is FactorKind.PASS_THROUGH for f in every)

    def __repr__(self) -> str:
        text = _einsum_text(self.operands, self.results)
        extra = [
            f"{kind.value}={','.join(f for f in self.factors if self.kind(f) is kind)}"
            for kind in FactorKind
            if kind is not FactorKind.PASS_THROUGH
            and any(self.kind(f) is kind for f in self.factors)
        ]
        if self.reduction_factors and self.reduce_op != "sum":
            extra.append(f"reduce_op={self.reduce_op}")
        for j, fs in sorted(self.result_reductions.items()):
            extra.append(f"result{j}-reduction={','.join(fs)}")
        if self.handler:
            extra.append(f"handler={self.handler}")
        return f"FactorRule({text}{'; ' + '; '.join(extra) if extra else ''})"


def _einsum_text(operands: Factors, results: Factors) -> str:
    """``"m k, k n -> m n"``: the einsum text of factor tuples (``*`` for a whole tensor)."""

    def fmt(t: TensorFactors | None) -> str:
        if t is None:
            return "*"
        return " ".join(
            ("1" if not d else d[0] if len(d) == 1 else "(" + " ".join(d) + ")") for d in t
        )

    return ", ".join(fmt(t) for t in operands) + " -> " + ", ".join(fmt(t) for t in results)


_TOKEN = re.compile(r"\(([^()]*)\)|([A-Za-z_][A-Za-z0-9_]*)|(1)|(\*)")


def _parse_tensor(text: str) -> TensorFactors | None:
    text = text.strip()
    if text == "*":
        return None
    dims: list[DimFactors] = []
    pos = 0
    for m in _TOKEN.finditer(text):
        if text[pos : m.start()].strip():
            raise RuleError(f"cannot parse {text[pos : m.start()]!r} in factor rule {text!r}")
        pos = m.end()
        if m.group(1) is not None:
            dims.append(tuple(m.group(1).split()))
        elif m.group(2) is not None:
            dims.append((m.group(2),))
        elif m.group(3) is not None:
            dims.append(())
        else:
            raise RuleError(f"'*' must stand alone for a whole tensor in {text!r}")
    if text[pos:].strip():
        raise RuleError(f"cannot parse {text[pos:]!r} in factor rule {text!r}")
    return tuple(dims)


@functools.lru_cache(maxsize=4096)
def parse_einsum(
    spec: str,
) -> tuple[tuple[TensorFactors | None, ...], tuple[TensorFactors | None, ...]]:
    """Parse ``"m k, k n -> m n"`` into per-tensor factor tuples.

    ``1`` is a dim with no factor; ``(i j)`` a compound dim; ``*`` a whole tensor that cannot
    be sharded (operand) or is not a tensor (result); an empty side is allowed (``"-> i j"``).

    Example:
        >>> parse_einsum("(i j) k -> i j k")
        (((('i', 'j'), ('k',)),), ((('i',), ('j',), ('k',)),))
    """
    if "->" not in spec:
        raise RuleError(f"factor rule {spec!r} has no '->'")
    lhs, rhs = spec.split("->")

    def side(s: str) -> tuple[TensorFactors | None, ...]:  # each tensor's text is stripped
        return tuple(_parse_tensor(t) for t in s.split(",")) if s.strip() else ()

    return side(lhs), side(rhs)


def einsum_rule(
    spec: str | tuple[Sequence[TensorFactors | None], Sequence[TensorFactors | None]],
    operands: Sequence[Any],
    results: Sequence[Any],
    *,
    reduction: str | Iterable[str] = (),
    need_replication: str | Iterable[str] = (),
    windowed: str | Iterable[str] = (),
    reduce_op: str = "sum",
    sizes: Mapping[str, int] | None = None,
    handler: str | None = None,
    result_reductions: Mapping[int, Iterable[str]] | None = None,
) -> FactorRule:
    """Build a FactorRule from einsum text and the shapes of the tensors it describes.

    ``operands`` and ``results`` are TensorMetas (or anything with ``.shape``; ``None`` for a
    non-tensor result). Factor sizes are read from single-factor dims; a factor that only
    appears inside compound dims needs ``sizes``. Factor names in ``reduction`` etc. are a
    space-separated string or an iterable. ``spec`` may also be the already parsed
    ``(operand_factors, result_factors)`` (rule code that builds factors programmatically; text
    cannot tell one 0-d tensor from none). A windowed factor may have a different size on each
    tensor (a strided conv or a pool shrinks it): ``sizes`` keeps its first (operand) size and
    the partitioner reads the others from the shapes.

    Example:
        >>> a, b, c = TensorMeta((16, 32)), TensorMeta((32, 24)), TensorMeta((16, 24))
        >>> einsum_rule("m k, k n -> m n", [a, b], [c], reduction="k")
        FactorRule(m k, k n -> m n; reduction=k)
    """
    op_factors, res_factors = (
        parse_einsum(spec) if isinstance(spec, str) else (tuple(spec[0]), tuple(spec[1]))
    )
    if len(op_factors) != len(operands) or len(res_factors) != len(results):
        raise RuleError(
            f"factor rule {spec!r} describes {len(op_factors)} operands and {len(res_factors)} "
            f"results, but the op has {len(operands)} and {len(results)}"
        )

    def names(x: str | Iterable[str]) -> tuple[str, ...]:
        return tuple(x.split()) if isinstance(x, str) else tuple(x)

    known: dict[str, int] = dict(sizes or {})
    windowed_names = set(names(windowed))
    compound: list[tuple[DimFactors, int]] = []
    for factors, metas in ((op_factors, operands), (res_factors, results)):
        for t, meta in zip(factors, metas, strict=True):
            if t is None or meta is None:
                continue
            shape = tuple(meta.shape)
            if len(t) != len(shape):
                raise RuleError(
                    f"factor rule {spec!r}: {len(t)} dims for a tensor of shape {shape}"
                )
            for dim, n in zip(t, shape, strict=True):
                if len(dim) == 1:
                    if known.setdefault(dim[0], n) != n and dim[0] not in windowed_names:
                        raise RuleError(
                            f"factor rule {spec!r}: factor {dim[0]!r} has sizes "
                            f"{known[dim[0]]} and {n}"
                        )
                elif len(dim) > 1:
                    compound.append((dim, n))
    for dim, n in compound:
        missing = [f for f in dim if f not in known]
        if len(missing) == 1:
            rest = math.prod(known[f] for f in dim if f in known)
            known[missing[0]] = n // rest if rest else 0
        elif missing:
            raise RuleError(f"factor rule {spec!r}: sizes of {missing} are unknown; pass sizes=")
        if math.prod(known[f] for f in dim) != n:
            raise RuleError(f"factor rule {spec!r}: compound dim {dim} does not multiply to {n}")

    kinds: dict[str, FactorKind] = {}
    for kind, fs in (
        (FactorKind.REDUCTION, reduction),
        (FactorKind.NEED_REPLICATION, need_replication),
        (FactorKind.WINDOWED, windowed),
    ):
        for f in names(fs):
            if f not in known:
                raise RuleError(f"factor rule {spec!r}: {kind.value} factor {f!r} is not used")
            kinds[f] = kind
    in_results = {f for t in res_factors for d in t or () for f in d}
    for f in known:
        if f not in in_results and f not in kinds and f not in (sizes or {}):
            raise RuleError(
                f"factor rule {spec!r}: factor {f!r} is in operands only; declare it reduction "
                f"or need_replication"
            )
    partial_of = {j: names(fs) for j, fs in (result_reductions or {}).items()}
    for j, fs in partial_of.items():
        for f in fs:
            if f not in known or any(f in d for d in res_factors[j] or ()):
                raise RuleError(
                    f"factor rule {spec!r}: result {j} cannot reduce over {f!r} (unknown, or "
                    f"the result has it)"
                )
    return FactorRule(op_factors, res_factors, known, kinds, reduce_op, handler, partial_of)
