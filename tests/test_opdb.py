"""PyTorch's operator database under ``partita.jit``: every entry matches eager or is listed.

``opdb_sweep.run_entry`` classifies one op-db entry (PASS, WRONG, UNSUPPORTED, ERROR, CAPTURE,
SKIP; see ``tests/opdb_sweep.py``). An entry that does not PASS must appear in
``tests/opdb_status.py`` with that status; an entry listed there that now passes fails too,
so the table stays true. WRONG (a sharded result that differs from eager) is never expected.

The default run covers ``opdb_sweep.SUBSET`` (a few entries of every op family); the slow test
sweeps the rest of the op-db in two halves, one per file (``test_opdb_all`` here, the other in
``tests/test_opdb_rest.py``): ``make test`` hands each file to one worker (``--dist loadfile``),
and one test of 100 s or more could keep one worker busy after the other ran out of files.
"""

from __future__ import annotations

from typing import Any

import pytest

from opdb_status import STATUS  # isort: skip
from opdb_sweep import SUBSET, Result, entry_name, op_db_entries, run_entry  # isort: skip


def _check(result: Result) -> str | None:
    """None when the result agrees with the status table, else why not."""
    expected = STATUS.get(result.name)
    if result.status == "WRONG":
        return f"{result.name}: WRONG: {result.detail}"
    if expected is None:
        if result.status == "PASS":
            return None
        return (
            f"{result.name}: {result.status} ({result.detail}) but not in tests/opdb_status.py; "
            f"fix it, or list it with its reason"
        )
    if result.status == "PASS":
        return f"{result.name} now passes: remove it from tests/opdb_status.py"
    if result.status != expected[0]:
        return (
            f"{result.name}: {result.status} ({result.detail}), but tests/opdb_status.py "
            f"expects {expected[0]} ({expected[1]})"
        )
    return None


def _in_subset(op: Any) -> bool:
    return op.name in SUBSET or entry_name(op) in SUBSET


def test_status_table_has_no_wrong_entries() -> None:
    assert not [k for k, (s, _) in STATUS.items() if s == "WRONG"]
    assert all(s in ("UNSUPPORTED", "ERROR", "CAPTURE", "SKIP") for s, _ in STATUS.values())


def test_subset_names_exist() -> None:
    names = {entry_name(op) for op in op_db_entries()} | {op.name for op in op_db_entries()}
    assert not [n for n in SUBSET if n not in names]


@pytest.mark.parametrize("op", op_db_entries(set(SUBSET)), ids=entry_name)
def test_opdb_subset(op: Any) -> None:
    problem = _check(run_entry(op))
    assert problem is None, problem


def rest_half(half: int) -> list[Any]:
    """Half ``half`` (0 or 1) of the entries outside the subset: every other entry in op-db
    order, so that slow families (linalg, FFTs, pooling) fall into both halves."""
    return [op for op in op_db_entries() if not _in_subset(op)][half::2]


def check_entries(ops: list[Any]) -> None:
    problems = [p for op in ops if (p := _check(run_entry(op))) is not None]
    assert not problems, "\n".join(problems)


def test_the_halves_cover_the_rest_once() -> None:
    halves = [rest_half(0), rest_half(1)]
    rest = [op for op in op_db_entries() if not _in_subset(op)]
    assert sorted(map(id, halves[0] + halves[1])) == sorted(map(id, rest))
    assert abs(len(halves[0]) - len(halves[1])) <= 1


@pytest.mark.slow
def test_opdb_all() -> None:
    """The first half of the entries outside the subset (``test_opdb_subset`` runs those;
    ``tests/test_opdb_rest.py`` the second half)."""
    check_entries(rest_half(0))


def test_check_flags_wrong_unlisted_and_stale() -> None:
    """The checker itself: WRONG always fails, so do unlisted failures and stale entries."""
    assert _check(Result("no-such-op", "PASS")) is None
    assert "WRONG" in (_check(Result("no-such-op", "WRONG", "x")) or "")
    assert "not in tests/opdb_status.py" in (_check(Result("no-such-op", "ERROR", "x")) or "")
    if STATUS:
        name, (status, _) = next(iter(STATUS.items()))
        assert "now passes" in (_check(Result(name, "PASS")) or "")
        other = "ERROR" if status != "ERROR" else "CAPTURE"
        assert "expects" in (_check(Result(name, other, "x")) or "")
