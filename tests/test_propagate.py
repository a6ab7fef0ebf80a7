"""Sharding propagation: annotate a few tensors, know every tensor's sharding before running."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F  # noqa: N812

import partita
import programs
from partita import Mesh, P, UnsupportedOpError
from partita.capture import ANNOTATE_OP
from partita.frontend.annotate import format_program, propagate_program
from partita.models import GPT, GPTConfig
from partita.propagate import fixpoint, propagate
from partita.propagate import state as state_module
from partita.propagate.state import ProgramState, call_key, info_key
from partita.rules import OpInfo, TensorMeta
from partita.rules.opinfo import op_info
from partita.training import init_opt_state

MESH = Mesh.create((2, 4), ("data", "model"))
XY = programs.MESH


def _by_target(gm: fx.GraphModule, target: object) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target == target]


def _spec(node: fx.Node) -> P:
    return node.meta["sharding"].spec


def _output_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    return [a for a in torch.utils._pytree.tree_leaves(out.args) if isinstance(a, fx.Node)]


def _producer(node: fx.Node) -> fx.Node:
    """The value behind an annotation node."""
    return node.args[0] if node.target == ANNOTATE_OP else node


# --- the 2-layer MLP -------------------------------------------------------------------------


def _megatron_mlp() -> partita.capture.Program:
    """The MLP with only its weights annotated: column-, then row-parallel on 'model'."""
    fn, args = programs.mlp()
    in_specs = (None, P(None, "model"), P("model"), P("model", None), None)
    return propagate_program(fn, args, mesh=MESH, in_specs=in_specs, out_specs=P())


def test_mlp_weights_only_column_then_row_parallel() -> None:
    prog = _megatron_mlp()
    gm = prog.graph_module
    mm1, mm2 = _by_target(gm, torch.ops.aten.mm.default)
    (relu,) = _by_target(gm, torch.ops.aten.relu.default)
    assert _spec(mm1) == P(None, "model")
    assert _spec(relu) == P(None, "model")  # the hidden activation is inferred sharded
    assert mm2.meta["sharding"].partial == ("model",)  # the output is partial ...
    assert mm2.meta["sharding"].sharded_axes == ()
    (out,) = _output_nodes(gm)
    assert out.meta["sharding"].is_replicated  # ... then replicated
    # nothing left unknown
    for node in gm.graph.nodes:
        if node.op != "output":
            assert "sharding" in node.meta, node.name


def test_mlp_golden_text() -> None:
    prog = _megatron_mlp()
    text = format_program(prog.graph_module)
    lines = [" ".join(line.split()[:1] + line.split()[2:]) for line in text.splitlines()[1:]]
    body = "\n".join(
        line.split("programs.py")[0].split(" in_specs")[0].split(" out_specs")[0].strip()
        for line in lines
    )
    assert body == (
        "%arg0_1 input float32[8, 16] P(None, None)\n"
        "%arg1_1 input float32[16, 32] P(None, 'model')\n"
        "%arg2_1 input float32[32] P('model')\n"
        "%arg3_1 input float32[32, 4] P('model', None)\n"
        "%arg4_1 input float32[4] P(None)\n"
        "%annotate partita.annotate(%arg1_1) float32[16, 32] P(None, 'model') (user)\n"
        "%annotate_1 partita.annotate(%arg2_1) float32[32] P('model') (user)\n"
        "%annotate_2 partita.annotate(%arg3_1) float32[32, 4] P('model', None) (user)\n"
        "%mm aten.mm(%arg0_1, %annotate) float32[8, 32] P(None, 'model')\n"
        "%add aten.add.Tensor(%mm, %annotate_1) float32[8, 32] P(None, 'model')\n"
        "%relu aten.relu(%add) float32[8, 32] P(None, 'model')\n"
        "%mm_1 aten.mm(%relu, %annotate_2) float32[8, 4] P(None, None) partial[sum](model)\n"
        "%add_1 aten.add.Tensor(%mm_1, %arg4_1) float32[8, 4] P(None, None)\n"
        "%annotate_3 partita.annotate(%add_1) float32[8, 4] P(None, None) (user)"
    )
    assert "programs.py:" in text  # every op names the user's source line


# --- forward and backward --------------------------------------------------------------------


def test_backward_only_annotation_reaches_every_input() -> None:
    def chain(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.relu(a * b + c).exp() - a

    x = torch.randn(16, 32)
    prog = propagate_program(chain, (x, x, x), mesh=MESH, out_specs=P("data", "model"))
    gm = prog.graph_module
    for ph in prog.input_nodes:
        assert _spec(ph) == P("data", "model"), ph.name
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert _spec(node) == P("data", "model"), node.name


def test_forward_through_broadcast_and_scalar() -> None:
    def f(a: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return (a + bias) * 2.0

    prog = propagate_program(
        f, (torch.randn(8, 32), torch.randn(32)), mesh=MESH, in_specs=(P("data", "model"), None)
    )
    (out,) = _output_nodes(prog.graph_module)
    assert _spec(out) == P("data", "model")
    assert _spec(prog.input_nodes[1]) == P("model")  # the bias is inferred backward


# --- reshape ---------------------------------------------------------------------------------


def test_reshape_splitting_a_sharded_major_dim_keeps_it() -> None:
    prog = propagate_program(
        lambda a: a.reshape(4, 4, 32) * 2,
        (torch.randn(16, 32),),
        mesh=XY,
        in_specs=(P("y", None),),
    )
    (out,) = _output_nodes(prog.graph_module)
    assert _spec(out) == P("y", None, None)


def test_reshape_merging_a_minor_sharded_dim_does_not_keep_it() -> None:
    (t20,) = [c for c in programs.canonical_cases() if c.name == "T20"]
    prog = propagate_program(t20.fn, t20.args, mesh=XY, in_specs=t20.in_specs)
    (out,) = _output_nodes(prog.graph_module)
    assert out.meta["sharding"].is_replicated  # XLA picks replicated too


def test_reshape_with_output_spec_shards_the_major_factor() -> None:
    (t20,) = [c for c in programs.canonical_cases() if c.name == "T20"]
    prog = propagate_program(
        t20.fn, t20.args, mesh=XY, in_specs=t20.in_specs, out_specs=t20.out_specs
    )
    (reshape,) = _by_target(prog.graph_module, torch.ops.aten.reshape.default)
    assert _spec(reshape) == P("y", None)
    # The op computes with the major factor on y; the input is resharded (T20: one all_to_all).
    assert reshape.meta["factor_axes"] == {"i": ("y",)} or "y" in str(reshape.meta["factor_axes"])


# --- the free-output choices of canonical_cases.md ------------------------------------------


def _free(name: str) -> fx.Node:
    (case,) = [c for c in programs.canonical_cases() if c.name == name]
    prog = propagate_program(case.fn, case.args, mesh=XY, in_specs=case.in_specs)
    (out,) = _output_nodes(prog.graph_module)
    return out


def test_free_output_t03_keeps_the_input_sharding() -> None:
    assert _spec(_free("T03")) == P("y", None)


@pytest.mark.parametrize("name", ["T14", "T15"])
def test_free_output_t14_t15_is_partial_then_replicated(name: str) -> None:
    s = _free(name).meta["sharding"]
    assert s.sharded_axes == () and s.partial == ("y",)


def test_free_output_t19_gathers_the_smaller_operand() -> None:
    assert _spec(_free("T19")) == P(None, "y")


def test_free_output_t20_is_replicated() -> None:
    assert _free("T20").meta["sharding"].is_replicated


def test_t15_value_keeps_the_requested_sharding_for_a_reduce_scatter() -> None:
    (case,) = [c for c in programs.canonical_cases() if c.name == "T15"]
    prog = propagate_program(
        case.fn, case.args, mesh=XY, in_specs=case.in_specs, out_specs=case.out_specs
    )
    (mm,) = _by_target(prog.graph_module, torch.ops.aten.mm.default)
    assert mm.meta["factor_axes"] == {"k": ("y",)}  # the op reduces over y ...
    assert _spec(mm) == P("y", None)  # ... and its value is wanted scattered on dim 0


# --- conflicts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pa", "pb", "expected"), [(1, 0, P(None, "model")), (0, 1, P("model", None))]
)
def test_conflicts_are_resolved_by_priority(pa: int, pb: int, expected: P) -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = partita.mark_sharding(a, MESH, P("model", None), priority=pa)
        b = partita.mark_sharding(b, MESH, P(None, "model"), priority=pb)
        return a + b

    prog = propagate_program(f, (torch.randn(16, 16), torch.randn(16, 16)), mesh=MESH)
    (add,) = _by_target(prog.graph_module, torch.ops.aten.add.Tensor)
    assert _spec(add) == expected


def test_conflict_at_equal_priority_prefers_the_larger_tensor() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = partita.mark_sharding(a, MESH, P("model", None))
        b = partita.mark_sharding(b, MESH, P(None, "model"))
        return a + b

    prog = propagate_program(f, (torch.randn(16, 16), torch.randn(1, 16)), mesh=MESH)
    (add,) = _by_target(prog.graph_module, torch.ops.aten.add.Tensor)
    assert _spec(add) == P("model", None)


def test_user_annotations_are_never_overwritten() -> None:
    def f(a: torch.Tensor) -> torch.Tensor:
        h = partita.mark_sharding(a * 2, MESH, P(None, "model"))
        return h + 1

    prog = propagate_program(f, (torch.randn(16, 16),), mesh=MESH, in_specs=(P("data", None),))
    anns = _by_target(prog.graph_module, ANNOTATE_OP)
    assert [_spec(n) for n in anns] == [P("data", None), P(None, "model")]


def test_propagation_is_deterministic() -> None:
    fn, args = programs.mlp()
    texts = {
        format_program(
            propagate_program(
                fn, args, mesh=MESH, in_specs=(P("data"), P(None, "model"), None, None, None)
            ).graph_module
        )
        for _ in range(3)
    }
    assert len(texts) == 1


# --- errors ----------------------------------------------------------------------------------


def test_unsupported_op_names_op_node_source_and_two_ways_forward() -> None:
    prog = partita.capture.trace(
        lambda a: torch.cumsum(a, 0), (torch.randn(8, 8),), in_specs=(P("data"),), mesh=MESH
    )
    gm = prog.graph_module
    target = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target != ANNOTATE_OP)
    target.target = torch.ops.aten.cummax.default  # an op without a rule
    with pytest.raises(UnsupportedOpError) as info:
        propagate(gm)
    msg = str(info.value)
    assert "aten.cummax" in msg and target.name in msg and "test_propagate.py:" in msg
    assert "annotate around it" in msg and "replicate_unsupported=True" in msg


def test_replicate_unsupported_opt_in() -> None:
    prog = partita.capture.trace(
        lambda a: a * 2, (torch.randn(8, 8),), in_specs=(P("data"),), mesh=MESH
    )
    gm = prog.graph_module
    mul = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
    mul.target = torch.ops.aten.cummax.default
    propagate(gm, replicate_unsupported=True)
    assert mul.meta["sharding"].is_replicated


def test_replicated_fallback_is_recorded_on_every_node_of_a_repeated_call() -> None:
    """Rules are memoised per distinct call; the replicated fallback is not (each node records
    why it is gathered, for the Plan)."""
    prog = partita.capture.trace(
        lambda a: (a * 2) * 2, (torch.randn(8, 8),), in_specs=(P("data"),), mesh=MESH
    )
    gm = prog.graph_module
    muls = _by_target(gm, torch.ops.aten.mul.Tensor)
    assert len(muls) == 2
    for mul in muls:
        mul.target = torch.ops.aten.cummax.default  # its rule cannot take (a, 2): twice, one shape
    propagate(gm, replicate_unsupported=True)
    reasons = [mul.meta.get("replicated_reason") for mul in muls]
    assert reasons[0] and reasons[0] == reasons[1]
    assert all(mul.meta["sharding"].is_replicated for mul in muls)


def test_memoised_rules_tell_equal_python_values_of_other_types_apart() -> None:
    """``1``, ``1.0`` and ``True`` are equal in Python but are different arguments to a rule;
    ``0.0`` and ``-0.0`` likewise. Equal calls share one rule object."""
    meta = TensorMeta((8, 4), torch.float32)

    def info(*args: object) -> OpInfo:
        return OpInfo(torch.ops.aten.mul.Tensor, (meta, *args), {}, (meta,), (meta,))

    keys = [info_key(info(v)) for v in (1, 1.0, True, 0.0, -0.0, [1, 2], (1, 2))]
    assert len(set(keys)) == len(keys)
    assert info_key(info(2.5)) == info_key(info(2.5))
    assert info_key(info(object())) is None  # not a plain value: not memoised

    prog = partita.capture.trace(
        lambda a, b: (a @ b) @ b, (torch.randn(8, 8), torch.randn(8, 8)),
        in_specs=(P("data"), P()), mesh=MESH,
    )  # fmt: skip
    propagate(prog.graph_module)
    mms = _by_target(prog.graph_module, torch.ops.aten.mm.default)
    assert len(mms) == 2 and mms[0].meta["rule"] is mms[1].meta["rule"]


def test_a_deeper_program_presents_no_more_calls_to_the_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule memo is keyed off the node (``call_key``, equal to ``info_key`` of its OpInfo),
    so a repeated layer builds no OpInfo: a 3-layer GPT step builds as many as a 1-layer one
    (counted, not timed)."""
    built: list[int] = []
    counting = op_info

    def spy(*args: Any) -> Any:
        built[-1] += 1
        return counting(*args)

    monkeypatch.setattr(state_module, "op_info", spy)
    ops = []
    for n in (1, 3):
        step, args = programs.gpt_step(GPTConfig(n_layer=n, n_head=2, d_model=16, vocab_size=32,
                                                 seq_len=8))  # fmt: skip
        gm = partita.capture.trace(step, args, mesh=MESH).graph_module
        built.append(0)
        ops.append(len(ProgramState(gm, MESH, False).ops))
        for node in gm.graph.nodes:
            if node.op == "call_function":
                operands: list[fx.Node] = []
                info, nodes, _ = counting(node, {})
                assert call_key(node, {}, operands) == info_key(info), node.name
                assert operands == nodes, node.name
    assert ops[1] > 2 * ops[0] and built[1] == built[0] < ops[1] // 4


def test_no_annotation_and_no_mesh_is_an_error() -> None:
    prog = partita.capture.trace(lambda a: a * 2, (torch.randn(4),))
    with pytest.raises(partita.ShardingConflictError, match="no sharding annotation"):
        propagate(prog.graph_module)


# --- a GPT training step, FSDP style ---------------------------------------------------------


def _fsdp_spec(shape: torch.Size) -> P:
    """Shard dim 0 on 'data' when it splits evenly; replicate small odd parameters."""
    return P("data") if shape[0] % 8 == 0 else P()


def _gpt_step_returning_grads() -> tuple[object, tuple[object, ...]]:
    """The GPT step of tests/programs.py, also returning the gradients it computed."""
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, vocab_size=32, seq_len=8)
    torch.manual_seed(0)
    model = GPT(cfg)

    def step(params: dict, opt_state: dict, ids: torch.Tensor, targets: torch.Tensor) -> tuple:
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        logits = torch.func.functional_call(model, leaves, (ids,))
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))
        with torch.no_grad():
            new_params, new_state = _adamw(params, grads, opt_state)
        return loss.detach(), grads, new_params, new_state

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len))
    return step, (params, init_opt_state(params, "adamw"), ids, torch.roll(ids, -1, 1))


def _adamw(params: dict, grads: dict, state: dict, lr: float = 1e-2) -> tuple[dict, dict]:
    """AdamW written out (betas 0.9/0.999, eps 1e-8, weight decay 0.01), as in training steps."""
    step = state["step"] + 1
    new_params, new_m, new_v = {}, {}, {}
    for name, p in params.items():
        g = grads[name]
        m = state["exp_avg"][name] * 0.9 + 0.1 * g
        v = state["exp_avg_sq"][name] * 0.999 + 0.001 * g * g
        m_hat = m / (1 - 0.9**step)
        v_hat = v / (1 - 0.999**step)
        new_params[name] = p * (1 - lr * 0.01) - lr * m_hat / (v_hat.sqrt() + 1e-8)
        new_m[name], new_v[name] = m, v
    return new_params, {"step": step, "exp_avg": new_m, "exp_avg_sq": new_v}


def test_gpt_step_fsdp_grads_and_adamw_states_get_the_parameter_sharding() -> None:
    mesh = Mesh.create((8,), ("data",))
    step, args = _gpt_step_returning_grads()
    params = args[0]
    pspecs = {k: _fsdp_spec(v.shape) for k, v in params.items()}
    assert sum(s != P() for s in pspecs.values()) >= 10
    prog = propagate_program(step, args, mesh=mesh, in_specs=(pspecs, None, P("data"), P("data")))
    gm = prog.graph_module
    # The fixpoint covered the whole program: every tensor value has a Sharding.
    for node in gm.graph.nodes:
        if node.op != "output" and isinstance(node.meta.get("val"), torch.Tensor):
            assert isinstance(node.meta.get("sharding"), partita.Sharding), node.name
    _, grads, new_params, new_state = torch.utils._pytree.tree_unflatten(
        _output_nodes(gm), prog.out_tree
    )
    for name, spec in pspecs.items():
        want = spec.to_sharding(mesh, params[name].ndim)
        for what, node in [
            ("grad", grads[name]),
            ("param", new_params[name]),
            ("exp_avg", new_state["exp_avg"][name]),
            ("exp_avg_sq", new_state["exp_avg_sq"][name]),
        ]:
            assert node.meta["sharding"] == want, (name, what, node.meta["sharding"])


class _NeverSettled(fixpoint._Propagator):
    """Propagation that visits every queued op in full (no skipping of settled ops), each
    visit choosing its assignment anew (no memo shared between ops)."""

    def _snapshot(self, op: object, round_priority: int) -> tuple[object, ...]:
        return (object(),)  # equal to no earlier snapshot

    def _assignment(self, op: Any, round_priority: int) -> Any:
        self._memo.clear()
        return super()._assignment(op, round_priority)


class _Counting(fixpoint._Propagator):
    """The default propagation, counting the visits that choose an assignment."""

    calls = 0

    def _assignment(self, op: Any, round_priority: int) -> Any:
        self.calls += 1
        return super()._assignment(op, round_priority)


@pytest.mark.parametrize("strategy", ["fsdp", "2d"])
def test_skipping_settled_ops_gives_the_same_shardings(strategy: str) -> None:
    """An op whose values did not move since a visit that changed nothing is not visited again
    (and _write_meta reuses that visit's assignment), and ops of one rule whose values are in
    the same states share one assignment (``_assignment``'s memo): same shardings and
    assignments as visiting every queued op in full, on the GPT step under FSDP and 2-D."""
    step, args = programs.gpt_step(GPTConfig(n_layer=1, n_head=2, d_model=16, vocab_size=32,
                                             seq_len=8))  # fmt: skip
    mesh = Mesh.create((8,), ("data",)) if strategy == "fsdp" else MESH
    params = args[0]
    if strategy == "fsdp":
        pspecs = {k: _fsdp_spec(v.shape) for k, v in params.items()}
    else:
        pspecs = {k: P(None, "model") if v.ndim == 2 else P() for k, v in params.items()}
    specs = (pspecs, None, {"step": P(), "exp_avg": pspecs, "exp_avg_sq": pspecs}, P("data"))
    gm = partita.capture.trace(step, args, in_specs=specs, mesh=mesh).graph_module
    results = []
    for propagator in (_Counting, _NeverSettled):
        state = propagator(gm, mesh, False)
        state.run()
        results.append(
            [(n.name, n.meta.get("sharding"), n.meta.get("factor_axes")) for n in gm.graph.nodes]
        )
        if isinstance(state, _Counting):
            assert sum(op.settled is not None for op in state.ops) > len(state.ops) // 2
            assert len(state._memo) < state.calls * 3 // 4  # a quarter reuse one (1 layer)
    assert results[0] == results[1]


def test_the_state_names_the_values_it_fixed() -> None:
    """``ProgramState.fixed`` holds exactly the values whose ``fixed`` flag its build set (the
    auto build reads it instead of walking every value): the user's annotations, the output's
    and a pinned input here. ``mark_stored=False`` (the auto build, which reads no ``stored``
    flag) skips only the stored walk: every other field of every value is the same."""
    fn, args = programs.mlp()
    in_specs = (None, P(None, "model"), P("model"), P("model", None), None)
    gm = partita.capture.trace(fn, args, mesh=MESH, in_specs=in_specs, out_specs=P()).graph_module
    pin = P("data", None).to_sharding(MESH, 2)
    state = ProgramState(gm, MESH, False, pinned=[pin])
    flagged = {k for k, v in state.values.items() if v.fixed}
    assert state.fixed == flagged and len(flagged) == 5  # 3 weights, the output, the pin
    light = ProgramState(gm, MESH, False, pinned=[pin], mark_stored=False)
    assert light.fixed == flagged and light.values.keys() == state.values.keys()
    stored = [k for k, v in state.values.items() if v.stored and k[0].op != "placeholder"]
    assert stored and not any(light.values[k].stored for k in stored)  # the annotated weights
    for k, v in light.values.items():
        v.stored = state.values[k].stored
    assert light.values == state.values


_DM = Mesh.create((2, 2), ("data", "model"))


def _row_parallel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A row-parallel matmul on a 3-d activation (aten: view, mm, view), its result wanted split
    over batch and model as sequence parallelism lays out the residual stream."""
    return partita.mark_sharding(x @ w, _DM, P(("data", "model"), None, None)) * 2


def test_a_partial_sum_wanted_split_finer_is_reduce_scattered_through_a_reshape() -> None:
    """The mm's result is a partial sum over ``model`` with its rows split over ``data``; the
    view after it is wanted split over ``(data, model)``. Invariant 4's exception gives the view
    the finer split, so the sum is reduce-scattered onto it, where the operand's own proposal
    (``data`` only) had it all-reduced whole and then cut by the annotation."""
    x, w = torch.randn(8, 4, 16), torch.randn(16, 6)
    step = partita.jit(_row_parallel, mesh=_DM, in_specs=(P("data", None, "model"), P("model")))
    assert step.lower(x, w).call_counts() == {"reduce_scatter": 1}
    torch.testing.assert_close(step(x, w).full(), (x @ w) * 2)


def test_a_partial_sum_with_two_readers_is_still_reduced_once() -> None:
    """When the partial sum has another reader, the finer split would reduce it twice (a
    reduce_scatter for the view and an all_reduce for the other reader): it keeps its
    operand's split and one all_reduce serves both."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.reshape(-1, 16) @ w  # the partial sum, read twice
        out = partita.mark_sharding(y.reshape(8, 4, 6), _DM, P(("data", "model"), None, None))
        return out * 2, y.exp()

    x, w = torch.randn(8, 4, 16), torch.randn(16, 6)
    step = partita.jit(fn, mesh=_DM, in_specs=(P("data", None, "model"), P("model")))
    assert sum(step.lower(x, w).call_counts().values()) == 1
    y = x.reshape(-1, 16) @ w
    for got, want in zip(step(x, w), (y.reshape(8, 4, 6) * 2, y.exp()), strict=True):
        torch.testing.assert_close(got.full(), want)
