"""partita on 4 Gloo processes beside PyTorch FSDP2 and TP + FSDP2, same GPT step, same run.

Run: ``.venv/bin/python bench/bench_distributed.py [--repeat 5]`` (it starts its own 4 worker
processes on 127.0.0.1 through ``partita.runtime.launch.spawn`` and prints rank 0's report).

The step: GPT (4 layers, width 256, 8 heads, vocabulary 512, sequence 128, global batch 16),
cross entropy, AdamW. For each configuration, the median wall time of a training step after two
warm-ups, and the bytes each rank moves per step:

* ``partita fsdp (4,)``: parameters ``P("data")``, batch ``P("data")``; bytes from the Plan
  (per-device bytes as XLA reports them: output of all_gather / all_reduce / all_to_all, input
  of reduce_scatter);
* ``partita 2-D (2, 2)``: FSDP over ``data`` and Megatron TP over ``model``;
* ``torch FSDP2 (4,)``: ``fully_shard`` on every block and the model, ``torch.optim.AdamW``;
* ``torch TP + FSDP2 (2, 2)``: ``parallelize_module`` on each block's MLP (fc colwise, proj
  rowwise) over ``tp`` and ``fully_shard`` over ``dp``. Attention is not tensor-parallel: the
  model's fused qkv projection is split by the full width, which DTensor's colwise plan does
  not support without rewriting the model.

torch bytes are counted with the same convention by wrapping ``torch.distributed``'s
collective functions (FSDP2) and a TorchDispatchMode over ``_c10d_functional`` ops (DTensor).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch.utils._python_dispatch import TorchDispatchMode

import partita
import partita.distributed as pd
from partita import Mesh, P
from partita.data import make_global, process_slice
from partita.models import GPT, GPTConfig, init_opt_state, make_train_step

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from train_gpt import param_spec, vector_step_counter  # noqa: E402

CFG = GPTConfig(n_layer=4, n_head=8, d_model=256, vocab_size=512, seq_len=128)
BATCH = 16


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(
        0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=torch.Generator().manual_seed(seed)
    )
    return ids, torch.roll(ids, -1, dims=1)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))


def _median(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # the slowest rank decides a step: take the max over ranks of each median
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# --- byte counting for torch ---------------------------------------------------------------------

_BYTES = [0]


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _wrap_dist() -> None:
    """Count FSDP2's collectives: output bytes of gathers, input bytes of reduce-scatters."""
    table = {
        "all_gather_into_tensor": lambda a, k: _nbytes(k.get("output_tensor", a[0] if a else None)),
        "reduce_scatter_tensor": lambda a, k: _nbytes(k.get("input", a[1] if len(a) > 1 else None)),
        "all_reduce": lambda a, k: _nbytes(k.get("tensor", a[0] if a else None)),
        "all_gather_single": lambda a, k: _nbytes(k.get("output_tensor", a[0] if a else None)),
        "reduce_scatter_single": lambda a, k: _nbytes(k.get("input", a[1] if len(a) > 1 else None)),
    }
    for name, size in table.items():
        original = getattr(dist, name)

        def wrapped(*a: Any, _o: Any = original, _s: Any = size, **k: Any) -> Any:
            _BYTES[0] += _s(a, k)
            return _o(*a, **k)

        setattr(dist, name, wrapped)


class _CountFunctional(TorchDispatchMode):
    """Count DTensor's functional collectives with the same convention."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if "_c10d_functional" in name and "wait_tensor" not in name:
            _BYTES[0] += _nbytes(args[0]) if "reduce_scatter" in name else _nbytes(out)
        return out


# --- configurations ------------------------------------------------------------------------------


def bench_partita(mesh: Mesh, repeat: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = GPT(CFG)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = init_opt_state(params)
    state["step"] = state["step"].reshape(1)
    pspecs = {k: param_spec(k, v, mesh) for k, v in params.items()}
    step = partita.jit(
        vector_step_counter(make_train_step(model, _loss, "adamw")),
        mesh=mesh,
        in_specs=(pspecs, {}, {"step": P(), "exp_avg": pspecs, "exp_avg_sq": pspecs},
                  (P("data"), P("data"))),
    )  # fmt: skip
    ids, targets = _batch(0)
    rows = process_slice(ids.shape, mesh, P("data"))
    batch = tuple(
        make_global(t[rows], mesh, P("data"), global_shape=t.shape) for t in (ids, targets)
    )
    carry = {"params": params, "state": state}

    def one() -> None:
        _, carry["params"], _, carry["state"] = step(carry["params"], {}, carry["state"], batch)

    seconds = _median(one, repeat)
    plan = step.lower(carry["params"], {}, carry["state"], batch)
    return seconds, plan.bytes_per_device


def bench_torch(tp: bool, repeat: int) -> tuple[float, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    if tp:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(
                block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
            )
        dp_mesh = mesh["dp"]
        rows = BATCH // 2
        first = (dist.get_rank() // 2) * rows
    else:
        dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        rows = BATCH // 4
        first = dist.get_rank() * rows
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, targets = _batch(0)
    ids, targets = ids[first : first + rows], targets[first : first + rows]

    def one() -> None:
        loss = _loss(model(ids), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()

    seconds = _median(one, repeat)
    _BYTES[0] = 0
    with _CountFunctional():
        one()
    return seconds, float(_BYTES[0])


def worker(ns: argparse.Namespace) -> None:
    pd.initialize()
    _wrap_dist()
    rows = []
    for name, run in [
        ("partita fsdp (4,)", lambda: bench_partita(Mesh.create((4,), ("data",)), ns.repeat)),
        ("partita 2-D (2, 2)", lambda: bench_partita(Mesh.create((2, 2), ("data", "model")),
                                                     ns.repeat)),
        ("torch FSDP2 (4,)", lambda: bench_torch(False, ns.repeat)),
        ("torch TP + FSDP2 (2, 2)", lambda: bench_torch(True, ns.repeat)),
    ]:  # fmt: skip
        try:
            seconds, nbytes = run()
            rows.append(f"{name:<26} {seconds:8.3f} s   {nbytes / 1e6:8.1f} MB")
        except Exception as e:  # report and go on: one failing configuration is a result too
            rows.append(f"{name:<26} failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
        pd.log(rows[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker or "RANK" in os.environ:
        worker(ns)
        return
    from partita.runtime.launch import spawn

    print(f"# {' '.join(['.venv/bin/python', *sys.argv])}")
    print(f"# GPT layers={CFG.n_layer} d_model={CFG.d_model} heads={CFG.n_head} "
          f"vocab={CFG.vocab_size} seq={CFG.seq_len} batch={BATCH}, AdamW; 4 Gloo processes "
          f"(OMP_NUM_THREADS=1 each), torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"median of {ns.repeat} steps after 2 warm-ups (max over ranks)")  # fmt: skip
    print(f"{'configuration':<26} {'step':>10}   {'bytes/rank/step':>12}")
    results = spawn([__file__, "--worker", "--repeat", str(ns.repeat)], 4, timeout=1200)
    for r in results:
        if r.returncode != 0:
            print(f"rank {r.rank} exited with {r.returncode}:\n{r.stderr[-3000:]}")
    print(results[0].stdout, end="")


if __name__ == "__main__":
    main()
