"""The guide of a recording: the step that last followed the same program (the fast path).

:class:`Guide` is data only; :class:`partita.virtual.recording.Recording` checks each op it
records against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from partita.virtual.sources import Source

__all__ = ["Guide"]


@dataclass
class Guide:
    """A finished recording, to check the next one against op by op (the cache-hit fast path).

    While a recording follows its guide (each op, its templates and its new inputs' metadata
    the same as at the same position of the guide), an op's results are made from the guide's
    description of them: no shape inference, no memo lookup. If the whole recording followed
    it, its structural key is the guide's, so :func:`partita.sync` takes the guide's program
    without hashing the key. The first difference drops the guide and recording goes on the
    ordinary way.

    Attributes:
        ops: the recorded entries, as in :attr:`Recording.ops`.
        results: per entry, how its results were made (see :func:`_describe_result`).
        inputs: per input, the metadata checked when the next recording takes its input there.
        described: the input part of the structural key (shapes, dtypes, shardings).
        out_slots: the slots of the values alive at the sync (the program's results).
        n_scalars: how many lifted floats.
        key, program: the structural key and the compiled program of that step.
        sources: per entry, the user's source line (:mod:`partita.virtual.sources`).
    """

    ops: list[tuple[Any, Any, Any, tuple[int | None, ...]]]
    results: list[Any]
    inputs: list[Any]
    described: tuple[Any, ...]
    out_slots: tuple[int | None, ...]
    n_scalars: int
    key: Any
    program: Any
    sources: list[Source]
