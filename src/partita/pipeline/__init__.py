"""Pipeline parallelism on a mesh axis, inside SPMD (GSPMD's vectorized pipeline).

``partita.pipeline(layers, mesh=, stage_axis=, microbatches=, schedule=, rounds=, remat=,
batch_axes=, layer_specs=)`` stacks identical layers, splits the stack over the stage axis and runs
micro-batches through the stages, the activations shifted by a collective-permute each
iteration (:mod:`partita.pipeline.body`, on the timetable of :mod:`partita.pipeline.schedule`);
:func:`pipeline_report` reads the schedule, its bubble and the bytes per stage boundary off a
Plan. See docs/pipeline.md.
"""

from __future__ import annotations

from partita.pipeline.module import Pipeline, pipeline
from partita.pipeline.report import PipelineReport, pipeline_report
from partita.pipeline.schedule import SCHEDULES, Schedule

__all__ = ["SCHEDULES", "Pipeline", "PipelineReport", "Schedule", "pipeline", "pipeline_report"]
