"""Joining a multi-process run, with a deadline; and starting local processes for tests.

``join_and_init`` is what ``partita.distributed.initialize()`` does: read torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), connect to the rendezvous TCPStore (torchrun's agent store, or one hosted by
rank 0 when processes are started without torchrun), check in, and wait for every rank with a
deadline. A rank that never arrives makes every waiting rank raise
:class:`~partita.errors.JoinTimeoutError` naming the missing ranks, the hosts that did join,
and saying that the script must be launched on every host. Only then is the process group
created (Gloo on CPU, NCCL on CUDA) with a bounded collective timeout, so a rank that dies
later makes the others fail instead of waiting forever.

Rank 0's store listens on ``MASTER_ADDR`` only (it is unauthenticated), and the collective
timeout chosen here is what every later process group gets (``active_collective_timeout``).
``spawn``, ``free_port`` and ``RankResult`` (local processes for tests) live in
``runtime.spawn`` and are re-exported here.

This module does not run programs (``runtime.distributed`` does).
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from partita import options
from partita.errors import DistributedError, JoinTimeoutError, LaunchError, OptionError
from partita.options import CompileOptions
from partita.runtime.spawn import RankResult, free_port, spawn
from partita.values.layout import ceil_div

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEFAULT_JOIN_TIMEOUT",
    "ProcessEnv",
    "RankResult",
    "active_collective_timeout",
    "connect_store",
    "free_port",
    "join_and_init",
    "listen_socket",
    "read_env",
    "spawn",
]

#: Seconds to wait for every rank to join (the option ``join_timeout``,
#: ``PARTITA_JOIN_TIMEOUT``, overrides).
DEFAULT_JOIN_TIMEOUT = CompileOptions().join_timeout
#: Seconds a collective may wait for its peers (the option ``collective_timeout``,
#: ``PARTITA_COLLECTIVE_TIMEOUT``, overrides).
DEFAULT_COLLECTIVE_TIMEOUT = CompileOptions().collective_timeout

_POLL = 0.1


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the run, from torchrun's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store (workers are clients)
    restart: int


def _integer(env: Mapping[str, str], name: str, low: int, high: int | None, why: str) -> int:
    """``env[name]`` as an int in ``[low, high)`` (no upper bound if None), else an error."""
    text = env[name]
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is not None and value >= low and (high is None or value < high):
        return value
    bound = f"{low} <= {name} < {high}" if high is not None else f"{name} >= {low}"
    problem = "is not an integer" if value is None else f"is out of range ({bound}: {why})"
    raise DistributedError(
        f"{name}={text!r} {problem}. partita reads the launcher's environment (RANK, "
        f"WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) to "
        f"join the run. Launch with torchrun, which sets them all, or set {name} to "
        f"{'an integer' if value is None else 'a value'} with {bound}; unset RANK and "
        f"WORLD_SIZE to run one process on the simulated mesh."
    )


def read_env(environ: Mapping[str, str] | None = None) -> ProcessEnv | None:
    """The torchrun environment, or None when this process was not started by a launcher.

    Every variable is checked here: a value that is not an integer, a RANK outside
    ``0 .. WORLD_SIZE - 1``, a negative LOCAL_RANK or a MASTER_PORT outside 1..65535 is a
    DistributedError naming the variable (not a failure later in the rendezvous).
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise DistributedError(
            f"RANK and WORLD_SIZE are set but {missing} are not: cannot find the rendezvous. "
            f"Launch with torchrun (which sets them all), or set MASTER_ADDR and MASTER_PORT "
            f"to rank 0's host and a free port."
        )
    world = _integer(env, "WORLD_SIZE", 1, None, "the number of processes")
    rank = _integer(env, "RANK", 0, world, f"ranks are 0..{world - 1} for WORLD_SIZE={world}")
    local_world = (
        _integer(env, "LOCAL_WORLD_SIZE", 1, world + 1, "the processes of this host")
        if "LOCAL_WORLD_SIZE" in env
        else world
    )
    local_rank = (
        _integer(env, "LOCAL_RANK", 0, local_world, "this process's index on its host")
        if "LOCAL_RANK" in env
        else rank % local_world
    )
    node_rank = (
        _integer(env, "GROUP_RANK", 0, None, "this host's index")
        if "GROUP_RANK" in env
        else rank // local_world
    )
    restart = (
        _integer(env, "TORCHELASTIC_RESTART_COUNT", 0, None, "torchrun's restart count")
        if "TORCHELASTIC_RESTART_COUNT" in env
        else 0
    )
    return ProcessEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=env["MASTER_ADDR"],
        master_port=_integer(env, "MASTER_PORT", 1, 65536, "a TCP port"),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True",
        restart=restart,
    )


def _seconds(value: float | None, argument: str, option: str) -> float:
    """An explicit argument, checked as the options check theirs; else the option's value
    (``partita.options.current()``: the environment variable, validated there)."""
    if value is None:
        return float(getattr(options.current(), option))
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise OptionError(
            f"partita.distributed.initialize({argument}={value!r}): {argument} must be a "
            f"finite number of seconds > 0 (like CompileOptions.{option} and its environment "
            f"variable PARTITA_{option.upper()}). Pass e.g. {argument}=300, or leave it out "
            f"to use the option."
        )
    return float(value)


def join_timeout(value: float | None = None) -> float:
    """Seconds every rank may take to join: ``value``, else ``options.current().join_timeout``."""
    return _seconds(value, "timeout", "join_timeout")


def collective_timeout(value: float | None = None) -> float:
    """Seconds one collective may wait: ``value``, else the option ``collective_timeout``."""
    return _seconds(value, "collective_timeout", "collective_timeout")


#: The collective timeout join_and_init gave the default group (None before it ran).
_ACTIVE_COLLECTIVE_TIMEOUT: float | None = None


def active_collective_timeout() -> float:
    """Seconds a collective may wait: what ``join_and_init`` used, else the environment's.

    Every process group partita creates later (one per set of mesh axes) gets the same bound.
    """
    if _ACTIVE_COLLECTIVE_TIMEOUT is not None:
        return _ACTIVE_COLLECTIVE_TIMEOUT
    return collective_timeout()


#: Who joined (rank -> "host node=.. local_rank=.."), filled by join_and_init.
JOINED: dict[int, str] = {}


def _launch_hint(env: ProcessEnv) -> str:
    nodes = ceil_div(env.world_size, max(env.local_world_size, 1))
    return (
        f"The same script must be launched on every host: torchrun --nnodes={nodes} "
        f"--node-rank=<0..{nodes - 1}> --nproc-per-node={env.local_world_size} "
        f"--master-addr={env.master_addr} --master-port={env.master_port} <script> ... on each "
        f"of the {nodes} host(s), within PARTITA_JOIN_TIMEOUT seconds of each other."
    )


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host:port`` only (never to every interface).

    The rendezvous store is unauthenticated: anyone who reaches it can join or disturb the
    run. TCPStore alone binds its server to every interface, so rank 0 binds the socket here,
    to MASTER_ADDR (127.0.0.1 for a one-host run), and hands it to the store.
    """
    errors = []
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
        except OSError as e:
            sock.close()
            errors.append(f"{address}: {e}")
            continue
        return sock
    raise LaunchError(f"cannot listen on {host}:{port}: {'; '.join(errors) or 'no address'}")


def connect_store(env: ProcessEnv, timeout: float) -> dist.Store:
    """Connect to the rendezvous store (rank 0 without torchrun hosts it, on MASTER_ADDR)."""
    is_master = env.rank == 0 and not env.agent_store
    fd = None
    if is_master:
        try:
            # The store takes ownership of the socket's file descriptor (and closes it).
            fd = listen_socket(env.master_addr, env.master_port).detach()
        except OSError as e:
            raise DistributedError(
                f"rank 0 (host {socket.gethostname()}) cannot host the rendezvous store on "
                f"MASTER_ADDR:MASTER_PORT = {env.master_addr}:{env.master_port}: {e}. Another "
                f"process holds the port (an earlier run still alive?), or MASTER_ADDR is not "
                f"an address of this host. Choose a free MASTER_PORT, or set MASTER_ADDR to "
                f"an address of rank 0's host (127.0.0.1 for a one-host run)."
            ) from e
    try:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            None,
            is_master,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except Exception as e:
        who = "the torchrun agent of node 0" if env.agent_store else "rank 0"
        raise JoinTimeoutError(
            f"rank {env.rank} (host {socket.gethostname()}) could not reach the rendezvous "
            f"store at {env.master_addr}:{env.master_port}, which {who} hosts, within "
            f"{timeout:g} s: rank 0 never joined (or MASTER_ADDR/MASTER_PORT are wrong). "
            f"{_launch_hint(env)} ({type(e).__name__}: {str(e).strip().splitlines()[0]})"
        ) from e
    if env.agent_store:  # torchrun namespaces each restart attempt
        return dist.PrefixStore(f"/partita/attempt_{env.restart}", store)
    return dist.PrefixStore("/partita", store)


def join(env: ProcessEnv, timeout: float) -> dist.Store:
    """Check in and wait until every rank has; JoinTimeoutError after ``timeout`` seconds."""
    start = time.monotonic()
    store = connect_store(env, timeout)
    me = (
        f"{socket.gethostname()} node={env.node_rank} local_rank={env.local_rank} pid={os.getpid()}"
    )
    keys = [f"join/{r}" for r in range(env.world_size)]
    try:
        store.set(keys[env.rank], me)
        store.add("joined", 1)
        while store.add("joined", 0) < env.world_size:
            if time.monotonic() - start > timeout:
                break
            time.sleep(_POLL)
        present = [r for r in range(env.world_size) if store.check([keys[r]])]
        joined = {r: store.get(keys[r]).decode() for r in present}
        store.add("read", 1)
        if env.rank == 0 and not env.agent_store:
            # This process hosts the store: keep it up until every rank that joined has read
            # who did (each waits out its own deadline), so that they all report the missing
            # ranks rather than a lost store. Bounded: a rank that died is not waited for long.
            grace = time.monotonic() + min(10.0, timeout)
            while store.add("read", 0) < len(present) and time.monotonic() < grace:
                time.sleep(_POLL)
    except JoinTimeoutError:
        raise
    except Exception as e:
        raise JoinTimeoutError(
            f"rank {env.rank} lost the rendezvous store at {env.master_addr}:"
            f"{env.master_port} while waiting for the other ranks to join (rank 0, which "
            f"hosts it, has probably given up or died). {_launch_hint(env)} "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0]})"
        ) from e
    missing = [r for r in range(env.world_size) if r not in joined]
    if missing:
        hosts: dict[str, list[int]] = {}
        for r, text in sorted(joined.items()):
            hosts.setdefault(text.split()[0], []).append(r)
        arrived = "; ".join(f"host {h}: ranks {_ranges(rs)}" for h, rs in hosts.items())
        per_node = max(env.local_world_size, 1)
        nodes = sorted({r // per_node for r in missing})
        raise JoinTimeoutError(
            f"partita: rank(s) {_ranges(missing)} (of {env.world_size}) never joined within "
            f"{timeout:g} s (PARTITA_JOIN_TIMEOUT); they would run on node(s) {nodes} "
            f"({per_node} processes per node). Joined: {arrived}. The host(s) of the missing "
            f"ranks were never launched, or crashed before partita.distributed.initialize(). "
            f"{_launch_hint(env)}"
        )
    JOINED.clear()
    JOINED.update(joined)
    return store


def join_and_init(
    env: ProcessEnv,
    *,
    timeout: float | None = None,
    backend: str | None = None,
    collective_timeout_s: float | None = None,
) -> None:
    """Join with a deadline, then create the default process group over the joined store."""
    global _ACTIVE_COLLECTIVE_TIMEOUT
    # Both timeouts are checked before joining: a bad value is this process's OptionError,
    # not a failed rendezvous that the other ranks blame on rank 0.
    joining, seconds = join_timeout(timeout), collective_timeout(collective_timeout_s)
    store = join(env, joining)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=seconds),
    )
    _ACTIVE_COLLECTIVE_TIMEOUT = seconds


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    ranks = sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)
