"""``wacc gate``: real runs through subprocesses (shards, baselines); the verdict rules are
``test_gate_compare.py``."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from wacc.choices import DEFAULT_IMPL

REPO = Path(__file__).resolve().parents[2]


def gate(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``python -m wacc gate ARGS``."""
    return subprocess.run(
        [sys.executable, "-m", "wacc", "gate", "--quiet", *args],
        cwd=cwd, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip


# The gate through the real command line on its last four units only (corpus scenarios: a
# run of seconds, not minutes): for the rules of shards and verdicts, not for the numbers.
_FEW_UNITS = (
    "import sys, wacc.gate.measure as m; every = m.units; "
    "m.units = lambda corpus: every(corpus)[-4:]; "
    "from wacc.cli import main; sys.exit(main(sys.argv[1:]))"
)


def small_gate(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """``wacc gate --quiet ARGS`` in a process whose gate runs only its last four units."""
    return subprocess.run(
        [sys.executable, "-c", _FEW_UNITS, "gate", "--quiet", *args],
        cwd=cwd, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_a_one_runner_matrix_writes_its_results_and_merges_to_the_same_verdict(
    tmp_path: Path,
) -> None:
    """``--shard 1/1 --results FILE`` (a matrix of one runner) writes FILE, and ``--merge`` of
    its folder gives the unsharded run's verdict and table against the same baseline."""
    baseline = str(tmp_path / "baseline.json")
    made = small_gate("--update-baseline", "--baseline", baseline)
    assert made.returncode == 0, made.stdout + made.stderr
    whole = small_gate("--baseline", baseline)
    shard = small_gate("--shard", "1/1", "--results", str(tmp_path / "results" / "shard-1.json"))
    assert shard.returncode == 0, shard.stdout + shard.stderr
    assert (tmp_path / "results" / "shard-1.json").is_file()
    merged = small_gate("--merge", str(tmp_path / "results"), "--baseline", baseline)
    assert whole.returncode == merged.returncode == 0, whole.stdout + merged.stdout
    timing = re.compile(r" \([0-9.]+ s\)$", re.MULTILINE)
    assert timing.sub("", merged.stdout) == timing.sub("", whole.stdout)
    assert "wacc gate passed" in merged.stdout


def test_results_make_a_run_a_shard_whose_verdict_is_the_merges(tmp_path: Path) -> None:
    """With --results, 1/1 too, the verdict's outputs and --update-baseline belong to --merge:
    asking a shard for them is exit 2 and one line, before anything runs."""
    results = ("--results", str(tmp_path / "r.json"))
    for extra in (["--junit-xml", str(tmp_path / "g.xml")], ["--update-baseline"]):
        refused = gate("--shard", "1/1", *results, *extra)
        assert refused.returncode == 2 and "--merge" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and not refused.stdout
    assert not (tmp_path / "r.json").exists()


def test_update_baseline_with_junit_or_summary_is_refused_before_the_run(tmp_path: Path) -> None:
    """--update-baseline with --junit-xml or --summary-md: exit 2 and one line at once, nothing
    written (an update judges nothing, so a JUnit file or summary could only say "passed" about
    a comparison that never ran), rather than the options ignored without a word."""
    baseline = tmp_path / "baseline.json"
    for option, name in (("--junit-xml", "gate.xml"), ("--summary-md", "gate.md")):
        refused = gate(
            "--update-baseline", "--baseline", str(baseline), option, str(tmp_path / name)
        )
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert option in refused.stderr and "--update-baseline" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and not refused.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_baseline_write_that_fails_half_way_leaves_the_old_one_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The baseline is replaced only by a complete, synced file: a write that fails after half
    of it is written (here: the sync, as a full disk or a kill would) is a UsageError naming the
    file, the old baseline is byte for byte as it was, and no temporary file is left."""
    from wacc.errors import UsageError
    from wacc.gate import baseline as gate_baseline
    from wacc.gate.baseline import BASELINE_FORMAT, GateFile, read_gate_file, write_gate_file

    path = tmp_path / "baseline.json"
    write_gate_file(GateFile(kind=BASELINE_FORMAT, implementation="old", entries={}), path)
    before = path.read_bytes()

    def fail(descriptor: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gate_baseline.os, "fsync", fail)
    with pytest.raises(UsageError, match="cannot write .*baseline.json.*No space left"):
        write_gate_file(GateFile(kind=BASELINE_FORMAT, implementation="new", entries={}), path)
    assert path.read_bytes() == before
    assert read_gate_file(path, kind=BASELINE_FORMAT).implementation == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["baseline.json"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Of wacc_torch, by the real command: a whole unsharded baseline (``baseline.json``), and
    the gate's last four units unsharded (``small.json``) and in two shards (``shards/``).

    The whole run is also the suite's proof that the default implementation holds every oracle
    on every check family and the machine under the ci profile, on every work dtype
    (``--update-baseline`` exits 1 on any failing scenario); test_engine.py does not repeat it.
    The shards' rules (a key split between them, the merge, its verdict) are the same on four
    units as on all of them: two whole shards more would double the fixture's five minutes on
    2 cores, and ``.ci/run`` merges two whole shards against the committed baseline anyway."""
    folder = tmp_path_factory.mktemp("gate")
    made = gate("--update-baseline", "--baseline", str(folder / "baseline.json"))
    assert made.returncode == 0, made.stdout + made.stderr
    small = small_gate("--update-baseline", "--baseline", str(folder / "small.json"))
    assert small.returncode == 0, small.stdout + small.stderr
    for index in (1, 2):
        shard = small_gate(
            "--shard", f"{index}/2", "--results", str(folder / "shards" / f"s{index}.json")
        )
        assert shard.returncode == 0, shard.stdout + shard.stderr
    return folder


def _entries(path: Path) -> dict[str, dict[str, Any]]:
    return json.loads(path.read_text(encoding="utf-8"))["entries"]


def _measured(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The entries without their wall-clock time: two runs of one key take different times."""
    return {key: {k: v for k, v in e.items() if k != "milliseconds"} for key, e in entries.items()}


@pytest.mark.slow  # one whole gate run (~100 s on 2 cores), and four units three times
def test_sharded_and_merged_equals_unsharded(runs: Path) -> None:
    """Merging the two shards gives exactly the unsharded run's entries, and passes against it."""
    merged = small_gate(
        "--merge", str(runs / "shards"), "--update-baseline", "--baseline", str(runs / "m.json")
    )
    assert merged.returncode == 0, merged.stdout + merged.stderr
    merged_entries = _entries(runs / "m.json")
    assert _measured(merged_entries) == _measured(_entries(runs / "small.json"))
    # A key's scenarios are split between the shards: the merge records the sum of their times.
    shard_times: dict[str, int] = {}
    for shard in sorted((runs / "shards").glob("*.json")):
        for key, entry in _entries(shard).items():
            shard_times[key] = shard_times.get(key, 0) + entry["milliseconds"]
    assert {key: e["milliseconds"] for key, e in merged_entries.items()} == shard_times
    verdict = small_gate(
        "--merge", str(runs / "shards"), "--baseline", str(runs / "small.json"),
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
    document = json.loads((runs / "small.json").read_text(encoding="utf-8"))
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
    result = small_gate(
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
def test_a_planted_regression_fails_the_gate_with_replayable_grouped_failures(
    runs: Path, tmp_path: Path
) -> None:
    """An implementation dividing once by S·W formed in D fails against wacc_torch's baseline
    (judged with --allow-other-impl; its records carry no checksum: allowed). Every failing
    scenario is a replay file under --out; failures are grouped by signature with counts, one
    replay command per group, and that command reproduces the failure; gate.md fits a comment
    and the JUnit cases carry their own measured times."""
    impl = "wacc.baselines:scale_times_weight"
    out = tmp_path / "replays"
    result = gate(
        "--impl", impl, "--baseline", str(runs / "baseline.json"), "--allow-missing", "checksum",
        "--allow-other-impl", "--out", str(out), "--summary-md", str(tmp_path / "gate.md"),
        "--junit-xml", str(tmp_path / "gate.xml"),
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "wacc gate FAILED" in result.stdout
    blocks = [line for line in result.stdout.splitlines() if line.startswith("FAILURE ")]
    replays = [line for line in result.stdout.splitlines() if line.startswith("  replay: ")]
    failing = sum(int(line.split()[1]) for line in blocks)
    written = sorted(out.glob("gate-*.json"))
    assert blocks and len(replays) == len(blocks)
    # Grouped: fewer blocks than failing scenarios, and the counts add up to the files written.
    assert len(blocks) < failing == len(written), result.stdout
    command = shlex.split(replays[0].removeprefix("  replay: ").split(" (")[0])
    assert command[:2] == ["wacc", "replay"] and command[-2:] == ["--impl", impl]
    replayed = subprocess.run(
        [sys.executable, "-m", "wacc", *command[1:]], cwd=REPO, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    summary = (tmp_path / "gate.md").read_text(encoding="utf-8").splitlines()
    assert len(summary) <= 60 and summary[0].startswith("### wacc gate FAILED")
    assert any(line.startswith("Artifacts: ") and str(out) in line for line in summary)
    times = [float(case.get("time", "nan")) for case in
             ET.parse(tmp_path / "gate.xml").iter("testcase")]  # fmt: skip
    assert all(t >= 0 for t in times) and len(set(times)) > 1  # measured per key, not averaged


@pytest.mark.slow  # two shards of 1/40 of the gate
@pytest.mark.parametrize(
    ("factory", "text"),
    [
        ("not_implemented_mean", "NotImplementedError: means are my text: not written yet"),
        ("state_dict_raises", "RuntimeError: state_dict cannot write a window with batches in it"),
    ],
)
def test_the_gate_prints_the_implementations_exception_text_and_never_exits_3(
    factory: str, text: str, tmp_path: Path
) -> None:
    """An implementation that raises outside §11 (in accumulate_mean; in state_dict() once a
    batch is in) fails a gate shard with exit 1, and its failure blocks show the exception's
    own text (not only "got unexpected <Class>"); the judge does not crash (exit 3)."""
    result = gate(
        "--impl", f"tests.wacc.impls:{factory}", "--allow-missing", "checksum", "--shard", "1/40",
        "--results", str(tmp_path / "shard.json"), "--out", str(tmp_path / "replays"),
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert text in result.stdout and "internal error" not in result.stderr


def test_a_missing_core_feature_still_writes_every_output_asked_for(tmp_path: Path) -> None:
    """An IMPL whose checksum probe fails (its state_dict() raises) stops the gate before the run
    with exit 1, and the JUnit XML and gate.md asked for are still written: a failing case
    ``features`` typed ``unsupported`` whose message is the printed line (the exception's text
    in it), and gate.md FAILED with the same line under ``Not run``."""
    xml, md = tmp_path / "gate.xml", tmp_path / "gate.md"
    result = gate(
        "--impl", "tests.wacc.impls:state_dict_raises", "--allow-other-impl",
        "--junit-xml", str(xml), "--summary-md", str(md),
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("unsupported: ")]
    assert line.startswith("unsupported: checksum: ") and "window with batches" in line
    cases = {case.get("name"): case for case in ET.parse(xml).iter("testcase")}
    (failure,) = list(cases["features"])
    assert (failure.tag, failure.get("type")) == ("failure", "unsupported")
    assert failure.get("message") == line[:200] and failure.text == line
    summary = md.read_text(encoding="utf-8")
    assert summary.startswith("### wacc gate FAILED: ")
    assert "0 of 0 keys as in the baseline." in summary  # nothing ran
    assert f"**Not run**\n\n- {line}\n" in summary


def test_every_missing_extension_is_a_not_judged_row_whatever_the_baseline_holds(
    tmp_path: Path,
) -> None:
    """A seed-API IMPL (no dynamic loss scaling) gated against a baseline recorded with it, so
    with no key of the extension's family: the table has a row ``feature: <name>`` with status
    ``not judged`` for each missing extension, and the JUnit XML a skipped case of that name
    whose message is the printed ``not judged: <name> (...)`` line; the same from ``--merge``."""
    from tests.wacc.rendered import text_table

    impl = ("--impl", "tests.wacc.impls:seed_api")
    baseline = ("--baseline", str(tmp_path / "b.json"))
    made = small_gate(*impl, *baseline, "--update-baseline")
    assert made.returncode == 0, made.stdout + made.stderr
    whole = small_gate(*impl, *baseline, "--junit-xml", str(tmp_path / "whole.xml"))
    shard = small_gate(*impl, "--shard", "1/1", "--results", str(tmp_path / "r" / "s.json"))
    assert shard.returncode == 0, shard.stdout + shard.stderr
    merged = small_gate("--merge", str(tmp_path / "r"), *baseline,
                        "--junit-xml", str(tmp_path / "merged.xml"))  # fmt: skip
    for done, xml in ((whole, "whole.xml"), (merged, "merged.xml")):
        assert done.returncode == 0, done.stdout + done.stderr
        lines = [x for x in done.stdout.splitlines() if x.startswith("not judged: ")]
        names = {x.split()[2] for x in lines}
        assert names == {"found_inf", "set_loss_scale", "loss_scaler"}, lines
        printed = done.stdout.splitlines()
        rows = text_table("\n".join(printed[: printed.index(lines[0])]))  # the table, first
        shown = {r["dtype/family/source"]: r["status"] for r in rows}
        assert all(shown.get(f"feature: {n}") == "not judged" for n in names), shown
        cases = {c.get("name"): c for c in ET.parse(tmp_path / xml).iter("testcase")}
        for line in lines:
            (skipped,) = list(cases[f"feature: {line.split()[2]}"])
            assert skipped.tag == "skipped" and skipped.get("message") == line[:200]
            assert skipped.text == line


def test_a_baseline_of_another_implementation_is_refused_before_the_run(tmp_path: Path) -> None:
    """Judging IMPL against a baseline recorded for another one is exit 2 at once, naming both
    and --allow-other-impl; an --out that is a file is exit 2 before the run too."""
    result = gate("--impl", "wacc.baselines:scale_times_weight", "--out", str(tmp_path / "o"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"recorded for {DEFAULT_IMPL!r}" in result.stderr, result.stderr
    assert "--allow-other-impl" in result.stderr
    assert not result.stdout and not (tmp_path / "o").exists()  # nothing ran, nothing written
    (tmp_path / "file").write_text("", encoding="utf-8")
    refused = gate("--out", str(tmp_path / "file"))
    assert refused.returncode == 2 and "--out" in refused.stderr and not refused.stdout


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "no gate file"),
        ("{not json", "(document): not JSON"),
        (json.dumps({"format": "something-else", "version": 2}), "expected 'wacc-gate-baseline'"),
        (json.dumps({"format": "wacc-gate-baseline", "version": 2}), "implementation: missing"),
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
        json.dumps({"format": "wacc-gate-results", "version": 2, "implementation": "x",
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


def test_results_under_a_file_are_exit_2_before_the_run(tmp_path: Path) -> None:
    """--results under an existing file (or naming a folder), and the default results folder
    when it is a file, are one line naming the path and exit 2 before the shard runs (issue 33:
    the shard ran, then NotADirectoryError, exit 3); the file is left as it was."""
    keep = tmp_path / "keepme.txt"
    keep.write_text("mine\n", encoding="utf-8")
    (tmp_path / "wacc-gate-results").write_text("mine too\n", encoding="utf-8")
    for args, cwd, fragment in (
        (["--shard", "1/1", "--results", str(keep / "x.json")], REPO, str(keep / "x.json")),
        (["--shard", "1/1", "--results", str(tmp_path)], REPO, "is a directory"),
        (["--shard", "2/2"], tmp_path, "wacc-gate-results/shard-2-of-2.json"),
    ):
        result = small_gate(*args, cwd=cwd)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "--results" in result.stderr and fragment in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert not result.stdout
    assert keep.read_text(encoding="utf-8") == "mine\n"
    assert (tmp_path / "wacc-gate-results").read_text(encoding="utf-8") == "mine too\n"


def test_a_shard_without_results_says_it_wrote_into_the_working_directory(
    tmp_path: Path,
) -> None:
    """A --shard K/N run without --results writes ./wacc-gate-results/shard-K-of-N.json in the
    working directory, and says so: in its last line and in --help (issue 33: undocumented)."""
    result = small_gate("--shard", "4/4", cwd=tmp_path)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    written = tmp_path / "wacc-gate-results" / "shard-4-of-4.json"
    assert json.loads(written.read_text(encoding="utf-8"))["shard"] == "4/4"
    last = result.stdout.strip().splitlines()[-1]
    assert "wacc-gate-results/shard-4-of-4.json" in last and "working directory" in last, last
    helped = "".join(gate("--help").stdout.split())  # argparse wraps lines at hyphens too
    assert "wacc-gate-results/shard-K-of-N.jsonintheworkingdirectory" in helped


def test_a_file_impl_is_one_implementation_however_its_path_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A baseline names a file IMPL by its path relative to the baseline's folder: acc.py,
    ./acc.py, the absolute path and ../acc.py from a subfolder are one implementation (accepted
    against it); another file, or a module spec, is another one (refused without
    --allow-other-impl)."""
    from wacc.commands.gate import _check_implementation, implementation_identity
    from wacc.errors import UsageError

    (tmp_path / "acc.py").write_text("", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    baseline = tmp_path / "numerics" / "b.json"
    monkeypatch.chdir(tmp_path)
    recorded = implementation_identity("acc.py:make", Path("numerics/b.json"))
    assert recorded == "../acc.py:make"
    for spec in ("acc.py:make", "./acc.py:make", f"{tmp_path / 'acc.py'}:make"):
        _check_implementation(recorded, spec, Path("numerics/b.json"), allowed=False)
    monkeypatch.chdir(tmp_path / "sub")
    _check_implementation(recorded, "../acc.py:make", Path("../numerics/b.json"), allowed=False)
    assert implementation_identity("pkg.mod:make", baseline) == "pkg.mod:make"
    for other in ("../other.py:make", "acc:make"):
        with pytest.raises(UsageError, match="recorded for '../acc.py:make'"):
            _check_implementation(recorded, other, Path("../numerics/b.json"), allowed=False)


def test_a_run_clears_only_its_own_shards_old_replay_files(tmp_path: Path) -> None:
    """Before a run, the replay files an earlier run of the same shard left in --out are
    removed (positions this shard runs), so the folder holds this run's failures; another
    shard's files (shards may share the folder) and other files stay."""
    from wacc.commands.gate import _clear_replays
    from wacc.gate.shards import Shard

    names = ["gate-00000-a.json", "gate-00001-b.json", "gate-00002-c.json", "notes.json"]
    for name in names:
        (tmp_path / name).write_text("{}", encoding="utf-8")
    _clear_replays(tmp_path, Shard(1, 2))  # positions 0, 2, 4, ...
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate-00001-b.json", "notes.json"]
    _clear_replays(tmp_path / "absent", Shard(1, 1))  # no folder yet: nothing to do


# Shard results and a baseline written by hand (the committed baseline's header, these entries):
# every status a key can have, metrics that differ column by column (issue 33).
_FINDING = {
    "signature": "[emulation] step # (finish_mean) grads[#][flat #]: expected #, got #",
    "message": "[emulation] step 3 (finish_mean) grads[w][flat 0]: expected 1.0, got 2.0",
    "replay": None,
    "steps": 3,
}
# key: (scenarios, failing, max_ulps, max_ratio, milliseconds) now, then in the baseline, status
_Values = tuple[int, int, float, float, int]
_KEYS: dict[str, tuple[_Values, _Values, str]] = {
    "bfloat16/sums/corpus": ((12, 0, 2.0, 0.123456789, 1234), (12, 0, 2.0, 0.123456789, 9), "ok"),
    "float16/windows/corpus": ((7, 0, 0.0, 0.99999, 5), (7, 0, 0.0, 0.5, 9), "REGRESSION"),
    "float32/windows/corpus": (
        (9, 0, 1.5, 1.234567e-5, 20), (9, 0, 3.75, 6.54321e-4, 9), "improved"
    ),
    "float64/windows/check": ((30, 2, 12345.678, 0.75, 987), (28, 0, 7.0, 0.0, 9), "FAIL"),
}  # fmt: skip


def _entry(values: _Values, findings: int) -> dict[str, Any]:
    scenarios, failing, ulps, ratio, milliseconds = values
    return {
        "scenarios": scenarios, "failing": failing, "max_ulps": ulps.hex(),
        "max_ratio": ratio.hex(), "milliseconds": milliseconds, "findings": [_FINDING] * findings,
    }  # fmt: skip


def test_the_gates_table_summary_and_junit_show_what_the_files_hold(tmp_path: Path) -> None:
    """``wacc gate --merge`` of shard results against a baseline: the printed table, gate.md's
    table and the JUnit XML, read back by column name, show each key's values from the results
    file and the baseline (metrics to 4 significant digits), with its status."""
    from tests.wacc.rendered import markdown_table, shows_metric, text_table

    header = json.loads((REPO / "reports" / "baseline.json").read_text(encoding="utf-8"))
    baseline = {**header, "entries": {k: _entry(b, 0) for k, (_, b, _) in _KEYS.items()}}
    results = {**header, "format": "wacc-gate-results",
               "entries": {k: _entry(n, n[1]) for k, (n, _, _) in _KEYS.items()}}  # fmt: skip
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "s.json").write_text(json.dumps(results), encoding="utf-8")
    (tmp_path / "b.json").write_text(json.dumps(baseline), encoding="utf-8")
    done = gate(
        "--merge", str(tmp_path / "shards"), "--baseline", str(tmp_path / "b.json"),
        "--junit-xml", str(tmp_path / "gate.xml"), "--summary-md", str(tmp_path / "gate.md"),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr

    def shows(cells: dict[str, str], key: str) -> None:
        now, base, status = _KEYS[key]
        assert (cells["scenarios"], cells["failing"]) == (str(now[0]), str(now[1]))
        for column, at in (("max ulps (baseline)", 2), ("max err/bound (baseline)", 3)):
            shown = re.fullmatch(r"(\S+) \((\S+)\)", cells[column])
            assert shown is not None, cells[column]
            assert shows_metric(shown[1], now[at]) and shows_metric(shown[2], base[at]), (
                key, column, cells[column],
            )  # fmt: skip
        assert cells["status"] == status

    printed = text_table("\n".join(done.stdout.splitlines()[: 2 + len(_KEYS)]))
    assert [cells["dtype/family/source"] for cells in printed] == sorted(_KEYS)
    for cells in printed:
        shows(cells, cells["dtype/family/source"])
    summary = markdown_table((tmp_path / "gate.md").read_text(encoding="utf-8"))
    assert [cells["dtype/family/source"] for cells in summary] == [
        key for key in sorted(_KEYS) if _KEYS[key][2] != "ok"
    ]
    for cells in summary:
        shows(cells, cells["dtype/family/source"])
    cases = {case.get("name"): case for case in ET.parse(tmp_path / "gate.xml").iter("testcase")}
    assert set(cases) == {"features", *_KEYS}
    for key, (now, _, status) in _KEYS.items():
        assert float(cases[key].get("time", "nan")) == now[4] / 1000
        outcome = [(child.tag, child.get("type")) for child in cases[key]]
        failed = status in ("FAIL", "REGRESSION")
        assert outcome == ([("failure", status)] if failed else []), key
