"""Per-host data reaches the device loop (issue 27): under torch.distributed each process loads
only its own rows, ``GlobalBatchLoader(..., device=dev)`` puts them on the virtual device without
a gather, and the loop trains as one process given the whole batch.

Every run is ``dist_scripts/device_loop.py`` (3 AdamW steps of an MLP whose weights are sharded
over ``model``): once in a single process (the reference: it loads all 16 rows), then with 2
and 4 processes on 127.0.0.1 (Gloo), started by ``partita.runtime.launch.spawn`` or by
``torchrun``, bounded in time.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from partita.runtime.launch import free_port, spawn

SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "device_loop.py"
ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH, STEPS, FEATURES = 16, 3, 8 + 4  # x has 8 columns, y 4 (float32)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("rank_zygote")]  # tests/rank_zygote.py


@functools.cache
def _reference(data: int, model: int) -> dict:
    """The loop in one process, which loads the whole global batch (run once per mesh: the
    spawn and the torchrun test of a mesh compare with the same run; ``_check`` reads it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(data), str(model)],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _check(results: list[dict], reference: dict, data: int, model: int) -> None:
    rows = GLOBAL_BATCH // data
    assert reference["read"] == [[0, GLOBAL_BATCH]] * STEPS
    assert sorted(r["rank"] for r in results) == list(range(data * model))
    for r in results:
        # rank r is mesh device r: coordinates (r // model, r % model); replicas along
        # ``model`` load the same rows
        start = (r["rank"] // model) * rows
        assert r["read"] == [[start, start + rows]] * STEPS, r
        # the bytes it put on the device: its rows of x and y, every step, nothing more
        assert r["upload_bytes"] == STEPS * rows * FEATURES * 4, r
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-6, rel=0), r
        assert r["shards"] == [[r["rank"]], [r["rank"]]], r  # local_shards: its own
    assert reference["shards"] == [list(range(data * model))] * 2


def _spawned(data: int, model: int) -> list[dict]:
    results = spawn([str(SCRIPT), str(data), str(model)], data * model, timeout=300)
    assert [r.returncode for r in results] == [0] * len(results), [
        r.stderr[-3000:] for r in results
    ]
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]


@pytest.mark.parametrize(("data", "model"), [(2, 1), (2, 2)], ids=["2 processes", "4 processes"])
def test_each_process_uploads_its_rows_and_trains_as_one(data: int, model: int) -> None:
    _check(_spawned(data, model), _reference(data, model), data, model)


@pytest.mark.parametrize(("data", "model"), [(2, 1), (2, 2)], ids=["2 processes", "4 processes"])
def test_under_torchrun(data: int, model: int) -> None:
    """The same loop launched by ``torchrun --nproc-per-node=N`` on loopback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
        f"--nproc-per-node={data * model}", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", str(SCRIPT), str(data), str(model),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    _check(results, _reference(data, model), data, model)
