"""Memory-bound workloads of GPT-S's step, and the fit of the cost model's local-op terms on them.

Used by ``bench/bench_collectives.py --ops`` (and its full run). Each workload is a function
traced by ``make_fx`` (fake tensors) into the kind of flat graph of aten ops a partitioned step
runs, one Python call per op; the bench runs the traced graph on real tensors on every process
at once. The model's own accounting of the graph (``partita.cost.node_flops`` /
``node_bytes``: the ops it counts, their bytes and FLOPs) is what the fit regresses the
measured time on, so the fitted figures mean exactly what ``partita.cost.op_time`` charges:

    seconds of a workload = ops * op_overhead + bytes / memory_bandwidth

(every op here is memory-bound: its bytes at any plausible bandwidth take longer than its
FLOPs at the profile's ``peak_flops``). The workloads, at GPT-S's per-device sizes:

* ``adamw/k``: the AdamW update (the ops of ``partita.training.optim._adam_param``) of every
  GPT-S parameter split ``k`` ways (1, 2, 4: replicated, one axis of a (2, 2) mesh, 4 devices);
* ``acts/r``: the memory-bound ops of a transformer layer on ``r`` rows of width 256 (512 and
  1024: the rows of a device's batch slice on a (4,) and on a (2, 2) mesh): layer norm, GELU
  and their backwards (autograd's own ops), residual adds, a log-softmax, bias-gradient sums,
  a concatenation and an index_select;
* ``tiny``: the optimizer's ops on bias-sized tensors (256 floats), where the per-op cost is
  all there is;
* ``copies/...`` (:func:`copy_workloads`): the runtime's own copies around collective calls
  (``runtime.dist_ops`` run with Gloo stubbed out, :func:`gloo_stubbed`) on GPT-S's buckets of
  one layer's parameters (and of the embeddings): a gather bucket's packing and the unpacking
  of each gathered member out of its ``[group, numel]`` rows, over 4 and (along the weights'
  second dimension) over 2; a reduce-scatter bucket's chunking and packing of the gradients;
  an all-reduce bucket's packing. Counted by ``partita.cost.copies.call_copies``, as the step
  estimate counts them: one op per copy. They are not among the rows of :func:`fit_ops`: in
  the fits so far (load 3-19) they took 1.3-1.4x what the other workloads' roofline prices,
  so :func:`fit_copies` fits their own ``copy_bandwidth``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch.fx.experimental.proxy_tensor import make_fx

import partita.ir.buckets  # noqa: F401  (registers the bucket ops)
from partita.cost.copies import call_copies
from partita.cost.flops import node_bytes, node_flops
from partita.runtime import comm, dist_ops

#: GPT-S's parameter sizes (4 layers, width 256, MLP 1024, vocabulary 512, sequence 128).
D, HIDDEN, VOCAB, SEQ, LAYERS = 256, 1024, 512, 128, 4


def gpt_param_numels() -> list[int]:
    """Element counts of GPT-S's parameters (weights and biases, layer norms, embeddings)."""
    layer = [D, D, 3 * D * D, 3 * D, D * D, D, D, D, HIDDEN * D, HIDDEN, D * HIDDEN, D]
    return [VOCAB * D, SEQ * D] + layer * LAYERS + [D, D, VOCAB * D]


def gpt_param_shapes() -> list[list[tuple[int, ...]]]:
    """GPT-S's parameter shapes by bucket, as its FSDP buckets them: the embeddings, then one
    bucket per layer, the last with the final layer norm and the head (:func:`gpt_param_numels`
    in that order)."""
    layer = [(D,), (D,), (3 * D, D), (3 * D,), (D, D), (D,), (D,), (D,), (HIDDEN, D), (HIDDEN,),
             (D, HIDDEN), (D,)]  # fmt: skip
    out = [[(VOCAB, D), (SEQ, D)]] + [list(layer) for _ in range(LAYERS)]
    out[-1] += [(D,), (D,), (VOCAB, D)]
    return out


def adamw(p, g, m, v, step_size, bias2_sqrt, decay):  # type: ignore[no-untyped-def]
    """One parameter's AdamW update, op for op as ``partita.training.optim._adam_param``
    (betas 0.9 / 0.999, eps 1e-8; the scalars are float32 0-dim tensors or floats there)."""
    p = p * decay
    m = m + 0.1 * (g - m)
    v = v * 0.999 + 0.001 * g * g
    denom = torch.sqrt(v) / bias2_sqrt + 1e-8
    return p - step_size * (m / denom), m, v


def _adamw_all(*flat: torch.Tensor) -> list[torch.Tensor]:
    *tensors, step_size, bias2_sqrt, decay = flat
    out: list[torch.Tensor] = []
    for i in range(0, len(tensors), 4):
        out += adamw(*tensors[i : i + 4], step_size, bias2_sqrt, decay)
    return out


def _adamw_inputs(numels: list[int]) -> list[torch.Tensor]:
    ts = [torch.randn(n) for n in numels for _ in range(4)]
    ts[3::4] = [t.abs() for t in ts[3::4]]  # exp_avg_sq is positive
    return [*ts, torch.tensor(0.01), torch.tensor(0.03), torch.tensor(0.99)]


def _acts(x, h, w, b, ids, targets):  # type: ignore[no-untyped-def]
    """The memory-bound part of a layer, forward and backward (``torch.autograd.grad``)."""
    y = F.layer_norm(x, (D,), w, b)
    a = F.gelu(h)
    r = y + x
    cat = torch.cat([r, r], dim=-1)
    rows = torch.index_select(x, 0, ids)
    logits = torch.log_softmax(cat[:, :VOCAB] + rows[:, :1], dim=-1)
    loss = F.nll_loss(logits, targets) + (a * a).mean() + (r * 0.5).sum()
    gx, gh, gw, gb = torch.autograd.grad(loss, (x, h, w, b))
    return gx, gh, gw, gb, gx.sum(0), gh.sum(0)


def _acts_inputs(rows: int) -> list[torch.Tensor]:
    x = torch.randn(rows, D, requires_grad=True)
    h = torch.randn(rows, HIDDEN, requires_grad=True)
    w, b = torch.ones(D, requires_grad=True), torch.zeros(D, requires_grad=True)
    ids = torch.randint(0, rows, (rows,))
    return [x, h, w, b, ids, torch.randint(0, VOCAB, (rows,))]


def workloads() -> list[tuple[str, Callable[..., Any], list[torch.Tensor]]]:
    """``(name, function, real inputs)`` of every workload of the module doc."""
    out: list[tuple[str, Callable[..., Any], list[torch.Tensor]]] = []
    for k in (1, 2, 4, 8):
        numels = [max(1, n // k) for n in gpt_param_numels()]
        out.append((f"adamw/{k}", _adamw_all, _adamw_inputs(numels)))
    for rows in (256, 512, 1024):
        out.append((f"acts/{rows}", _acts, _acts_inputs(rows)))
    out.append(("tiny", _adamw_all, _adamw_inputs([D] * 32)))
    return out


@contextlib.contextmanager
def gloo_stubbed() -> Iterator[None]:
    """``runtime.dist_ops``'s Gloo calls return at once inside the block (this process only):
    what is left of a mesh op run by it is the runtime's own packing and unpacking."""

    class Done:
        def wait(self) -> None:
            pass

    def done(*args: Any, **kwargs: Any) -> Done:
        return Done()

    saved = dist_ops.ALL_GATHER, dist_ops.REDUCE_SCATTER, dist_ops.dist
    dist_ops.ALL_GATHER = dist_ops.REDUCE_SCATTER = done  # type: ignore[assignment]
    dist_ops.dist = types.SimpleNamespace(all_reduce=done, all_to_all_single=done)  # type: ignore[assignment]
    try:
        yield
    finally:
        dist_ops.ALL_GATHER, dist_ops.REDUCE_SCATTER, dist_ops.dist = saved  # type: ignore[assignment]


def _shard(shape: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    return tuple(s // n if i == dim else s for i, s in enumerate(shape))


def _copy_calls(kind: str, n: int, shard_dim: int) -> list[list[Any]]:
    """The arguments but the group size of ``kind`` (a bucket op of ``partita.ir.buckets``)
    over a group of ``n`` for each of GPT-S's buckets (:func:`gpt_param_shapes`): a gather of
    the members' shards, a reduction of their whole gradients; ``shard_dim`` 1 shards a weight
    along its second dimension (a vector along its only one)."""
    out: list[list[Any]] = []
    for shapes in gpt_param_shapes():
        dims = [min(shard_dim, len(s) - 1) for s in shapes]
        if kind == "all_gather_bucket":
            xs = [torch.randn(_shard(s, d, n)) for s, d in zip(shapes, dims, strict=True)]
            out.append([xs, dims, ["data"]])
        elif kind == "reduce_scatter_bucket":
            out.append([[torch.randn(s) for s in shapes], dims, "sum", ["data"]])
        else:
            out.append([[torch.randn(s) for s in shapes], "sum", ["data"]])
    return out


def _node(kind: str, args: list[Any], n: int) -> tuple[torch.fx.Node, dict[torch.fx.Node, Any]]:
    """A graph node of the mesh op ``kind`` on ``args`` (as the per-device program holds it)
    and its operands' values, for ``call_copies``."""
    graph = torch.fx.Graph()
    places = [graph.placeholder(f"x{i}") for i in range(len(args[0]))]
    target = getattr(torch.ops.partita, kind).default
    node = graph.call_function(target, (places, *args[1:], n))
    return node, dict(zip(places, args[0], strict=True))


#: (name, bucket op, group size, sharded dimension) of the copy workloads.
COPIES = [
    ("copies/gather4", "all_gather_bucket", 4, 0),
    ("copies/gather2", "all_gather_bucket", 2, 1),
    ("copies/scatter4", "reduce_scatter_bucket", 4, 0),
    ("copies/scatter2", "reduce_scatter_bucket", 2, 1),
    ("copies/reduce4", "all_reduce_bucket", 4, 0),
]


def copy_workloads() -> list[tuple[str, Callable[[], Any], dict[str, Any]]]:
    """``(name, run, counts)`` of each copy workload (:data:`COPIES`): ``run()`` runs every
    bucket's op through ``runtime.dist_ops`` with Gloo stubbed out (this rank as member 0 of a
    group of ``n``, the group's torch order partita's), ``counts`` as :func:`traced` gives them,
    each copy one op of the bytes ``call_copies`` counts for it (read plus written)."""
    out = []
    for name, kind, n, shard_dim in COPIES:
        calls, counts = _copy_calls(kind, n, shard_dim), _counts()
        for args in calls:
            launch, wait = call_copies(*_node(kind, args, n))
            for b in launch + wait:
                _add(counts, 0.0, b)
        group = comm.Group(None, tuple(range(n)), tuple(range(n)), 0)
        fn = getattr(dist_ops, kind)

        def run(calls=calls, group=group, fn=fn, name=name) -> list[Any]:  # type: ignore[no-untyped-def]
            with gloo_stubbed():
                return [dist_ops.run(fn(group, *args, name)) for args in calls]

        out.append((name, run, counts))
    return out


def _counts() -> dict[str, Any]:
    return {"ops": 0, "bytes": 0, "flops": 0, "views": 0, "each": []}


def _add(counts: dict[str, Any], flops: float, nbytes: float) -> None:
    counts["ops"] += 1
    counts["bytes"] += nbytes
    counts["flops"] += flops
    counts["each"].append(nbytes)


def traced(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> tuple[Any, dict[str, float]]:
    """``(graph module, counts)``: ``fn`` traced to aten ops (fake tensors), and the model's
    count of it: ``ops`` (nodes with FLOPs or bytes, as ``partition.estimate`` counts them),
    ``bytes``, ``flops`` and ``views`` (the other call nodes)."""
    fake = [
        torch.empty_like(t, requires_grad=t.requires_grad) if t.is_floating_point() else t
        for t in inputs
    ]
    gm = make_fx(fn, tracing_mode="fake")(*fake)
    counts = _counts()
    for node in gm.graph.nodes:
        f, b = node_flops(node), node_bytes(node)
        if f or b:
            _add(counts, f, b)
        elif node.op == "call_function":
            counts["views"] += 1
    return gm, counts


#: The cache sizes the fit tries (bytes an op may read and write at the cache's bandwidth).
CACHES = [0] + [1 << p for p in range(17, 25)]


def memory_terms(each: list[int], cache: float) -> tuple[float, float]:
    """``(bytes in cache, bytes beyond)`` of ops of ``each`` bytes: the first ``cache`` bytes
    of an op at the cache's bandwidth, the rest at the memory's (``partita.cost.op_time``)."""
    inside = sum(min(b, cache) for b in each)
    return float(inside), float(sum(each) - inside)


def fit_ops(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The local-op terms of the profile that best fit ``rows`` (each with ``ops``, the bytes
    of ``each`` op and the measured ``seconds``): ``op_overhead``, ``cache_bytes``,
    ``cache_bandwidth`` and ``memory_bandwidth`` of ``ops * overhead + inside / cache_bandwidth
    + beyond / memory_bandwidth`` (:func:`memory_terms`), least squares of the relative error
    for each cache size of :data:`CACHES` (size 0: one bandwidth for every byte); no term is
    negative. The fit kept is the one of least Akaike information (``n log(rss / n) + 2k``,
    ``k`` = 2 terms with one bandwidth, 4 with a cache: the size, two bandwidths, the
    overhead), so a cache is kept only where it explains the measurements beyond its extra
    terms; ``error`` is the kept fit's root-mean-square relative error, ``error_flat`` the
    one-bandwidth fit's."""
    t = np.array([r["seconds"] for r in rows], dtype=float)
    best: dict[str, float] = {}
    for cache in CACHES:
        terms = [memory_terms(r["each"], cache) for r in rows]
        cols = [
            np.array([r["ops"] for r in rows], dtype=float),
            np.array([x[0] for x in terms]),
            np.array([x[1] for x in terms]),
        ]
        keep = [j for j, c in enumerate(cols) if c.any()]
        coef = _nonnegative([cols[j] / t for j in keep], np.ones_like(t))
        full = dict(zip(keep, coef, strict=True))
        x = [full.get(j, 0.0) for j in range(3)]
        if cache and (x[1] <= 0 or x[2] <= 0):
            continue  # one of the two bandwidths infinite: not a two-level fit
        model = sum(c * x[j] for j, c in enumerate(cols))
        rss = float(np.sum((model / t - 1) ** 2))
        aic = len(t) * np.log(max(rss, 1e-12) / len(t)) + 2 * (4 if cache else 2)
        if not best or aic < best["aic"]:
            best = {
                "op_overhead": x[0],
                "cache_bytes": float(cache),
                "cache_bandwidth": 1 / x[1] if cache else 0.0,
                "memory_bandwidth": 1 / x[2] if x[2] > 0 else float("inf"),
                "error": float(np.sqrt(rss / len(t))),
                "aic": float(aic),
            }
        if not cache:
            flat = float(np.sqrt(rss / len(t)))
    return {**best, "error_flat": flat}


def fit_copies(rows: list[dict[str, Any]], op_overhead: float) -> float:
    """``copy_bandwidth`` of the profile that best fits the copy workloads ``rows`` (each with
    ``ops``, ``bytes`` and the measured ``seconds``) given the fitted ``op_overhead``: ``ops *
    op_overhead + bytes / copy_bandwidth`` (``Hardware.copy_seconds``), least squares of the
    relative error; 0 (no term: copies priced as any op) when the overheads alone explain the
    times."""
    t = np.array([r["seconds"] for r in rows], dtype=float)
    per_byte = np.array([r["bytes"] for r in rows], dtype=float) / t
    rest = 1 - np.array([r["ops"] for r in rows], dtype=float) * op_overhead / t
    x = float(np.sum(per_byte * rest) / np.sum(per_byte**2))
    return 1 / x if x > 0 else 0.0


def _nonnegative(cols: list[np.ndarray], y: np.ndarray) -> list[float]:
    """Least squares of ``y`` on ``cols`` with every coefficient >= 0 (``scipy.optimize.nnls``)."""
    from scipy.optimize import nnls

    coef, _ = nnls(np.stack(cols, 1), y)
    return [float(c) for c in coef]
