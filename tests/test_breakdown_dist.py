"""``runtime.breakdown.measure`` on a DistributedMesh: 2 Gloo processes on 127.0.0.1.

Every category but ``idle`` is CPU time and they add up to the measured CPU. It used to apply
the profiler's wall time inside ops to the CPU total: a collective's range there holds the
wait for the peer and the time the rank is descheduled, and Gloo's own threads' ops counted
as top-level ops of the step, so "collectives" could exceed the whole CPU time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partita.runtime.breakdown import CATEGORIES, CPU_CATEGORIES
from partita.runtime.launch import spawn

SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "breakdown_step.py"

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("rank_zygote")]  # tests/rank_zygote.py


def test_categories_are_cpu_time_and_add_up_to_it(tmp_path: Path) -> None:
    results = spawn([str(SCRIPT), str(tmp_path)], 2, timeout=240)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        parts, cpu = got["parts"], got["cpu"]
        assert set(parts) == set(CATEGORIES)
        assert all(v >= 0 for v in parts.values()), parts
        assert sum(parts[k] for k in CPU_CATEGORIES) == pytest.approx(cpu), (parts, cpu)
        assert all(parts[k] <= cpu for k in CPU_CATEGORIES), (parts, cpu)
        # the step's thread did work in every kind of op; Gloo's threads moved the bytes
        assert parts["collectives"] > 0 and parts["local compute"] > 0, parts
        # ``other`` may be 0: when the instrumented runs' ops add up to more than the plain
        # runs' thread CPU they are scaled down to it (``breakdown``'s module doc)
        assert parts["threads"] > 0, parts
