"""The fit of the cost model's local-op terms (bench/op_workloads.py, which
``bench/bench_collectives.py --ops`` runs): it recovers the terms of ``partita.cost.op_time``
from times made by that very formula, and counts a workload as the step estimate counts ops
(the runtime's copies around collectives as ``cost.copies`` counts them)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from partita.cost import PROFILES, node_bytes, op_time
from partita.runtime import dist_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from runtime_copies import Copies  # isort: skip
from op_workloads import COPIES, copy_workloads, fit_copies, fit_ops, traced, workloads


def _rows(hw, sizes: list[list[int]]) -> list[dict]:  # type: ignore[no-untyped-def]
    return [
        {"ops": len(each), "each": each, "seconds": sum(op_time(0, b, hw) for b in each)}
        for each in sizes
    ]


SIZES = [[1 << 12] * 400, [1 << 16] * 300, [1 << 19] * 200, [3 << 20] * 50, [12 << 20] * 20]


def test_the_fit_recovers_the_terms_of_op_time() -> None:
    hw = dataclasses.replace(
        PROFILES["cpu-gloo"],
        op_overhead=1e-5,
        cache_bytes=1 << 20,
        cache_bandwidth=2e10,
        memory_bandwidth=4e9,
        launch=0.0,
    )
    fit = fit_ops(_rows(hw, SIZES))
    assert fit["cache_bytes"] == 1 << 20
    assert fit["op_overhead"] == pytest.approx(1e-5, rel=1e-3)
    assert fit["cache_bandwidth"] == pytest.approx(2e10, rel=1e-3)
    assert fit["memory_bandwidth"] == pytest.approx(4e9, rel=1e-3)
    assert fit["error"] < 1e-6 < fit["error_flat"]


def test_one_bandwidth_is_kept_when_a_cache_explains_nothing() -> None:
    hw = dataclasses.replace(
        PROFILES["cpu-gloo"], op_overhead=2e-5, memory_bandwidth=3e9, cache_bytes=0, launch=0.0
    )
    fit = fit_ops(_rows(hw, SIZES))
    assert fit["cache_bytes"] == 0
    assert fit["op_overhead"] == pytest.approx(2e-5, rel=1e-3)
    assert fit["memory_bandwidth"] == pytest.approx(3e9, rel=1e-3)


def test_the_copy_fit_recovers_copy_bandwidth_beside_the_fitted_overhead() -> None:
    hw = dataclasses.replace(
        PROFILES["cpu-gloo"], op_overhead=1e-5, copy_bandwidth=1.5e9, launch=0.0
    )
    rows = [
        {"ops": len(each), "bytes": sum(each), "seconds": sum(map(hw.copy_seconds, each))}
        for each in SIZES
    ]
    assert fit_copies(rows, 1e-5) == pytest.approx(1.5e9, rel=1e-9)
    assert fit_copies([{**r, "seconds": r["ops"] * 1e-5} for r in rows], 1e-5) == 0.0


def test_a_workload_is_counted_as_the_estimate_counts_its_ops() -> None:
    _name, fn, inputs = workloads()[-1]  # bias-sized AdamW updates
    gm, counts = traced(fn, inputs)
    ops = [n for n in gm.graph.nodes if node_bytes(n)]
    assert counts["ops"] == len(ops) == len(counts["each"]) > 0
    assert counts["bytes"] == sum(counts["each"]) == sum(node_bytes(n) for n in ops)
    out = gm(*inputs)  # it runs on real tensors
    assert all(isinstance(t, torch.Tensor) for t in out)


def test_a_copy_workload_is_the_runtimes_copies_counted_as_the_estimate_counts_them() -> None:
    saved = dist_ops.ALL_GATHER, dist_ops.REDUCE_SCATTER, dist_ops.dist
    copies = copy_workloads()
    assert [name for name, *_ in copies] == [name for name, *_ in COPIES]
    for name, run, counts in copies:
        with Copies() as seen:
            out = run()  # runtime.dist_ops with Gloo stubbed out, a result per bucket
        assert len(out) == 5, name
        assert counts["ops"] == len(counts["each"]) == len(seen.sizes) > 0, name
        assert sorted(counts["each"]) == sorted(seen.sizes), name
        assert counts["bytes"] == sum(counts["each"]), name
    assert (dist_ops.ALL_GATHER, dist_ops.REDUCE_SCATTER, dist_ops.dist) == saved  # restored
