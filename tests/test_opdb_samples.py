"""The op-db sweep draws the samples torch's own tests draw (tests/opdb_sweep.py)."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal import common_utils

from opdb_sweep import _no_test_case_lookup, op_db_entries


def test_no_test_case_runs_the_sweep() -> None:
    # The premise of _no_test_case_lookup: torch's lookup of the running TestCase finds none.
    assert common_utils.extract_test_fn() is None


@pytest.mark.parametrize("name", ["add", "nn.functional.conv2d", "index_put", "linalg.svd"])
def test_the_samples_are_the_ones_sample_inputs_draws(name: str) -> None:
    op = op_db_entries({name})[0]

    def draw(n: int = 3) -> list[list[torch.Tensor]]:
        out = []
        for sample in list(op.sample_inputs("cpu", torch.float32))[:n]:
            leaves = [sample.input, *sample.args, *sample.kwargs.values()]
            out.append([t for t in leaves if isinstance(t, torch.Tensor)])
        return out

    want = draw()
    with _no_test_case_lookup():
        got = draw()
    assert [len(s) for s in got] == [len(s) for s in want]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert common_utils.extract_test_fn.__name__ == "extract_test_fn"  # restored
