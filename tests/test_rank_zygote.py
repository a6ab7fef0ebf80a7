"""tests/rank_zygote.py: a rank forked from the pre-imported zygote is the process a fresh
``python script.py`` would be (its environment, session, argv, path, output, exit status, a
seed of its own), and spawn's deadline still kills it and everything it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from partita.runtime.spawn import spawn
from rank_zygote import Zygote

SCRIPT = """
import json, os, sys, threading, time
import torch
mode = sys.argv[1]
if mode == "hang":
    child = os.fork()  # something it started: in its session, killed with it
    if child == 0:
        time.sleep(300)
    time.sleep(300)
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
print(json.dumps({
    "rank": os.environ["RANK"], "knob": os.environ.get("PARTITA_ZYGOTE_PROBE"),
    "omp": os.environ["OMP_NUM_THREADS"], "session": os.getsid(0) == os.getpid(),
    "argv": sys.argv, "path0": sys.path[0], "file": __file__, "name": __name__,
    "cwd": os.getcwd(), "seed": torch.initial_seed(),
}))
print("to stderr", file=sys.stderr)
if os.environ["RANK"] == "1":
    raise SystemExit(3)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def test_a_forked_rank_is_a_fresh_process(
    rank_zygote: Zygote, script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(script.parent)
    before = rank_zygote.forked
    results = spawn(
        [script.name, "ok"], 2, env={"PARTITA_ZYGOTE_PROBE": "seen"}, starter=rank_zygote
    )
    assert rank_zygote.forked == before + 2  # not started fresh
    assert [r.returncode for r in results] == [0, 3], [r.stderr for r in results]
    got = [json.loads(r.stdout.splitlines()[0]) for r in results]
    for rank, (r, g) in enumerate(zip(results, got, strict=True)):
        assert g["rank"] == str(rank) and g["knob"] == "seen" and g["omp"] == "1"
        assert g["session"]  # its own session: spawn kills it with killpg
        assert g["argv"] == [script.name, "ok"] and g["name"] == "__main__"
        assert g["path0"] == str(script.parent) and g["file"] == str(script)
        assert g["cwd"] == str(script.parent)
        assert r.stdout.splitlines()[1:] == ["thread joined"]  # non-daemon threads joined
        assert r.stderr == "to stderr\n"
    assert got[0]["seed"] != got[1]["seed"]  # each its own random seed, as fresh processes


def test_the_deadline_kills_a_forked_rank_and_what_it_started(
    rank_zygote: Zygote, script: Path
) -> None:
    results = spawn([str(script), "hang"], 1, timeout=3, starter=rank_zygote)
    assert results[0].returncode in (None, -signal.SIGKILL)  # killed at the deadline
    sid = results[0].pid
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            left.append(stat.parent.name)
    assert left == []


def test_what_torch_reads_at_import_starts_a_fresh_process(
    rank_zygote: Zygote, script: Path
) -> None:
    """OMP_NUM_THREADS is read when OpenMP loads, at torch's import: another value than the
    zygote's would be frozen in a fork, so that rank is a fresh interpreter."""
    before = rank_zygote.fresh
    started = rank_zygote([str(script), "ok"], {**os.environ, "RANK": "0", "OMP_NUM_THREADS": "2"})
    assert rank_zygote.fresh == before + 1
    started.communicate()
    assert started.returncode == 0
    assert isinstance(started, subprocess.Popen)
