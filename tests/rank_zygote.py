"""A pre-imported "zygote" that starts the rank processes of ``runtime.spawn.spawn`` in tests.

Each rank that ``spawn`` starts as a fresh ``python script.py`` imports torch and partita
before it does anything: about 3 s of CPU, most of what a short fault test costs. The zygote is
one process per test session (per xdist worker) that has imported them once, starts no thread
and runs no torch operation; for each rank it forks a child that sets up what a fresh process
would have -- its own session (``setsid``), its environment, stdin from /dev/null, stdout and
stderr to files, its working directory, ``sys.argv``, ``sys.path[0]`` (the script's directory),
a fresh random seed -- and runs the script as ``__main__``, then exits as Python does
(``SystemExit``'s code, 1 and a traceback for an uncaught exception, non-daemon threads joined,
``atexit`` handlers run).

What torch reads from the environment at import (``TORCH*``, ``OMP_*``, ``PYTHON*``, ...) would
be frozen in the zygote: a rank whose environment differs from the zygote's in such a variable,
or a command that is not ``script.py args``, is started as a fresh process instead. partita
reads its ``PARTITA_*`` variables when used (``options.current`` looks at the environment on
every call), never at import.

The guarantees of ``spawn`` hold: a rank is a process of its own in a session of its own
(``spawn`` kills it with ``killpg`` at the deadline), and it dies with the zygote
(``PR_SET_PDEATHSIG``), which dies with the test process (the same, and its stdin closing).

Opt in with the ``rank_zygote`` fixture (tests/conftest.py):
``pytestmark = pytest.mark.usefixtures("rank_zygote")``.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from partita.runtime.spawn import popen_rank

#: Environment variables read at import (by the interpreter, torch, OpenMP, MKL, ...): a rank
#: whose value differs from the zygote's is started fresh.
FROZEN_PREFIXES = (
    "PYTHON", "TORCH", "PYTORCH", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_",
    "MALLOC", "CUDA", "TRITON", "LC_", "LANG",
)  # fmt: skip
#: ... but read when used: inductor sets this one in the test process at its first compile.
LAZY = ("TORCHINDUCTOR_CACHE_DIR",)

PRELOAD = (
    "torch", "torch.nn.functional", "torch.distributed", "torch.distributed.checkpoint",
    "partita", "partita.distributed", "partita.checkpoint", "partita.options", "partita.models",
    "partita.training", "partita.data",
)  # fmt: skip

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def frozen(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(FROZEN_PREFIXES) and k not in LAZY}


# --- the client (in the test process) ----------------------------------------------------


class ZygoteProcess:
    """A rank forked by the zygote, with the part of ``subprocess.Popen`` that spawn uses."""

    def __init__(self, zygote: Zygote, pid: int, tmp: str) -> None:
        self.zygote, self.pid, self.tmp = zygote, pid, tmp
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_status(self.pid, block=False)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exit_status(self.pid, block=True)
        assert self.returncode is not None
        return self.returncode

    def communicate(self) -> tuple[str, str]:
        self.wait()
        try:
            out = Path(self.tmp, "out").read_text()
            err = Path(self.tmp, "err").read_text()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return out, err


class Zygote:
    """The zygote process and its replies; ``zygote(argv, env)`` starts one rank."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=os.getcwd(),
        )
        self.lock = threading.Condition()
        self.writing = threading.Lock()  # one request at a time on its stdin
        self.started: dict[int, int | str] = {}  # request id -> pid, or the error
        self.exits: dict[int, int] = {}  # pid -> exit status as Popen.returncode
        self.gone = False
        self.next_id = 0
        self.forked = self.fresh = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, a, b = line.decode().split(" ", 2)
            with self.lock:
                if kind == "S":
                    self.started[int(a)] = int(b) if b.strip().isdigit() else b
                else:
                    self.exits[int(a)] = int(b)
                self.lock.notify_all()
        with self.lock:
            self.gone = True
            self.lock.notify_all()

    def exit_status(self, pid: int, *, block: bool) -> int | None:
        with self.lock:
            while pid not in self.exits:
                if self.gone:  # its ranks died with it (PR_SET_PDEATHSIG)
                    return -signal.SIGKILL
                if not block:
                    return None
                self.lock.wait(0.5)
            return self.exits[pid]

    def __call__(self, argv: Sequence[str], env: Mapping[str, str]) -> Any:
        script = argv[0] if argv else ""
        if (
            self.gone
            or not script.endswith(".py")
            or not Path(script).is_file()
            or frozen(env) != frozen(self.env)
        ):
            self.fresh += 1
            return popen_rank(argv, env)
        tmp = tempfile.mkdtemp(prefix="partita-rank-")
        with self.lock:
            rid = self.next_id
            self.next_id += 1
        request = {
            "id": rid, "argv": list(argv), "env": dict(env), "cwd": os.getcwd(),
            "out": os.path.join(tmp, "out"), "err": os.path.join(tmp, "err"),
        }  # fmt: skip
        assert self.proc.stdin is not None
        with self.writing:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        with self.lock:
            while rid not in self.started and not self.gone:
                self.lock.wait(0.5)
            pid = self.started.get(rid)
        if not isinstance(pid, int):
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"the rank zygote could not start {list(argv)}: {pid}")
        self.forked += 1
        return ZygoteProcess(self, pid, tmp)

    def close(self) -> None:
        """Close its stdin: it kills the sessions of the ranks still running and exits."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- the zygote (``python tests/rank_zygote.py``) ------------------------------------------


def _exit_code(code: object) -> int:
    """The exit status of ``raise SystemExit(code)``, as the interpreter makes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_main(script: str) -> None:
    """Run ``script`` as ``python script`` does: a new ``__main__`` module (in ``sys.modules``
    for the rest of the process), its ``__file__`` absolute (since Python 3.9)."""
    import builtins
    import importlib.machinery
    import types

    path = os.path.abspath(script)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    code = compile(Path(path).read_bytes(), path, "exec")  # honours a coding cookie
    exec(code, main.__dict__)


def _run_rank(request: dict[str, Any]) -> int:
    """In the forked child: become the fresh process a ``python script.py`` would be."""
    import atexit

    import torch

    os.setsid()
    _die_with_parent()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.close(null)
    # As a fresh interpreter has them: stdout block-buffered to a file (unless
    # PYTHONUNBUFFERED), stderr line-buffered and never failing on an unencodable character.
    unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False, buffering=1 if unbuffered else -1)
    sys.stderr = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    torch.seed()  # a fresh process's default generator starts from a random seed too
    code = 0
    try:
        _run_main(script)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads
    except BaseException:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    return code


def _serve() -> None:
    import importlib

    _die_with_parent()
    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1
    sys.stdout.flush()
    out = sys.stdout.buffer
    children: set[int] = set()
    buffered = b""

    def reply(line: str) -> None:
        out.write(line.encode() + b"\n")
        out.flush()

    def reap() -> None:
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            children.discard(pid)
            reply(f"X {pid} {os.waitstatus_to_exitcode(status)}")

    while True:
        ready, _, _ = select.select([0], [], [], 0.02 if children else 0.5)
        if ready:
            data = os.read(0, 1 << 16)
            if not data:  # the test process closed our stdin, or is gone
                break
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        code = _run_rank(request)
                    finally:
                        os._exit(code)
                children.add(pid)
                reply(f"S {request['id']} {pid}")
        reap()
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    _serve()
