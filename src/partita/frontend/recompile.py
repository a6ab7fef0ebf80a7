"""Why a jitted function keeps recompiling: the message of ``partita.jit``'s RecompileWarning.

``partita.jit`` keeps the cache keys of its last compilations; :func:`recompile_message` finds
which part of the signature changed among them (argument structure, a static value, a shape, a
dtype, a sharding, the options) and says how to keep it fixed. This module only writes the message.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECOMPILE_WARNING_AT", "recompile_message"]

#: The compilation count at which a jitted function (or the virtual device) warns that what
#: it compiles keeps changing.
RECOMPILE_WARNING_AT = 8


def recompile_message(name: str, recent: list[tuple[Any, list[str]]], limit: int) -> str:
    """Why ``name`` keeps recompiling: which part of its signature changed among ``recent``
    (``(cache key, leaf names)`` of the last compilations) and how to keep it fixed."""
    changes: list[str] = []
    fixes: list[str] = []
    if len({key[0] for key, _ in recent}) > 1:
        changes.append("the structure of the arguments (containers, keyword names)")
        fixes.append("call it with the same containers and keywords every time")
    else:
        names = recent[-1][1]
        for j, leaf_name in enumerate(names):
            seen = list(dict.fromkeys(key[j + 1] for key, _ in recent))
            if len(seen) < 2:
                continue
            if seen[0][0] == "static":
                shown = ", ".join(repr(v[1]) for v in seen[:4])
                changes.append(f"the value of {leaf_name} (a static argument: {shown}, ...)")
                fixes.append("pass a changing number as a tensor, not a Python value")
                continue
            for part, label, fix in (
                (0, "shape", "pad inputs to a few fixed shapes (bucket the lengths)"),
                (1, "dtype", "cast to one dtype before the call"),
                (2, "sharding", "reshard the argument to one spec before the call"),
            ):
                values = list(dict.fromkeys(v[part] for v in seen))
                if len(values) > 1:
                    shown = ", ".join(str(v) for v in values[:4])
                    changes.append(f"the {label} of {leaf_name} ({shown}, ...)")
                    fixes.append(fix)
    options = {next((p[1] for p in key if _is_options(p)), None) for key, _ in recent}
    if len(options) > 1:
        changes.append("the options (a partita.options.using block or PARTITA_* variables)")
        fixes.append("set the options once, around the whole loop")
    return (
        f"partita.jit({name}) compiled {len(recent)} distinct input signatures; what keeps "
        f"changing: {'; '.join(changes) or 'nothing visible in the last calls'}. Each new "
        f"signature traces, propagates and partitions the program again (the cache keeps the "
        f"last {limit}, jit(cache_limit=...)). To compile once: "
        f"{'; '.join(dict.fromkeys(fixes)) or 'keep the arguments the same'}."
    )


def _is_options(part: Any) -> bool:
    return isinstance(part, tuple) and len(part) == 2 and part[0] == "options"
