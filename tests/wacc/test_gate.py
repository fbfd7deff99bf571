"""``wacc gate``: real runs through subprocesses (shards, baselines); the verdict rules are
``test_gate_compare.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def gate(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``python -m wacc gate ARGS``."""
    return subprocess.run(
        [sys.executable, "-m", "wacc", "gate", "--quiet", *args],
        cwd=cwd, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One unsharded baseline and two shard results of wacc_torch, made by the real command.

    The unsharded run is also the suite's proof that the default implementation holds every
    oracle on every check family and the machine under the ci profile, on every work dtype
    (``--update-baseline`` exits 1 on any failing scenario); test_engine.py does not repeat it."""
    folder = tmp_path_factory.mktemp("gate")
    made = gate("--update-baseline", "--baseline", str(folder / "baseline.json"))
    assert made.returncode == 0, made.stdout + made.stderr
    for index in (1, 2):
        shard = gate(
            "--shard", f"{index}/2", "--results", str(folder / "shards" / f"s{index}.json")
        )
        assert shard.returncode == 0, shard.stdout + shard.stderr
    return folder


def _entries(path: Path) -> dict[str, object]:
    return json.loads(path.read_text(encoding="utf-8"))["entries"]


@pytest.mark.slow  # one whole gate run and two shards (~2 x 40 s on 2 cores)
def test_sharded_and_merged_equals_unsharded(runs: Path) -> None:
    """Merging the two shards gives exactly the unsharded run's entries, and passes against it."""
    merged = gate(
        "--merge", str(runs / "shards"), "--update-baseline", "--baseline", str(runs / "m.json")
    )
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert _entries(runs / "m.json") == _entries(runs / "baseline.json")
    verdict = gate(
        "--merge", str(runs / "shards"), "--baseline", str(runs / "baseline.json"),
        "--junit-xml", str(runs / "gate.xml"), "--summary-md", str(runs / "gate.md"),
    )  # fmt: skip
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr
    assert "wacc gate passed" in verdict.stdout
    xml = (runs / "gate.xml").read_text(encoding="utf-8")
    assert "<testcase" in xml and "<failure" not in xml
    assert "### wacc gate passed" in (runs / "gate.md").read_text(encoding="utf-8")


@pytest.mark.slow
def test_a_baseline_stricter_than_reality_fails_with_a_regression(runs: Path) -> None:
    """Lowering one recorded max error/bound below what the run measures is exit 1, REGRESSION."""
    document = json.loads((runs / "baseline.json").read_text(encoding="utf-8"))
    key = next(
        k
        for k, e in document["entries"].items()
        if k.endswith("/corpus") and float.fromhex(e["max_ratio"]) > 0
    )
    document["entries"][key]["max_ratio"] = (
        float.fromhex(document["entries"][key]["max_ratio"]) * 0.9
    ).hex()
    stricter = runs / "stricter.json"
    stricter.write_text(json.dumps(document), encoding="utf-8")
    result = gate(
        "--merge",
        str(runs / "shards"),
        "--baseline",
        str(stricter),
        "--junit-xml",
        str(runs / "s.xml"),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"REGRESSION: {key}: max_ratio" in result.stdout
    assert "<failure" in (runs / "s.xml").read_text(encoding="utf-8")


@pytest.mark.slow
def test_a_planted_regression_fails_the_gate(runs: Path) -> None:
    """An implementation dividing once by S·W formed in D fails against wacc_torch's baseline
    (its records, the spec baseline's, carry no checksum: allowed, so the numbers are judged)."""
    result = gate(
        "--impl", "wacc.baselines:scale_times_weight", "--baseline", str(runs / "baseline.json"),
        "--allow-missing", "checksum",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILURE:" in result.stdout and "wacc gate FAILED" in result.stdout


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "no gate file"),
        ("{not json", "(document): not JSON"),
        (json.dumps({"format": "something-else", "version": 1}), "expected 'wacc-gate-baseline'"),
        (json.dumps({"format": "wacc-gate-baseline", "version": 1}), "implementation: missing"),
    ],
)
def test_a_missing_corrupt_or_foreign_baseline_is_exit_2(
    tmp_path: Path, content: str | None, fragment: str
) -> None:
    """A baseline that cannot be used is one line on stderr and exit 2, never a traceback."""
    baseline = tmp_path / "baseline.json"
    if content is not None:
        baseline.write_text(content, encoding="utf-8")
    shards = tmp_path / "none"
    shards.mkdir()
    (shards / "s1.json").write_text(
        json.dumps({"format": "wacc-gate-results", "version": 1, "implementation": "x",
                    "corpus": {"seed": 0, "size": "default"}, "hypothesis": "0", "entries": {},
                    "provenance": {}, "shard": "1/1", "profile": "ci"}),
        encoding="utf-8")  # fmt: skip
    result = gate("--merge", str(shards), "--baseline", str(baseline))
    assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr


def test_usage_errors_are_exit_2() -> None:
    """A bad shard or contradictory options are refused with exit 2."""
    assert "--shard" in gate("--shard", "0/3").stderr
    assert gate("--shard", "1/2", "--update-baseline").returncode == 2


def test_an_output_path_that_is_a_directory_is_exit_2_before_the_run(tmp_path: Path) -> None:
    """--junit-xml / --summary-md naming a directory are refused with one line and exit 2 before
    anything is measured, not with a traceback after the whole run."""
    for option in ("--junit-xml", "--summary-md"):
        result = gate(option, str(tmp_path))
        assert result.returncode == 2, result.stderr
        assert option in result.stderr and "is a directory" in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
