"""Why a step recompiled: the difference between a new recording's key and the cached ones.

:func:`recompile_reason` compares the structural key of a recording that missed the cache with
the closest cached key and says, in one line, what changed and where: the first op that
differs (by index and name), or the input whose shape, dtype or sharding changed. This module
only reads keys; it does not compile.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

__all__ = ["end_miss", "input_miss", "op_miss", "recompile_reason", "recompile_warning"]


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
    if key[3:] != closest[3:]:  # type: ignore[index]
        return "the options changed (partita.options: a using() block, PARTITA_* variables)"
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


def _template(t: Any) -> str:
    kind, value = t
    if kind == "t":
        return f"tensor value #{value}"
    if kind == "s":
        return f"lifted float #{value}"
    if kind == "l":
        return "[" + ", ".join(_template(v) for v in value) + "]"
    return repr(value)


def op_miss(n: int, expected: tuple[Any, ...] | None, func: Any, targs: tuple[Any, ...]) -> str:
    """Why op ``n`` left the fast path: it is not the op the guide has there.

    Example:
        >>> before = ("aten.add", (("t", 0), ("c", 2)), (), (1,))
        >>> op_miss(3, before, "aten.add", (("t", 0), ("c", 3)))
        'op 3 (aten.add): argument 1 is 3, the previous step had 2'
    """
    if expected is None:
        return f"op {n} ({func}): the previous step had only {n} ops"
    if expected[0] != func:
        return f"op {n} is {func}, the previous step had {expected[0]}"
    for i, (new, old) in enumerate(zip(targs, expected[1], strict=False)):
        if new != old:
            return (
                f"op {n} ({func}): argument {i} is {_template(new)}, the previous step had "
                f"{_template(old)}"
            )
    if len(targs) != len(expected[1]):
        return f"op {n} ({func}): {len(targs)} arguments, the previous step had {len(expected[1])}"
    return f"op {n} ({func}): its keyword arguments changed"


def input_miss(n: int, expected: Any, got: Any) -> str:
    """Why taking input ``n`` left the fast path: its metadata is not the guide's."""
    if expected is None:
        return f"the step took more inputs than the previous one (input {n}: {_meta(got)})"
    return f"input {n} of the step is {_meta(got)}, the previous step had {_meta(expected)}"


def _meta(desc: Any) -> str:
    if desc[0] == "cpu":
        return f"a CPU tensor {list(desc[1])} {desc[3]} (strides {desc[2]})"
    return f"{list(desc[0])} {desc[3]} (strides {desc[1]}, offset {desc[2]})"


def end_miss(got: tuple[Any, ...], expected: tuple[Any, ...]) -> str | None:
    """Why a step that followed its guide op by op still has another key at the sync (None
    when it has the guide's): ``(ops, inputs, scalars, output slots, described inputs)``."""
    ops, inputs, scalars, out_slots, described = got
    if ops != expected[0]:
        return f"the step ended after {ops} ops, the previous one after {expected[0]}"
    if inputs != expected[1] or scalars != expected[2]:
        return (
            f"the step used {inputs} inputs and {scalars} lifted floats, the previous one "
            f"{expected[1]} and {expected[2]}"
        )
    if out_slots != expected[3]:
        return "the set of tensors alive at the sync changed (different results)"
    for i, (new, old) in enumerate(zip(described, expected[4], strict=True)):
        if new != old:
            return f"input {i} of the step is {_describe_input(new)}, before {_describe_input(old)}"
    return None


def recompile_warning(compiles: int, reasons: list[str], compile_s: float, run_s: float) -> str:
    """The RecompileWarning of a loop whose steps keep compiling: the last reasons and the fix.

    Example:
        >>> print(recompile_warning(8, ["input 1 of the step changed from [8, 7] torch.int64 "
        ...       "P('data', None) to [8, 8] torch.int64 P('data', None) (first used by op 0 "
        ...       "(aten.embedding))"], 6.0, 1.5)[:71])
        the virtual device compiled 8 distinct step programs since metrics were
    """
    last = "; ".join(reasons[-3:]) or "(no reason recorded)"
    return (
        f"the virtual device compiled {compiles} distinct step programs since metrics were "
        f"reset ({compile_s:.1f} s compiling, {run_s:.1f} s running); the latest changes: "
        f"{last}. Every new program traces, propagates and partitions the step again, so a "
        f"loop whose steps differ compiles at every step. To compile once: pad inputs to a few "
        f"fixed shapes (bucket the sequence lengths), keep the same ops every step (no Python "
        f"branch on a changing value), and mark the same shardings. partita.metrics() lists "
        f"every reason."
    )
