"""FSDP's data axis stays on the batch: parameters are gathered, activations stay batch-split.

Under ``fsdp+tp`` (and ``fsdp``) a parameter and the batch both ask for the ``data`` mesh axis,
on different factors of the same matmul. Propagation gives it to the factor a computed operand
(an activation) proposes, not to the one only a stored program input (the parameter) proposes,
even when the parameter is the larger tensor (invariant 5 of ``partita.propagate``). Before,
the larger tensor won: a vocabulary-sized head weight split the logits' vocabulary over
``data`` and the loss all_to_all'ed them back onto the batch.

The GPT here is sized so that the weights are larger than the activations (vocabulary 128 and
qkv 48 x 16 against 32 tokens), the case where size alone picks the weight.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F  # noqa: N812

from partita import Mesh, P
from partita.frontend.annotate import propagate_program
from partita.models import GPT, GPTConfig
from partita.partition.plan import Plan
from partita.training import TrainStep, train_step

from adamw_parity import AdamWParity  # isort: skip

CFG = GPTConfig(n_layer=2, n_head=4, d_model=16, vocab_size=128, seq_len=8, bias=False)
BATCH = 8
MESH = Mesh.create((2, 4), ("data", "model"))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
        out.append((ids, torch.roll(ids, -1, 1)))
    return out


def _step(shard: str, mesh: Mesh) -> tuple[TrainStep, GPT]:
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return train_step(model, _loss, opt, mesh=mesh, param_specs=shard), ref


@pytest.fixture(scope="module")
def fsdp_tp() -> tuple[TrainStep, GPT, Plan]:
    step, ref = _step("fsdp+tp", MESH)
    return step, ref, step.lower(_batches(1)[0])


def _split_over_data(step: TrainStep) -> int:
    return sum(1 for s in step.param_specs.values() if "data" in tuple(s))


def test_fsdp_tp_gathers_parameters_and_keeps_the_batch_split(fsdp_tp: tuple) -> None:
    step, _, plan = fsdp_tp
    counts = plan.counts()
    assert "all_to_all" not in counts  # the logits and the residual stream stay batch-split
    over_data = [c for c in plan.collectives if c.mesh_axes == ("data",)]
    gathered = [c.value for c in over_data if c.kind == "all_gather"]
    scattered = [c.value for c in over_data if c.kind == "reduce_scatter"]
    # Parameters (program inputs, ``arg*``) are gathered, each once, and their gradients
    # reduce-scattered once. The position table is the one data-split parameter not gathered:
    # its lookup by the unsplit positions is all-reduced instead (the same bytes).
    assert all(v.startswith("arg") for v in gathered), gathered
    assert len(set(gathered)) == len(gathered) == len(scattered) == _split_over_data(step) - 1
    # Over 'data' only small values are all-reduced (the loss, the position rows), never a
    # batch shard of the [tokens, d_model] residual stream.
    shard = BATCH * CFG.seq_len // 2 * CFG.d_model
    reduced = [c.shape for c in over_data if c.kind == "all_reduce"]
    assert all(math.prod(s) < shard for s in reduced), reduced


def test_fsdp_tp_logits_are_batch_split(fsdp_tp: tuple) -> None:
    _, _, plan = fsdp_tp
    # The head is the GPT's only addmm (its linears have no bias): [tokens, vocab] logits.
    assert plan.shardings["addmm"].spec == P("data", None)
    assert "all_to_all" not in plan.counts()


def test_fsdp_tp_trains_like_torch(fsdp_tp: tuple) -> None:
    """The loss, AdamW's moments and the parameters after a step equal torch.optim's; the
    parameters within 1e-5 plus what the moments' difference makes of the update
    (``tests/adamw_parity.py``: a qkv weight's gradient element here is ~2e-7, near eps)."""
    step, ref, _ = fsdp_tp
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    parity = AdamWParity(ref_opt, [n for n, _ in ref.named_parameters()], rtol=1e-5, atol=1e-5)
    for inputs, targets in _batches(1):
        ref_opt.zero_grad()
        want = _loss(ref(inputs), targets)
        want.backward()
        ref_opt.step()
        got = float(step((inputs, targets)))
        torch.testing.assert_close(torch.tensor(got), want.detach(), rtol=1e-5, atol=1e-5)
        parity.after_step(step.state_dict()["optimizer"]["state"])
    full = step.state_dict()["model"]
    parity.check_parameters(full)
    for name, value in ref.named_buffers():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_fsdp_alone_is_one_gather_and_one_reduce_scatter_per_parameter() -> None:
    step, _ = _step("fsdp", Mesh.create((8,), ("data",)))
    plan = step.lower(_batches(1)[0])
    counts = plan.counts()
    assert "all_to_all" not in counts
    assert counts["all_gather"] == counts["reduce_scatter"] == _split_over_data(step) - 1


# --- the rule itself, on one matmul ----------------------------------------------------------


def _head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) @ w.t()  # relu: x reaches the matmul as a computed activation


def _mm(gm: fx.GraphModule) -> fx.Node:
    (mm,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default]
    return mm


def test_a_computed_operand_wins_the_axis_over_a_larger_stored_one() -> None:
    x, w = torch.randn(16, 8), torch.randn(64, 8)  # the weight is 4x the activation
    prog = propagate_program(
        _head, (x, w), mesh=Mesh.create((2,), ("data",)), in_specs=(P("data"), P("data"))
    )
    mm = _mm(prog.graph_module)
    assert mm.meta["factor_axes"] == {"m": ("data",)}
    assert mm.meta["sharding"].spec == P("data", None)


def test_between_program_inputs_the_larger_tensor_still_wins() -> None:
    """Without a computed operand nothing changes: T19's rule (gather the smaller one)."""
    x, w = torch.randn(16, 8), torch.randn(64, 8)
    prog = propagate_program(
        lambda x, w: x @ w.t(),
        (x, w),
        mesh=Mesh.create((2,), ("data",)),
        in_specs=(P("data"), P("data")),
    )
    mm = _mm(prog.graph_module)
    assert mm.meta["factor_axes"] == {"n": ("data",)}
