"""Fault injection: a multi-process run never hangs and never silently disagrees.

Two Gloo processes on 127.0.0.1 run ``dist_scripts/faults.py MODE``; rank 1 stalls, dies,
raises, passes other shapes or dtypes, compiles another program, or stops early. Every
surviving process must exit with a typed partita error (exit status 17, the error's type and
message checked) within the collective timeout (5 s here), and no test may leave a process or
a listening port behind. The store and plan-agreement tests run in this process and are fast.
"""

from __future__ import annotations

import re
import socket
import sys
import warnings
from pathlib import Path

import pytest
import torch

import partita
import partita.checkpoint as ckpt
from partita import Mesh, P, ShardedTensor
from partita.checkpoint import directory
from partita.errors import (
    DistributedError,
    JoinTimeoutError,
    OptionError,
    PartitaWarning,
    PlanMismatchError,
)
from partita.runtime import launch
from partita.runtime.launch import ProcessEnv, RankResult, free_port, spawn
from partita.runtime.plan_check import mismatch_error, program_digest, program_lines

SCRIPT = str(Path(__file__).resolve().parent / "dist_scripts" / "faults.py")
TIMEOUT = 5.0  # PARTITA_COLLECTIVE_TIMEOUT for every run here
PARTITA_EXIT = 17  # faults.py exits with it after printing a PartitaError
SLACK = 4.0  # process exit and a loaded 2-core machine, on top of the timeout

pytestmark = pytest.mark.usefixtures("rank_zygote")  # ranks forked from one pre-imported process

needs_proc = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc/net/tcp"
)


# --- what is listening, what is still running ----------------------------------------------


def listeners(port: int) -> set[str]:
    """The local addresses with a socket listening on ``port`` (from /proc/net/tcp{,6})."""
    out = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not Path(table).exists():
            continue
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) != port or fields[3] != "0A":  # 0A: TCP_LISTEN
                continue
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out.add(socket.inet_ntop(family, raw))
    return out


def session_members(sid: int) -> list[int]:
    """Live processes in session ``sid`` (spawn starts each rank in a session of its own)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


# --- the rendezvous store (in this process) -------------------------------------------------


def _env(port: int, addr: str = "127.0.0.1") -> ProcessEnv:
    return ProcessEnv(
        rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
        master_addr=addr, master_port=port, agent_store=False, restart=0,
    )  # fmt: skip


@needs_proc
def test_store_listens_on_master_addr_only() -> None:
    """Rank 0's TCPStore used to bind every interface (``*:PORT``, unauthenticated)."""
    port = free_port()
    store = launch.connect_store(_env(port), timeout=5)
    try:
        store.set("k", "v")
        assert listeners(port) == {"127.0.0.1"}
    finally:
        del store
    assert listeners(port) == set()


def test_store_port_taken_is_an_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DistributedError, match=r"cannot host the rendezvous store") as info:
            launch.connect_store(_env(port), timeout=5)
    assert not isinstance(info.value, JoinTimeoutError)
    assert f"127.0.0.1:{port}" in str(info.value)
    assert re.search(r"Choose a free MASTER_PORT", str(info.value))


def test_collective_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_ACTIVE_COLLECTIVE_TIMEOUT", None)
    monkeypatch.setenv("PARTITA_COLLECTIVE_TIMEOUT", "7")
    assert launch.active_collective_timeout() == 7.0
    monkeypatch.setenv("PARTITA_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(OptionError, match=r"PARTITA_COLLECTIVE_TIMEOUT='soon': must be a number"):
        launch.active_collective_timeout()


def _launcher_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """This process as rank 0 of a one-process run (nothing is joined unless a test fails)."""
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    base = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**base, "MASTER_PORT": str(free_port()), **env}.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("PARTITA_COLLECTIVE_TIMEOUT", "nan"),
        ("PARTITA_COLLECTIVE_TIMEOUT", "-1"),
        ("PARTITA_COLLECTIVE_TIMEOUT", "0"),
        ("PARTITA_JOIN_TIMEOUT", "inf"),
        ("PARTITA_JOIN_TIMEOUT", "nan"),
    ],
)
def test_a_bad_timeout_is_an_option_error_before_joining(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """``nan`` used to reach Gloo, whose failure the other ranks blamed on rank 0."""
    import partita.distributed as pd

    _launcher_env(monkeypatch, **{variable: value})
    try:
        with pytest.raises(
            OptionError, match=rf"{variable}='{value}': must be a finite number of seconds > 0"
        ):
            pd.initialize()
    finally:
        pd.shutdown()  # only if the error did not come first


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"timeout": float("nan")}, "timeout"), ({"collective_timeout": 0}, "collective_timeout"),
     ({"collective_timeout": float("inf")}, "collective_timeout")],
)  # fmt: skip
def test_a_bad_timeout_argument_is_an_option_error(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, float], argument: str
) -> None:
    import partita.distributed as pd

    _launcher_env(monkeypatch)
    try:
        with pytest.raises(
            OptionError,
            match=rf"initialize\({argument}=\S+\): {argument} must be a finite number of "
            rf"seconds > 0",
        ):
            pd.initialize(**kwargs)
    finally:
        pd.shutdown()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        # Used to fail in the rendezvous: "lost the rendezvous store (IndexError)".
        ({"RANK": "2", "WORLD_SIZE": "2"},
         r"RANK='2' is out of range \(0 <= RANK < 2: ranks are 0\.\.1 for WORLD_SIZE=2\)"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK='-1' is out of range \(0 <= RANK < 2"),
        ({"RANK": "one"}, r"RANK='one' is not an integer"),
        ({"WORLD_SIZE": "2.5"}, r"WORLD_SIZE='2.5' is not an integer"),
        ({"WORLD_SIZE": "0"}, r"WORLD_SIZE='0' is out of range \(WORLD_SIZE >= 1"),
        ({"LOCAL_RANK": "x"}, r"LOCAL_RANK='x' is not an integer"),
        ({"LOCAL_RANK": "-2"}, r"LOCAL_RANK='-2' is out of range \(0 <= LOCAL_RANK < 1"),
        ({"MASTER_PORT": "http"}, r"MASTER_PORT='http' is not an integer"),
        ({"MASTER_PORT": "70000"}, r"MASTER_PORT=.70000. is out of range \(1 <= MASTER_PORT <"),
    ],
)  # fmt: skip
def test_bad_launcher_variables_are_named(env: dict[str, str], message: str) -> None:
    base = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(DistributedError, match=message) as info:
        launch.read_env({**base, **env})
    assert "Launch with torchrun" in str(info.value)


def test_launcher_variables_are_read() -> None:
    env = launch.read_env(
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h",
         "MASTER_PORT": "29500"}
    )  # fmt: skip
    assert env is not None
    assert (env.rank, env.local_rank, env.node_rank, env.master_port) == (5, 1, 1, 29500)


# --- plan agreement (in this process) ----------------------------------------------------------


def _compiled(fn: object, *args: torch.Tensor, in_specs: object) -> object:
    step = partita.jit(fn, mesh=Mesh.create((2,), ("data",)), in_specs=in_specs)
    return step._compile(args, {})[0]


def test_plan_hash_covers_input_shapes_and_dtypes() -> None:
    """Input shapes were not hashed: (8, 4) on one rank and (10, 4) on another agreed."""
    sum0 = lambda x: x.sum(0)  # noqa: E731
    eight = _compiled(sum0, torch.ones(8, 4), in_specs=P("data"))
    ten = _compiled(sum0, torch.ones(10, 4), in_specs=P("data"))
    wide = _compiled(sum0, torch.ones(8, 4, dtype=torch.float64), in_specs=P("data"))
    assert len({program_digest(c) for c in (eight, ten, wide)}) == 3
    assert program_lines(eight)[0] == (
        "input 0 (args[0]): shape (8, 4), dtype torch.float32, sharding P('data', None)"
    )


def test_plan_mismatch_names_the_argument() -> None:
    fn = lambda x, w, scale=1.0: (x @ w).sum() * scale  # noqa: E731
    specs = (P("data", None), P())
    mine = _compiled(fn, torch.ones(8, 4), torch.ones(4, 3), in_specs=specs)
    theirs = _compiled(fn, torch.ones(8, 4), torch.ones(4, 5), in_specs=specs)
    lines = [program_lines(mine), program_lines(theirs)]
    digests = [program_digest(mine), program_digest(theirs)]
    with pytest.raises(
        PlanMismatchError,
        match=re.escape(
            "The first difference is input 1 (args[1]): this rank (1) has shape (4, 5), dtype "
            "torch.float32, sharding P(None, None); rank 0 has shape (4, 3), dtype "
            "torch.float32, sharding P(None, None)."
        ),
    ):
        raise mismatch_error(1, digests, lines)
    error = mismatch_error(0, digests, lines)
    assert re.search(r"ranks \[0\] have plan [0-9a-f]{12}; ranks \[1\] have plan", str(error))
    assert "partita.data.make_global" in str(error)


# --- injected faults (2 processes) -------------------------------------------------------------


def _explain(results: list[RankResult]) -> str:
    return "\n".join(
        f"--- rank {r.rank}: returncode {r.returncode} after {r.seconds:.1f} s\n"
        f"{r.stdout[-1500:]}\n{r.stderr[-2500:]}"
        for r in results
    )


def run_fault(mode: str, **env: str) -> list[RankResult]:
    """Run faults.py MODE on 2 ranks; check that nothing is left behind."""
    port = free_port()
    results = spawn(
        [SCRIPT, mode], 2, master_port=port, timeout=90,
        env={"PARTITA_COLLECTIVE_TIMEOUT": f"{TIMEOUT:g}", **env},
    )  # fmt: skip
    assert all(r.returncode is not None for r in results), "killed at the deadline: a hang\n" + (
        _explain(results)
    )
    if sys.platform == "linux":
        for r in results:
            assert session_members(r.pid) == [], f"rank {r.rank} left processes behind"
        assert listeners(port) == set(), f"port {port} still listening"
    return results


def partita_error(r: RankResult, kind: str) -> tuple[float, str]:
    """(time, message) of the typed partita error ``r`` exited with."""
    assert r.returncode == PARTITA_EXIT, r.stderr[-2500:]
    found = re.search(rf"^PARTITA {kind} at ([\d.]+): (.*)$", r.stderr, flags=re.M)
    assert found, r.stderr[-2500:]
    return float(found[1]), found[2]


#: What a survivor's error names: the step's plan check (the first collective of every call)
#: or its all_reduce over the mesh axis.
FIRST_COLLECTIVE = (
    r"(plan check over mesh axes \('data',\) with group ranks \[0, 1\] \(every process\)"
    r"|all_reduce at node '\w+' over mesh axes \('data',\) with group ranks \[0, 1\])"
)


def fault_time(r: RankResult) -> float:
    found = re.search(r"^fault \w+ at ([\d.]+)$", r.stdout, flags=re.M)
    assert found, r.stdout
    return float(found[1])


@pytest.mark.slow
def test_stalled_rank_is_a_timeout_on_its_peer() -> None:
    """Mesh-axis groups used to get torch's 30-minute default: the peer waited out the stall."""
    results = run_fault("stall", FAULT_STALL=f"{TIMEOUT + SLACK + 1:g}")
    stalled, survivor = results[1], results[0]
    when, message = partita_error(survivor, "DistributedError")
    assert TIMEOUT - 1 <= when - fault_time(stalled) <= TIMEOUT + SLACK, _explain(results)
    # The first collective of a step is its plan check (on every call), else its all_reduce.
    assert re.search(FIRST_COLLECTIVE + r" failed on rank 0", message), message
    assert "within the collective timeout (5 s, PARTITA_COLLECTIVE_TIMEOUT)" in message
    assert "raise PARTITA_COLLECTIVE_TIMEOUT" in message
    # The stalled rank wakes up to a dead peer: a typed error too, not a hang.
    partita_error(stalled, "DistributedError")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "raise", "fewer_steps"])
def test_a_rank_that_goes_away_fails_its_peer(mode: str) -> None:
    results = run_fault(mode)
    gone, survivor = results[1], results[0]
    expected = {"kill": -9, "raise": 1, "fewer_steps": 0}[mode]
    assert gone.returncode == expected, _explain(results)
    if mode == "raise":
        assert "injected failure on rank 1" in gone.stderr
    if mode == "fewer_steps":
        assert "shutdown released the process groups" in gone.stdout, _explain(results)
    when, message = partita_error(survivor, "DistributedError")
    if mode != "fewer_steps":
        assert when - fault_time(gone) <= TIMEOUT + SLACK, _explain(results)
    assert re.search(FIRST_COLLECTIVE + r" failed on rank 0", message), message
    assert "every process must be restarted" in message


@pytest.mark.slow
def test_printing_on_the_main_process_only_times_out_typed() -> None:
    """Rank 0's gather used to meet rank 1's plan check on the default group: rank 0 printed
    garbage (the other's digest bytes as floats) and rank 1 aborted inside Gloo."""
    results = run_fault("main_only_print")
    timed_out = []
    for r in results:
        when, message = partita_error(r, "DistributedError")
        assert when - fault_time(r) <= TIMEOUT + SLACK, _explain(results)
        # The rank that times out first exits; the other may then meet a peer that is gone.
        hit = "within the collective timeout (5 s, PARTITA_COLLECTIVE_TIMEOUT)" in message
        assert hit or "A peer process has most likely died" in message, message
        assert not hit or "under is_main_process(): use partita.distributed.log" in message
        timed_out.append(hit)
    assert any(timed_out), _explain(results)
    kind = {0: "ShardedTensor.full", 1: "plan check"}
    for r in results:
        assert re.search(
            rf"^PARTITA DistributedError at [\d.]+: {kind[r.rank]} over", r.stderr, re.M
        )
    assert "sharding=" not in results[0].stdout  # nothing was printed


@pytest.fixture(scope="module")
def mismatch_run() -> list[RankResult]:
    """One run of four mistakes (shapes, dtypes, programs, prints), then a matching call."""
    results = run_fault("mismatch")
    assert [r.returncode for r in results] == [0, 0], _explain(results)
    return results


def mismatch_message(r: RankResult, case: str) -> str:
    found = re.search(rf"^PARTITA PlanMismatchError case={case} at [\d.]+: (.*)$", r.stderr, re.M)
    assert found, r.stderr[-3000:]
    assert "ranks [0] have plan" in found[1] and "ranks [1] have plan" in found[1]
    return found[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "mine", "theirs"),
    [
        # Used to run and print the same wrong sum on both ranks, exit status 0.
        ("shapes", "shape (8, 4), dtype torch.float32", "shape (10, 4), dtype torch.float32"),
        # Used to abort both processes inside Gloo ("Received data size doesn't match").
        ("dtypes", "shape (8, 4), dtype torch.float32", "shape (8, 4), dtype torch.float64"),
    ],
)
def test_different_inputs_are_a_plan_mismatch(
    mismatch_run: list[RankResult], case: str, mine: str, theirs: str
) -> None:
    for r in mismatch_run:
        message = mismatch_message(r, case)
        a, b = (mine, theirs) if r.rank == 0 else (theirs, mine)
        sharding = "sharding P('data', None)"
        assert (
            f"The first difference is input 0 (args[0]): this rank ({r.rank}) has {a}, "
            f"{sharding}; rank {1 - r.rank} has {b}, {sharding}." in message
        ), message
        assert "same global shapes, dtypes and specs" in message
        assert f"case={case} ran" not in r.stdout


@pytest.mark.slow
def test_different_programs_are_a_plan_mismatch(mismatch_run: list[RankResult]) -> None:
    for r in mismatch_run:
        message = mismatch_message(r, "programs")
        mine, theirs = ("sum", "amax") if r.rank == 0 else ("amax", "sum")
        assert re.search(
            rf"of the per-device program: this rank \({r.rank}\) has `[^`]*{mine}[^`]*`, "
            rf"rank {1 - r.rank} has `[^`]*{theirs}[^`]*`",
            message,
        ), message
        assert "per-rank branches" in message


@pytest.mark.slow
def test_printing_different_values_is_an_error(mismatch_run: list[RankResult]) -> None:
    """Gathers of different sizes on one group used to abort in Gloo or read the peer's bytes."""
    shapes = {0: "(8, 4)", 1: "(6, 4)"}
    for r in mismatch_run:
        found = re.search(r"^PARTITA DistributedError case=prints at [\d.]+: (.*)$", r.stderr, re.M)
        assert found, r.stderr[-3000:]
        mine, other = shapes[r.rank], shapes[1 - r.rank]
        assert (
            f"called on different values by different processes: this rank ({r.rank}) gathers "
            f"a value of shape {mine}, dtype torch.float32, sharding P('data', None); rank "
            f"{1 - r.rank} one of shape {other}" in found[1]
        ), found[1]
        assert "use partita.distributed.log(x) on every process" in found[1]
        assert "sharding=" not in r.stdout  # nothing was printed


@pytest.mark.slow
def test_a_plan_mismatch_leaves_the_run_usable(mismatch_run: list[RankResult]) -> None:
    """The checks run before any collective that could mismatch: the ranks stay in step."""
    losses = [re.findall(r"^after mismatches loss=\S+$", r.stdout, re.M) for r in mismatch_run]
    assert losses[0] and losses[0] == losses[1], _explain(mismatch_run)


# --- checkpoints (2 processes) -------------------------------------------------------------


def _checkpoint_template() -> dict[str, torch.Tensor]:
    mesh = Mesh.create((2,), ("data",))
    return {
        "w": ShardedTensor.from_global(torch.zeros(4, 2), P(None, "data").to_sharding(mesh, 2)),
        "b": torch.zeros(3),
    }


def _checkpoint_offset(path: Path) -> float:
    """Which of faults.py's checkpoints (A: 0, B: 100, C: 200) ``path`` loads as."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PartitaWarning)  # left-overs beside it are expected
        got = ckpt.load(_checkpoint_template(), path)
    offset = float(got["b"][0])
    assert torch.equal(got["w"].full(), torch.arange(8.0).reshape(4, 2) + offset)
    assert torch.equal(got["b"], torch.arange(3.0) + offset)
    return offset


@pytest.mark.slow
def test_ranks_passing_different_paths_is_an_error_on_every_rank(tmp_path: Path) -> None:
    """Each rank used to write its own shards to its own path and return normally."""
    results = run_fault("ckpt_paths", FAULT_DIR=str(tmp_path))
    assert [r.returncode for r in results] == [0, 0], _explain(results)
    for r in results:
        for call, names in (("save", ("rank0", "rank1")), ("load", ("c", "d"))):
            found = re.search(
                rf"^PARTITA CheckpointError case={call} at [\d.]+: (.*)$", r.stderr, re.M
            )
            assert found, _explain(results)
            paths = ", ".join(f"rank {i}: '{tmp_path / name}'" for i, name in enumerate(names))
            assert f"checkpoint.{call}: the processes passed different paths ({paths})" in found[1]
            assert "Pass the same path on every process" in found[1]
        found = re.search(r"^PARTITA CheckpointError case=one at [\d.]+: (.*)$", r.stderr, re.M)
        assert found, _explain(results)
        mine = "checkpoint.save: 'note' is a str; a tensor dict holds ShardedTensors"
        theirs = f"checkpoint.save failed on rank 1 (so on every rank): {mine}"
        assert found[1].startswith(mine if r.rank == 1 else theirs), found[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # refused before any write
    assert _checkpoint_offset(tmp_path / "c") == 0.0


@pytest.mark.slow
def test_save_on_one_rank_only_times_out_typed(tmp_path: Path) -> None:
    """Used to be a raw Gloo RuntimeError out of the save's first broadcast."""
    results = run_fault(
        "ckpt_one_rank", FAULT_DIR=str(tmp_path), FAULT_STALL=f"{TIMEOUT + SLACK:g}"
    )
    alone, idle = results
    when, message = partita_error(alone, "CheckpointError")
    assert when - fault_time(alone) <= TIMEOUT + SLACK, _explain(results)
    assert message.startswith("checkpoint.save on rank 0 of 2: the check that every process")
    assert "every process must call it, with the same path" in message
    assert "collective timeout (5 s, PARTITA_COLLECTIVE_TIMEOUT)" in message
    assert idle.returncode == 0, _explain(results)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_rank_dying_inside_dcp_is_a_checkpoint_error_on_its_peer(tmp_path: Path) -> None:
    """DCP's own collectives (here: gathering the write results) are bounded and typed too."""
    results = run_fault("ckpt_rank_dies", FAULT_DIR=str(tmp_path))
    survivor, gone = results
    assert gone.returncode == 3, _explain(results)
    when, message = partita_error(survivor, "CheckpointError")
    assert when - fault_time(gone) <= TIMEOUT + SLACK, _explain(results)
    assert message.startswith(
        "checkpoint.save on rank 0 of 2: torch.distributed.checkpoint's planning and finishing"
    ), message
    assert "every process must call it" in message
    assert _checkpoint_offset(tmp_path / "c") == 0.0  # A, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # rank 0 removed the temporary


#: The checkpoint at the path after a crash at each point: A (0) before, B (100) once B is
#: complete and the old one is out of the way.
CRASHED = {
    "restored": 0.0,
    "leftovers_removed": 0.0,
    "files_written": 0.0,
    "manifest_written": 0.0,
    "old_moved_aside": 100.0,
    "new_renamed": 100.0,
    "old_removed": 100.0,
}


@pytest.mark.slow
@pytest.mark.parametrize("point", directory.CRASH_POINTS)
def test_a_save_crashed_at_any_point_keeps_a_complete_checkpoint(
    tmp_path: Path, point: str
) -> None:
    """Rank 0 os._exit()s after each filesystem step of saving B over A. A crash between
    the two renames used to leave no checkpoint at the path, and the next save deleted both."""
    assert set(CRASHED) == set(directory.CRASH_POINTS)
    env = {"FAULT_DIR": str(tmp_path), "FAULT_CRASH_AT": point}
    path = tmp_path / "c"
    if point == "restored":  # a save that stopped between its renames left A aside
        ckpt.save(_checkpoint_state(0.0), path)
        path.rename(tmp_path / "c.old-00000000000000a1")
        env["FAULT_FIRST_SAVE"] = "0"
    results = run_fault("ckpt_crash", **env)
    crashed, peer = results
    assert crashed.returncode == 3, _explain(results)
    fault_time(crashed)
    _, message = partita_error(peer, "CheckpointError")
    assert message.startswith("checkpoint.save on rank 1 of 2: "), message
    assert CRASHED[point] == _checkpoint_offset(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PartitaWarning)  # naming the left-overs it cleans up
        ckpt.save(_checkpoint_state(200.0), path)  # the next save succeeds, and is complete
    assert _checkpoint_offset(path) == 200.0
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "partita.json"]


def _checkpoint_state(offset: float) -> dict[str, torch.Tensor]:
    mesh = Mesh.create((2,), ("data",))
    w = torch.arange(8.0).reshape(4, 2) + offset
    return {
        "w": ShardedTensor.from_global(w, P("data", None).to_sharding(mesh, 2)),
        "b": torch.arange(3.0) + offset,
    }


# --- every call is checked, not only a program's first run (2 processes) ----------------------


@pytest.fixture(scope="module")
def calls_run() -> list[RankResult]:
    """After warm-up the ranks call different variants; then both call every variant."""
    results = run_fault("calls")
    assert [r.returncode for r in results] == [0, 0], _explain(results)
    return results


def _calls_error(r: RankResult, case: str, kind: str = "PlanMismatchError") -> str:
    found = re.search(rf"^PARTITA {kind} case={case} at [\d.]+: (.*)$", r.stderr, re.M)
    assert found, f"case {case}: rank {r.rank}\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}"
    assert f"case={case} ran" not in r.stdout
    return found[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "mine", "theirs"),
    [
        # Both ranks used to print 9.0 (right: 8.0 on rank 0, 10.0 on rank 1).
        ("shapes", "shape (8, 4), dtype torch.float32", "shape (10, 4), dtype torch.float32"),
        # Used to abort rank 0 inside Gloo (SIGABRT).
        ("dtypes", "shape (8, 4), dtype torch.float32", "shape (8, 4), dtype torch.float64"),
        # The short last batch is a first run on rank 1 only, beside rank 0's warmed-up
        # full-batch program (reported: a loss neither one-process run gives).
        ("short_batch", "shape (8, 4), dtype torch.float32", "shape (6, 4), dtype torch.float32"),
        # check_calls=False skips the check after a program's first run, never the first run.
        ("unchecked_first", "shape (8, 4), dtype torch.float32",
         "shape (10, 4), dtype torch.float32"),
    ],
)  # fmt: skip
def test_calls_after_warm_up_are_checked(
    calls_run: list[RankResult], case: str, mine: str, theirs: str
) -> None:
    for r in calls_run:
        message = _calls_error(r, case)
        a, b = (mine, theirs) if r.rank == 0 else (theirs, mine)
        assert re.search(
            rf"The first difference is input \d \(args\[\d\]\): this rank \({r.rank}\) has "
            rf"{re.escape(a)}, sharding P\('data', None\); rank {1 - r.rank} has {re.escape(b)}",
            message,
        ), message
        assert "ranks [0] have plan" in message and "ranks [1] have plan" in message


@pytest.mark.slow
def test_two_compiled_functions_on_two_ranks_are_a_mismatch(calls_run: list[RankResult]) -> None:
    """``double`` on rank 0 and ``triple`` on rank 1 used to give 80.0 on both (right: 64, 96)."""
    for r in calls_run:
        message = _calls_error(r, "functions")
        assert "of the per-device program" in message and "per-rank branches" in message


@pytest.mark.slow
def test_unseeded_replicas_are_an_error(calls_run: list[RankResult]) -> None:
    for r in calls_run:
        message = _calls_error(r, "replicas", "ReplicaMismatchError")
        assert (
            "2 of the 2 replicated input(s) differ between ranks that must hold equal copies "
            "of them: parameter 'weight' (input 0), replicated over mesh axis 'data': ranks "
            "[0], ranks [1] hold 2 different values; parameter 'bias' (input 1)" in message
        ), message
        assert "torch.manual_seed(0) before model = ..." in message
        assert "PARTITA_CHECK_REPLICAS=0" in message


@pytest.mark.slow
def test_the_run_stays_usable_and_every_variant_is_right(calls_run: list[RankResult]) -> None:
    """After the five errors, both ranks run every variant and get one process's values."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 3, generator=gen), torch.randn(8, 4, generator=gen)
    w = w - 0.1 * (x @ w).tanh().mean() * w
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    want = {
        "quarter8": 8.0, "quarter10": 10.0, "quarter64": 8.0, "double": 64.0, "triple": 96.0,
        "loss": float(((x @ w) ** 2).mean()), "short": float(((x[:6] @ w) ** 2).mean()),
        "forward": model(x).sum().item(),
    }  # fmt: skip
    for r in calls_run:
        got = dict(re.findall(r"^after (\w+)=(\S+)$", r.stdout, re.M))
        assert set(got) == set(want), _explain(calls_run)
        for name, value in want.items():
            assert float(got[name]) == pytest.approx(value, rel=1e-5, abs=1e-6), (name, r.rank)


def test_replica_digest_is_exact_and_axes_are_the_replicated_ones() -> None:
    from partita.runtime.plan_check import replicated_axes, tensor_digest

    x = torch.randn(4, 3)
    y = x.clone()
    y.view(-1)[5] = torch.nextafter(y.view(-1)[5], torch.tensor(10.0))  # one ulp apart
    assert tensor_digest(x) == tensor_digest(x.clone()) != tensor_digest(y)
    assert tensor_digest(x) != tensor_digest(x.reshape(3, 4))  # shape counts too
    assert tensor_digest(torch.tensor(1.5)) == tensor_digest(torch.tensor(1.5))  # 0-dim
    mesh = Mesh.create((2, 2, 1), ("data", "model", "pipe"))
    params = partita.Sharding(mesh, (("model",), ()))
    assert replicated_axes(params) == ("data",)  # 'pipe' has one device: nothing to compare
    assert replicated_axes(partita.Sharding(mesh, ((), ()), partial=("data",))) == ("model",)


def test_replica_groups_follow_the_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a (2, 2) mesh a weight split over 'model' is compared within each 'data' group: ranks
    1 and 3 differ while 0 and 2 agree; every rank sees every group and raises alike."""
    from partita.errors import ReplicaMismatchError
    from partita.runtime import plan_check

    mesh = Mesh.create((2, 2), ("data", "model"))
    step = partita.jit(
        lambda x, w: (x @ w).sum(), mesh=mesh, in_specs=(P("data", None), P(None, "model"))
    )
    compiled = step._compile((torch.ones(4, 4), torch.ones(4, 6)), {})[0]
    assert [plan_check.replicated_axes(s) for s in compiled.input_shardings] == [
        ("model",),
        ("data",),
    ]
    # every rank's digests of (x, w): x agrees within each 'model' group {0, 1} and {2, 3}
    gathered = torch.tensor([[10, 7], [10, 8], [20, 7], [20, 9]], dtype=torch.int64)
    monkeypatch.setattr(plan_check, "gather_flat", lambda *a, **k: gathered)
    monkeypatch.setattr(plan_check.dist, "get_world_size", lambda *a: 4)
    local = [torch.ones(2, 4), torch.ones(4, 3)]
    with pytest.raises(
        ReplicaMismatchError,
        match=re.escape(
            "1 of the 2 replicated input(s) differ between ranks that must hold equal copies of "
            "them: w (input 1), replicated over mesh axis 'data': ranks [1], ranks [3] "
            "hold 2 different values."
        ),
    ):
        plan_check.check_replicas(compiled, local, [True, True], mesh)
    # only the user's values are compared: w computed by partita is skipped, x agrees
    plan_check.check_replicas(compiled, local, [True, False], mesh)
