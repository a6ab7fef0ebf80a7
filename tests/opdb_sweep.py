"""PyTorch's operator database run through ``partita.jit``: one status per op-db entry.

For each entry of ``torch.testing._internal.common_methods_invocations.op_db``, the first few
samples in float32 on CPU (``op.sample_inputs("cpu", torch.float32)``; int64 for an entry
without float32, such as the bitwise ops, ``gcd``, ``one_hot``; else complex64) are run
twice: eagerly, and under ``partita.jit`` on a 2x4 mesh with seeded random input specs (each
tensor dim unsplit or split over one mesh axis, each mesh axis at most once per tensor; sizes
that do not divide the mesh happen naturally). Every tensor of the sample becomes an argument of
the jitted function; everything else is closed over. ``.full()`` of each result is compared with
eager (``assert_close``, NaN-equal, tolerance below).

An entry's status is the worst over its samples, in this order:

* ``WRONG``: the sharded result differs from eager (never acceptable);
* ``ERROR``: any exception other than the two below (records type and first line);
* ``CAPTURE``: ``partita.CaptureError`` (records its cause);
* ``UNSUPPORTED``: ``partita.UnsupportedOpError`` (records the aten op it names);
* ``PASS``;
* ``SKIP``: no sample could be run at all (none of those dtypes, random or non-deterministic, eager
  raises, sparse layouts or complex inputs, non-tensor results: the reason says which).
  Complex *results* (FFTs, ``linalg.eig``, ``polar``) are compared as real and imaginary parts.

Run it as a script::

    .venv/bin/python tests/opdb_sweep.py [--all] [--ops name,...] [--json out.json]
        [--samples N] [--write-status]

Without ``--all`` or ``--ops`` it runs ``SUBSET`` (the entries ``tests/test_opdb.py`` runs by
default). ``--write-status`` rewrites ``tests/opdb_status.py`` from the results (entries that
are not PASS), keeping entries of ops that were not run.

This module only classifies; the expected statuses live in ``tests/opdb_status.py``.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

import partita
from partita import Mesh, P
from partita.errors import CaptureError, UnsupportedOpError
from partita.values.spec import PartitionSpec
from partita.values.tensor import ShardedTensor

MESH = Mesh.create((2, 4), ("x", "y"))
STATUSES = ("PASS", "WRONG", "UNSUPPORTED", "ERROR", "CAPTURE", "SKIP")
_ORDER = {"SKIP": 0, "PASS": 1, "UNSUPPORTED": 2, "CAPTURE": 3, "ERROR": 4, "WRONG": 5}

#: Samples run per entry by default.
SAMPLES = 3
#: Seconds one sample may take before it counts as an ERROR (a hang is a bug too).
TIMEOUT = 60

#: Tolerance (rtol, atol) by default: sharding reorders sums, so a little looser than eager's
#: float32 defaults; atol scales with the largest expected magnitude (see ``_compare``).
TOL = (1e-4, 1e-4)
#: Entries whose numerics are ill-conditioned enough to amplify a reordered sum.
LOOSE: dict[str, tuple[float, float]] = {
    "linalg.det": (1e-3, 1e-3),
    "linalg.inv": (1e-3, 1e-3),
    "linalg.pinv": (1e-3, 1e-3),
    "linalg.solve": (1e-3, 1e-3),
    "cumprod": (1e-3, 1e-3),
    "logcumsumexp": (1e-3, 1e-3),
}

#: The sample dtypes, in order of preference (``sample_dtype``).
_DTYPES = (torch.float32, torch.int64, torch.complex64)

#: Names that mark a random op (results cannot match eager draw for draw).
_RANDOM = re.compile(
    r"rand|normal|bernoulli|dropout|multinomial|uniform|poisson|exponential|"
    r"geometric|cauchy|log_normal|fractional_max_pool"
)

#: Names of ops whose values are uninitialised memory (equal to eager only by chance).
_UNINITIALISED = re.compile(r"^(new_)?empty")

#: The default subset: a few entries per family (elementwise, binary with broadcasting,
#: reductions, shapes and views, indexing, matmuls, norms, convolution and pooling, scans,
#: sorting, creation, losses, softmax).
SUBSET: tuple[str, ...] = (
    # elementwise unary / binary / ternary
    "abs",
    "exp",
    "sigmoid",
    "nn.functional.gelu",
    "clamp",
    "where",
    "add",
    "mul",
    "div",
    "pow",
    "maximum",
    "atan2",
    "lerp",
    "addcmul",
    "isnan",
    "to",
    "float",
    # integer- and complex-only entries (int64 / complex64 samples)
    "bitwise_left_shift",
    "gcd",
    "view_as_real",
    "nn.functional.one_hot",
    # reductions
    "sum",
    "mean",
    "amax",
    "argmax",
    "std",
    "var",
    "prod",
    "norm",
    "logsumexp",
    "all",
    # shapes and views
    "reshape",
    "view",
    "flatten",
    "permute",
    "transpose",
    "t",
    "squeeze",
    "unsqueeze",
    "expand",
    "cat",
    "stack",
    "split",
    "chunk",
    "narrow",
    "flip",
    "roll",
    "repeat",
    "tile",
    "movedim",
    "contiguous",
    "select",
    "diagonal",
    "tril",
    # indexing
    "index_select",
    "gather",
    "take_along_dim",
    "masked_fill",
    "index_add",
    "scatter_add",
    "scatter",
    "take",
    "__getitem__",
    # matmuls and linear algebra
    "mm",
    "bmm",
    "matmul",
    "addmm",
    "einsum",
    "nn.functional.linear",
    "outer",
    "linalg.vector_norm",
    # normalisation, softmax, losses
    "softmax",
    "log_softmax",
    "nn.functional.layer_norm",
    "nn.functional.cross_entropy",
    "nn.functional.mse_loss",
    # convolution and pooling
    "nn.functional.conv2d",
    "nn.functional.conv1d",
    "nn.functional.max_pool2d",
    "nn.functional.avg_pool2d",
    # scans and sorting
    "cumsum",
    "sort",
    "topk",
    # creation
    "zeros_like",
    "full_like",
    "new_zeros",
)


@dataclass
class Result:
    """The status of one op-db entry and why (the first sample with the worst status)."""

    name: str
    status: str
    detail: str = ""
    samples: int = 0
    seconds: float = 0.0


def entry_name(op: Any) -> str:
    """``name`` or ``name.variant`` for an OpInfo (the keys of the status table)."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def op_db_entries(names: set[str] | None = None) -> list[Any]:
    """The op-db OpInfos, optionally only those whose entry name (or base name) is in names."""
    from torch.testing._internal.common_methods_invocations import op_db

    if names is None:
        return list(op_db)
    return [op for op in op_db if entry_name(op) in names or op.name in names]


# --- one sample --------------------------------------------------------------------------------


class _TimeoutError(Exception):
    pass


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise _TimeoutError(f"took longer than {seconds} s")

    if not hasattr(signal, "SIGALRM"):
        yield
        return
    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def random_spec(t: torch.Tensor, g: torch.Generator) -> PartitionSpec:
    """Each dim unsplit or split over one mesh axis (each mesh axis used at most once)."""
    free = list(MESH.axis_names)
    entries: list[str | None] = []
    for _ in range(t.ndim):
        pick = int(torch.randint(0, len(free) + 1, (), generator=g)) if free else 0
        if pick == 0:
            entries.append(None)
        else:
            entries.append(free.pop(pick - 1))
    return P(*entries)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def _unsupported_op(e: UnsupportedOpError) -> str:
    """The op an UnsupportedOpError names (``aten.foo.bar``, or a custom op), else its first
    line."""
    m = re.search(r"\baten\.[\w.]+", str(e)) or re.search(r"rule (?:for|of) ([\w.]+)", str(e))
    return m.group(m.lastindex or 0).rstrip(".") if m else _first_line(e)


def _tensor_leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def sample_dtype(op: Any) -> torch.dtype | None:
    """The dtype an entry's samples are drawn in: float32, else (an integer, bitwise or
    complex-only op) int64, else complex64; None if it has none of them on CPU."""
    supported = op.supported_dtypes("cpu")
    return next((d for d in _DTYPES if d in supported), None)


def _skip_reason(sample: Any, want: Any, dtype: torch.dtype = torch.float32) -> str | None:
    tensors = _tensor_leaves((sample.input, sample.args, sample.kwargs))
    if any(t.layout != torch.strided for t in tensors + _tensor_leaves(want)):
        return "sparse or other non-strided layout"
    outs = pytree.tree_leaves(want)
    if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
        return "results that are not all tensors"
    if not dtype.is_complex and any(t.is_complex() for t in tensors):
        return "complex inputs"  # in a float32 sample; complex *results* are compared
    return None


def _compare(name: str, got: Any, want: Any) -> str | None:
    """None when the sharded results equal eager, else what differs."""
    got_l, want_l = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(got_l) != len(want_l):
        return f"{len(got_l)} results, eager has {len(want_l)}"
    rtol, atol = LOOSE.get(name, TOL)
    for i, (g, w) in enumerate(zip(got_l, want_l, strict=True)):
        if not isinstance(g, ShardedTensor):
            return f"result {i} is a {type(g).__name__}, not a ShardedTensor"
        full = g.full()
        if tuple(full.shape) != tuple(w.shape) or full.dtype != w.dtype:
            return f"result {i}: {full.dtype}{list(full.shape)} != {w.dtype}{list(w.shape)}"
        if w.is_complex():  # an FFT, eig, polar...: compare real and imaginary parts
            full, w = torch.view_as_real(full.resolve_conj()), torch.view_as_real(w.resolve_conj())
        if w.dtype.is_floating_point:
            finite = w[torch.isfinite(w)]
            scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
            try:
                torch.testing.assert_close(full, w, rtol=rtol, atol=atol * scale, equal_nan=True)
            except AssertionError as e:
                return f"result {i}: {_first_line(e)} {str(e).splitlines()[1:4]}"
        elif not torch.equal(full, w):
            return f"result {i}: {(full != w).sum().item()} of {w.numel()} elements differ"
    return None


def _same(a: Any, b: Any) -> bool:
    """Bitwise the same results (NaN equal to NaN)."""
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b), strict=True):
        try:
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
        except AssertionError:
            return False
    return True


def _random_ops(fn: Any, tensors: list[torch.Tensor], specs: tuple[Any, ...]) -> list[str]:
    """The random (seeded) ops of the captured program."""
    prog = partita.capture.trace(fn, tuple(tensors), in_specs=specs, mesh=MESH)
    return sorted(
        {
            str(n.target)
            for n in prog.graph_module.graph.nodes
            if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
        }
    )


def _seed(seed: int) -> None:
    """Seed the CPU generator only: ``torch.manual_seed`` also seeds every accelerator
    backend, which costs more than most samples here (the sweep is CPU-only)."""
    torch.random.default_generator.manual_seed(seed)


def run_sample(
    op: Any, sample: Any, g: torch.Generator, dtype: torch.dtype = torch.float32
) -> tuple[str, str]:
    """(status, detail) of one sample."""
    name = entry_name(op)
    leaves, tree = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def fn(*tensors: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, t in zip(positions, tensors, strict=True):
            filled[i] = t
        x, args, kwargs = pytree.tree_unflatten(filled, tree)
        return op.op(x, *args, **kwargs)

    tensors = [leaves[i].detach().clone() for i in positions]
    try:
        _seed(0)
        want = fn(*[t.clone() for t in tensors])
        _seed(0)
        again = fn(*[t.clone() for t in tensors])
        _seed(1)
        other = fn(*[t.clone() for t in tensors])
    except Exception as e:  # the sample itself is not valid eagerly
        return "SKIP", f"eager raises {_first_line(e)}"
    reason = _skip_reason(sample, want, dtype)
    if reason:
        return "SKIP", reason
    for other_run, what in ((again, "non-deterministic"), (other, "random")):
        if not _same(want, other_run):
            return "SKIP", what
    specs = tuple(random_spec(t, g) for t in tensors)
    try:
        with _time_limit(TIMEOUT), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = partita.jit(fn, mesh=MESH, in_specs=specs)(*tensors)
    except UnsupportedOpError as e:
        return "UNSUPPORTED", _unsupported_op(e)
    except CaptureError as e:
        # The cause, not the "Cannot trace ... at <line> in fn:" preamble every entry shares.
        return "CAPTURE", str(e).split(" in fn: ", 1)[-1].strip()[:200]
    except Exception as e:  # classified: the point of the sweep
        return "ERROR", _first_line(e)
    diff = _compare(name, got, want)
    if diff is not None and (drawn := _random_ops(fn, tensors, specs)):
        # Seeded in the op's wrapper (dropout_p > 0): eager repeats, sharded draws differ.
        return "SKIP", f"random ({', '.join(drawn)} inside)"
    if diff is not None:
        shapes = [list(t.shape) for t in tensors]
        return "WRONG", f"{diff} (shapes {shapes}, specs {[str(s) for s in specs]})"
    return "PASS", ""


@contextmanager
def _no_test_case_lookup() -> Iterator[None]:
    """``OpInfo.sample_inputs`` looks twice for the ``unittest.TestCase`` running it, by
    ``inspect.stack()`` (``common_utils.extract_test_fn``: the source lines of every frame of
    pytest's stack, ~25 ms a call), to seed per test and to read sample-specific skips. No
    TestCase runs this sweep, so the lookup always finds none: answering None directly gives
    the same seed (torch's ``SEED``) and the same samples."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    before = common_utils.extract_test_fn, core.extract_test_fn
    common_utils.extract_test_fn = core.extract_test_fn = lambda: None
    try:
        yield
    finally:
        common_utils.extract_test_fn, core.extract_test_fn = before


def run_entry(op: Any, samples: int = SAMPLES, seed: int = 0) -> Result:
    """Run up to ``samples`` samples of one op-db entry (in ``sample_dtype``) and classify
    it."""
    name = entry_name(op)
    start = time.perf_counter()
    dtype = sample_dtype(op)
    if dtype is None:
        return Result(name, "SKIP", "no float32, int64 or complex64 on CPU")
    if _RANDOM.search(op.name) and not op.name.startswith("__"):  # not __rand__ (bitwise and)
        return Result(name, "SKIP", "random")
    if _UNINITIALISED.search(op.name):
        return Result(name, "SKIP", "uninitialised values (empty*)")
    g = torch.Generator().manual_seed(seed)
    worst = Result(name, "SKIP", "no samples")
    ran = 0
    try:
        with _no_test_case_lookup():
            it = iter(op.sample_inputs("cpu", dtype, requires_grad=False))
        while ran < samples:
            try:
                sample = next(it)
            except StopIteration:
                break
            status, detail = run_sample(op, sample, g, dtype)
            ran += 1
            first = worst.detail == "no samples"
            if first or _ORDER[status] > _ORDER[worst.status]:
                worst = Result(name, status, detail)
    except Exception as e:  # sample generation itself failed
        if worst.status == "SKIP":
            worst = Result(name, "SKIP", f"sample_inputs raises {_first_line(e)}")
    worst.samples = ran
    worst.seconds = round(time.perf_counter() - start, 3)
    return worst


def sweep(ops: list[Any], samples: int = SAMPLES, progress: bool = False) -> list[Result]:
    results = []
    for i, op in enumerate(ops):
        r = run_entry(op, samples)
        results.append(r)
        if progress:
            print(f"[{i + 1}/{len(ops)}] {r.name}: {r.status} {r.detail[:100]}", file=sys.stderr)
    return results


# --- reporting ---------------------------------------------------------------------------------


def summary(results: list[Result]) -> dict[str, int]:
    counts = Counter(r.status for r in results)
    return {s: counts.get(s, 0) for s in STATUSES}


def print_table(results: list[Result]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"op_db under partita.jit on {MESH!r}")
    for col in ("entry", "status", "detail"):
        table.add_column(col)
    for r in sorted(results, key=lambda r: (-_ORDER[r.status], r.name)):
        if r.status != "PASS":
            table.add_row(r.name, r.status, r.detail[:120])
    console = Console(width=180)
    console.print(table)
    unsupported = Counter(r.detail for r in results if r.status == "UNSUPPORTED")
    console.print("most common UNSUPPORTED aten ops:", unsupported.most_common(15))
    console.print("counts:", summary(results), f"total {len(results)}")


def write_status(results: list[Result], path: Path) -> None:
    """Rewrite the status table with these results (other entries kept as they are)."""
    sys.path.insert(0, str(path.parent))
    import opdb_status

    table = dict(opdb_status.STATUS)
    for r in results:
        table.pop(r.name, None)
        if r.status == "WRONG":  # never expected: it stays a test failure until fixed
            print(f"not listed (WRONG is never expected): {r.name}", file=sys.stderr)
        elif r.status != "PASS":
            table[r.name] = (r.status, r.detail[:80])
    head = path.read_text().split("STATUS: dict[str, tuple[str, str]] = {")[0]
    lines = [f"    {k!r}: ({s!r}, {d!r}),\n" for k, (s, d) in sorted(table.items())]
    path.write_text(head + "STATUS: dict[str, tuple[str, str]] = {\n" + "".join(lines) + "}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every op-db entry")
    parser.add_argument("--ops", default="", help="comma-separated entry names")
    parser.add_argument("--json", default="", help="write the results to this file")
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--write-status", action="store_true", help="update opdb_status.py")
    parser.add_argument("-q", "--quiet", action="store_true", help="no per-entry progress")
    ns = parser.parse_args(argv)
    if ns.all:
        ops = op_db_entries()
    elif ns.ops:
        ops = op_db_entries(set(ns.ops.split(",")))
    else:
        ops = op_db_entries(set(SUBSET))
    start = time.perf_counter()
    results = sweep(ops, ns.samples, progress=not ns.quiet)
    print_table(results)
    print(f"{len(results)} entries in {time.perf_counter() - start:.1f} s")
    if ns.json:
        Path(ns.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    if ns.write_status:
        write_status(results, Path(__file__).with_name("opdb_status.py"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
