"""The ``wacc`` command through real subprocesses: exit codes 0/1/2, replay files, hostile input."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from wacc_ref import formats
from wacc_ref.scenario import Accumulate, Finish, Scenario, from_json, to_json

REPO = Path(__file__).resolve().parents[2]


def wacc(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m wacc ARGS`` in ``cwd`` (the repository root: ``tests.wacc.impls`` imports)."""
    return subprocess.run(
        [sys.executable, "-m", "wacc", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wacc: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_help_lists_the_subcommands_with_examples() -> None:
    """``wacc --help`` names check and replay; each subcommand's help shows examples."""
    top = wacc("--help")
    assert top.returncode == 0 and "check" in top.stdout and "replay" in top.stdout
    for command in ("check", "replay"):
        sub = wacc(command, "--help")
        assert sub.returncode == 0 and "examples:" in sub.stdout and "exit codes" in sub.stdout


def test_check_passes_wacc_torch_with_exit_0(tmp_path: Path) -> None:
    """A small check of wacc_torch exits 0 and prints the per-dtype table."""
    result = wacc("check", "--dtype", "float16", "--examples", "10", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "float16" in result.stdout and "max err/bound" in result.stdout
    assert not list(tmp_path.iterdir())


def test_check_finds_a_divergence_writes_it_and_its_replay_reproduces_it(tmp_path: Path) -> None:
    """A buggy implementation exits 1 with a one-line replay command that exits 1 again."""
    impl = "tests.wacc.impls:double_unscale"
    result = wacc(
        "check", impl, "--dtype", "float32", "--family", "windows", "--examples", "20",
        "--out", str(tmp_path), "--quiet",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if "replay:" in line]
    command = line.split("replay: ", 1)[1].split()
    assert command[:2] == ["wacc", "replay"] and command[-2:] == ["--impl", impl]
    scenario_file = Path(command[2])
    assert scenario_file.parent == tmp_path
    from_json(scenario_file.read_text(encoding="utf-8"))  # the wacc_ref format, loadable
    replay = wacc(*command[1:])
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert "FAIL emulation,bound" in replay.stdout and "DIVERGES" in replay.stdout
    agrees = wacc("replay", str(scenario_file))  # the default implementation agrees
    assert agrees.returncode == 0, agrees.stdout + agrees.stderr
    assert "agrees with the reference" in agrees.stdout


@pytest.mark.parametrize("profile", ["ci", "dev"])
def test_check_writes_nothing_into_the_working_directory(tmp_path: Path, profile: str) -> None:
    """``wacc check`` run in an empty folder leaves it empty: no ``.hypothesis/`` (Hypothesis'
    cache of constants, or the dev profile's example database) unless asked for."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HYPOTHESIS_STORAGE_DIRECTORY", "WACC_HYPOTHESIS_DB")}  # fmt: skip
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-m", "wacc", "check", "--dtype", "float64", "--family", "windows",
         "--examples", "3", "--profile", profile, "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(tmp_path.iterdir()) == []


def test_check_out_that_can_never_be_a_folder_is_exit_2_before_the_run(tmp_path: Path) -> None:
    """``--out`` naming an existing file, or a path under one, is one line and exit 2 before
    anything runs (issue 33: it was the whole run, then a FileExistsError traceback, exit 3),
    and the file is left as it was."""
    keep = tmp_path / "keepme.txt"
    keep.write_text("mine\n", encoding="utf-8")
    for out, fragment in ((keep, "exists and is not a folder"), (keep / "sub", "is a file")):
        result = wacc(
            "check", "tests.wacc.impls:double_unscale", "--dtype", "float32", "--family",
            "windows", "--examples", "5", "--quiet", "--out", str(out),
        )  # fmt: skip
        line = _one_line_error(result)
        assert "--out" in line and str(out) in line and fragment in line, line
        assert not result.stdout  # nothing ran
    assert keep.read_text(encoding="utf-8") == "mine\n"


def test_check_never_overwrites_a_file_already_in_out(tmp_path: Path) -> None:
    """A file in --out with the name a divergence would take (the user's, or an earlier run's)
    is kept as it was: the divergence goes to the next free number, and the replay line names
    that file (issue 33: it was silently overwritten)."""
    mine = tmp_path / "divergence-01-float32-windows.json"
    mine.write_text("my notes\n", encoding="utf-8")
    result = wacc(
        "check", "tests.wacc.impls:double_unscale", "--dtype", "float32", "--family", "windows",
        "--examples", "20", "--quiet", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert mine.read_text(encoding="utf-8") == "my notes\n"
    (line,) = [line for line in result.stdout.splitlines() if "replay:" in line]
    written = Path(line.split("replay: ", 1)[1].split()[2])
    assert written == tmp_path / "divergence-02-float32-windows.json"
    from_json(written.read_text(encoding="utf-8"))  # this run's scenario


def test_check_exitfirst_stops_at_the_first_divergence(tmp_path: Path) -> None:
    """``-x`` stops after the first family that finds a divergence (pytest's convention): one
    divergence block and one file, the dtypes and families after it never run; without it the
    same check goes on to the next dtype."""
    impl = "tests.wacc.impls:double_unscale"  # divides by S twice: fails in every dtype
    args = ["check", impl, "--dtype", "float32", "--dtype", "float16", "--family", "windows",
            "--examples", "20", "--quiet"]  # fmt: skip
    first = wacc(*args, "-x", "--out", str(tmp_path / "x"))
    assert first.returncode == 1, first.stdout + first.stderr
    assert first.stdout.count("\nDIVERGENCE ") == 1
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["divergence-01-float32-windows.json"]
    assert not re.search(r"^\s*float16 ", first.stdout, re.MULTILINE)  # never ran
    without = wacc(*args, "--out", str(tmp_path / "none"))
    assert without.returncode == 1 and len(list((tmp_path / "none").iterdir())) == 2


def test_a_factory_that_returns_none_is_named_with_exit_2(tmp_path: Path) -> None:
    """A factory without its ``return`` (it returns None): exit 2 and one line naming the
    factory and what it returned, not a list of missing methods."""
    (tmp_path / "acc.py").write_text("def make(dtype, loss_scale):\n    object()\n")
    spec = f"{tmp_path / 'acc.py'}:make"
    message = _one_line_error(wacc("check", spec, "--examples", "1"))
    assert f"factory {spec!r} returned None" in message, message


def test_an_unsupported_feature_fails_unless_allowed(tmp_path: Path) -> None:
    """Missing records is ``unsupported: records`` and exit 1; --allow-missing makes it pass."""
    impl = "tests.wacc.impls:counters_only"
    common = ["--dtype", "float64", "--examples", "5", "--out", str(tmp_path)]
    refused = wacc("check", impl, *common)
    assert refused.returncode == 1 and "unsupported: records" in refused.stdout
    allowed = wacc(
        "check", impl, *common, "--allow-missing", "records", "--allow-missing", "async_records"
    )
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


_FAST_PROBE = """
import sys
from wacc.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # argparse's --help
    code = exc.code
heavy = sorted(m for m in ("torch", "wacc_ref.formats", "wacc_ref.accumulator", "numpy")
               if m in sys.modules)
print("EXIT", code, "LOADED", *heavy)
"""


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--help"], 0),
        *[([command, "--help"], 0) for command in ("check", "replay", "report", "gate", "audit")],
        (["chekc"], 2),
        (["check", "--dtpye", "float16"], 2),
        (["check", "--examples", "0"], 2),
        (["check", "no/such/file.py:make"], 2),
        (["check", "a:b:c"], 2),
        (["replay", "/no/such/file.json"], 2),
        (["replay", "README.md", "--impl", "no_colon"], 2),
        (["gate", "--impl", "missing.py:make"], 2),
        (["gate", "--shard", "3/2"], 2),
        (["gate", "--baseline", "README.md"], 2),
        (["gate", "--baseline", "/no/such/baseline.json"], 2),
        (["gate", "--impl", "no_such_module_xyz:make"], 2),
        (["gate", "--impl", "wacc.baselines:scale_times_weight"], 2),
        (["gate", "--out", "README.md"], 2),
        (["gate", "--shard", "1/2", "--update-baseline"], 2),
        (["gate", "--shard", "1/2", "--summary-md", "gate.md"], 2),
        (["report", "--out", "README.md"], 2),
        (["report", "--impl", "nocolon"], 2),
        (["report", "--impl", "a:b", "--impl", "a:b"], 2),
        (["report", "--compare-to", "/no/such/report"], 2),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else str(value),
)
def test_help_usage_errors_and_path_checks_do_not_import_torch(args: list[str], code: int) -> None:
    """``--help``, a usage error, a missing path, a missing, corrupt or foreign gate baseline and
    an IMPL whose module does not exist answer from the parser, the file system and the light
    file readers alone: neither torch nor the reference model (nor numpy) is imported, so the
    answer is immediate (0.1-0.3 s measured, against 4-14 s when every command imported the
    judge first)."""
    result = subprocess.run(
        [sys.executable, "-c", _FAST_PROBE, *args], cwd=REPO, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    last = result.stdout.strip().splitlines()[-1]
    assert last == f"EXIT {code} LOADED", result.stdout + result.stderr
    if code == 2:
        assert "Traceback" not in result.stderr and result.stderr.startswith("wacc: error: ")


def test_an_internal_error_exits_3_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An exception wacc did not expect is a bug, not a finding: exit 3 (never 1, a divergence,
    nor 2, bad input), the traceback, then one line that says so."""
    from wacc import cli
    from wacc.commands import replay

    def broken(args: object) -> int:
        raise RuntimeError("a bug\nin two lines")

    monkeypatch.setattr(replay, "run", broken)
    assert cli.main(["replay", "x.json"]) == cli.INTERNAL_ERROR == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and 'raise RuntimeError("a bug' in err
    assert err.strip().splitlines()[-1] == (
        "wacc: internal error: RuntimeError: a bug\\nin two lines (a bug in wacc, not a finding; "
        "please report it with the traceback above)"
    )


def test_the_gate_reads_its_baseline_before_the_run(tmp_path: Path) -> None:
    """A missing or corrupt baseline is exit 2 naming it, found before the corpus runs (it takes
    minutes): the answer comes before any scenario is judged."""
    started = time.monotonic()
    missing = wacc("gate", "--quiet", "--baseline", str(tmp_path / "none.json"))
    corrupt_path = tmp_path / "corrupt.json"
    corrupt_path.write_text("{not json", encoding="utf-8")
    corrupt = wacc("gate", "--quiet", "--baseline", str(corrupt_path))
    assert time.monotonic() - started < 60
    for result, path in ((missing, "none.json"), (corrupt, "corrupt.json")):
        assert path in _one_line_error(result)


@pytest.mark.parametrize(
    ("impl", "kinds"),
    [
        ("tests.wacc.impls:opaque_unchecked", "(flipped_byte_file)"),
        ("tests.wacc.impls:schema_unchecked", "(checksum_malformed, checksum_mismatch)"),
    ],
    ids=["opaque", "documented-layout"],
)
def test_records_without_integrity_fail_as_unsupported_checksum_unless_allowed(
    tmp_path: Path, impl: str, kinds: str
) -> None:
    """A correct accumulator whose records carry no integrity check, in either layout: exit 1
    with one ``unsupported: checksum`` line naming the kinds not judged and the flag, and no
    divergence; with ``--allow-missing checksum``, exit 0 (semantics §9 Reading "integrity")."""
    common = ["--dtype", "float32", "--family", "interruptions", "--family", "non_finite",
              "--examples", "25", "--out", str(tmp_path), "--quiet"]  # fmt: skip
    refused = wacc("check", impl, *common)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    (line,) = [line for line in refused.stdout.splitlines() if line.startswith("unsupported:")]
    assert line.startswith("unsupported: checksum: ") and kinds in line
    assert line.endswith("(allow with --allow-missing checksum)")
    assert "DIVERGENCE" not in refused.stdout and not list(tmp_path.iterdir())
    allowed = wacc("check", impl, *common, "--allow-missing", "checksum")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "unsupported" not in allowed.stdout


def test_results_without_found_inf_are_not_judged_and_pass_without_a_flag(tmp_path: Path) -> None:
    """A correct accumulator whose finished results have no found_inf (an extension: dynamic
    loss scaling, wacc.judge.contract): exit 0 with no flag, one ``not judged: found_inf`` line
    naming the extension, no ``unsupported`` line and no divergence."""
    common = ["--dtype", "float16", "--family", "windows", "--examples", "25",
              "--out", str(tmp_path), "--quiet"]  # fmt: skip
    result = wacc("check", "tests.wacc.impls:no_found_inf", *common)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("not judged:")]
    assert line.startswith("not judged: found_inf (the dynamic loss scaling extension, ")
    assert "finished results without found_inf" in line
    assert "unsupported" not in result.stdout and "DIVERGENCE" not in result.stdout


def test_opaque_records_with_integrity_pass_without_the_flag(tmp_path: Path) -> None:
    """Records of their own layout with a hash of their own: every corruption is judged, the
    flipped file included, and the check passes with no flag."""
    result = wacc(
        "check", "tests.wacc.impls:opaque_records", "--dtype", "float32", "--family",
        "interruptions", "--examples", "25", "--out", str(tmp_path), "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "unsupported" not in result.stdout


def test_the_gate_fails_an_unsupported_feature_before_running() -> None:
    """``wacc gate`` answers a missing feature like ``wacc check`` (exit 1, the same line) at
    once, before the corpus runs; --allow-missing is one of its options."""
    started = time.monotonic()
    result = wacc(
        "gate", "--impl", "tests.wacc.impls:schema_unchecked", "--allow-other-impl", "--quiet"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()  # the note on the baseline's IMPL, then the verdict
    assert lines[0].startswith("note: the baseline was recorded for "), lines
    assert lines[-1].startswith("unsupported: checksum: ") and "Traceback" not in result.stderr
    assert time.monotonic() - started < 60  # the corpus takes minutes
    assert "--allow-missing FEATURE" in wacc("gate", "--help").stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["check", "tests.wacc.impls:nothing_here"], "has no attribute 'nothing_here'"),
        (["check", "no_such_module_xyz:make"], "cannot import module"),
        (["check", "tests.wacc.impls:factory_raises"], "raised for (torch.float32, 1.0)"),
        (["check", "--dtype", "float128"], "invalid choice: 'float128'"),
        (["check", "--examples", "0"], "--examples must be >= 1"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["replay", "/no/such/file.json"], "cannot read"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args: list[str], fragment: str) -> None:
    """Bad usage or environment gets exit 2 and one line on stderr naming the problem."""
    assert fragment in _one_line_error(wacc(*args))


def test_cuda_asked_for_without_a_device_is_exit_2() -> None:
    """``--device cuda`` on a machine without CUDA is an environment error, not a crash."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the environment error does not apply")
    assert "no CUDA device" in _one_line_error(wacc("check", "--device", "cuda"))


def _small_scenario() -> Scenario:
    return Scenario(
        work_dtype="float16",
        grad_dtype="float32",
        loss_scale=2.0**15,
        fused=False,
        parameters=(("weight", (2,)),),
        steps=(
            Accumulate.of("sum", 4000.0, {"weight": (2.0**15, 3.0)}),
            Accumulate.of("mean", 96.0, {"weight": (2.0**-9, -1.0)}),
            Finish("mean"),
        ),
    )


def test_a_replay_file_round_trips_and_prints_every_step(tmp_path: Path) -> None:
    """A scenario written with to_json replays on wacc_torch with one table row per step."""
    path = tmp_path / "scenario.json"
    path.write_text(to_json(_small_scenario(), indent=1), encoding="utf-8")
    result = wacc("replay", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [
        line for line in result.stdout.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])
    ]
    assert [row.split()[1] for row in rows] == ["accumulate_sum", "accumulate_mean", "finish_mean"]


def _hostile_files(tmp_path: Path) -> dict[str, Path]:
    good = json.loads(to_json(_small_scenario()))
    files: dict[str, object] = {
        "json bomb (nesting)": "[" * 200_000 + "]" * 200_000,
        "huge integer": '{"format": ' + "9" * 100_000 + "}",
        "wrong types": {**good, "steps": "all of them", "loss_scale": 3},
        "huge shape": {
            **good,
            "parameters": [{"name": "weight", "shape": [2**40, 2**40]}],
            "steps": [],
        },
        "unknown op": {**good, "steps": [{"op": "rm -rf /"}]},
        "not utf-8": b"\xff\xfe{\x00",
        "not json": "hello",
        "oversized": " " * (5 * 2**20),
    }
    paths = {}
    for index, (name, content) in enumerate(files.items()):
        path = tmp_path / f"hostile-{index}.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(
                content if isinstance(content, str) else json.dumps(content), encoding="utf-8"
            )
        paths[name] = path
    return paths


def test_hostile_replay_files_are_refused_quickly_with_exit_2(tmp_path: Path) -> None:
    """Each malformed or hostile file is refused in seconds with one line naming the problem."""
    for name, path in _hostile_files(tmp_path).items():
        started = time.perf_counter()
        message = _one_line_error(wacc("replay", str(path), timeout=60))
        assert time.perf_counter() - started < 30, name
        assert str(path) in message, (name, message)


@contextlib.contextmanager
def _endless_fifo(path: Path) -> Iterator[Path]:
    """A FIFO at ``path`` fed zeros without end (until its reader closes it): a file that
    ``stat()`` calls empty and that a read without a bound never finishes."""
    os.mkfifo(path)
    stop = threading.Event()

    def feed() -> None:
        try:
            with path.open("wb") as sink:  # blocks until the command opens it
                while not stop.is_set():
                    sink.write(bytes(2**16))
        except OSError:  # BrokenPipeError: the reader read its bound and closed
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        stop.set()
        # A command that never opened the FIFO leaves the writer blocked in open(): open it
        # (non-blocking) to let the writer through and end.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        writer.join(timeout=10)
        os.close(descriptor)


# (where the unbounded file goes, the command line reading it): every file the CLI reads.
_UNBOUNDED_READS = {
    "replay FILE": ("scenario.json", ["replay", "{}"]),
    "gate --baseline": ("baseline.json", ["gate", "--baseline", "{}"]),
    "gate --merge": ("shards/s1.json", ["gate", "--merge", "{dir}"]),
    "report --compare-to": ("before/divergence.csv", ["report", "--compare-to", "{dir}"]),
    "report --audit": ("audit/audit.csv", ["report", "--audit", "{dir}"]),
}


@pytest.mark.parametrize("source", ["/dev/zero", "FIFO"])
@pytest.mark.parametrize("reader", list(_UNBOUNDED_READS))
def test_a_file_without_end_is_read_to_a_bound_and_refused(
    tmp_path: Path, reader: str, source: str
) -> None:
    """Every user file the CLI reads is read to a bound, whatever ``stat()`` says: /dev/zero
    or a FIFO that never ends is refused with exit 2 and one line naming it, in seconds, not read
    until the machine runs out of memory."""
    name, template = _UNBOUNDED_READS[reader]
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if name.startswith("audit/"):
        (path.parent / "audit.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    args = [a.format(path, dir=path.parent) for a in template]
    if reader.startswith("report"):
        args += ["--quick", "--out", str(tmp_path / "r")]
    with contextlib.ExitStack() as stack:
        if source == "FIFO":
            stack.enter_context(_endless_fifo(path))
        else:
            path.symlink_to("/dev/zero")
        message = _one_line_error(wacc(*args, timeout=60))
    assert str(path) in message and "has more than" in message, message
    assert not (tmp_path / "r").exists()


def test_check_prints_an_implementations_exception_with_its_line_and_traceback(
    tmp_path: Path,
) -> None:
    """An exception the implementation raised is printed under its divergence with its text and
    the implementation's own file and line; --traceback adds the whole traceback, and replay
    --traceback prints it too."""
    impls = (REPO / "tests" / "wacc" / "impls.py").read_text(encoding="utf-8").splitlines()
    (line,) = [
        n
        for n, text in enumerate(impls, start=1)
        if 'RuntimeError("means are not implemented")' in text
    ]
    where = (
        "RuntimeError: means are not implemented "
        f"(at tests/wacc/impls.py:{line}, in accumulate_mean)"
    )
    args = ("check", "tests.wacc.impls:raises_on_mean", "--dtype", "float64", "--family",
            "windows", "--examples", "20", "--out", str(tmp_path), "--quiet")  # fmt: skip
    plain = wacc(*args)
    assert plain.returncode == 1, plain.stdout + plain.stderr
    assert f"raised {where}" in plain.stdout
    assert "Traceback" not in plain.stdout
    traced = wacc(*args, "--traceback")
    assert traced.returncode == 1, traced.stdout + traced.stderr
    assert "Traceback (most recent call last)" in traced.stdout
    assert f"line {line}, in accumulate_mean" in traced.stdout
    (replay_line,) = [text for text in traced.stdout.splitlines() if "replay:" in text]
    command = replay_line.split("replay: ", 1)[1].split()
    replay = wacc(*command[1:], "--traceback")
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert (
        f"raised {where}" in replay.stdout and "Traceback (most recent call last)" in replay.stdout
    )


@pytest.mark.parametrize(
    ("factory", "code", "shown"),
    [
        ("state_dict_raises", 1, "RuntimeError: state_dict cannot write a window with batches in "
         "it (at tests/wacc/impls.py:"),
        ("async_result_raises", 1, "RuntimeError: the async record was lost in transit (at "
         "tests/wacc/impls.py:"),
        # correct implementations: their records are judged, and pass
        ("sparse_record", 0, "records: opaque"),
        ("stride_zero_record", 0, "records: opaque"),
    ],
)  # fmt: skip
def test_an_implementations_exception_anywhere_is_a_divergence_never_exit_3(
    factory: str, code: int, shown: str, tmp_path: Path
) -> None:
    """A state_dict() that raises, an async handle whose .result() raises: `wacc check` exits 1
    with a DIVERGENCE block that shows the exception's text; records holding a sparse or a
    stride-0 tensor are judged (the integrity probe compares them): never exit 3."""
    result = wacc(
        "check", f"tests.wacc.impls:{factory}", "--dtype", "float32", "--family",
        "interruptions", "--examples", "20", "--allow-missing", "checksum", "--out",
        str(tmp_path), "--quiet",
    )  # fmt: skip
    assert result.returncode == code, result.stdout + result.stderr
    assert shown in result.stdout and "internal error" not in result.stderr
    assert ("DIVERGENCE" in result.stdout) == (code == 1)


def test_one_bug_in_several_dtypes_and_families_is_one_block(tmp_path: Path) -> None:
    """The same divergence found in 2 dtypes x 2 families is printed once, naming all four
    cells, with one replay command and the other three scenario files (all written)."""
    result = wacc(
        "check", "tests.wacc.impls:double_unscale", "--dtype", "float32", "--dtype", "float64",
        "--family", "windows", "--family", "invalid_weights", "--examples", "30",
        "--out", str(tmp_path), "--quiet",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    blocks = [line for line in result.stdout.splitlines() if line.startswith("DIVERGENCE ")]
    assert len(blocks) == 1, result.stdout
    cells = "float32/windows, float32/invalid_weights, float64/windows, float64/invalid_weights"
    assert blocks[0].startswith(f"DIVERGENCE {cells} [emulation, bound]"), blocks[0]
    assert "(the first of 4 with the same signature)" in blocks[0]
    assert len([line for line in result.stdout.splitlines() if "replay:" in line]) == 1
    (others,) = [line for line in result.stdout.splitlines() if "the others: " in line]
    paths = others.split("the others: ", 1)[1].split(", ")
    assert len(paths) == 3 and all(Path(path).is_file() for path in paths)
    assert len(list(tmp_path.glob("divergence-*.json"))) == 4


def test_a_check_says_what_it_judged_and_shows_values_in_the_dtypes_own_width(
    tmp_path: Path,
) -> None:
    """A failing bfloat16 check prints each diverging value as its shortest decimal with the hex
    beside it in bfloat16's width (2 hex digits), never float64's 13, and closes with what was
    judged: the implementation, the scenarios per family, how records were judged, the profile
    and its seed."""
    result = wacc(
        "check", "tests.wacc.impls:double_unscale", "--dtype", "bfloat16", "--family", "windows",
        "--examples", "30", "--out", str(tmp_path), "--quiet",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    values = re.findall(r"expected (\S+) \((-?0x[0-9a-f.]+p[+-]\d+)\)", result.stdout)
    assert values, result.stdout
    for decimal, hexed in values:
        assert re.fullmatch(r"-?0x[01]\.[0-9a-f]{2}p[+-]\d+", hexed), hexed
        # the decimal names the same value: it rounds to it in bfloat16
        assert formats.round_to(float(decimal), "bfloat16") == float.fromhex(hexed)
    judged = result.stdout.split("what was judged:\n", 1)[1].splitlines()
    assert judged[0] == "  implementation: tests.wacc.impls:double_unscale (fused: no)"
    assert re.fullmatch(r"  scenarios per family \(all dtypes\): windows \d+", judged[1])
    assert judged[2].startswith("  records: judged by the schema")
    assert judged[3].startswith("  profile: ci; derandomized")
