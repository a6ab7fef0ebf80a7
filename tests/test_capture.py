"""Tests of partita.capture: trace, normalisation, source lines, annotations, reference steps."""

from __future__ import annotations

import operator
import re
import warnings
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.capture import (
    ANNOTATE_OP,
    VALUE_VIEW_OPS,
    Annotation,
    annotate,
    is_tracing,
    source_line,
    trace,
)
from partita.errors import CaptureError, ShardingConflictError
from partita.models import GPT, GPTConfig, SmallCNN
from partita.training import init_opt_state, make_train_step

from adamw_parity import AdamWParity  # isort: skip
from programs import MESH, canonical_cases, cnn_step, gpt_step, mlp  # isort: skip

#: Every op a captured GPT step, CNN step, MLP or canonical program may contain (golden).
GOLDEN_OPS = [
    "<built-in function getitem>",
    "aten._log_softmax.default",
    "aten._log_softmax_backward_data.default",
    "aten._native_batch_norm_legit_functional.default",
    "aten._softmax.default",
    "aten._to_copy.default",
    "aten.add.Tensor",
    "aten.addmm.default",
    "aten.amax.default",
    "aten.arange.start_step",
    "aten.avg_pool2d.default",
    "aten.avg_pool2d_backward.default",
    "aten.bmm.default",
    "aten.cat.default",
    "aten.constant_pad_nd.default",
    "aten.convolution.default",
    "aten.convolution_backward.default",
    "aten.div.Tensor",
    "aten.embedding.default",
    "aten.embedding_dense_backward.default",
    "aten.full_like.default",
    "aten.gelu.default",
    "aten.gelu_backward.default",
    "aten.le.Scalar",
    "aten.max_pool2d_with_indices.default",
    "aten.max_pool2d_with_indices_backward.default",
    "aten.mm.default",
    "aten.mul.Tensor",
    "aten.native_batch_norm_backward.default",
    "aten.native_layer_norm.default",
    "aten.native_layer_norm_backward.default",
    "aten.nll_loss_backward.default",
    "aten.nll_loss_forward.default",
    "aten.permute.default",
    "aten.pow.Scalar",
    "aten.reciprocal.default",
    "aten.relu.default",
    "aten.reshape.default",
    "aten.scalar_tensor.default",
    "aten.slice.Tensor",
    "aten.sort.default",
    "aten.sqrt.default",
    "aten.sub.Tensor",
    "aten.sum.dim_IntList",
    "aten.where.self",
    "partita.annotate.default",
    "partita.sdpa.default",
    "partita.sdpa_backward.default",
]

VIEW_NAMES = ("view", "_unsafe_view", "_reshape_alias", "alias", "detach", "t", "transpose")


@pytest.fixture(scope="module")
def gpt():
    step, args = gpt_step()
    return step, args, trace(step, args)


@pytest.fixture(scope="module")
def cnn():
    step, args = cnn_step()
    return step, args, trace(step, args)


def _calls(program):
    return [n for n in program.graph.nodes if n.op == "call_function"]


def _all_programs(gpt, cnn):
    fn, args = mlp()
    yield trace(fn, args)
    yield gpt[2]
    yield cnn[2]
    for case in canonical_cases():
        yield trace(case.fn, case.args, in_specs=case.in_specs, out_specs=case.out_specs, mesh=MESH)


# --- the graph is functional and small ---------------------------------------------------------


def test_op_set_is_golden(gpt, cnn):
    ops = set()
    for program in _all_programs(gpt, cnn):
        ops |= {str(n.target) for n in _calls(program)}
    print("\n".join(sorted(ops)))
    assert sorted(ops) == GOLDEN_OPS


def test_graph_is_functional(gpt, cnn):
    for program in _all_programs(gpt, cnn):
        for node in _calls(program):
            if node.target is operator.getitem:
                continue
            schema = node.target._schema
            assert not schema.is_mutable, node.format_node()
            aliases = any(r.alias_info is not None for r in schema.returns)
            assert not aliases or node.target in VALUE_VIEW_OPS, node.format_node()
            name = node.target._opname
            assert name not in VIEW_NAMES, node.format_node()
            assert name == "_to_copy" or not name.endswith("_copy"), node.format_node()


@pytest.mark.parametrize("which", ["mlp", "gpt", "cnn"])
def test_traced_graph_equals_eager(which, gpt, cnn):
    if which == "mlp":
        fn, args = mlp()
        program = trace(fn, args)
    else:
        fn, args, program = gpt if which == "gpt" else cnn
    torch.testing.assert_close(program(*args), fn(*args), rtol=1e-5, atol=1e-6)


def test_sdpa_is_device_neutral(gpt):
    targets = {str(n.target) for n in _calls(gpt[2])}
    assert "partita.sdpa.default" in targets and "partita.sdpa_backward.default" in targets
    assert not any("flash" in t for t in targets)


def test_sdpa_math_path_matches_cpu_kernel():
    from partita.capture import ops

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    out, lse = ops.sdpa(q, k, v, None, 0.0, True, None)
    # the default (non-CPU) implementation, called directly
    ref_out, ref_lse = ops.sdpa._init_fn(q, k, v, None, 0.0, True, None)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    grad = torch.randn_like(out)
    got = ops.sdpa_backward(grad, q, k, v, out, lse, None, 0.0, True, None)
    ref = ops.sdpa_backward._init_fn(grad, q, k, v, out, lse, None, 0.0, True, None)
    torch.testing.assert_close(got, ref)
    want = torch.func.vmap(lambda a: ops.sdpa(a, k, v, None, 0.0, True, None)[0])(q[None])
    torch.testing.assert_close(want[0], out)


# --- source lines -------------------------------------------------------------------------------


def test_source_lines_point_at_user_code(gpt):
    sources = [source_line(n) for n in _calls(gpt[2])]
    assert all(s is not None for s in sources)
    assert any(s.startswith("gpt.py:") and s.endswith("in forward") for s in sources)
    assert any(s.startswith("optim.py:") and "_adam" in s for s in sources)
    sdpa = [n for n in _calls(gpt[2]) if "sdpa" in str(n.target)]
    # forward and backward attention both point at the F.scaled_dot_product_attention line
    assert {source_line(n) for n in sdpa} == {source_line(sdpa[0])}
    assert source_line(sdpa[0]).startswith("gpt.py:")


def test_source_line_of_a_local_function():
    def fn(a):
        return a.cos()  # this line

    program = trace(fn, (torch.ones(3),))
    (cos,) = _calls(program)
    line = fn.__code__.co_firstlineno + 1
    assert source_line(cos) == f"test_capture.py:{line} in fn" == cos.meta["source"]


def test_a_user_function_equal_to_a_torch_one_is_the_users() -> None:
    """Which frames are torch's or partita's is remembered per code object, and code objects
    compare equal by their contents, not their file: the same function at the same line in a
    torch file and in the user's was one key, and the one asked first answered for both."""
    import os

    from partita.capture.source import is_internal

    text = "def _same_in_both(x):\n    return x + 1\n"
    torch_file = os.path.join(os.path.dirname(torch.__file__), "nn", "_same_in_both.py")
    theirs = compile(text, torch_file, "exec").co_consts[0]
    mine = compile(text, "/home/user/model.py", "exec").co_consts[0]
    assert theirs == mine and hash(theirs) == hash(mine)  # one key, but two files
    assert is_internal(theirs)
    assert not is_internal(mine)
    assert is_internal(theirs)


# --- pytrees, statics, errors -------------------------------------------------------------------


def test_pytree_inputs_and_static_leaves():
    def fn(d, scale, *, bias):
        return {"y": d["a"] * scale + bias, "z": [d["b"].sum()]}

    args = ({"a": torch.ones(2, 3), "b": torch.ones(4)}, 3.0)
    program = trace(fn, args, {"bias": torch.zeros(3)})
    assert program.num_inputs == 3 == len(program.input_nodes)
    out = program(*args, bias=torch.full((3,), 2.0))
    assert torch.equal(out["y"], torch.full((2, 3), 5.0)) and out["z"][0].item() == 4.0


def test_non_static_leaf_is_rejected():
    with pytest.raises(CaptureError, match=r"input args\[1\] is a object .*neither a tensor"):
        trace(lambda a, o: a, (torch.ones(2), object()))


def _line_of(fn, text: str) -> str:
    """``"test_capture.py:N in name"`` of the line of ``fn`` holding ``text``."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    (n,) = [first + i for i, line in enumerate(lines) if text in line]
    return f"test_capture.py:{n} in {fn.__name__}"


def test_untraceable_function_names_it():
    def branchy(a):
        if a.sum() > 0:
            return a
        return -a

    where = re.escape(_line_of(branchy, "if a.sum()"))
    with pytest.raises(CaptureError, match=rf"Cannot trace 'test_untraceable.*branchy' at {where}: "
                       r"GuardOnDataDependentSymNode.*This is data-dependent") as info:  # fmt: skip
        trace(branchy, (torch.ones(2),))
    assert info.value.__cause__ is not None


def _item(a):
    return a * a.sum().item()


def _tolist(a):
    return a * sum(a.tolist())


def _numpy(a):
    return torch.as_tensor(a.numpy())


def _int(a):
    return a * int(a.max())


def _mask(a):
    return a[a > 0]


@pytest.mark.parametrize(
    ("fn", "text", "what"),
    [
        (_item, ".item()", "a Python number read from a tensor"),
        (_tolist, ".tolist()", "a Python number read from a tensor"),
        (_numpy, ".numpy()", r"RuntimeError: \.numpy\(\) is not supported"),
        (_int, "int(a.max())", "GuardOnDataDependentSymNode"),
        (_mask, "a[a > 0]", "a tensor whose shape depends on the data"),
    ],
)
def test_data_dependent_code_names_the_line(fn, text, what):
    where = re.escape(_line_of(fn, text))
    with pytest.raises(CaptureError, match=rf"Cannot trace '{fn.__name__}' at {where}: .*{what}.*"
                       r"This is data-dependent: .*fake tensors .*torch.where"):  # fmt: skip
        trace(fn, (torch.ones(3),))


def test_user_bug_gets_no_fake_tensor_hint(caplog):
    def matmul(x, w):
        return x @ w

    def typo(x):
        return x.sum(dim="0")

    where = re.escape(_line_of(matmul, "x @ w"))
    with pytest.raises(CaptureError, match=rf"Cannot trace .*matmul' at {where}: RuntimeError: "
                       r".*\[4, 4\] X \[3, 3\].*fix the call at that line") as info:  # fmt: skip
        trace(matmul, (torch.ones(4, 4), torch.ones(3, 3)))
    assert "data-dependent" not in str(info.value) and "fake tensors" not in str(info.value)
    # FakeTensor's own ERROR log of the failed shape check is not printed beside the error.
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
    # A library's compile path (transformers leaves attention_mask None under is_compiling):
    # eager does not fail, and the message says what differs.

    def compile_path(x, mask=None):
        if mask is None and not torch.compiler.is_compiling():
            mask = torch.ones_like(x)
        return x * mask[0]

    with pytest.raises(CaptureError, match=r"is_compiling\(\) True.*attention_mask="):
        trace(compile_path, (torch.ones(4),))
    where = re.escape(_line_of(typo, "x.sum("))
    with pytest.raises(CaptureError, match=rf"Cannot trace .*typo' at {where}: TypeError") as info:
        trace(typo, (torch.ones(4),))
    assert "data-dependent" not in str(info.value) and "fake tensors" not in str(info.value)


def test_input_update_becomes_an_extra_output():
    # Before: the update was refused here, and silently dropped under in_specs (partita.jit).
    def fn(a, b):
        a.add_(1)
        b[0] = 5.0
        return a * 2

    program = trace(fn, (torch.ones(2), torch.zeros(3)), mesh=MESH, in_specs=(P("x"), None))
    assert program.mutated_inputs == (0, 1)
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    assert len(out_node.args[0]) == 3  # the result, then the new a and the new b
    # the new value of a keeps a's sharding
    sources = [a.source for a in program.annotations.values()]
    assert "in-place update of args[0]" in sources
    a, b = torch.ones(2), torch.zeros(3)
    out = program(a, b)
    assert torch.equal(out, torch.full((2,), 4.0))
    assert torch.equal(a, torch.full((2,), 2.0)) and torch.equal(b, torch.tensor([5.0, 0, 0]))


def test_input_metadata_update_is_refused():
    def fn(a):
        a.t_()
        return a * 2

    with pytest.raises(
        CaptureError,
        match=r"'.*fn' changes the shape or strides of its input "
        r"args\[0\] \(shape \(2, 3\), then \(3, 2\)\) in place .*use the out-of-place op",
    ):
        trace(fn, (torch.ones(2, 3),))


def test_static_outputs_come_back_beside_the_tensors():
    """None, numbers, strings and shapes in the result are fixed while tracing and returned."""

    def fn(a, b):
        b.add_(1)  # an in-place update: its new value follows the results in the graph
        return {"y": a * 2, "n": a.shape[0], "none": None, "rows": a.shape, "tag": "x"}, a + 1

    program = trace(fn, (torch.ones(2, 3), torch.zeros(3)))
    assert program.static_outputs == {1: 2, 2: None, 3: torch.Size([2, 3]), 4: "x"}
    assert program.num_results == 2
    b = torch.zeros(3)
    out, z = program(torch.full((2, 3), 3.0), b)
    assert (out["n"], out["none"], out["rows"], out["tag"]) == (2, None, (2, 3), "x")
    assert type(out["rows"]) is torch.Size  # not the plain tuple pytree rebuilds
    assert torch.equal(out["y"], torch.full((2, 3), 6.0)) and torch.equal(
        z, torch.full((2, 3), 4.0)
    )
    assert torch.equal(b, torch.ones(3))


def test_jit_returns_static_outputs_and_shards_only_the_tensors():
    mesh = Mesh.create((2, 2), ("x", "y"))
    f = partita.jit(
        lambda a: (a.sum(0), None, a.shape[1], 0.5), mesh=mesh, in_specs=P("x", None),
        out_specs=(P("y"), None, None, None),
    )  # fmt: skip
    a = torch.randn(4, 6)
    total, none, cols, half = f(a)
    assert (none, cols, half) == (None, 6, 0.5)
    assert total.spec == P("y") and torch.allclose(total.full(), a.sum(0))


def test_a_size_argument_reaches_the_function_as_a_size():
    """``shape.numel()`` on a ``torch.Size`` argument works under jit as it does eagerly."""
    mesh = Mesh.create((2, 2), ("x", "y"))
    f = partita.jit(lambda a, shape: a.reshape(shape) * shape.numel(), mesh=mesh,
                    in_specs=(P("x", None), None))  # fmt: skip
    a = torch.randn(4, 6)
    out = f(a, torch.Size([4, 3, 2]))
    assert torch.allclose(out.full(), a.reshape(4, 3, 2) * 24)


def test_a_number_read_from_a_tensor_in_the_result_is_called_data_dependent():
    with pytest.raises(CaptureError, match=r"returns a Python number read from a tensor at "
                       r"\[1\] .*This is data-dependent"):  # fmt: skip
        trace(lambda a: (a, a.sum().tolist()), (torch.ones(2),))


def test_an_object_output_is_refused_with_the_fix():
    with pytest.raises(CaptureError, match=r"returned object <object.*at \[1\].*build the object"):
        trace(lambda a: (a, object()), (torch.ones(2),))


def test_internal_mutation_is_functionalized():
    def fn(a):
        b = a.clone()
        b[0] = 5.0
        b.mul_(2)
        return b.view(-1).t()

    program = trace(fn, (torch.ones(2, 2),))
    assert all(not n.target._schema.is_mutable for n in _calls(program))
    assert torch.equal(program(torch.ones(2, 2)), fn(torch.ones(2, 2)))


# --- annotations --------------------------------------------------------------------------------


def test_annotate_nodes_carry_their_annotation():
    seen = []

    def fn(a, b):
        seen.append(is_tracing())
        c = annotate(a @ b, MESH, P("x", None), priority=2)
        return c.relu()

    program = trace(fn, (torch.ones(8, 4), torch.ones(4, 8)))
    assert seen == [True] and not is_tracing()
    (node,) = [n for n in _calls(program) if n.target == ANNOTATE_OP]
    ann = program.annotations[node]
    assert node.meta["annotation"] is ann
    assert ann == Annotation(P("x", None).to_sharding(MESH, 2), 2, ann.source)
    assert ann.source.startswith("test_capture.py:") and ann.source.endswith("in fn")


def test_unused_annotation_is_kept():
    def fn(a):
        annotate(a, MESH, P("x"))  # PyTorch/XLA style: the result is ignored
        return a + 1

    program = trace(fn, (torch.ones(8),))
    (node,) = program.annotations
    assert node.args[0].op == "placeholder"


def test_in_specs_and_out_specs():
    def fn(params, x):
        return {"out": x @ params["w"], "aux": params["b"] * 2}

    args = ({"w": torch.ones(4, 8), "b": torch.ones(8)}, torch.ones(2, 4))
    program = trace(
        fn, args, mesh=MESH,
        in_specs=({"w": P(None, "y"), "b": None}, P("x")),
        out_specs={"out": P("x", "y"), "aux": None},
    )  # fmt: skip
    anns = list(program.annotations.items())
    specs = [str(a.sharding) for _, a in anns]
    assert specs == ["P(None, 'y')", "P('x', None)", "P('x', 'y')"]
    assert all(n.args[0].op == "placeholder" for n, _ in anns[:2])
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    assert anns[2][0] in out_node.args[0]
    assert anns[0][1].source == "in_specs for args[0]['w']"
    # a single P is a prefix of every argument
    program = trace(lambda a, b: a + b, (torch.ones(8), torch.ones(8)), mesh=MESH, in_specs=P("x"))
    assert len(program.annotations) == 2


def test_spec_errors():
    with pytest.raises(CaptureError, match="pass mesh=Mesh"):
        trace(lambda a: a, (torch.ones(2),), in_specs=P())
    with pytest.raises(CaptureError, match=r"Write P\('x', None\)"):
        trace(lambda a: a, (torch.ones(2, 2),), mesh=MESH, in_specs=(("x", None),))
    shown = r"in_specs is \(P\(\), P\(\)\), the values are \(tensor\[2\],\)"
    with pytest.raises(CaptureError, match=rf"does not match the structure of the values: {shown}"):
        trace(lambda a: a, (torch.ones(2),), mesh=MESH, in_specs=(P(), P()))


def test_two_meshes_conflict():
    other = Mesh.create((8,), ("d",))

    def fn(a):
        b = annotate(a, MESH, P("x"))
        return annotate(b, other, P("d"))

    with pytest.raises(ShardingConflictError, match=r"Mesh\(x=2, y=4\).*test_capture.py:\d+ in fn"
                       r".*Mesh\(d=8\).*test_capture.py:\d+ in fn"):  # fmt: skip
        trace(fn, (torch.ones(8),))


def test_annotation_gradient_passes_through():
    def fn(w, x):
        with torch.enable_grad():
            w = w.detach().requires_grad_(True)
            loss = (annotate(w, MESH, P("x")) * x).sum()
            (g,) = torch.autograd.grad(loss, [w])
        return g

    args = (torch.ones(8), torch.arange(8.0))
    program = trace(fn, args)
    assert torch.equal(program(*args), torch.arange(8.0))
    assert len(program.annotations) == 1


# --- reference models and steps -----------------------------------------------------------------


def _reference_step(model, loss_fn, opt, batch):
    opt.zero_grad()
    loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("which", ["gpt", "cnn"])
def test_functional_steps_match_torch_optim(which, optimizer):
    """Three steps of the functional step equal torch.optim's (losses, parameters, buffers at
    1e-6 and 1e-5 of the value). Under AdamW the parameters are compared through
    ``tests/adamw_parity.py`` (the moments after every step, then the parameters give or take
    what the moments' difference makes of the updates): the GPT's key bias has an exactly-zero
    gradient (softmax ignores a constant shift), so its computed gradient is rounding noise
    (~1e-10, below eps) that AdamW divides by rounding noise."""
    torch.manual_seed(0)
    if which == "gpt":
        cfg = GPTConfig(n_layer=1, n_head=2, d_model=16, vocab_size=32, seq_len=8)
        model = GPT(cfg)
        batch = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))

        def loss_fn(logits, y):
            return F.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))
    else:
        model = SmallCNN(3, 10, 8, 4).train()
        batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))
        loss_fn = F.cross_entropy
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    step = make_train_step(model, loss_fn, optimizer, **kw)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    state = init_opt_state(params, optimizer)
    names = list(params)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), **kw)
        parity = AdamWParity(opt, names, rtol=1e-5, atol=1e-6)
    else:
        opt = torch.optim.SGD(model.parameters(), momentum=0.9, **kw)
    losses, ref_losses = [], []
    for _ in range(3):
        loss, params, buffers, state = step(params, buffers, state, batch)
        losses.append(loss)
        ref_losses.append(_reference_step(model, loss_fn, opt, batch))
        if optimizer == "adamw":
            moments = {k: state[k] for k in ("exp_avg", "exp_avg_sq")}
            by_position = {i: {k: m[n] for k, m in moments.items()} for i, n in enumerate(names)}
            parity.after_step({i: {"step": state["step"], **s} for i, s in by_position.items()})
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
    if optimizer == "adamw":
        parity.check_parameters(params)
    else:
        ref = {k: v.detach() for k, v in model.named_parameters()}
        torch.testing.assert_close(params, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(buffers, dict(model.named_buffers()), rtol=1e-5, atol=1e-6)


def test_the_same_tensor_passed_twice_stays_two_inputs() -> None:
    from partita.capture import trace

    x = torch.randn(4, 4)
    prog = trace(lambda a, b: a * 2 + b, (x, x))
    assert len(prog.input_nodes) == 2
    assert all(len(n.users) == 1 for n in prog.input_nodes)
    torch.testing.assert_close(prog(x, x), x * 3)


# --- tensor constants become inputs --------------------------------------------------------------


def test_constants_are_lifted_to_inputs():
    closed = torch.arange(4.0)
    linear = torch.nn.Linear(4, 3)

    def fn(x):
        return linear(x * closed * torch.tensor(2.0)) + torch.tensor([]).sum()

    x = torch.randn(2, 4)
    program = trace(fn, (x,), mesh=MESH)
    assert not [n for n in program.graph.nodes if n.op == "get_attr"]
    assert program.num_inputs == 1 + 5 == len(program.input_nodes)
    shapes = [tuple(c.shape) for c in program.constants]
    assert sorted(shapes) == [(), (0,), (3,), (3, 4), (4,)]
    assert any(c is not closed and c.data_ptr() == closed.data_ptr() for c in program.constants)
    assert all(not c.requires_grad for c in program.constants)
    # each constant is annotated replicated, with the line that uses it
    anns = list(program.annotations.values())
    assert len(anns) == 5 and all(a.sharding.is_replicated for a in anns)
    assert all("tensor constant" in a.source and "test_capture.py" in a.source for a in anns)
    torch.testing.assert_close(program(x), fn(x))
    closed.add_(1)  # the program reads the closed-over tensor's current value
    torch.testing.assert_close(program(x), fn(x))


# --- normalisation: slice bounds, split and unbind dims ------------------------------------------


def test_slice_bounds_are_clamped():
    def fn(x):
        x = x.clone().requires_grad_(True)
        y = (x[..., 2:] * x[-1:, :-1].sum()).sum()
        return torch.autograd.grad(y, x)[0]

    x = torch.randn(3, 6)
    program = trace(fn, (x,))
    slicing = [n for n in _calls(program) if "slice" in str(n.target)]
    assert {str(n.target) for n in slicing} == {"aten.slice.Tensor", "aten.slice_scatter.default"}
    for node in slicing:
        dim, start, end, step = node.args[-4:]
        size = node.args[0].meta["val"].shape[dim]
        assert 0 <= start <= end <= size and step == 1, node.format_node()
    torch.testing.assert_close(program(x), fn(x))


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: torch.unbind(a, 1),
        lambda a: torch.unbind(a, -1),
        lambda a: torch.unbind(a),
        lambda a: torch.ops.aten.unbind_copy.int(a, 1),
        lambda a: torch.split(a, [1, 3], dim=1),
        lambda a: torch.split(a, [2, 1], dim=-2),
        lambda a: torch.split(a, 2, 1),
    ],
)
def test_split_and_unbind_keep_their_dim(fn):
    # unbind's dim is its second argument (split's the third): unbind(a, 1) gave rows.
    a = torch.arange(12.0).reshape(3, 4)
    program = trace(fn, (a,))
    for got, want in zip(program(a), fn(a), strict=True):
        assert torch.equal(got, want)


def test_normalize_clamps_open_bounds_for_vmap():
    # torch.vmap (the simulated mesh's executor) rejects end=2**63-1 ("cannot be represented
    # as a SymInt") and mis-reads a negative start of a batched slice_scatter.
    from torch import fx

    from partita.capture import normalize

    a, b = torch.zeros(4, 8), torch.ones(4, 4)
    graph = fx.Graph()
    pa, pb = graph.placeholder("a"), graph.placeholder("b")
    pa.meta["val"], pb.meta["val"] = a, b
    scatter = graph.call_function(torch.ops.aten.slice_scatter.default, (pa, pb, -1, -4, 2**63 - 1))
    sliced = graph.call_function(torch.ops.aten.slice.Tensor, (scatter, 1, None, 2**63 - 1))
    sliced.meta["val"] = scatter.meta["val"] = a
    graph.output(sliced)
    gm = normalize(fx.GraphModule({}, graph))
    assert scatter.args[2:] == (1, 4, 8, 1) and sliced.args[1:] == (1, 0, 8, 1)
    got = torch.vmap(gm)(a.expand(2, 4, 8), b.expand(2, 4, 4))
    assert torch.equal(got[0], torch.cat([a[:, :4], b], 1))


@pytest.mark.parametrize("spec", [P("x", None), P(None, "y"), P("x", "y")])
def test_full_range_slice_scatter_is_its_source(spec: P) -> None:
    """``slice_scatter(x, src, d, 0, n)`` with ``src`` as large as ``x`` is ``src``: capture
    drops it, so no global ``end`` reaches a sharded dim's local call (op-db's slice_scatter
    failed with "Expected index [8, 20, ...] to be no larger than self [8, 5, ...]")."""
    mesh = Mesh.create((2, 4), ("x", "y"))
    x, src = torch.randn(8, 20), torch.randn(8, 20)
    for dim, end in ((0, 8), (1, 20)):
        fn = lambda a, b, dim=dim, end=end: torch.ops.aten.slice_scatter(a, b, dim, 0, end)  # noqa: E731
        program = trace(fn, (x, src))
        targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
        assert torch.ops.aten.slice_scatter.default not in targets
        out = partita.jit(fn, mesh=mesh, in_specs=(spec, spec))(x, src).full()
        torch.testing.assert_close(out, src)


def test_linalg_error_checks_are_not_captured() -> None:
    """``torch.linalg.inv``/``solve``/``cholesky`` check ``info`` with
    ``aten._linalg_check_errors`` (an effectful op that only raises, on values a trace cannot
    see): capture drops it, and a batched inverse sharded on its batch dim equals eager."""
    mesh = Mesh.create((2, 4), ("x", "y"))
    a = torch.randn(5, 3, 3) + 3 * torch.eye(3)
    program = trace(torch.linalg.inv, (a,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("check_errors" in t for t in targets), targets
    out = partita.jit(torch.linalg.inv, mesh=mesh, in_specs=(P("x", None, None),))(a)
    torch.testing.assert_close(out.full(), torch.linalg.inv(a), rtol=1e-4, atol=1e-5)


def test_trace_pauses_the_garbage_collector_and_restores_it():
    """gc_pause: no cyclic collection while tracing, the caller's setting back afterwards, also
    when the trace fails (a collector left off would grow every later process's memory)."""
    import gc

    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(gc.isenabled())
        return x.sin()

    def bad(x: torch.Tensor) -> object:
        seen.append(gc.isenabled())
        return object()  # not a tensor nor a static value: a CaptureError

    assert gc.isenabled()
    trace(fn, (torch.ones(3),))
    with pytest.raises(CaptureError, match=r"returned object"):
        trace(bad, (torch.ones(3),))
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        trace(fn, (torch.ones(3),))
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()


def test_a_pinned_source_names_its_own_threads_ops_only() -> None:
    """``pin_source`` (how the virtual device gives replayed ops their recorded lines) applies
    to the thread that set it: a trace on another thread keeps the lines of its own stack."""
    import threading

    from partita.capture.source import pin_source, stack_entry

    def here() -> None:
        pass

    other: list = []
    pin_source(stack_entry(here.__code__, 7))
    try:
        worker = threading.Thread(target=lambda: other.append(trace(torch.sin, (torch.ones(2),))))
        worker.start()
        worker.join()
        pinned = trace(lambda x: x.cos(), (torch.ones(2),))
    finally:
        pin_source(None)
    assert {source_line(n) for n in _calls(pinned.graph_module)} == {"test_capture.py:7 in here"}
    assert "in here" not in str({source_line(n) for n in _calls(other[0].graph_module)})
    unpinned = trace(lambda x: x.cos(), (torch.ones(2),))
    assert all(":7 in here" not in str(source_line(n)) for n in _calls(unpinned.graph_module))


def _positional(program) -> list[tuple]:
    """Every node as (op, target, arguments by position, shape, dtype, source): the program
    up to node names (an inlined copy names its nodes differently)."""
    nodes = list(program.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    out = []
    for n in nodes:
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (list, tuple)) else [vals]
        metas = [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for v in vals]
        out.append((n.op, str(n.target), repr(args), metas, n.meta.get("source")))
    return out


def test_scanned_layers_trace_the_unrolled_program_op_for_op():
    """scan_layers copies a block's forward and backward where the unrolled trace has them:
    the same nodes in the same order (a backward op that reads no output gradient, such as a
    matmul's ``weight.t()``, stays in the backward), the same shapes and source lines."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, vocab_size=32, seq_len=8)
    model = GPT(cfg)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))

    step = make_train_step(model, loss_fn, "sgd")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    args = (params, {}, init_opt_state(params, "sgd"), (ids, ids))
    unrolled = _positional(trace(step, args))
    partita.scan_layers(model.blocks)
    scanned = trace(step, args)
    assert _positional(scanned) == unrolled


class _Block(torch.nn.Module):
    """A layer that counts its forward calls; with ``by_position`` the layers first called at
    an even position compute relu, the others tanh (a difference the layer signature, which
    sees the class, the attributes and the shapes, cannot see)."""

    calls = 0
    order: ClassVar[dict[int, int]] = {}

    def __init__(self, by_position: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.by_position = by_position
        self.gain = 1.0

    def forward(self, x):
        type(self).calls += 1
        y = self.lin(x) if self.gain == 1.0 else self.lin(x) * self.gain
        position = type(self).order.setdefault(id(self), len(type(self).order))
        return y.tanh() if self.by_position and position % 2 else y.relu()


def _stack_program(by_position: bool, n: int = 6, odd: int | None = None):
    torch.manual_seed(0)
    _Block.calls, _Block.order = 0, {}
    model = torch.nn.Sequential(*[_Block(by_position) for _ in range(n)])
    if odd is not None:
        model[odd].gain = 2.0  # one layer differs in a Python attribute
    step = make_train_step(model, F.mse_loss, "sgd")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    args = (params, {}, init_opt_state(params, "sgd"), (torch.randn(2, 4), torch.randn(2, 4)))
    return trace(step, args), _Block.calls


@pytest.mark.parametrize("by_position", [False, True])
def test_training_step_traces_repeated_layers_once_when_two_trace_alike(by_position, monkeypatch):
    """make_train_step marks a module list's same-class children (capture.layer_auto): the
    second layer of a signature is traced too, and only if it traced like the first do the
    others reuse the trace. Either way the program is the unrolled one op for op."""
    monkeypatch.setenv("PARTITA_SCAN_LAYERS", "0")
    unrolled, unrolled_calls = _stack_program(by_position)
    monkeypatch.setenv("PARTITA_SCAN_LAYERS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # found layers fall back silently
        scanned, scanned_calls = _stack_program(by_position)
    assert unrolled_calls == 6
    # The layers are twins (same class and attributes), so the first call of each signature
    # is traced alone (a shape probe and the trace): layer 0 (its input needs no gradient)
    # and layer 1. Layer 2 is traced once more, to compare with layer 1 (no probe: it has
    # layer 1's outputs); if it differs (by_position), it and layers 3-5 run as ordinary code,
    # else they reuse layer 1's trace.
    assert scanned_calls == (2 + 2 + (1 + 1) + 1 + 1 + 1 if by_position else 2 + 2 + 1)
    assert _positional(scanned) == _positional(unrolled)
    tanh = sum(n.target == torch.ops.aten.tanh.default for n in scanned.graph.nodes)
    assert tanh == (3 if by_position else 0)


def test_a_found_layer_without_a_twin_is_traced_as_ordinary_code(monkeypatch):
    """A layer whose Python attributes differ from every other's (here its gain) is no twin of
    any: it runs as ordinary code, and the others still reuse one trace; the program is the
    unrolled one op for op."""
    monkeypatch.setenv("PARTITA_SCAN_LAYERS", "0")
    unrolled, _ = _stack_program(False, odd=3)
    monkeypatch.setenv("PARTITA_SCAN_LAYERS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scanned, calls = _stack_program(False, odd=3)
    # layers 0 and 1 traced alone (probe and trace), 2 compared, 3 ordinary, 4 and 5 reuse
    assert calls == 2 + 2 + 1 + 1
    assert _positional(scanned) == _positional(unrolled)


def test_constants_read_twice_through_autograd_grad_are_one_input():
    """The backward of a closed-over module's op (traced through autograd.grad) reads its
    weight with a second get_attr of the same constant; lifting it used to fail on the
    second (AttributeError '_param_constant0')."""
    torch.manual_seed(0)
    conv = torch.nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1)
    targets = torch.tensor([1, 0, 3, 2])

    def grads(x):
        x = x.detach().requires_grad_(True)
        smooth = F.cross_entropy(conv(x).mean((2, 3)), targets, label_smoothing=0.1)
        return torch.autograd.grad(smooth, x)[0]

    x = torch.randn(4, 3, 5, 4)
    mesh = Mesh.create((2,), ("x",))
    got = partita.jit(grads, mesh=mesh, in_specs=(P("x"),))(x).full()
    torch.testing.assert_close(got, grads(x))
