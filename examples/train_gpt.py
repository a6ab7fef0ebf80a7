"""Train a small GPT with partita, in one process or one process per device.

    python examples/train_gpt.py --mesh 2x2 --steps 5                          # simulated mesh
    torchrun --nproc-per-node=4 examples/train_gpt.py --mesh 2x2 --steps 5     # 4 processes
    # two hosts (run on each, node rank 0 and 1):
    torchrun --nnodes=2 --node-rank=$I --nproc-per-node=2 --master-addr=$HOST0 \\
        --master-port=29500 examples/train_gpt.py --mesh 2x2 --steps 5

Both print the same ``step=i loss=...`` lines (from the main process only). The mesh is
``data x model``: parameters are FSDP-sharded over ``data`` and Megatron-sharded over
``model`` (column-parallel qkv and fc, row-parallel projections); the batch is split over
``data``. Each step's batch comes from a generator seeded by (seed, step): every process makes
the same *global* batch and loads only its own rows (``partita.data.process_slice``), as a
real per-host loader would.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F  # noqa: N812

import partita
import partita.distributed as pd
from partita import Mesh, P
from partita.data import make_global, process_slice
from partita.models import GPT, GPTConfig
from partita.training import init_opt_state, make_train_step

Tensors = dict[str, torch.Tensor]
COLUMN = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias")
ROW = ("attn.proj.weight", "mlp.proj.weight")


def param_spec(name: str, p: torch.Tensor, mesh: Mesh) -> P:
    """FSDP over ``data`` plus tensor parallelism over ``model`` (when the mesh has it).

    Every parameter is split over ``data`` where its size allows, the column-parallel biases
    too (their ``model`` halves cut again over ``data``, as ``fully_shard`` does under tensor
    parallelism): their gradients then join the reduce_scatter buckets instead of each
    taking an all_reduce of its own."""
    tp = "model" in mesh.axis_names
    if tp and name.endswith(COLUMN):
        if p.ndim == 2:
            return P("model", "data")
        divisible = p.shape[0] % mesh.axes_size(("model", "data")) == 0
        return P(("model", "data")) if divisible else P("model")
    if tp and name.endswith(ROW):
        return P("data", "model")
    if p.shape[0] % mesh.axis_size("data") == 0:
        return P("data")
    return P()


def parse_mesh(text: str) -> Mesh:
    shape = tuple(int(s) for s in text.lower().split("x"))
    names = ("data", "model")[: len(shape)]
    if len(shape) > 2:
        raise SystemExit(f"--mesh {text}: use N (data) or NxM (data x model)")
    return Mesh.create(shape, names)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2x2", help="N or NxM (data x model)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--save", help="save the final parameters (global values) here")
    ns = parser.parse_args(argv)

    distributed = pd.initialize()  # a no-op (with a note on stderr) without torchrun
    mesh = parse_mesh(ns.mesh)
    if distributed and pd.process_count() != mesh.size:
        raise SystemExit(
            f"--mesh {ns.mesh} has {mesh.size} devices but torchrun started "
            f"{pd.process_count()} processes; launch one process per device."
        )

    # Every process builds the same initial model from the same seed.
    torch.manual_seed(ns.seed)
    cfg = GPTConfig(ns.layers, ns.heads, ns.width, ns.vocab, ns.seq)
    model = GPT(cfg)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = init_opt_state(params)
    pspecs = {k: param_spec(k, v, mesh) for k, v in params.items()}
    batch_spec = P("data")
    step = partita.jit(
        make_train_step(model, loss_fn, "adamw"),
        mesh=mesh,
        in_specs=(pspecs, {}, {"step": P(), "exp_avg": pspecs, "exp_avg_sq": pspecs},
                  (batch_spec, batch_spec)),
    )  # fmt: skip

    n_params = sum(p.numel() for p in params.values())
    pd.log(
        f"# {pd.process_count()} process(es), {mesh!r}, GPT {n_params / 1e6:.2f} M params, "
        f"global batch {ns.global_batch_size} x {ns.seq} tokens"
    )
    global_shape = (ns.global_batch_size, ns.seq)
    rows = process_slice(global_shape, mesh, batch_spec)
    for i in range(ns.steps):
        # The same global batch on every process; each loads only its own rows.
        gen = torch.Generator().manual_seed(ns.seed * 1_000_003 + i)
        ids = torch.randint(0, ns.vocab, global_shape, generator=gen)
        targets = torch.roll(ids, -1, dims=1)
        batch = (
            make_global(ids[rows], mesh, batch_spec, global_shape=global_shape),
            make_global(targets[rows], mesh, batch_spec, global_shape=global_shape),
        )
        loss, params, _, state = step(params, {}, state, batch)
        value = loss.full().item()  # on every process (a sharded value's full() gathers)
        if not math.isfinite(value):
            raise SystemExit(f"step {i}: loss is {value}")
        pd.log(f"step={i} loss={value:.6f}")

    full = {k: v.full() for k, v in params.items()}  # every process: full() may gather
    checksum = sum(float(v.double().sum()) for v in full.values())
    pd.log(f"params_checksum={checksum:.6f}")
    if ns.save and pd.is_main_process():
        torch.save(full, ns.save)


if __name__ == "__main__":
    main()
