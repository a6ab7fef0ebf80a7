"""The process ``test_checkpoint.test_a_sigkilled_save_leaves_the_last_checkpoint`` kills.

    python checkpoint_kill.py <path>

Saves checkpoint A (``A`` below) to ``<path>``, then starts saving B to the same path with
DCP's item writer patched to SIGKILL this process right after it has written and flushed the
first tensor: a data file exists half written in ``<path>.tmp-<id>``, no ``.metadata``. The
process never returns normally (the test checks it died of SIGKILL).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

import partita.checkpoint as ckpt
from partita import Mesh, P, ShardedTensor


def state(offset: float) -> dict[str, Any]:
    """Checkpoint A is ``state(0.0)``, B ``state(100.0)``: a sharded and a plain tensor."""
    mesh = Mesh.create((2,), ("data",))
    w = torch.arange(8.0).reshape(4, 2) + offset
    return {
        "w": ShardedTensor.from_global(w, P("data", None).to_sharding(mesh, 2)),
        "b": torch.arange(3.0) + offset,
    }


def main(path: str) -> None:
    ckpt.save(state(0.0), path)
    write_item = dcp_fs._write_item

    def write_then_die(*args: Any, **kwargs: Any) -> Any:
        result = write_item(*args, **kwargs)
        stream = args[1]
        stream.flush()
        os.fsync(stream.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
        return result

    dcp_fs._write_item = write_then_die
    ckpt.save(state(100.0), path)


if __name__ == "__main__":
    main(sys.argv[1])
