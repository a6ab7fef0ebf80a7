"""The per-device code of a pipeline: one ``shard_map`` body that runs the whole timetable.

The region is manual over the stage axis and the batch axes; any other mesh axis stays with
propagation (tensor parallelism inside a layer). Each device sees:

- its stage's stacked weights, ``[V * k, ...]`` (the stage axis splits the stack's dim 0);
- its block of the micro-batched input, ``[1, M / S, b, ...]``: the batch axes split dim 0
  (``b`` rows of each micro-batch per device), the stage axis the micro-batches, so stage
  ``o`` holds micro-batches ``o * M / S`` to ``(o + 1) * M / S - 1`` (a *group*).

First stage 0 gets the whole input: one ``ppermute`` ``o -> 0`` per other stage carries
group ``o`` (the input as stage 0 sees it, zeros on the other stages). Then, for each of the
``V * M + S - 1`` iterations of :class:`~partita.pipeline.schedule.Schedule` (unrolled: the
program holds one copy of the stage's layers per iteration):

1. the stage's input: stage 0 takes the next micro-batch (or, in a circular schedule, what the
   last stage handed back a round ago), the others what the previous stage sent. The program
   is the same on every device: where stage 0 received nothing from the last permute (zeros)
   the two are added (the input is zeros off stage 0); where it did (a circular schedule's
   wrap), a ``torch.where`` on ``axis_index(stage)`` picks;
2. the stage's chunk of ``k`` layers runs on it (under ``torch.utils.checkpoint`` when
   ``remat``: the backward recomputes the chunk from its input instead of keeping its
   activations), with chunk ``(t - stage) // M`` of the weights in a circular schedule;
3. the slots move one stage on: ``ppermute`` over the stage axis with only the pairs that carry
   a real micro-batch at this iteration (so each boundary carries exactly ``V * M`` slots
   forward, and as many gradients back: the permute's transpose is the reverse permute).

At the end the last stage stacks its results group by group and sends group ``o`` to stage
``o`` (one ``ppermute`` ``S - 1 -> o`` each): the output leaves the region split over the
stages as the input came in, and nothing is summed over the stage axis. In the backward the
permutes reverse: each stage's output gradient goes to the last stage, stage 0's input
gradient back to the stage that holds that input, once. The weights are marked varying over
the batch axes and the stage axis at the top (``pvary``), so their gradients are summed once
per step: one ``all_reduce`` per weight over the batch axes (data parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from partita.manual.collectives import axis_index, ppermute
from partita.manual.vma import pvary
from partita.pipeline.schedule import Schedule

__all__ = ["stage_body"]

Weights = dict[str, Tensor]


def _chunk_runner(template: nn.Module, names: Sequence[str], k: int) -> Callable[..., Tensor]:
    """``run(x, *w)``: ``k`` layers of ``template`` over ``x``; ``w`` holds, for each layer in
    turn, its parameters in the order of ``names``."""

    def run(x: Tensor, *w: Tensor) -> Tensor:
        n = len(names)
        for j in range(k):
            x = functional_call(
                template, dict(zip(names, w[j * n : (j + 1) * n], strict=True)), (x,)
            )
        return x

    return run


def stage_body(
    schedule: Schedule,
    template: nn.Module,
    names: Sequence[str],
    stage_axis: str,
    batch_axes: tuple[str, ...],
    remat: bool,
) -> Callable[[Weights, Tensor], Tensor]:
    """The body ``(stacked weights, xs [1, M / S, b, ...]) -> ys [1, M / S, b, ...]`` of the
    pipeline's region: this device's group of micro-batches in and out (see the module's
    doc)."""
    sch = schedule
    k, rounds = sch.layers_per_chunk, sch.rounds
    run = _chunk_runner(template, names, k)

    def chunk(x: Tensor, weights: list[Tensor]) -> Tensor:
        if remat and torch.is_grad_enabled():
            return checkpoint(run, x, *weights, use_reentrant=False)
        return run(x, *weights)

    def body(stacked: Weights, xs: Tensor) -> Tensor:
        varying = (stage_axis, *batch_axes)
        stacked = {n: pvary(stacked[n], varying) for n in names}  # gradients summed once
        me = axis_index(stage_axis)
        first = me == 0
        inputs = _to_first_stage(xs[0], me, stage_axis, sch.stages)
        g = sch.microbatches // sch.stages
        # Static chunks: per (round, layer) the weights, sliced once so that the gradient of
        # every use adds up on one slice.
        static = [[stacked[n][v * k + j] for j in range(k) for n in names] for v in range(rounds)]
        blocks = {n: w.reshape(rounds, k, *w.shape[1:]) for n, w in stacked.items() if rounds > 1}
        sent: list[Tensor | None] = []
        outs: dict[int, Tensor] = {}
        zeros: list[Tensor] = []

        def zero() -> Tensor:
            if not zeros:
                zeros.append(torch.zeros_like(inputs[0][0]))
            return zeros[0]

        for t in range(sch.iterations):
            prev = sent[t - 1] if t else None
            kind, at = sch.source(t)
            if kind == "input":
                x = inputs[at // g][at % g]  # zeros on the other stages
                if prev is not None and _first_receives(sch, t - 1):
                    x = torch.where(first, x, prev)
                elif prev is not None:  # stage 0 got nothing (zeros): one add, no where
                    x = prev + x
            elif kind == "wrap":
                back = sent[at]
                x = torch.where(
                    first,
                    back if back is not None else zero(),
                    prev if prev is not None else zero(),
                )
            else:
                x = prev if prev is not None else zero()
            x = chunk(x, _weights_at(sch, t, me, static, blocks, names))
            m = sch.output(t)
            if m is not None:
                outs[m] = x
            pairs = sch.pairs(t)
            sent.append(ppermute(x, stage_axis, pairs) if pairs else None)
        ys = [torch.stack([outs[o * g + i] for i in range(g)]) for o in range(sch.stages)]
        return _to_owners(ys, me, stage_axis)[None]

    return body


def _first_receives(sch: Schedule, t: int) -> bool:
    """Whether the permute after iteration ``t`` sends stage 0 anything (the circular wrap)."""
    return any(dst == 0 for _, dst in sch.pairs(t))


def _to_first_stage(own: Tensor, me: Tensor, axis: str, stages: int) -> list[Tensor]:
    """Stage 0's input, group by group (``[g, ...]`` each; group ``o`` is stage ``o``'s block
    of the input): one permute ``o -> 0`` per other stage; zeros on every other stage."""
    mine = torch.where(me == 0, own, torch.zeros((), dtype=own.dtype))
    return [mine, *(ppermute(own, axis, [(o, 0)]) for o in range(1, stages))]


def _to_owners(groups: list[Tensor], me: Tensor, axis: str) -> Tensor:
    """Each stage's block of the output: the last stage's group ``o`` (``[g, ...]``), sent to
    stage ``o`` by one permute ``S - 1 -> o``; the last stage keeps its own."""
    last = len(groups) - 1
    out = torch.where(me == last, groups[last], torch.zeros((), dtype=groups[last].dtype))
    for o in range(last):
        out = out + ppermute(groups[o], axis, [(last, o)])
    return out


def _weights_at(
    sch: Schedule,
    t: int,
    me: Tensor,
    static: list[list[Tensor]],
    blocks: Weights,
    names: Sequence[str],
) -> list[Tensor]:
    """The flat weights of the chunk each stage runs at iteration ``t``: the same round on
    every working stage is a static slice; stages in different rounds (a circular schedule
    where a round ends between them) pick their round with ``index_select`` on their index."""
    live = sch.rounds_at(t)
    if len(live) <= 1:
        return static[min(live, default=0)]
    v = torch.clamp(torch.div(t - me, sch.microbatches, rounding_mode="floor"), 0, sch.rounds - 1)
    picked = {n: w.index_select(0, v.reshape(1)).squeeze(0) for n, w in blocks.items()}
    return [picked[n][j] for j in range(sch.layers_per_chunk) for n in names]
