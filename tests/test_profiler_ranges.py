"""partita's work in the PyTorch profiler: one named range per collective of the Plan per step.

The first 3 steps of a program, under ``torch.profiler`` on the LocalMesh and on 2 Gloo
processes (the DistributedMesh), export their chrome trace; the test reads it back and finds,
in every step (the first one too), one range per call of the Plan (a collective alone, or a
fused bucket), named with its kind, mesh axes and per-device bytes (``partition.ranges``,
``runtime.ranges``).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from partita.partition.ranges import collective_name
from partita.runtime import ranges
from partita.runtime.spawn import spawn

SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))

from profiled import STEPS, profiled_steps  # noqa: E402

COLLECTIVE = re.compile(
    r"^partita\.(all_gather|all_reduce|reduce_scatter|all_to_all|collective_permute)(_bucket)?"
    r"\[[\w,]*\] (\d+) B"
)


def plan_calls(plan: Any) -> Counter[str]:
    """The range names one run of ``plan`` opens: one per call (a bucket is one call)."""
    fused = {i for b in plan.buckets for i in b.members}
    names = [collective_name(plan, b.members) for b in plan.buckets]
    names += [collective_name(plan, [i]) for i in range(len(plan.collectives)) if i not in fused]
    return Counter(names)


def trace_ranges(path: Path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return [e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("partita.")]


def step_ranges(path: Path) -> list[list[str]]:
    """The ``partita.`` range names inside each ``partita.step`` range, in the steps' order."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("partita.step ")), key=_ts)
    return [
        [e["name"] for e in events if e["name"].startswith("partita.") and e is not s
         and _ts(s) <= _ts(e) and _ts(e) + float(e["dur"]) <= _ts(s) + float(s["dur"])]
        for s in steps
    ]  # fmt: skip


def _ts(event: dict[str, Any]) -> float:
    return float(event["ts"])


def check_trace(names: list[str], plan: Any) -> None:
    want = plan_calls(plan)
    assert want, "the test program should have collectives"
    got = Counter(n for n in names if COLLECTIVE.match(n))
    assert got == Counter({k: STEPS * v for k, v in want.items()})
    for name in got:  # kind, axes and bytes as the Plan's records of its call have them
        m = COLLECTIVE.match(name)
        members = re.search(r" #([\d,]+)", name)
        assert m is not None and members is not None, name
        records = [plan.collectives[int(i)] for i in members.group(1).split(",")]
        assert {r.kind for r in records} == {m.group(1)}, name
        assert int(m.group(3)) == sum(r.bytes for r in records) > 0, name
        assert f"[{','.join(records[0].mesh_axes)}]" in name
    assert sum(n.startswith("partita.step ") for n in names) == STEPS


def test_local_mesh_ranges(tmp_path: Path) -> None:
    plan = profiled_steps(tmp_path / "trace.json")
    names = trace_ranges(tmp_path / "trace.json")
    check_trace(names, plan)
    for step in step_ranges(tmp_path / "trace.json"):  # the first step (compiling) too
        assert Counter(n for n in step if COLLECTIVE.match(n)) == plan_calls(plan)
    assert any(n.startswith("partita.segment ") for n in names)
    kinds = {COLLECTIVE.match(n).group(1) for n in names if COLLECTIVE.match(n)}  # type: ignore[union-attr]
    assert kinds == {c.kind for c in plan.collectives}


def test_local_mesh_ranges_demo_gpt(tmp_path: Path) -> None:
    """The demo's GPT on the 2x4 mesh (fsdp+tp): buckets, and collective_permutes that the
    LocalMesh folds into the selections reading them (``runtime.device_route``)."""
    from test_plan_html import gpt_plan_and_step

    plan, step, batch = gpt_plan_and_step()
    assert "collective_permute" in plan.counts() and plan.buckets
    step(batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            step(batch)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    check_trace(trace_ranges(tmp_path / "trace.json"), plan)


def test_no_ranges_off_the_profiler(tmp_path: Path) -> None:
    """Off the profiler the executors read one flag per step and open nothing."""
    assert not ranges.enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert ranges.enabled()
    assert not ranges.enabled()


@pytest.mark.slow
@pytest.mark.usefixtures("rank_zygote")  # ranks forked from a pre-imported process
def test_distributed_mesh_ranges(tmp_path: Path) -> None:
    results = spawn([str(SCRIPTS / "profiled.py"), str(tmp_path)], 2, timeout=180)
    assert all(r.returncode == 0 for r in results), "\n".join(r.stderr[-3000:] for r in results)
    plan = profiled_steps(tmp_path / "local.json")  # the same program, on the LocalMesh
    for rank in range(2):
        names = trace_ranges(tmp_path / f"rank{rank}.json")
        check_trace(names, plan)
        per_step = step_ranges(tmp_path / f"rank{rank}.json")
        assert len(per_step) == STEPS  # every step has its ranges, the first one too
        for step in per_step:
            assert Counter(n for n in step if COLLECTIVE.match(n)) == plan_calls(plan)
        # with overlap on, each launched collective is waited for in its own range; the first
        # run has none to wait for (it runs every collective where the partitioner put it)
        waits = [sum(n.startswith("partita.wait ") for n in step) for step in per_step]
        assert waits == [0] + [sum(plan_calls(plan).values())] * (STEPS - 1)
