"""The second half of PyTorch's operator database outside the subset (``tests/test_opdb.py``
runs the first): a file of its own, so that ``make test`` (``--dist loadfile``) can hand the two
halves to its two workers."""

from __future__ import annotations

import pytest

from test_opdb import check_entries, rest_half  # isort: skip


@pytest.mark.slow
def test_opdb_all_second_half() -> None:
    check_entries(rest_half(1))
