"""mutation.smoke: the sample is checked against the report, and mutmut's table is narrowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from mutation.scope import ROOT
from mutation.smoke import Sample, SmokeError, narrowed_pyproject, read_samples

RESULTS = "mutant,module,function,status,verdict,change\n"


def test_a_sample_names_its_source_file() -> None:
    """``wacc_ref.bounds.x_f__mutmut_1`` is a mutant of ``wacc_ref/bounds.py``."""
    assert Sample("wacc_ref.bounds.x_f__mutmut_1", "", ()).path == "wacc_ref/bounds.py"
    assert Sample("wacc.gate.compare.xǁCǁm__mutmut_2", "", ()).path == "wacc/gate/compare.py"


def test_the_narrowed_table_mutates_only_the_samples_and_runs_only_their_tests() -> None:
    """Everything else in [tool.mutmut] and in pyproject.toml is kept as it is."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    samples = [
        Sample("wacc_ref.bounds.x_f__mutmut_1", "a => b", ("tests/wacc_ref/test_bounds.py::t",)),
        Sample(
            "wacc.judge.shrink.x_g__mutmut_2", "a => b", ("tests/wacc/judge/test_shrink.py::u",)
        ),
    ]
    narrowed = tomllib.loads(narrowed_pyproject(text, samples))
    original = tomllib.loads(text)
    table = narrowed["tool"]["mutmut"]
    assert table["only_mutate"] == ["wacc/judge/shrink.py", "wacc_ref/bounds.py"]
    assert table["pytest_add_cli_args_test_selection"] == [
        "tests/wacc/judge/test_shrink.py::u",
        "tests/wacc_ref/test_bounds.py::t",
    ]
    assert table["process_isolation"] == original["tool"]["mutmut"]["process_isolation"]
    del narrowed["tool"]["mutmut"], original["tool"]["mutmut"]
    assert narrowed == original


def _files(tmp_path: Path, smoke: str, results: str) -> tuple[Path, Path]:
    (tmp_path / "smoke.csv").write_text(smoke, encoding="utf-8")
    (tmp_path / "results.csv").write_text(results, encoding="utf-8")
    return tmp_path / "smoke.csv", tmp_path / "results.csv"


@pytest.mark.parametrize(
    ("smoke_row", "results_row", "message"),
    [
        ("m,a => b,t.py::x", "m,p.py,f,survived,gap,a => b", "m is survived in"),
        ("m,a => b,t.py::x", "n,p.py,f,killed,,a => b", "m is absent in"),
        ("m,a => b,t.py::x", "m,p.py,f,killed,,a => c", "not the change"),
        ("m,a => b,", "m,p.py,f,killed,,a => b", "names no test"),
    ],
)
def test_a_sample_the_report_does_not_show_killed_is_refused(
    tmp_path: Path, smoke_row: str, results_row: str, message: str
) -> None:
    """The smoke run only re-kills what the committed report says is killed, as that change."""
    smoke, results = _files(tmp_path, f"mutant,change,tests\n{smoke_row}\n", RESULTS + results_row)
    with pytest.raises(SmokeError, match=message):
        read_samples(smoke, results)


def test_a_good_sample_is_read_with_its_tests(tmp_path: Path) -> None:
    """Tests are space-separated node ids."""
    smoke, results = _files(
        tmp_path,
        "mutant,change,tests\nm,a => b,t.py::x t.py::y\n",
        RESULTS + "m,p.py,f,timeout,,a => b\n",
    )
    assert read_samples(smoke, results) == [Sample("m", "a => b", ("t.py::x", "t.py::y"))]
