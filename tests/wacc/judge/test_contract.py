"""The contract in one place (:mod:`wacc.judge.contract`): the seed API is the core, dynamic loss
scaling an extension, and every command (check, replay, gate, report, the pytest plugin) judges
an implementation by the same rule: a missing core feature fails unless allowed, a missing
extension is "not judged" and fails nothing; the gate and the report agree with the check."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.wacc.test_plugin import _user_pytest
from wacc.errors import UsageError
from wacc.gate.baseline import BASELINE_FORMAT, V2_INFERRED, read_gate_file
from wacc.gate.measure import units
from wacc.judge.contract import CONTRACT, Coverage, feature
from wacc.judge.implementation import load_implementation
from wacc.report.previous import read_rows
from wacc.report.provenance import Provenance
from wacc.report.rows import NotJudged, Row
from wacc.report.writer import write_csv
from wacc_ref.scenario import (
    Accumulate,
    Finish,
    ScalerOptions,
    Scenario,
    SetLossScale,
    UpdateScaler,
    to_json,
)

REPO = Path(__file__).resolve().parents[3]
SEED_API = "tests.wacc.impls:seed_api"  # correct, written to the seed API: no dynamic scaling
WACC_TORCH = "wacc.implementation:wacc_torch_reproducible"
PLANTED = "tests.wacc.planted:equal_weight_mean"  # every mean microbatch weighs 1
STRUCTURAL = "tests.wacc.impls:broadcast_accepted"  # a (1, n) gradient added to an (m, n) buffer
DYNAMIC = ("found_inf", "set_loss_scale", "loss_scaler")


def wacc(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``python -m wacc ARGS``."""
    return subprocess.run(
        [sys.executable, "-m", "wacc", *args],
        cwd=cwd, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip


def test_the_seed_api_is_the_core_and_dynamic_scaling_an_extension() -> None:
    """The core is the seed API's records, async records and integrity; found_inf,
    set_loss_scale and loss_scaler (absent from the seed API: its loss scale is fixed) are the
    dynamic loss scaling extension. A missing core feature fails unless allowed; a missing
    extension fails nothing, without any flag, and its families are not run."""
    assert [f.name for f in CONTRACT if f.core] == ["records", "async_records", "checksum"]
    assert all(feature(name).part == "dynamic loss scaling" for name in DYNAMIC)
    seed = Coverage(missing=DYNAMIC)
    assert seed.unsupported == () and seed.not_judged == DYNAMIC
    assert seed.skipped_families == ("dynamic_scaling",) and seed.judges_family("windows")
    core = Coverage(missing=("checksum", "loss_scaler"))
    assert core.unsupported == ("checksum",) and core.not_judged == ("loss_scaler",)
    allowed = Coverage(missing=("checksum",), allowed=("checksum",))
    assert allowed.unsupported == () and allowed.not_judged == ("checksum",)
    assert load_implementation(SEED_API).missing == DYNAMIC


def test_a_state_without_fused_is_judged_in_the_reproducible_order() -> None:
    """The seed API's state has no ``fused`` (the fused mode is an extension): such an
    implementation loads, is judged in the reproducible order, and lacks no feature for it."""
    seed = load_implementation(SEED_API)
    assert not hasattr(seed.factory(torch.float32, 1.0).state, "fused")
    assert seed.fused is False and seed.missing == DYNAMIC


def _dynamic_scenario() -> Scenario:
    return Scenario(
        work_dtype="float32", grad_dtype="float32", loss_scale=1024.0, fused=False,
        parameters=(("w", (2,)),),
        steps=(
            Accumulate(kind="sum", weight=1.0, grads=(("w", (1.0, 2.0)),)),
            Finish("sums"),
            UpdateScaler(False),
            SetLossScale(2048.0),
            Accumulate(kind="mean", weight=3.0, grads=(("w", (0.5, 0.25)),)),
            Finish("mean"),
        ),
        scaler=ScalerOptions(growth_interval=1),
    )  # fmt: skip


def test_replay_runs_no_step_that_needs_a_missing_extension(tmp_path: Path) -> None:
    """A dynamic-scaling scenario replayed on the seed-API accumulator is not run: exit 0, the
    not-judged lines and why, no table and no "unsupported" (before: it ran, every later step
    at the wrong scale, and diverged). wacc_torch replays the same file and agrees."""
    path = tmp_path / "dynamic.json"
    path.write_text(to_json(_dynamic_scenario()), encoding="utf-8")
    result = wacc("replay", str(path), "--impl", SEED_API)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not judged: the scenario has steps that need set_loss_scale, loss_scaler" in (
        result.stdout
    )
    assert "not judged: set_loss_scale (the dynamic loss scaling extension" in result.stdout
    assert "unsupported" not in result.stdout and "DIVERGES" not in result.stdout
    agreed = wacc("replay", str(path), "--impl", WACC_TORCH)
    assert agreed.returncode == 0 and "agrees with the reference" in agreed.stdout


def test_the_plugin_skips_a_family_that_needs_a_missing_extension(tmp_path: Path) -> None:
    """The pytest plugin judges like ``wacc check``: the seed-API accumulator's dynamic_scaling
    item is skipped with the not-judged line, the others pass, no flag is needed, and the
    terminal summary says what was not judged."""
    result = _user_pytest(
        tmp_path, "--wacc-impl", SEED_API, "--wacc-dtype", "float32", "--wacc-examples", "3",
        "-k", "windows or dynamic_scaling", "-rs",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout, result.stdout
    assert "not judged: set_loss_scale (the dynamic loss scaling extension" in result.stdout
    assert "wacc: not judged: found_inf" in result.stdout


# The three commands on three implementations: (spec, flags, passes). The planted bug's records
# carry no checksum (a core feature): allowed, in every command alike.
AGREEMENT = [
    (SEED_API, (), True),
    (WACC_TORCH, (), True),
    (PLANTED, ("--allow-missing", "checksum"), False),
]


@pytest.fixture(scope="module")
def report(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One quick report judging wacc_torch (always in it) and, with --impl, the seed-API
    accumulator, the planted bug and the planted structural bug."""
    out = tmp_path_factory.mktemp("report") / "wacc-report"
    result = wacc("report", "--quick", "--quiet", "--out", str(out), "--impl", SEED_API,
                  "--impl", PLANTED, "--impl", STRUCTURAL,
                  "--allow-missing", "checksum")  # fmt: skip
    return out, result


def _report_verdict(out: Path, name: str) -> bool:
    """Whether every row of ``name`` in divergence.csv passes (not-judged lines aside)."""
    with (out / "divergence.csv").open(newline="", encoding="utf-8") as handle:
        rows = [row for row in csv.DictReader(handle) if row["implementation"] == name]
    judged = [row for row in rows if not row["verdict"].startswith("not judged")]
    assert judged, name
    return all(row["verdict"] == "pass" for row in judged)


@pytest.mark.slow  # a quick report, then per implementation a check and a shard of the gate
@pytest.mark.parametrize(("spec", "flags", "passes"), AGREEMENT)
def test_check_gate_and_report_give_the_same_verdict(
    spec: str,
    flags: tuple[str, ...],
    passes: bool,
    report: tuple[Path, subprocess.CompletedProcess[str]],
    tmp_path: Path,
) -> None:
    """The same implementation has the same verdict in ``wacc check``, ``wacc gate`` (a
    deterministic shard: corpus keys of every family and a check family) and ``wacc report``:
    the seed-API accumulator passes all three with no flag (its dynamic-scaling scenarios not
    judged, and each output says so), wacc_torch passes, the planted bug fails all three."""
    checked = wacc("check", spec, *flags, "--dtype", "float32", "--examples", "5", "--quiet",
                   "--out", str(tmp_path / "check"))  # fmt: skip
    assert (checked.returncode == 0) is passes, checked.stdout + checked.stderr
    gated = wacc("gate", "--quiet", "--impl", spec, *flags, "--shard", "1/24", "--results",
                 str(tmp_path / "shard.json"), "--out", str(tmp_path / "gate"))  # fmt: skip
    assert (gated.returncode == 0) is passes, gated.stdout + gated.stderr
    out, reported = report
    name = "wacc_torch" if spec == WACC_TORCH else spec
    assert _report_verdict(out, name) is passes
    assert reported.returncode == 1  # the planted bugs' rows fail; nothing else does
    if spec != SEED_API:
        return
    for output in (checked.stdout, gated.stdout, reported.stdout):
        assert "not judged: set_loss_scale (the dynamic loss scaling extension" in output
        assert "unsupported" not in output.replace(f"{PLANTED}: unsupported", "")
    results = json.loads((tmp_path / "shard.json").read_text(encoding="utf-8"))
    assert results["features"] == ["records", "async_records", "checksum"]
    assert not [key for key in results["entries"] if "/dynamic_scaling/" in key]
    index = (out / "index.md").read_text(encoding="utf-8")
    assert f"- `{SEED_API}`: not judged: set_loss_scale (the dynamic loss scaling" in index
    with (out / "divergence.csv").open(newline="", encoding="utf-8") as handle:
        rows = [row for row in csv.DictReader(handle) if row["implementation"] == SEED_API]
    skipped = [row for row in rows if row["verdict"].startswith("not judged")]
    assert skipped and {row["family"] for row in skipped} == {"dynamic_scaling"}
    assert {row["verdict"] for row in skipped} == {"not judged: set_loss_scale, loss_scaler"}
    # --compare-to reads such a report back: the not-judged lines have no numbers, and are left out.
    with (out / "divergence.csv").open(newline="", encoding="utf-8") as handle:
        every = list(csv.DictReader(handle))
    assert len(read_rows(out)) == sum(not r["verdict"].startswith("not judged") for r in every)


def _shard_with(key: str) -> str:
    """The gate shard ``K/N`` whose one check unit is ``key`` (N: the number of check units, so
    each shard runs one check family on one dtype and a slice of the corpus)."""
    checks = [unit.key for unit in units([])]
    return f"{checks.index(key) + 1}/{len(checks)}"


@pytest.mark.slow  # a check of one family, then a shard of the gate
def test_check_and_gate_fail_a_planted_structural_bug_alike(tmp_path: Path) -> None:
    """A planted bug that skips a §5 check (a gradient whose shape broadcasts to the
    parameter's is added) fails ``wacc check`` and ``wacc gate`` alike: exit 1, never 3, one
    divergence block in the check and one failure group in the gate's shard that holds the
    float32 structural family, each naming the structural family and the refusal §5 demands."""
    flags = ("--allow-missing", "checksum")
    checked = wacc("check", STRUCTURAL, *flags, "--family", "structural", "--dtype", "float32",
                   "--quiet", "--out", str(tmp_path / "check"))  # fmt: skip
    assert checked.returncode == 1, checked.stdout + checked.stderr
    blocks = [line for line in checked.stdout.splitlines() if line.startswith("DIVERGENCE")]
    assert len(blocks) == 1 and "float32/structural" in blocks[0], checked.stdout
    assert "ParameterMismatchError" in checked.stdout
    gated = wacc("gate", "--quiet", "--impl", STRUCTURAL, *flags, "--shard",
                 _shard_with("float32/structural/check"), "--results",
                 str(tmp_path / "shard.json"), "--out", str(tmp_path / "gate"))  # fmt: skip
    assert gated.returncode == 1, gated.stdout + gated.stderr
    groups = [line for line in gated.stdout.splitlines() if line.startswith("FAILURE ")]
    assert len(groups) == 1, gated.stdout
    assert "float32/structural/check" in gated.stdout and "ParameterMismatchError" in groups[0]


@pytest.mark.slow  # shares the quick report of the agreement test
def test_the_report_fails_a_planted_structural_bug_like_check_and_gate(
    report: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """``wacc report --impl`` judges a planted bug that skips a §5 check as ``wacc check``
    and ``wacc gate`` do (they fail it: the test above): some of its rows fail."""
    out, _ = report
    assert _report_verdict(out, STRUCTURAL) is False


def test_divergence_csv_says_what_was_not_judged_and_reads_back(tmp_path: Path) -> None:
    """divergence.csv writes a scenario an implementation was not judged on as a line whose
    verdict is ``not judged: <features>`` (its oracles ``not judged``, no numbers), and
    ``--compare-to`` reads such a file back without that line (no numbers to compare)."""
    row = Row(scenario_id="float32-windows-0123456789", family="windows", implementation="a",
              device="cpu", work_dtype="float32", grad_dtype="float32", window_length=1,
              weight_skew=1.0, loss_scale=1.0, max_ulps=0.0, max_rel_error=0.0, max_ratio=0.5,
              verdict="pass", replay="")  # fmt: skip
    skipped = NotJudged(scenario_id="float32-dynamic_scaling-0123456789",
                        family="dynamic_scaling", implementation="a", device="cpu",
                        work_dtype="float32", grad_dtype="float32",
                        features=("set_loss_scale", "loss_scaler"))  # fmt: skip
    provenance = Provenance(versions={}, commit="c", devices={}, corpus_seed=0,
                            corpus_size="quick", scenarios=2, date="d")  # fmt: skip
    write_csv([row], tmp_path / "divergence.csv", provenance=provenance, not_judged=[skipped])
    with (tmp_path / "divergence.csv").open(newline="", encoding="utf-8") as handle:
        lines = list(csv.DictReader(handle))
    assert [line["verdict"] for line in lines] == [
        "pass",
        "not judged: set_loss_scale, loss_scaler",
    ]
    assert lines[1]["family"] == "dynamic_scaling" and lines[1]["max_ratio"] == ""
    assert {lines[1][oracle] for oracle in ("emulation", "bound", "semantics")} == {"not judged"}
    assert read_rows(tmp_path) == [row]


def _entry(scenarios: int) -> dict[str, Any]:
    return {"scenarios": scenarios, "failing": 0, "max_ulps": "0x0.0p+0",
            "max_ratio": "0x1.0000000000000p-1", "milliseconds": 5, "findings": []}  # fmt: skip


def _gate_file(kind: str, features: list[str], keys: list[str], **fields: Any) -> dict[str, Any]:
    document = {
        "format": kind, "version": 3, "implementation": SEED_API, "features": features,
        "corpus": {"seed": 0, "size": "default"}, "profile": "ci", "hypothesis": "6.0",
        "shard": "1/1", "provenance": {}, "entries": {key: _entry(36) for key in keys},
    }  # fmt: skip
    document.update(fields)
    return document


def _write(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


CORE = ["records", "async_records", "checksum"]
WINDOWS, DYNAMIC_KEY = "float32/windows/corpus", "float32/dynamic_scaling/corpus"


def _merge(tmp_path: Path, baseline: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``wacc gate --merge`` of a run of the seed-API accumulator (two shards: the windows key,
    no dynamic_scaling key, features the core) against ``baseline``, with JUnit and gate.md."""
    for index, keys in ((1, [WINDOWS]), (2, [])):
        _write(tmp_path / "shards" / f"s{index}.json",
               _gate_file("wacc-gate-results", CORE, keys, shard=f"{index}/2"))  # fmt: skip
    return wacc(
        "gate", "--merge", str(tmp_path / "shards"), "--baseline",
        str(_write(tmp_path / "baseline.json", baseline)), "--junit-xml",
        str(tmp_path / "gate.xml"), "--summary-md", str(tmp_path / "gate.md"),
    )  # fmt: skip


def test_a_feature_lost_since_the_baseline_is_a_regression_in_every_output(
    tmp_path: Path,
) -> None:
    """A baseline made with dynamic loss scaling, and a run of an implementation without it:
    exit 1, one ``REGRESSION: lost feature`` line per lost feature on stdout, in gate.md and in
    the JUnit test case ``features``; the key the run could not judge is a row ``not judged``
    (a skipped test case saying why), not a foreign baseline."""
    everything = [f.name for f in CONTRACT]
    result = _merge(tmp_path, _gate_file(BASELINE_FORMAT, everything, [WINDOWS, DYNAMIC_KEY]))
    assert result.returncode == 1, result.stdout + result.stderr
    lost = [line for line in result.stdout.splitlines() if "lost feature" in line]
    assert [line.split(":")[2].strip() for line in lost] == list(DYNAMIC), result.stdout
    assert all(line.startswith("REGRESSION: lost feature since the baseline: ") for line in lost)
    (row,) = [line for line in result.stdout.splitlines() if line.startswith(DYNAMIC_KEY)]
    assert row.split()[1:3] == ["0", "0"] and row.endswith("not judged")
    assert "wacc gate FAILED" in result.stdout
    summary = (tmp_path / "gate.md").read_text(encoding="utf-8")
    assert (
        "### wacc gate FAILED" in summary
        and "lost feature since the baseline: set_loss_scale" in summary
    )
    assert "**Not judged**" in summary and "- not judged: loss_scaler (the dynamic" in summary
    cases = {case.get("name"): case for case in ET.parse(tmp_path / "gate.xml").iter("testcase")}
    failure = cases["features"].find("failure")
    assert failure is not None and "lost feature since the baseline: found_inf" in (
        failure.text or ""
    )
    skipped = cases[DYNAMIC_KEY].find("skipped")
    assert skipped is not None and "not judged: set_loss_scale" in (skipped.text or "")
    assert cases[WINDOWS].find("failure") is None and cases[WINDOWS].find("skipped") is None


def test_a_baseline_made_without_the_extension_passes_and_says_what_was_not_judged(
    tmp_path: Path,
) -> None:
    """The same run against a baseline made without dynamic loss scaling (so without its keys):
    exit 0, nothing lost, and the outputs still say what was not judged and why."""
    result = _merge(tmp_path, _gate_file(BASELINE_FORMAT, CORE, [WINDOWS]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wacc gate passed" in result.stdout and "lost feature" not in result.stdout
    assert "not judged: set_loss_scale (the dynamic loss scaling extension" in result.stdout
    assert "- not judged: found_inf" in (tmp_path / "gate.md").read_text(encoding="utf-8")


def test_a_version_2_baseline_loads_with_the_features_its_keys_show(tmp_path: Path) -> None:
    """A baseline of the format before features (version 2) still loads: judged dynamic_scaling
    corpus keys show set_loss_scale and loss_scaler (a version-2 gate failed every such scenario
    without them, and a baseline records a passing run); without them, no feature is read. A
    version-3 file without features, or with a feature twice or unknown, is refused."""
    old = _gate_file(BASELINE_FORMAT, [], [WINDOWS, DYNAMIC_KEY], version=2)
    del old["features"]
    read = read_gate_file(_write(tmp_path / "v2.json", old), kind=BASELINE_FORMAT)
    assert read.features == V2_INFERRED == ("set_loss_scale", "loss_scaler")
    old["entries"] = {WINDOWS: _entry(36)}
    read = read_gate_file(_write(tmp_path / "v2-plain.json", old), kind=BASELINE_FORMAT)
    assert read.features == () and read.version == 2
    for features, message in ((None, "features"), (["records", "records"], "once"),
                              (["speed"], "must be one of")):  # fmt: skip
        document = _gate_file(BASELINE_FORMAT, features or [], [WINDOWS])
        if features is None:
            del document["features"]
        with pytest.raises(UsageError, match=message):
            read_gate_file(_write(tmp_path / "bad.json", document), kind=BASELINE_FORMAT)
