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
  all there is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch.fx.experimental.proxy_tensor import make_fx

from partita.cost.flops import node_bytes, node_flops

#: GPT-S's parameter sizes (4 layers, width 256, MLP 1024, vocabulary 512, sequence 128).
D, HIDDEN, VOCAB, SEQ, LAYERS = 256, 1024, 512, 128, 4


def gpt_param_numels() -> list[int]:
    """Element counts of GPT-S's parameters (weights and biases, layer norms, embeddings)."""
    layer = [D, D, 3 * D * D, 3 * D, D * D, D, D, D, HIDDEN * D, HIDDEN, D * HIDDEN, D]
    return [VOCAB * D, SEQ * D] + layer * LAYERS + [D, D, VOCAB * D]


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


def traced(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> tuple[Any, dict[str, float]]:
    """``(graph module, counts)``: ``fn`` traced to aten ops (fake tensors), and the model's
    count of it: ``ops`` (nodes with FLOPs or bytes, as ``partition.estimate`` counts them),
    ``bytes``, ``flops`` and ``views`` (the other call nodes)."""
    fake = [
        torch.empty_like(t, requires_grad=t.requires_grad) if t.is_floating_point() else t
        for t in inputs
    ]
    gm = make_fx(fn, tracing_mode="fake")(*fake)
    counts: dict[str, Any] = {"ops": 0, "bytes": 0, "flops": 0, "views": 0, "each": []}
    for node in gm.graph.nodes:
        f, b = node_flops(node), node_bytes(node)
        if f or b:
            counts["ops"] += 1
            counts["bytes"] += b
            counts["flops"] += f
            counts["each"].append(b)
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


def _nonnegative(cols: list[np.ndarray], y: np.ndarray) -> list[float]:
    """Least squares of ``y`` on ``cols`` with every coefficient >= 0 (``scipy.optimize.nnls``)."""
    from scipy.optimize import nnls

    coef, _ = nnls(np.stack(cols, 1), y)
    return [float(c) for c in coef]
