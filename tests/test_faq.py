"""Every answer of docs/faq.md carries a test that runs its code.

Most answers have ```python blocks, which tests/test_docs_examples.py runs in order (and checks
what their `print(...)  # text` comments say). The answers whose code needs several processes
(```sh blocks with torchrun) name the tests that run those commands, in ``BY_TEST`` below; this
file checks that every question is covered one way or the other and that the named tests exist.
It also runs what the compile-cache answer claims of a second process.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_docs_examples import blocks

ROOT = Path(__file__).resolve().parent.parent
FAQ = ROOT / "docs" / "faq.md"

# Answers whose commands need torchrun: the tests that run them.
BY_TEST = {
    "How do I start on several hosts?": [
        "tests/test_distributed.py::test_two_hosts_with_torchrun",
        "tests/test_distributed.py::test_join_timeout_names_the_missing_ranks",
    ],
    "Rendezvous: which variables, which timeouts?": [
        "tests/test_distributed.py::test_join_timeout_names_the_missing_ranks",
        "tests/test_distributed.py::test_join_timeout_without_rank_0",
    ],
    "How do I check that all hosts train the same model?": [
        "tests/test_distributed.py::test_gpt_training_equals_local_mesh",
        "tests/test_distributed.py::test_plan_mismatch_is_an_error_on_every_rank",
    ],
}


def _answers() -> dict[str, str]:
    """Question -> its answer's text (up to the next heading)."""
    parts = re.split(r"^### (.+)$", FAQ.read_text(), flags=re.M)
    pairs = zip(parts[1::2], parts[2::2], strict=True)
    return {q.strip(): re.split(r"^## ", a, flags=re.M)[0] for q, a in pairs}


def _runs_a_block(answer: str) -> bool:
    runnable = [b.code for b in blocks(FAQ) if b.fragment is None]
    return any(f"```python\n{code}```" in answer for code in runnable)


def test_there_are_about_twenty_answers() -> None:
    assert len(_answers()) >= 20


@pytest.mark.parametrize("question", list(_answers()))
def test_each_answer_runs_code(question: str) -> None:
    """The answer has a block the docs test runs, or names tests that run its commands."""
    answer = _answers()[question]
    if question in BY_TEST:
        for ref in BY_TEST[question]:
            path, name = ref.split("::")
            tree = ast.parse((ROOT / path).read_text())
            assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, ref
    else:
        assert _runs_a_block(answer), f"FAQ answer {question!r} has no python block that runs"


_CACHED_STEP = """
import sys, torch, partita
from partita import Mesh, P
mesh = Mesh.create((2, 4), ("data", "model"))
dev = partita.use_spmd(mesh, cache_dir=sys.argv[1])
x = partita.mark_sharding(torch.full((8, 4), 3.0).to(dev), mesh, P("data", None))
y = (x.exp() * 5 - x).cpu()
assert torch.allclose(y, torch.full((8, 4), 3.0).exp() * 5 - 3)
m = partita.metrics()
print(m.compiles, m.disk_hits)
"""


def test_a_second_process_reads_the_compile_cache(tmp_path: Path) -> None:
    """The FAQ's compile-cache answer: the first process compiles and writes one file, the
    second compiles nothing and reads it."""
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("PARTITA_COMPILE_CACHE", None)
    outs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _CACHED_STEP, str(cache)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout.split())
    assert outs == [["1", "0"], ["0", "1"]]
    assert len(list(cache.glob("*.json"))) == 1
