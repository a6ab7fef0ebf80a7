"""The static timetable of a vectorized pipeline: who works on what at every iteration.

A pipeline of ``S`` stages runs ``M`` micro-batches through ``V`` rounds (``V = 1``: GPipe; ``V >
1``: the circular schedule, each stage holding ``V`` chunks of ``k`` layers, a micro-batch going
round the ring of stages ``V`` times). Every iteration, every stage runs one chunk on the slot it
holds, then the slots shift one stage on (a collective-permute). Micro-batch ``m`` in round
``v`` is on stage ``s`` at iteration ``v * M + m + s``, so there are ``V * M + S - 1``
iterations, of which stage ``s`` works on a real micro-batch in ``V * M``: the rest, ``S - 1``
iterations per stage, is the *bubble*, a fraction ``(S - 1) / (V * M + S - 1)`` of the time.

In the circular schedule a micro-batch leaving the last stage after round ``v`` re-enters stage
0 at iteration ``(v + 1) * M + m``; it left at ``v * M + m + S - 1``, so ``M >= S`` is needed
(it waits ``M - S`` iterations on stage 0, the circular buffer of MaxText's pipeline).

Layers are numbered as the user gave them. Stage ``s`` holds chunk ``v`` = layers ``(v * S + s)
* k ... + k - 1``: in the stacked parameters (``storage_order``) stage ``s``'s ``V * k`` layers
are contiguous, so splitting the stack's dim 0 over the stage axis gives each stage its own.

This module is plain Python: it knows nothing of tensors or meshes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from partita.errors import PipelineError

__all__ = ["SCHEDULES", "Schedule", "Source"]

#: The schedules ``partita.pipeline`` runs.
SCHEDULES = ("gpipe", "circular")

#: Where stage 0 takes its input at an iteration: ``("input", m)`` micro-batch ``m`` of the
#: pipeline's input, ``("wrap", t)`` what the last stage sent it after iteration ``t`` (the next
#: round of a circular schedule), or ``("none", -1)``: nothing (the bubble).
Source = tuple[Literal["input", "wrap", "none"], int]


@dataclass(frozen=True)
class Schedule:
    """The timetable of ``stages`` stages, ``microbatches`` micro-batches and ``rounds`` rounds
    of ``layers_per_chunk`` layers per stage and round.

    Example:
        >>> s = Schedule("gpipe", stages=4, microbatches=8, rounds=1, layers_per_chunk=2)
        >>> s.iterations, round(s.bubble_fraction, 4)
        (11, 0.2727)
        >>> s.work(3, 2), s.work(1, 2)
        ((1, 0), None)
    """

    kind: str
    stages: int
    microbatches: int
    rounds: int
    layers_per_chunk: int

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise PipelineError(
                f"partita.pipeline: unknown schedule {self.kind!r}; the schedules are "
                f"{list(SCHEDULES)} ('gpipe': each stage holds its layers once; 'circular': "
                f"each holds rounds= chunks and micro-batches go round the stages)."
            )
        for name in ("stages", "microbatches", "rounds", "layers_per_chunk"):
            if getattr(self, name) < 1:
                raise PipelineError(
                    f"partita.pipeline: {name}={getattr(self, name)}; it must be at least 1."
                )
        if self.kind == "gpipe" and self.rounds != 1:
            raise PipelineError(
                f"partita.pipeline: schedule='gpipe' runs one round, got rounds={self.rounds}. "
                f"Use schedule='circular' for {self.rounds} rounds."
            )
        if self.rounds > 1 and self.microbatches < self.stages:
            raise PipelineError(
                f"partita.pipeline: the circular schedule needs at least as many micro-batches "
                f"as stages, got microbatches={self.microbatches} for {self.stages} stages: a "
                f"micro-batch leaving the last stage must find stage 0 done with the round's "
                f"other micro-batches. Use microbatches>={self.stages}, or schedule='gpipe'."
            )

    # --- sizes -------------------------------------------------------------------------------

    @property
    def layers(self) -> int:
        """Layers in the pipeline (``S * V * k``)."""
        return self.stages * self.rounds * self.layers_per_chunk

    @property
    def iterations(self) -> int:
        """Iterations of one forward pass: ``V * M + S - 1``."""
        return self.rounds * self.microbatches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """The fraction of iterations a stage spends outside real work: ``(S-1)/(V*M+S-1)``."""
        return (self.stages - 1) / self.iterations

    # --- the timetable -----------------------------------------------------------------------

    def work(self, t: int, stage: int) -> tuple[int, int] | None:
        """``(micro-batch, round)`` stage ``stage`` runs at iteration ``t``, None in the bubble."""
        i = t - stage
        if not 0 <= i < self.rounds * self.microbatches:
            return None
        return i % self.microbatches, i // self.microbatches

    def rounds_at(self, t: int) -> set[int]:
        """The rounds the stages that work at iteration ``t`` are in."""
        return {w[1] for s in range(self.stages) if (w := self.work(t, s)) is not None}

    def source(self, t: int) -> Source:
        """Where stage 0 takes its input at iteration ``t``."""
        if t < self.microbatches:
            return ("input", t)
        if t < self.rounds * self.microbatches:
            return ("wrap", t - self.microbatches + self.stages - 1)
        return ("none", -1)

    def pairs(self, t: int) -> list[tuple[int, int]]:
        """The ``(from, to)`` stages whose slot carries a real micro-batch after iteration ``t``
        (the permute after iteration ``t`` moves only those; the rest are bubble)."""
        out = []
        for s in range(self.stages):
            w = self.work(t, s)
            if w is None:
                continue
            if s < self.stages - 1:
                out.append((s, s + 1))
            elif w[1] < self.rounds - 1:  # the last stage hands the next round to stage 0
                out.append((s, 0))
        return out

    def output(self, t: int) -> int | None:
        """The micro-batch the last stage finishes at iteration ``t``, if any."""
        w = self.work(t, self.stages - 1)
        return w[0] if w is not None and w[1] == self.rounds - 1 else None

    def transfers(self) -> dict[tuple[int, int], int]:
        """Micro-batch slots sent across each ``(from, to)`` stage boundary in one forward."""
        out: dict[tuple[int, int], int] = {}
        for t in range(self.iterations):
            for p in self.pairs(t):
                out[p] = out.get(p, 0) + 1
        return out

    # --- where layers live -------------------------------------------------------------------

    def layer(self, stage: int, chunk: int, j: int) -> int:
        """The user's index of layer ``j`` of chunk (round) ``chunk`` on stage ``stage``."""
        return (chunk * self.stages + stage) * self.layers_per_chunk + j

    def storage_order(self) -> list[int]:
        """``order[p]`` is the user's layer at position ``p`` of the stacked parameters: stage
        ``s`` holds positions ``s * V * k`` to ``(s + 1) * V * k - 1``, chunk by chunk."""
        return [
            self.layer(s, v, j)
            for s in range(self.stages)
            for v in range(self.rounds)
            for j in range(self.layers_per_chunk)
        ]
