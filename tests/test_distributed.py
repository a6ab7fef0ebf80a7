"""The DistributedMesh under Gloo: 4 processes on 127.0.0.1 equal the LocalMesh.

Every test starts its processes through ``partita.runtime.launch.spawn`` (or ``torchrun``) with
a deadline, and every process is killed when the test ends. Marked ``slow``: CI runs them all
(the file takes about two minutes on a 2-core machine).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import partita
from partita.runtime.launch import RankResult, free_port, spawn

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))

from programs import cases  # noqa: E402

pytestmark = pytest.mark.slow


def _explain(results: list[RankResult]) -> str:
    return "\n".join(
        f"--- rank {r.rank}: returncode {r.returncode} after {r.seconds:.1f} s\n"
        f"{r.stdout[-1500:]}\n{r.stderr[-2500:]}"
        for r in results
    )


def _run_ok(argv: list[str], timeout: float = 120.0, **kw: object) -> list[RankResult]:
    results = spawn(argv, 4, timeout=timeout, **kw)  # type: ignore[arg-type]
    assert all(r.returncode == 0 for r in results), _explain(results)
    return results


# --- the op subset -----------------------------------------------------------------------------


def test_ops_equal_local_mesh(tmp_path: Path) -> None:
    out = tmp_path / "ops.pt"
    _run_ok([str(SCRIPTS / "ops.py"), str(out)])
    got = torch.load(out)
    for name, (mesh, fn, args, in_specs, out_specs, kinds) in cases().items():
        jitted = partita.jit(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
        want = jitted(*args).full()  # the LocalMesh: torch.distributed is not initialised here
        value, got_kinds = got[name]
        torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-6, msg=name)
        assert kinds <= set(got_kinds), (name, got_kinds)
