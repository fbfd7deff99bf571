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


def test_stages_cover_every_id_once_fastest_first_in_growing_stages() -> None:
    """The stages are the ids sorted by duration (untimed last, stable), cut into 16, 64, 256,
    ... ids, the last stage taking a remainder of up to twice its size: every id exactly once."""
    ids = [f"t.py::t{n}" for n in range(500)]
    durations = {node_id: float(500 - n) for n, node_id in enumerate(ids[:400])}
    cuts = mutant.stages(ids, durations)
    assert [len(cut) for cut in cuts] == [16, 64, 420]
    flat = [node_id for cut in cuts for node_id in cut]
    assert flat == ids[:400][::-1] + ids[400:]
    assert mutant.stages(ids[:40], {}) == [ids[:16], ids[16:40]]
    assert mutant.stages(ids[:32], {}) == [ids[:32]]
    assert mutant.stages([], {}) == []


_STAGED_SUITE = {
    "tests/__init__.py": "",
    "tests/deep/__init__.py": "",
    "tests/deep/conftest.py": (
        "import pytest\n\n@pytest.fixture\ndef deep_value():\n    return 7\n"
    ),
    "tests/deep/test_deep.py": (
        "import os, pathlib\n\n"
        "def _log(name):\n"
        "    with pathlib.Path(os.environ['STAGE_LOG']).open('a') as f:\n"
        "        f.write(name + '\\n')\n\n"
        "{tests}\n"
    ),
}


def _staged_suite(tmp_path: Path, failing: int | None) -> list[str]:
    """A small suite in ``tmp_path`` with this repository's conftest and ``tests/mutant.py``:
    40 tests in a directory whose own conftest holds a fixture (parsed again for each stage),
    test ``n`` lasting ``40 - n`` by the stats file, so fastest first is the reverse order."""
    import shutil

    repo_tests = Path(__file__).resolve().parents[1]
    for name, text in _STAGED_SUITE.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tests = "\n".join(
            f"def test_{n}(deep_value):\n    _log('test_{n}')\n    assert deep_value == 7"
            + (" and False" if n == failing else "")
            + "\n"
            for n in range(40)
        )
        path.write_text(text.replace("{tests}", tests), encoding="utf-8")
    for module in ("conftest.py", "mutant.py", "record_skipped.py"):  # conftest imports the others
        shutil.copy(repo_tests / module, tmp_path / "tests" / module)
    ids = [f"tests/deep/test_deep.py::test_{n}" for n in range(40)]
    stats = {"duration_by_test": {node_id: float(40 - n) for n, node_id in enumerate(ids)}}
    (tmp_path / "mutmut-stats.json").write_text(json.dumps(stats), encoding="utf-8")
    return ids


def _run_staged(
    tmp_path: Path, ids: list[str], mutant_name: str | None, codes: tuple[int, ...] = (0, 1)
) -> tuple[int, list[str]]:
    import os
    import subprocess
    import sys

    log = tmp_path / "stage.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, STAGE_LOG=str(log), PYTHONPATH=str(tmp_path))
    env.pop("MUTANT_UNDER_TEST", None)
    if mutant_name is not None:
        env["MUTANT_UNDER_TEST"] = mutant_name
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", "/dev/null", *ids],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    ran = log.read_text(encoding="utf-8").split() if log.exists() else []
    assert result.returncode in codes, result.stdout[-3000:] + result.stderr[-3000:]
    return result.returncode, ran


def test_staged_collection_runs_what_pytest_runs_fastest_first(tmp_path: Path) -> None:
    """Under a mutant, a suite that passes runs every given test once, fastest first, across
    stages (16 then 24 tests), with a later stage still seeing its directory's conftest fixture;
    without a mutant the same ids run in pytest's own order. Exit 0 both ways."""
    ids = _staged_suite(tmp_path, failing=None)
    code, ran = _run_staged(tmp_path, ids, "pkg.mod.x_f__mutmut_1")
    assert code == 0
    assert ran == [f"test_{n}" for n in reversed(range(40))]
    code, ran = _run_staged(tmp_path, ids, None)
    assert code == 0
    assert ran == [f"test_{n}" for n in range(40)]


@pytest.mark.parametrize("failing", [30, 5], ids=["stage-1", "stage-2"])
def test_staged_collection_stops_at_the_first_failure_like_x(tmp_path: Path, failing: int) -> None:
    """A failing test in any stage ends the run with exit 1 right after it, as ``-x`` does
    without stages: the mutant counts as killed, and no later stage is collected or run."""
    ids = _staged_suite(tmp_path, failing=failing)
    code, ran = _run_staged(tmp_path, ids, "pkg.mod.x_f__mutmut_1")
    assert code == 1
    assert ran == [f"test_{n}" for n in reversed(range(failing, 40))]


def test_read_carried_from_the_carry_file(tmp_path: Path) -> None:
    """The carried names come from the file ``python -m mutation run`` writes (what mutation.carry
    writes, tests/mutant.py reads: same file name and exit code on both sides)."""
    from mutation import carry

    assert mutant.CARRY.name == carry.CARRY.name and carry.CARRY.parent.name == "mutants"
    assert mutant.CARRIED_EXIT == carry.CARRIED_EXIT == 34
    carry.write_carry(tmp_path, ["a.x_f__mutmut_1", "b.xǁCǁg__mutmut_2"])
    path = tmp_path / carry.CARRY
    assert mutant.read_carried(path) == {"a.x_f__mutmut_1", "b.xǁCǁg__mutmut_2"}


@pytest.mark.parametrize(
    "content", [None, "", "{not json", "[]", '{"carried": "a"}', '{"other": []}', b"\xff\xfe"]
)
def test_read_carried_unreadable_is_none(tmp_path: Path, content: str | bytes | None) -> None:
    """A missing or damaged carry file carries nothing: it can only make a run run more."""
    path = tmp_path / "wacc-carry.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    assert mutant.read_carried(path) == frozenset()


def test_a_carried_mutant_runs_no_test_and_exits_skipped(tmp_path: Path) -> None:
    """Under a mutant the carry file names, pytest runs nothing and exits 34 (mutmut's
    "skipped", reported as carried); another mutant, and a run without a mutant, run as before."""
    ids = _staged_suite(tmp_path, failing=None)
    (tmp_path / "wacc-carry.json").write_text('{"carried": ["pkg.mod.x_f__mutmut_1"]}', "utf-8")
    code, ran = _run_staged(tmp_path, ids, "pkg.mod.x_f__mutmut_1", codes=(34,))
    assert (code, ran) == (34, [])
    code, ran = _run_staged(tmp_path, ids, "pkg.mod.x_f__mutmut_2")
    assert code == 0 and ran == [f"test_{n}" for n in reversed(range(40))]
    code, ran = _run_staged(tmp_path, ids, None)
    assert code == 0 and len(ran) == 40
