"""Shared fixtures and hypothesis settings for partita's tests."""

from __future__ import annotations

import gc
import os
from collections.abc import Generator, Iterator

import pytest
from hypothesis import HealthCheck, settings

import partita.runtime.spawn as spawn_module
from partita import Mesh
from rank_zygote import Zygote

# Modest example counts keep the property tests to seconds; CI can raise them with
# HYPOTHESIS_PROFILE=ci.
settings.register_profile(
    "default", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", max_examples=500, deadline=None)
settings.load_profile(__import__("os").environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def mesh_2x4() -> Mesh:
    """The mesh of the issue's test vectors: devices 0..7, x major."""
    return Mesh.create((2, 4), ("x", "y"))


@pytest.fixture
def mesh_4() -> Mesh:
    return Mesh.create((4,), ("x",))


@pytest.fixture(autouse=True)
def _trace_flat_at_second_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LocalMesh traces a segment's flat graph once its eager runs cost as much as the trace
    (runtime/flat_trace.py): in a test that runs a program two or three times, often never.
    Tracing at the second run keeps the flat graphs (folded matmuls, fused bias adds) under
    test wherever a program runs twice; tests of the cost-based policy unset it."""
    monkeypatch.setenv("PARTITA_TRACE_FLAT_AT", "2")


@pytest.fixture(scope="session")
def _zygote() -> Iterator[Zygote]:
    # The environment every rank gets from spawn unless told otherwise (OMP_NUM_THREADS is
    # read when OpenMP loads, at torch's import).
    zygote = Zygote({**os.environ, "OMP_NUM_THREADS": "1"})
    yield zygote
    zygote.close()


@pytest.fixture(scope="module")
def rank_zygote(_zygote: Zygote) -> Iterator[Zygote]:
    """``spawn`` starts the ranks of this module's tests from a process that has imported
    torch and partita once (tests/rank_zygote.py) instead of fresh interpreters: opt in with
    ``pytestmark = pytest.mark.usefixtures("rank_zygote")``."""
    before = spawn_module.default_starter
    spawn_module.default_starter = _zygote
    yield _zygote
    spawn_module.default_starter = before


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> Generator[None, None, None]:
    """In an xdist worker, the heap's garbage collected and the rest frozen before the worker
    reports "workerfinished" (xdist's wrapper around this hook sends it after this returns).

    Once every worker has finished, the controller closes their gateways, and execnet's
    worker waits 5 s for the session to end and then sends itself SIGINT. What is left after
    "workerfinished" is ``pytest_unconfigure``, where pytest's unraisable-exception plugin
    runs ``gc.collect()``: a full collection over every object the session still holds
    (compiled programs, modules, graphs), which on a loaded CI machine took longer than
    that; the SIGINT then arrived inside the collection, as a KeyboardInterrupt in
    hypothesis's ``gc_callback`` reported as a PytestUnraisableExceptionWarning. Collecting
    here keeps what that collection checks (an exception raised by a finalizer is still
    reported), and ``gc.freeze()`` leaves the later one only the objects made after it."""
    result = yield
    if hasattr(session.config, "workerinput"):
        gc.collect()
        gc.freeze()
    return result


#: Worker seconds of the slowest test files (every file of 15 s or more): in the whole-suite run of
#: session 34 under ``make test``'s options (a loaded machine: 1310 s per worker), the time from
#: the end of a worker's previous test to the end of the file's last, which includes the file's
#: import and module fixtures. ``test_opdb.py`` and ``test_opdb_rest.py`` share that run's 140 s
#: of ``test_opdb.py`` (its slow sweep is now in two halves, 50.7 s and 51.0 s of CPU alone).
#: Only the order matters: ``make test`` (``-n 2 --dist loadfile --no-loadscope-reorder``) hands
#: whole files to its two workers in collection order, these first, slowest first, so that no
#: slow file starts last while the other worker idles; the rest follow by number of tests, most
#: first (xdist's own order). docs/architecture.md "Where the suite's time goes".
SLOW_FILES = {
    "tests/test_op_table.py": 194,
    "tests/test_models.py": 114,
    "tests/test_pipeline_parallel.py": 110,
    "tests/test_moe_models.py": 108,
    "tests/test_faults.py": 103,
    "tests/test_faults_step.py": 83,
    "tests/test_docs_examples.py": 79,
    "tests/test_fused_step.py": 79,
    "tests/test_distributed.py": 77,
    "tests/test_opdb.py": 77,
    "tests/test_train_step.py": 72,
    "tests/test_control_flow.py": 64,
    "tests/test_opdb_rest.py": 63,
    "tests/test_auto_api.py": 61,
    "tests/test_moe_dispatch.py": 58,
    "tests/test_estimate_memory.py": 53,
    "tests/test_auto.py": 51,
    "tests/test_recurrent_sharding.py": 49,
    "tests/test_child_compile.py": 46,
    "tests/test_diffusers.py": 44,
    "tests/test_virtual_device.py": 44,
    "tests/test_device_loop_dist.py": 40,
    "tests/test_plan_cli.py": 40,
    "tests/test_virtual_device_compiled.py": 38,
    "tests/test_auto_costs.py": 36,
    "tests/test_partial_sums.py": 35,
    "tests/test_checkpoint.py": 34,
    "tests/test_half_partials.py": 33,
    "tests/test_plan_html.py": 31,
    "tests/test_architecture.py": 28,
    "tests/test_auto_virtual.py": 28,
    "tests/test_auto_solver.py": 27,
    "tests/test_train_step_schedules.py": 26,
    "tests/test_overlap.py": 25,
    "tests/test_scan_layers_loop.py": 24,
    "tests/test_special_handlers.py": 24,
    "tests/test_jit.py": 22,
    "tests/test_estimate_overlap.py": 19,
    "tests/test_examples.py": 18,
    "tests/test_local_runtime.py": 18,
    "tests/test_moe_virtual.py": 17,
    "tests/test_moe_ep.py": 16,
    "tests/test_auto_templates.py": 15,
    "tests/test_compiled_programs.py": 15,
    "tests/test_scan_layers.py": 15,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    counts: dict[str, int] = {}
    for item in items:
        counts[item.nodeid.split("::")[0]] = counts.get(item.nodeid.split("::")[0], 0) + 1

    def key(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        return -SLOW_FILES.get(path, 0), -counts[path]

    items.sort(key=key)  # stable: the order within a file stays
