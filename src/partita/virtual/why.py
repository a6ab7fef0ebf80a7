"""Why a step recompiled: the difference between a new recording's key and the cached ones.

:func:`recompile_reason` compares the structural key of a recording that missed the cache with
the closest cached key and says, in one line, what changed and where: the first op that
differs (by index and name), or the input whose shape, dtype or sharding changed. This module
only reads keys; it does not compile.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

__all__ = ["recompile_reason"]


def _describe_input(desc: tuple[Any, ...]) -> str:
    if desc[0] == "cpu":
        return f"CPU tensor {list(desc[1])} {desc[2]}"
    sharding = getattr(desc[2], "spec", desc[2])
    return f"{list(desc[0])} {desc[1]} {sharding}"


def _distance(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[int, int]:
    """How far apart two keys are: first by the sequence of op names (the same program with
    other shapes is closer than another program), then by whole entries and inputs."""
    (ops_a, in_a), (ops_b, in_b) = a[0], b[0]
    length = abs(len(ops_a) - len(ops_b))
    names = sum(x[0] != y[0] for x, y in zip(ops_a, ops_b, strict=False)) + length
    entries = (
        sum(x != y for x, y in zip(ops_a, ops_b, strict=False))
        + length
        + sum(x != y for x, y in zip(in_a, in_b, strict=False))
    )
    return names, entries


def recompile_reason(key: Hashable, cached: list[Hashable], rec: Any) -> str:
    """One line: what differs between ``key`` and the closest of ``cached``."""
    closest = min(cached, key=lambda k: _distance(key, k))  # type: ignore[arg-type]
    (ops_new, in_new), (ops_old, in_old) = key[0], closest[0]  # type: ignore[index]
    for i, (new, old) in enumerate(zip(in_new, in_old, strict=False)):
        if new != old:
            return (
                f"input {i} of the step changed from {_describe_input(old)} to "
                f"{_describe_input(new)} (first used by op {_first_use(rec, i)})"
            )
    for i, (new, old) in enumerate(zip(ops_new, ops_old, strict=False)):
        if new != old:
            return f"op {i} changed: {_op(old)} became {_op(new)}"
    if len(ops_new) != len(ops_old) or len(in_new) != len(in_old):
        return (
            f"the step records {len(ops_new)} ops on {len(in_new)} inputs, the closest "
            f"cached program {len(ops_old)} ops on {len(in_old)} inputs"
        )
    return "the set of tensors alive at the sync changed (different outputs)"


def _op(entry: tuple[Any, ...]) -> str:
    func, targs, _, _ = entry
    consts = [repr(v) for kind, v in targs if kind == "c"]
    return f"{func}({', '.join(consts)})" if consts else str(func)


def _first_use(rec: Any, i: int) -> str:
    slot = rec.inputs[i][0]
    for n, (func, targs, _kwargs, _) in enumerate(rec.ops):
        if any(t == ("t", slot) for t in targs):
            return f"{n} ({func})"
    return "none"
