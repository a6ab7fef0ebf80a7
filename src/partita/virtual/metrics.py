"""The virtual device's counters: what ``partita.metrics()`` returns and prints.

Data only; :mod:`partita.virtual.step` and :mod:`partita.virtual.compiled` update them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MISSES_KEPT", "Metrics"]

#: How many fast-path misses :class:`Metrics` keeps (the latest).
MISSES_KEPT = 20


@dataclass
class Metrics:
    """What the virtual device did so far (``partita.metrics()``).

    Attributes:
        compiles: programs compiled (in this process).
        cache_hits: syncs that reused a compiled program.
        disk_hits: compilations avoided by the persistent cache.
        syncs: syncs that ran a program.
        ops_recorded: ops recorded in all steps.
        recompile_reasons: one line per compilation after the first: what changed and where.
        fast_path_hits: syncs whose step repeated the step that last followed the same program
            op by op, so recording made no shape inference and the key was not hashed.
        fast_path_misses: one line per step that left the fast path: the first op or input
            that differed from the step it was checked against (the last ``MISSES_KEPT``).
        compile_seconds, run_seconds: time spent compiling and running steps.
        compiled_step_replays: calls of a ``partita.compile`` step that replayed its captured
            program instead of running the function.
        compiled_steps: per ``partita.compile`` function, one line: captured, or why not.
        upload_bytes: bytes of host data put on the device: CPU tensors copied in
            (``x.to(dev)``: the whole tensor, in every process) and ShardedTensors moved there
            (``make_global(..., device=dev)``: under torch.distributed only this process's
            shard).
    """

    compiles: int = 0
    cache_hits: int = 0
    disk_hits: int = 0
    syncs: int = 0
    ops_recorded: int = 0
    recompile_reasons: list[str] = field(default_factory=list)
    fast_path_hits: int = 0
    fast_path_misses: list[str] = field(default_factory=list)
    compile_seconds: float = 0.0
    run_seconds: float = 0.0
    compiled_step_replays: int = 0
    compiled_steps: dict[str, str] = field(default_factory=dict)
    upload_bytes: int = 0

    def __str__(self) -> str:
        lines = [
            f"compiles={self.compiles} cache_hits={self.cache_hits} disk_hits={self.disk_hits} "
            f"syncs={self.syncs} ops_recorded={self.ops_recorded} "
            f"fast_path_hits={self.fast_path_hits} upload_bytes={self.upload_bytes} "
            f"compile={self.compile_seconds:.2f}s run={self.run_seconds:.2f}s"
        ]
        if self.compiled_steps:
            lines[0] += f" compiled_step_replays={self.compiled_step_replays}"
        lines += [f"recompiled: {r}" for r in self.recompile_reasons]
        lines += [f"left the fast path: {r}" for r in self.fast_path_misses]
        lines += [f"compiled step {name}: {line}" for name, line in self.compiled_steps.items()]
        return "\n".join(lines)
