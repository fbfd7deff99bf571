"""``wacc audit --world-size 2 --repro`` for the framework loops: each FAIL row across ranks gets
``<loop>-<window>-ranks2.py``, a script that ``python -m torch.distributed.run --nproc-per-node 2``
runs on a CPU (gloo) outside wacc, each rank building its own window, and that prints the row's
float64 error on rank 0 (:mod:`wacc.audit.repro_templates`: the loop's ``ranks`` text).

Here: ``accelerate``'s documented loop (the ``frameworks`` extra, in the normal suite); the
other framework rows are :mod:`tests.wacc.audit.test_repro_ranks_extras`'s (tox -e
audit-extras).  The audit runs the loops across two ranks on the ``unequal`` window (ranks of
211 and 17 target tokens), writes their reproducers, and each script runs under
``torch.distributed.run`` in an isolated interpreter with every wacc import refused.
"""

from __future__ import annotations

import ast

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.wacc.audit.repro_check import (  # noqa: E402
    RankRuns,
    check_prints_its_rows_number,
    rank_runs,
)
from wacc.audit.repro_templates import LOOPS as TEMPLATES  # noqa: E402

LOOPS = ["accelerate"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> RankRuns:
    return rank_runs(LOOPS, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_script_across_ranks_prints_its_rows_number(runs: RankRuns, loop: str) -> None:
    """:func:`check_prints_its_rows_number` for ``loop``."""
    check_prints_its_rows_number(runs, loop)


def _keywords(text: str) -> set[tuple[str, str]]:
    """(called name, keyword) of every keyword argument in the script text ``text``, but those
    of ``os.environ.update`` (a one-process run's world, which torchrun gives across ranks)."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) != "os.environ.update":
            found |= {(ast.unparse(node.func), k.arg) for k in node.keywords if k.arg}
    return found


def test_each_ranks_text_keeps_every_option_of_its_one_process_run() -> None:
    """A loop's text across ranks is its one-process code path with the data-parallel options
    added: every keyword argument the one-process text passes, it passes too (none lost to a
    comment or a rewrite)."""
    checked = 0
    for name, template in TEMPLATES.items():
        if template.ranks is None:
            continue
        lost = _keywords(template.body) - _keywords(template.ranks)
        assert not lost, (name, sorted(lost))
        checked += 1
    assert checked >= 14  # every trainer-* row, accelerate, lightning, deepspeed, nanogpt, plain
