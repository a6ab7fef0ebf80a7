"""A rank's program with fewer Python calls (runtime.rank_calls), and the freed heap given back
(runtime.release): the same results bit for bit, fewer nodes. On 4 Gloo processes the bound
programs run in tests/test_overlap.py and tests/test_distributed.py."""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from partita.runtime.overlap import run_measuring
from partita.runtime.rank_calls import fewer_calls
from partita.runtime.release import release_freed

N = 9  # parameters: more than flat_foreach's smallest group


def _update(*ts: torch.Tensor) -> list[torch.Tensor]:
    """An AdamW-like update of N parameters, and a permute of a permute."""
    ps, gs, ms = ts[:N], ts[N : 2 * N], ts[2 * N : 3 * N]
    out = []
    for p, g, m in zip(ps, gs, ms, strict=True):
        m2 = m * 0.9 + g * 0.1
        out.append(p - 0.01 * m2 / (torch.sqrt(m2 * m2) + 1e-8))
    out.append(ts[0].reshape(4, 3).permute(1, 0).permute(1, 0).reshape(4, 3) * 2)
    return out


def _program() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(4, 3, generator=g) for _ in range(3 * N)]
    return make_fx(_update)(*args), args


def _calls(gm: fx.GraphModule) -> int:
    """The torch ops a run dispatches (a ``getitem`` of a group's results is no dispatch)."""
    return sum(n.op == "call_function" and n.target is not operator.getitem for n in gm.graph.nodes)


def test_fewer_calls_same_bits() -> None:
    gm, args = _program()
    for n in gm.graph.nodes:  # a rank's program has no values recorded: the first run's
        n.meta.pop("val", None)
    want, _ = run_measuring(gm, args)
    vals: dict[str, torch.Tensor] = {}
    run_measuring(gm, args, vals)
    assert all(v.device.type == "meta" for v in vals.values())
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    grouped = fewer_calls(graph, gm, vals)
    fewer = fx.GraphModule(gm, graph)
    assert grouped >= 5 * N  # each step of the N updates is one _foreach call
    assert _calls(fewer) < _calls(gm) - 4 * N
    assert not any(n.target is torch.ops.aten.permute.default for n in fewer.graph.nodes)
    got = fewer(*args)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_without_values_only_views_fold() -> None:
    gm, args = _program()
    for n in gm.graph.nodes:
        n.meta.pop("val", None)
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    assert fewer_calls(graph, gm, {}) == 0  # nothing grouped without the values' metadata
    fewer = fx.GraphModule(gm, graph)
    for a, b in zip(fewer(*args), gm(*args), strict=True):
        assert torch.equal(a, b)


def test_release_freed_runs() -> None:
    import platform

    ran = release_freed()
    assert ran == (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
