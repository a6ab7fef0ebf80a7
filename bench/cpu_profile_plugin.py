"""A pytest plugin: the CPU time of the tests of one run, and optionally their cProfile.

Each test's setup, call and teardown are timed with ``time.process_time`` (what pytest's
collection and torch's import cost is left out) and, with ``PARTITA_PROFILE_OUT=path``,
profiled by cProfile with a CPU-time timer; at the end of the session the total goes to
stdout and the profile to ``path.prof`` (read it with ``pstats``; several can be added).
The profiler costs about twice the test's own CPU, most of it on many small Python calls, so
read its shares as rough and time a change without it. ::

    PYTHONPATH=src:bench .venv/bin/python -m pytest -q -p cpu_profile_plugin tests/test_models.py
"""

from __future__ import annotations

import cProfile
import os
import time
from collections.abc import Generator

import pytest

_PROFILE = cProfile.Profile(time.process_time)
_CPU = [0.0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    profiling = bool(os.environ.get("PARTITA_PROFILE_OUT"))
    start = time.process_time()
    if profiling:
        _PROFILE.enable()
    try:
        return (yield)
    finally:
        if profiling:
            _PROFILE.disable()
        _CPU[0] += time.process_time() - start


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("PARTITA_PROFILE_OUT")
    if out:
        _PROFILE.dump_stats(out + ".prof")
    print(f"\nCPU of the tests (setup, call, teardown): {_CPU[0]:.2f} s")
