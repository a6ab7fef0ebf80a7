"""Hardware profiles and the time of a collective or a local op on them.

A :class:`Hardware` profile is a few numbers: the peak FLOP/s and memory bandwidth of one
device, its memory, how many devices share a host, and one :class:`Link` (bandwidth, latency)
inside a host and one between hosts. A mesh axis whose device groups stay inside one host
crosses the host link; any other crosses the network (:func:`link_of`).

**Collectives** are timed with the alpha-beta model of ring algorithms
(:func:`collective_time`): ``steps * latency + wire_bytes / bandwidth``, where a group of ``n``
devices takes ``n - 1`` ring steps for all_gather, reduce_scatter and all_to_all, ``2 (n - 1)``
for all_reduce (a reduce-scatter then an all-gather) and one for a collective_permute, and
:func:`wire_bytes` is what each device sends. The bytes a collective is *reported* with follow
the Plan's convention (XLA's: the output of all_gather, all_reduce, all_to_all and
collective_permute, the input of reduce_scatter), so a record's ``bytes`` goes in unchanged.

A profile may add a ``call_overhead`` to every call: on a CPU shared by more processes than
it has cores, a call that interrupts compute waits for its peers' turn on a core. With a
``call_window``, a call after less compute than that since the previous call waits that much
less (the overhead grows linearly with the compute up to the window): a call right behind
another finds its peers already there. Its
``overlap_efficiency`` is the fraction of a collective's time that compute running beside it
hides (the step estimate, ``partition.estimate``, charges the rest).

**Local ops** follow a roofline (:func:`op_time`): the larger of the FLOPs at the profile's
sustained compute rate and the bytes read and written at its sustained memory bandwidth (where
the profile has a cache, an op's first ``cache_bytes`` at ``cache_bandwidth``), plus
the profile's ``op_overhead`` (the fixed cost of dispatching one op where the host runs ops
one after another: an eager CPU program), and never less than the fixed cost of launching one
op (``launch``: a GPU's kernel launch, which overlaps the previous kernel).

The profiles (:data:`PROFILES`, :func:`get_profile`) and where their numbers come from are
listed in ``docs/cost-model.md``; ``cpu-gloo`` was fitted on a 2-core machine by
``bench/bench_collectives.py``, which prints the fitted values. This module is pure values: it
never looks at the machine it runs on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partita.errors import ArgumentError

__all__ = [
    "PROFILES",
    "Hardware",
    "Link",
    "collective_time",
    "get_profile",
    "link_of",
    "memory_seconds",
    "op_time",
    "ring_steps",
    "wire_bytes",
]

#: The collective kinds partita emits.
KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "collective_permute")


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of connection between devices.

    Attributes:
        bandwidth: bytes per second one device sends over it (a ring's bus bandwidth).
        latency: seconds of fixed cost per ring step (per message).
    """

    bandwidth: float
    latency: float


@dataclass(frozen=True, slots=True)
class Hardware:
    """The numbers the cost model needs about one kind of machine.

    Attributes:
        name: the profile's name (``"cpu-gloo"``, ``"h100-nvlink-ib"``...).
        peak_flops: FLOP/s one device sustains on large matmuls at the training dtype.
        memory_bandwidth: bytes/s one device sustains reading and writing its memory.
        memory: bytes of memory per device (what "does it fit" compares against).
        devices_per_host: devices sharing one host (and its fast link).
        intra_host: the link between devices of one host.
        inter_host: the link between hosts.
        launch: seconds an op takes at least (a kernel launch; the roofline's floor).
        source: where the numbers come from, in words.
        collective_scale: ``{kind: factor}`` on the ring model's time, for a library that does
            not run that kind as a ring (Gloo's reduce_scatter); a missing kind is 1.
        call_overhead: seconds each collective call waits for its group to meet when it
            interrupts compute: on a CPU with more processes than cores, the peers' turn on a
            core (0 where every device has its own processor).
        overlap_efficiency: the fraction of a collective's time that compute running beside
            it hides (1: all of it, as when the collective has its own engine; less on a CPU
            whose cores the collective's threads share with the compute). The step estimate
            (``partition.estimate``) charges the rest.
        op_overhead: seconds added to every local op's roofline time: the dispatch of one
            op where ops run one after another on the host (an eager CPU program: Python,
            the dispatcher, the output's allocation); 0 where launches overlap the work.
        cache_bytes: bytes of one op that its cache serves (0: none, every byte at
            ``memory_bandwidth``): an op reading and writing ``b`` bytes moves ``min(b,
            cache_bytes)`` of them at ``cache_bandwidth`` and the rest at
            ``memory_bandwidth`` (:func:`memory_seconds`).
        cache_bandwidth: bytes/s of the part of an op inside ``cache_bytes``.
        overhead_efficiency: the fraction of a call's overhead (its wait for its peers) that
            compute running beside it hides; None: ``overlap_efficiency``, as for its bytes.
            Waiting takes no core, so on a shared CPU it hides more than the transfer does.
        call_window: seconds of compute since the previous collective call after which a
            call waits the whole ``call_overhead``; after less, it waits ``call_overhead *
            compute / call_window`` (peers drift apart while they compute). 0: every call
            waits the whole overhead.
        copy_bandwidth: bytes/s of the runtime's copies around collective calls
            (``cost.copies``: a bucket's packing, a gathered member's unpacking), fitted on
            those copies (:meth:`copy_seconds`); 0: priced as any memory-bound op.
    """

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory: int
    devices_per_host: int
    intra_host: Link
    inter_host: Link
    launch: float
    source: str = ""
    collective_scale: Mapping[str, float] = field(default_factory=dict)
    call_overhead: float = 0.0
    overlap_efficiency: float = 1.0
    op_overhead: float = 0.0
    cache_bytes: float = 0.0
    cache_bandwidth: float = 0.0
    call_window: float = 0.0
    overhead_efficiency: float | None = None
    copy_bandwidth: float = 0.0

    def collective_seconds(
        self,
        kind: str,
        nbytes: float,
        mesh: Any,
        mesh_axes: Sequence[Any],
        compute_before: float | None = None,
    ) -> float:
        """Seconds a collective of ``kind`` reported with ``nbytes`` takes over ``mesh_axes``
        of ``mesh``: the ring model on the link those axes cross (:func:`link_of`), times the
        kind's ``collective_scale``, plus the call's overhead (:meth:`call_seconds`; the whole
        ``call_overhead`` when ``compute_before`` is not known)."""
        n = mesh.axes_size(mesh_axes)
        if n <= 1:
            return 0.0
        link = link_of(self, mesh, mesh_axes)
        ring = collective_time(kind, nbytes, n, link) * self.collective_scale.get(kind, 1.0)
        return ring + self.call_seconds(compute_before)

    def call_seconds(self, compute_before: float | None = None) -> float:
        """The overhead of one collective call after ``compute_before`` seconds of compute
        since the previous call: ``call_overhead * min(1, compute_before / call_window)``,
        the whole overhead without a window or when the compute is not known (None)."""
        if compute_before is None or self.call_window <= 0:
            return self.call_overhead
        return self.call_overhead * min(1.0, max(0.0, compute_before) / self.call_window)

    def op_seconds(self, flops: float, nbytes: float) -> float:
        """Seconds one local op takes on this hardware (:func:`op_time`)."""
        return op_time(flops, nbytes, self)

    def copy_seconds(self, nbytes: float) -> float:
        """Seconds one of the runtime's copies around a call takes, reading and writing
        ``nbytes`` in all: ``op_overhead + nbytes / copy_bandwidth`` (at least ``launch``), or
        the op's roofline (:func:`op_time`) when the profile has no ``copy_bandwidth``."""
        if self.copy_bandwidth <= 0:
            return op_time(0.0, nbytes, self)
        return max(self.launch, self.op_overhead + nbytes / self.copy_bandwidth)

    def describe(self) -> str:
        """One line per number, for reports."""
        gb = 1e9
        return "\n".join(
            [
                f"{self.name}: {self.peak_flops / 1e12:.3g} TFLOP/s, "
                f"{self.memory_bandwidth / gb:.3g} GB/s memory, "
                f"{self.memory / 2**30:.3g} GiB per device, {self.devices_per_host} per host",
                f"  inside a host: {self.intra_host.bandwidth / gb:.3g} GB/s, "
                f"{self.intra_host.latency * 1e6:.3g} us per step",
                f"  between hosts: {self.inter_host.bandwidth / gb:.3g} GB/s, "
                f"{self.inter_host.latency * 1e6:.3g} us per step",
                f"  per op: {self.launch * 1e6:.3g} us at least, {self.op_overhead * 1e6:.3g} "
                f"us added; per collective call: "
                f"{self.call_overhead * 1e6:.3g} us"
                + (
                    f" (after {self.call_window * 1e6:.3g} us of compute or more, less after less)"
                    if self.call_window > 0
                    else ""
                ),
            ]
        )


def ring_steps(kind: str, group_size: int) -> int:
    """The messages in a row one device sends for ``kind`` over ``group_size`` devices."""
    _check_kind(kind)
    if group_size <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (group_size - 1)
    if kind == "collective_permute":
        return 1
    return group_size - 1


def wire_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one device sends for a collective reported with ``nbytes`` (the Plan's
    convention: output bytes, input bytes for reduce_scatter) over ``group_size`` devices.

    >>> wire_bytes("all_gather", 1024, 4)
    768.0
    >>> wire_bytes("all_reduce", 1024, 4)
    1536.0
    """
    _check_kind(kind)
    n = group_size
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind == "collective_permute":
        return float(nbytes)
    return (n - 1) / n * nbytes


def collective_time(kind: str, nbytes: float, group_size: int, link: Link) -> float:
    """Seconds a collective takes: ``ring_steps * latency + wire_bytes / bandwidth``.

    >>> round(collective_time("all_gather", 4e6, 4, Link(1e9, 1e-5)) * 1e3, 3)
    3.03
    """
    return ring_steps(kind, group_size) * link.latency + (
        wire_bytes(kind, nbytes, group_size) / link.bandwidth
    )


def op_time(flops: float, nbytes: float, hardware: Hardware) -> float:
    """Seconds one local op takes: ``op_overhead + max(flops / peak, bytes / bandwidth)``
    (the roofline plus the profile's per-op dispatch cost), at least its ``launch``.

    >>> hw = PROFILES["h100-nvlink-ib"]
    >>> op_time(0, 0, hw) == hw.launch
    True
    """
    roofline = max(flops / hardware.peak_flops, memory_seconds(nbytes, hardware))
    return max(hardware.launch, hardware.op_overhead + roofline)


def memory_seconds(nbytes: float, hardware: Hardware) -> float:
    """Seconds one op takes to read and write ``nbytes``: the first ``cache_bytes`` at the
    profile's ``cache_bandwidth``, the rest at its ``memory_bandwidth`` (all of them there
    when the profile has no cache).

    >>> hw = Hardware("x", 1e12, 1e9, 1, 1, Link(1, 0), Link(1, 0), 0.0, cache_bytes=1e6,
    ...               cache_bandwidth=1e10)
    >>> round(memory_seconds(3e6, hw) * 1e3, 6)  # 1 MB at 10 GB/s, 2 MB at 1 GB/s
    2.1
    """
    cached = min(nbytes, hardware.cache_bytes) if hardware.cache_bytes > 0 else 0.0
    inside = cached / hardware.cache_bandwidth if cached else 0.0
    return inside + (nbytes - cached) / hardware.memory_bandwidth


def link_of(hardware: Hardware, mesh: Any, mesh_axes: Iterable[Any]) -> Link:
    """The link a collective over ``mesh_axes`` of ``mesh`` crosses: the host link when every
    group of those axes lies inside one host (device ids ``0 .. devices_per_host - 1`` on the
    first host, and so on), the network otherwise. Vectorised over the mesh's device array,
    so a mesh of a million devices costs milliseconds."""
    axes = [mesh.axis_index(a) for a in mesh_axes]
    if not axes:
        return hardware.intra_host
    ids = np.asarray(mesh.devices)
    rest = [d for d in range(ids.ndim) if d not in axes]
    rows = np.transpose(ids, rest + axes).reshape(-1, math.prod(ids.shape[d] for d in axes))
    hosts = rows // hardware.devices_per_host
    return hardware.intra_host if bool((hosts == hosts[:, :1]).all()) else hardware.inter_host


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ArgumentError(f"unknown collective kind {kind!r}; the kinds are {KINDS}.")


_GB = 1e9

#: The named profiles. ``docs/cost-model.md`` gives every number's source.
PROFILES: dict[str, Hardware] = {
    # Fitted on this project's 2-core CI machine by bench/bench_collectives.py: 4 Gloo
    # processes on 127.0.0.1 sharing 2 cores (what the distributed tests and benches run).
    "cpu-gloo": Hardware(
        name="cpu-gloo",
        # fit 8 of issue 29 (docs/cost-model.md, "The quiet fit"): `bench_collectives.py
        # --repeat 9` with no other job on the machine (load average 2.77, its own 4
        # processes), checked by `bench_estimate.py --profile` (every GPT-S preset's estimate
        # within 1.31x of its measured step)
        peak_flops=8.93e10,
        memory_bandwidth=4.83e9,
        memory=24 * 2**30,
        devices_per_host=4,
        intra_host=Link(bandwidth=8.39e8, latency=288e-6),
        inter_host=Link(bandwidth=8.39e8, latency=288e-6),
        launch=5.94e-6,
        source="fitted by bench/bench_collectives.py --repeat 9 on a 2-core x86-64 machine "
        "with no other job (load average 2.77), 4 processes computing and communicating at "
        "once (GPT-S matmuls, its memory-bound workloads, collectives over all 4); the "
        "reduce_scatter factor refitted alone for the runtime's all_to_all and sum",
        collective_scale={
            "all_gather": 1.42,
            "all_reduce": 1.29,
            # refitted alone in session 36: the runtime runs a reduce_scatter on Gloo as an
            # all_to_all and a local sum since session 35 (fit 8 timed Gloo's own, 3.28); the
            # runtime's costs 0.935x an all_gather of the same bytes and 0.535x Gloo's
            # reduce_scatter (bench_reduce_scatter.py, medians over 8 sizes and groups), which
            # fit 8's all_gather and reduce_scatter factors put at 1.33 and 1.75
            "reduce_scatter": 1.5,
            "all_to_all": 0.791,
        },
        call_overhead=1.94e-3,
        call_window=4.91e-4,
        overlap_efficiency=0.19,
        overhead_efficiency=0.41,
        op_overhead=4.79e-6,
        cache_bytes=2 * 2**20,
        cache_bandwidth=9.66e9,
    ),
    # An 8-GPU H100 SXM host (DGX H100 / HGX H100): 989 TFLOP/s dense BF16 and 3.35 TB/s HBM3
    # per GPU (NVIDIA H100 datasheet), 80 GB; NVLink 4 at 900 GB/s per GPU both ways together,
    # 450 GB/s each way (datasheet), of which NCCL's all-reduce bus bandwidth reaches about
    # 80 %; hosts joined by eight ConnectX-7 400 Gb/s InfiniBand NICs, one per GPU: 50 GB/s
    # per GPU (DGX H100 user guide). Sustained rates: 60 % of peak compute, 80 % of HBM.
    "h100-nvlink-ib": Hardware(
        name="h100-nvlink-ib",
        peak_flops=0.6 * 989e12,
        memory_bandwidth=0.8 * 3.35e12,
        memory=80 * 10**9,
        devices_per_host=8,
        intra_host=Link(bandwidth=0.8 * 450 * _GB, latency=3e-6),
        inter_host=Link(bandwidth=0.8 * 50 * _GB, latency=8e-6),
        launch=5e-6,
        source="NVIDIA H100 datasheet; NVIDIA DGX H100 user guide (8x ConnectX-7 400 Gb/s)",
    ),
    # An 8-GPU A100 SXM 80 GB host (DGX A100): 312 TFLOP/s dense BF16, 2.04 TB/s HBM2e
    # (NVIDIA A100 datasheet); NVLink 3 at 600 GB/s both ways, 300 GB/s each way; eight
    # ConnectX-6 200 Gb/s HDR InfiniBand NICs: 25 GB/s per GPU (DGX A100 user guide).
    "a100-nvlink-ib": Hardware(
        name="a100-nvlink-ib",
        peak_flops=0.6 * 312e12,
        memory_bandwidth=0.8 * 2.039e12,
        memory=80 * 10**9,
        devices_per_host=8,
        intra_host=Link(bandwidth=0.8 * 300 * _GB, latency=3e-6),
        inter_host=Link(bandwidth=0.8 * 25 * _GB, latency=8e-6),
        launch=5e-6,
        source="NVIDIA A100 datasheet; NVIDIA DGX A100 user guide (8x ConnectX-6 200 Gb/s)",
    ),
}


def get_profile(profile: str | Hardware) -> Hardware:
    """A profile by name (or the :class:`Hardware` given); an unknown name is an
    :class:`~partita.errors.ArgumentError` listing the known ones."""
    if isinstance(profile, Hardware):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise ArgumentError(
            f"unknown hardware profile {profile!r}; the profiles are "
            f"{', '.join(sorted(PROFILES))}, or pass a partita.cost.Hardware(...) of your own."
        ) from None
