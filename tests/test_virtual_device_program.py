"""The virtual device's recorded program against ``train_step``'s, and attention on the device.

The loop records eager autograd and ``torch.optim``'s kernels, ``train_step`` traces its own
functional step; both must become programs that move no more bytes. Attention is where they
used to differ: PyTorch runs ``F.scaled_dot_product_attention`` on a device without a fused
kernel through its math decomposition, whose ``(batch heads)`` reshape cost an all-gather per
attention reshape. Every result is checked against the same code run eagerly on the CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.capture.source import source_line
from partita.models import GPT, GPTConfig
from partita.virtual import recording
from partita.virtual import state as virtual_state
from partita.virtual import step as vstep

MESH = Mesh.create((2, 4), ("data", "model"))
CFG = GPTConfig(n_layer=1, n_head=4, d_model=16, vocab_size=32, seq_len=8, bias=False)


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return partita.use_spmd(MESH)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _recorded_ops() -> list[str]:
    return [str(op) for op, *_ in recording.current().ops]


def test_the_loop_moves_no_more_than_train_step(dev: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), generator=g)
    y = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), generator=g)
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    twin = copy.deepcopy(ref)
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    step = partita.train_step(
        twin, _loss, opt, mesh=MESH, param_specs="fsdp+tp", batch_spec=P("data", None)
    )
    expected = step.lower((x, y))

    model = model.to(dev)
    for name, spec in partita.presets.param_specs("fsdp+tp", model, MESH).items():
        partita.mark_sharding(model.get_parameter(name), MESH, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    partita.sync()  # anything an earlier test left recorded runs now, not in this step
    virtual_state.get().programs.clear()
    xd, yd = x.to(dev), y.to(dev)
    partita.mark_sharding(xd, MESH, P("data", None))
    loss = _loss(model(xd), yd)
    loss.backward()
    opt.step()
    opt.zero_grad()
    attention_ops = _recorded_ops().count("partita.sdpa.default")
    partita.sync()
    (program,) = virtual_state.get().programs.values()
    plan = program.compiled.plan

    # Before the attention kernel, this 1-layer GPT's loop had 4 all-gathers over "model" more
    # than train_step (the merged (batch heads) reshapes of the math decomposition).
    counts, limit = plan.counts(), expected.counts()
    assert all(counts.get(k, 0) <= n for k, n in limit.items()), (
        plan.summary(),
        expected.summary(),
    )
    assert set(counts) <= set(limit), (plan.summary(), expected.summary())
    assert plan.bytes_per_device <= expected.bytes_per_device, (
        plan.summary(),
        expected.summary(),
    )
    assert attention_ops == CFG.n_layer
    # Each collective names the user's line that needed it, as train_step's Plan does: the
    # model's lines for forward and backward (a gradient's reduce_scatter points at its
    # forward's line), the loss function's for the loss, never the replay or partita.sync().
    sources = [c.source for c in plan.collectives]
    assert all(
        s is not None and (s.startswith("gpt.py:") or s.endswith("in _loss")) for s in sources
    ), plan.explain()
    assert {
        s for c, s in zip(plan.collectives, sources, strict=True) if c.kind == "reduce_scatter"
    } <= {s for s in sources if s.startswith("gpt.py:") and s.endswith("in forward")}
    assert len({s for s in sources if s.startswith("gpt.py:")}) >= 5, plan.explain()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_loss = _loss(ref(x), y)
    ref_loss.backward()
    ref_opt.step()
    torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-5, atol=1e-5)


def _attention_case(
    dev: torch.device, heads_kv: int = 4, **kwargs: object
) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """Forward and backward of one attention call on the device and eagerly on the CPU."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 8, 16, generator=g)
    k = torch.randn(2, heads_kv, 8, 16, generator=g)
    v = torch.randn(2, heads_kv, 8, 16, generator=g)
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    on_dev = [t.to(dev).requires_grad_() for t in (q, k, v)]
    w = torch.randn(2, 4, 8, 16, generator=g)
    out = F.scaled_dot_product_attention(*eager, **kwargs)
    (out * w).sum().backward()
    dout = F.scaled_dot_product_attention(*on_dev, **kwargs)
    (dout * w.to(dev)).sum().backward()
    ops = _recorded_ops()
    got = [dout.cpu(), *(t.grad.cpu() for t in on_dev)]
    want = [out.detach(), *(t.grad for t in eager)]
    return ops, got, want


@pytest.mark.parametrize(
    "kwargs",
    [
        {"is_causal": True},
        {"attn_mask": torch.ones(8, 8, dtype=torch.bool).tril(), "scale": 0.3},
    ],
    ids=["causal", "bool-mask"],
)
def test_attention_is_recorded_as_one_op(dev: torch.device, kwargs: dict) -> None:
    ops, got, want = _attention_case(dev, **kwargs)
    assert ops.count("partita.sdpa.default") == 1
    assert ops.count("partita.sdpa_backward.default") == 1
    assert "aten.bmm.default" not in ops
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_the_flash_kernel_does_not_take_runs_decomposed(dev: torch.device) -> None:
    # Grouped-query broadcasting (2 key/value heads for 4 query heads) is the math path's.
    ops, got, want = _attention_case(dev, heads_kv=2, is_causal=True, enable_gqa=True)
    assert "partita.sdpa.default" not in ops
    assert "aten.bmm.default" in ops
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True, amsgrad=True),
    ],
    ids=["adamw-default", "adam-amsgrad-foreach"],
)
def test_foreach_optimizers_equal_eager_and_compile_once(dev: torch.device, make) -> None:
    """torch.optim runs its foreach kernels on the device (by default, as on an accelerator);
    each ``_foreach_*`` op is replayed per tensor, its floats lifted, so an lr schedule does not
    recompile. An explicit ``foreach=True`` used to fail in propagation (no rule for
    ``aten._foreach_mul.Scalar``)."""
    ref = _mlp()
    model = copy.deepcopy(ref).to(dev)
    partita.mark_sharding(model[0].weight, MESH, P("model", None))
    virtual_state.get().programs.clear()
    recording.forget_guides()
    partita.metrics(reset=True)
    g = torch.Generator().manual_seed(3)
    runs = []
    for m, on_dev in ((model, True), (ref, False)):
        opt = make(list(m.parameters()))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        losses, foreach_ops = [], 0
        g.manual_seed(3)
        for _ in range(4):
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
            if on_dev:
                x, y = x.to(dev), y.to(dev)
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if on_dev:
                foreach_ops += sum("_foreach_" in op for op in _recorded_ops())
                partita.sync()
            losses.append(loss.item())
        runs.append((losses, foreach_ops))
    (losses, foreach_ops), (ref_losses, _) = runs
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-5, atol=1e-5)
    assert foreach_ops > 0
    # Step 1 creates the optimizer's state (data): steps 2-4 are one program.
    assert partita.metrics().compiles <= 2, str(partita.metrics())


def test_a_fused_optimizer_is_refused_with_the_fix(dev: torch.device) -> None:
    model = _mlp().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ((model(torch.randn(8, 8).to(dev)) ** 2).mean()).backward()
    with pytest.raises(partita.VirtualDeviceError, match=r"_fused_adamw_.*fused=True.*Drop fused"):
        opt.step()
    recording.reset()  # the refused step's recording is not run


def test_a_small_pending_condition_is_read_without_cutting_the_step(dev: torch.device) -> None:
    """What Hugging Face's causal mask does mid-forward: branch on a condition computed from an
    ``arange``. It is computed on the side; the step stays one program."""
    virtual_state.get().programs.clear()
    partita.metrics(reset=True)
    w = torch.randn(16, 4)
    wd = partita.mark_sharding(w.to(dev), MESH, P("model", None))
    h = wd.t() @ wd  # pending, and not small: not what the branch reads
    ids = torch.arange(16, device=dev).unsqueeze(0) * 2
    packed = (ids[:, -1] == 0).all()
    assert bool(packed) is False
    assert bool((ids[:, 0] == 0).all()) is True
    assert partita.metrics().syncs == 0
    noise = torch.rand(4, device=dev)  # a random op: read only by running the step
    assert bool((noise < 2).all()) is True
    assert partita.metrics().syncs == 1
    torch.testing.assert_close(h.cpu(), w.t() @ w)
    assert ids.cpu().tolist() == [list(range(0, 32, 2))]


def test_a_pending_value_too_big_to_peek_syncs(dev: torch.device) -> None:
    partita.metrics(reset=True)
    x = torch.arange(float(1 << 17)).to(dev)
    assert bool(((x * 2).sum() > 0).all()) is True  # its input is over MAX_ELEMENTS
    assert partita.metrics().syncs == 1


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _double_too(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _node_sources(program: vstep.StepProgram, target: object) -> set[str | None]:
    graph = program.compiled.program.graph_module.graph
    return {source_line(n) for n in graph.nodes if n.target == target}


def test_recorded_source_lines_reach_the_program_and_not_its_key(dev: torch.device) -> None:
    aten = torch.ops.aten
    virtual_state.get().programs.clear()
    recording.forget_guides()
    partita.metrics(reset=True)
    x = torch.arange(32.0).reshape(8, 4).to(dev)
    outs = []
    # The same ops from other lines, with the fast path and without: one program.
    for fn, fast in [(_double, True), (_double_too, True), (_double_too, False)]:
        virtual_state.get().fast_path = fast
        try:
            outs.append(fn(x))
            partita.sync()
        finally:
            virtual_state.get().fast_path = True
    m = partita.metrics()
    assert (m.compiles, m.cache_hits, m.fast_path_hits) == (1, 2, 1), str(m)
    (first,) = virtual_state.get().programs.values()
    assert _node_sources(first, aten.mul.Tensor) == {
        f"{__name__.split('.')[-1]}.py:{_double.__code__.co_firstlineno + 1} in _double"
    }
    # A step that follows its guide (the last step), then differs: the op recorded on the fast
    # path has the guide's line, the new one its own.
    outs.append(_double_too(x).exp())
    partita.sync()
    assert partita.metrics().compiles == 2
    second = next(reversed(virtual_state.get().programs.values()))
    assert _node_sources(second, aten.mul.Tensor) == {
        f"{__name__.split('.')[-1]}.py:{_double_too.__code__.co_firstlineno + 1} in _double_too"
    }
    (exp_line,) = _node_sources(second, aten.exp.default)
    assert exp_line is not None and exp_line.endswith(
        "in test_recorded_source_lines_reach_the_program_and_not_its_key"
    )
    for out in outs[:3]:
        torch.testing.assert_close(out.cpu(), torch.arange(32.0).reshape(8, 4) * 2)
    torch.testing.assert_close(outs[3].cpu(), (torch.arange(32.0).reshape(8, 4) * 2).exp())
