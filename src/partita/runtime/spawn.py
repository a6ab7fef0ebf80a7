"""Starting a multi-process run on this machine without torchrun: for tests and benchmarks.

``spawn`` starts ``world_size`` processes of a script with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ...), each in a session of its own, waits with a
deadline and kills what is left, so a test can never hang or leave processes behind.
Everything stays on loopback: the rendezvous store (rank 0 binds it to ``MASTER_ADDR``) and,
on Linux, Gloo's own sockets (``GLOO_SOCKET_IFNAME=lo`` unless set).

How a rank's process starts is a ``Starter``: by default ``popen_rank`` (a fresh
``python argv``); the test suite may start ranks from a pre-imported process instead
(tests/rank_zygote.py: the ``starter`` argument, or ``default_starter``, set by a test fixture).

This module does not join runs (``runtime.launch`` does).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["RankProcess", "RankResult", "Starter", "free_port", "popen_rank", "spawn"]


class RankProcess(Protocol):
    """What ``spawn`` uses of a started rank (a ``subprocess.Popen`` has it): its id is also
    the id of its session (it must call ``setsid``)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...

    def communicate(self) -> tuple[str, str]: ...


#: Starts ``python argv`` with environment ``env`` in a session of its own, stdout and stderr
#: captured as text.
Starter = Callable[[Sequence[str], Mapping[str, str]], RankProcess]


def popen_rank(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[str]:
    """A fresh interpreter: ``python argv``."""
    return subprocess.Popen(
        [sys.executable, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: killed as a whole by spawn
    )


#: The starter of ``spawn`` calls that name none.
default_starter: Starter = popen_rank


@dataclass
class RankResult:
    """What one spawned process did."""

    rank: int
    returncode: int | None  # None: killed at the deadline
    stdout: str
    stderr: str
    seconds: float
    pid: int = 0  # also the id of its session: every process it started is in it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(
    argv: Sequence[str],
    world_size: int,
    *,
    ranks: Sequence[int] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    master_port: int | None = None,
    kill_after: Mapping[int, float] | None = None,
    starter: Starter | None = None,
) -> list[RankResult]:
    """Run ``python argv`` as ranks ``ranks`` (default all) of a ``world_size`` run on
    127.0.0.1, without torchrun; wait at most ``timeout`` seconds, then kill what is left.

    ``kill_after={rank: seconds}`` SIGKILLs that rank after so many seconds (to test failure).
    ``starter`` starts each process (default ``default_starter``: a fresh interpreter).

    Example (4 processes training for a few seconds; tests/test_distributed.py runs it):
        >>> argv = ["examples/train_gpt.py", "--steps", "2"]
        >>> results = spawn(argv, 4, timeout=60)  # doctest: +SKIP
        >>> [r.returncode for r in results]  # doctest: +SKIP
        [0, 0, 0, 0]
    """
    port = master_port or free_port()
    start = starter or default_starter
    procs: dict[int, RankProcess] = {}
    started = time.monotonic()
    for rank in ranks if ranks is not None else range(world_size):
        penv = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": (env or {}).get("OMP_NUM_THREADS", "1"),
        }
        if sys.platform == "linux":  # Gloo's own sockets on loopback too, not on the host's IP
            penv.setdefault("GLOO_SOCKET_IFNAME", "lo")
        penv.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs[rank] = start(argv, penv)
    pending_kills = dict(kill_after or {})
    outputs: dict[int, tuple[str, str]] = {}
    ended: dict[int, float] = {}
    try:

        def reader(rank: int, p: RankProcess) -> None:
            out, err = p.communicate()
            outputs[rank] = (out, err)
            ended[rank] = time.monotonic() - started

        threads = [
            threading.Thread(target=reader, args=(r, p), daemon=True) for r, p in procs.items()
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            elapsed = time.monotonic() - started
            for rank, after in list(pending_kills.items()):
                if elapsed >= after:
                    _kill(procs[rank])
                    del pending_kills[rank]
            if elapsed > timeout:
                break
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                _kill(p)
        for p in procs.values():
            p.wait()
    time.sleep(0.05)
    results = []
    for rank, p in procs.items():
        out, err = outputs.get(rank, ("", ""))
        timed_out = rank not in ended
        results.append(
            RankResult(
                rank,
                None if timed_out else p.returncode,
                out,
                err,
                ended.get(rank, time.monotonic() - started),
                p.pid,
            )
        )
    return results


def _kill(p: RankProcess) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
