"""tests/mutant.py: what the suite does differently when mutmut runs it for one mutant."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import mutant


@dataclass
class _Item:
    nodeid: str


def test_under_mutant_only_for_a_mutant_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a mutant's name counts: mutmut's stats and clean runs (and CI) are not a mutant."""
    monkeypatch.delenv("MUTANT_UNDER_TEST", raising=False)
    assert not mutant.under_mutant()
    for value in ("", "stats", "fail", "list_all_tests"):
        monkeypatch.setenv("MUTANT_UNDER_TEST", value)
        assert not mutant.under_mutant(), value
    monkeypatch.setenv("MUTANT_UNDER_TEST", "wacc_ref.bounds.x_f__mutmut_3")
    assert mutant.under_mutant()


def test_fastest_first_orders_by_duration_untimed_last_and_stable() -> None:
    """Items go by duration ascending; ties and untimed items keep their order, untimed last."""
    items = [
        _Item("slow"),
        _Item("new1"),
        _Item("fast"),
        _Item("tie_a"),
        _Item("new2"),
        _Item("tie_b"),
    ]
    durations = {"slow": 9.0, "fast": 0.01, "tie_a": 1.0, "tie_b": 1.0}
    ordered = [item.nodeid for item in mutant.fastest_first(items, durations)]
    assert ordered == ["fast", "tie_a", "tie_b", "slow", "new1", "new2"]
    assert [i.nodeid for i in mutant.fastest_first(items, {})] == [i.nodeid for i in items]


def test_read_durations_from_mutmut_stats(tmp_path: Path) -> None:
    """The durations come from the stats file's duration_by_test (other keys are ignored)."""
    path = tmp_path / "mutmut-stats.json"
    path.write_text(
        json.dumps(
            {"tests_by_mangled_function_name": {"f": ["t"]}, "duration_by_test": {"t": 0.5, "u": 2}}
        ),
        encoding="utf-8",
    )
    assert mutant.read_durations(path) == {"t": 0.5, "u": 2.0}


@pytest.mark.parametrize(
    "content",
    [None, "", "{not json", "[]", '{"duration_by_test": 3}', '{"other": {}}', b"\xff\xfe"],
    ids=["missing", "empty", "bad-json", "list", "not-a-dict", "no-key", "not-utf8"],
)
def test_read_durations_unreadable_is_empty(tmp_path: Path, content: str | bytes | None) -> None:
    """A missing or malformed stats file means no ordering (the run still works), never a crash
    in conftest, which every pytest run imports."""
    path = tmp_path / "mutmut-stats.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    assert mutant.read_durations(path) == {}


def test_every_test_mutmut_runs_has_an_id_it_can_pass_back() -> None:
    """mutmut names each covering test by node id on pytest's command line, in a forked process
    that already collected once; an id with a backslash (pytest's escape of a line break, or of
    a regex parameter) is escaped again there and no longer found, so pytest exits 4 and mutmut
    counts every mutant those tests cover as a timeout (1184 mutants once). Every id in the
    mutation run's test selection is printable ASCII without a backslash."""
    import subprocess
    import sys

    from mutation.scope import ROOT, mutmut_config

    config = mutmut_config(ROOT)
    args = [*config["pytest_add_cli_args_test_selection"], *config["pytest_add_cli_args"]]  # type: ignore[misc]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    assert len(ids) > 1000
    bad = [i for i in ids if "\\" in i or not i.isascii() or not i.isprintable()]
    assert not bad, bad[:5]
