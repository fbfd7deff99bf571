"""``wacc audit`` as a subprocess: exit codes, files, one-line usage errors."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wacc.audit.adapters import ADAPTERS
from wacc.commands import audit as audit_command

ROOT = Path(__file__).resolve().parents[3]


def _wacc(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "wacc", "audit", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_passing_loops_exit_0_and_write_the_report(tmp_path: Path) -> None:
    """Correct loops exit 0; stdout has the table, --out has audit.md, audit.csv, audit.png."""
    out = tmp_path / "report"
    done = _wacc("plain", "wacc_torch-mean", "--windows", "unequal", "equal", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "wacc_torch-mean" in done.stdout and "pass" in done.stdout
    assert "FAIL" not in done.stdout
    rows = list(csv.DictReader((out / "audit.csv").read_text().splitlines()))
    assert [(r["loop"], r["window"], r["verdict"]) for r in rows] == [
        ("plain", "unequal", "pass"), ("plain", "equal", "pass"),
        ("wacc_torch-mean", "unequal", "pass"), ("wacc_torch-mean", "equal", "pass"),
    ]  # fmt: skip
    skips = "skips the whole window (scale {})"
    assert [r["fp16_overflow"] for r in rows] == [skips.format("65536 -> 32768")] * 2 + [
        skips.format("4096 -> 2048")
    ] * 2
    assert "fp16 overflow" in done.stdout
    assert "## Per loop and window" in (out / "audit.md").read_text()
    assert (out / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_failing_user_loop_exits_1(tmp_path: Path) -> None:
    """A module:function loop that weighs microbatches equally is a divergence: exit 1."""
    done = _wacc("tests.wacc.audit.loops:equal_weighting", "--windows", "unequal", "--quiet",
                 "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "FAIL" in done.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["no-such-framework"],
        ["--windows", "nope"],
        ["--dtype", "float8"],
        ["nocolon:"],
        ["no_such_module_xyz:run"],
        ["plain", "--jobs", "0"],
        ["plain", "--jobs", "two"],
        ["plain", "--jobs", "2", "--in-process"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], tmp_path: Path) -> None:
    """Unknown framework, window or dtype, a bad module:function, a number of jobs below one or
    not a number, or jobs with --in-process: one line, exit 2."""
    done = _wacc(*args, "--out", str(tmp_path))
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "error" in done.stderr
    assert "Traceback" not in done.stderr


_USER_LOOP = """
from wacc.audit.adapters import ADAPTERS


def loop(task):
    {doc!r}
    return ADAPTERS["plain"].run(task)


{attributes}
"""


def test_a_user_loop_with_a_blank_docstring_runs_under_its_name(tmp_path: Path) -> None:
    """A user loop whose docstring is only whitespace is titled by its spec and audited (exit
    0: it is the plain loop), not an internal error."""
    (tmp_path / "blank.py").write_text(_USER_LOOP.format(doc=" \n\t ", attributes=""))
    spec = f"{tmp_path / 'blank.py'}:loop"
    done = _wacc(spec, "--windows", "equal", "--in-process", "--quiet", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert spec in done.stdout and "pass" in done.stdout


@pytest.mark.parametrize(
    ("attributes", "fragment"),
    [
        ('loop.model = ["plain"]', "model ['plain'] is not one of"),
        ("loop.model = 3", "model 3 is not one of"),
        ('loop.fp16 = "no"', "fp16 'no' is not True or False"),
        ("loop.checkpoint = 1", "checkpoint 1 is not True or False"),
    ],
)
def test_a_user_loops_bad_attribute_is_one_line_and_exit_2(
    tmp_path: Path, attributes: str, fragment: str
) -> None:
    """A user loop's model that is not a model kind's name (a list is not even hashable), or a
    capability flag that is not a bool: exit 2, one line naming the loop and the value."""
    (tmp_path / "bad.py").write_text(_USER_LOOP.format(doc="A loop.", attributes=attributes))
    done = _wacc(f"{tmp_path / 'bad.py'}:loop", "--in-process", "--out", str(tmp_path / "o"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert fragment in done.stderr and "bad.py:loop" in done.stderr


def test_out_that_is_a_file_is_exit_2(tmp_path: Path) -> None:
    """--out naming an existing file is a usage error."""
    target = tmp_path / "file"
    target.write_text("x")
    done = _wacc("plain", "--out", str(target))
    assert done.returncode == 2 and str(target) in done.stderr


def test_help_lists_every_builtin_loop() -> None:
    """The command's list of built-in loops is the adapter registry, in order."""
    assert list(audit_command._BUILTIN) == list(ADAPTERS)


AUTOCAST_LOOP = '''
import torch

from wacc.audit.protocol import LoopRun


def autocast_mean(task):
    """loss_sum / N under CPU bfloat16 autocast: the right weighting, rounded in bfloat16."""
    model = task.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    task.hook_optimizer(optimizer, model)
    data = task.dataset
    batches = [{k: v[None] for k, v in data[i].items()} for i in range(len(data))]
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # float64 is never autocast
            logits = model(input_ids=batch["input_ids"])["logits"][:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum"
        )
        (loss / total).backward()
    optimizer.step()
    return LoopRun(counted_tokens=total)
'''


@pytest.fixture(scope="module")
def met(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """What a new user meets: ``wacc audit plain nanogpt loop.py:autocast_mean`` in a folder of
    their own, where the installed torch's metadata says 9.9.9 (a ``torch-9.9.9.dist-info`` first
    on the path: ``importlib.metadata`` finds it, ``import torch`` still imports the real one)."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "loop.py").write_text(AUTOCAST_LOOP, encoding="utf-8")
    info = folder / "site" / "torch-9.9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder / "site"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "wacc", "audit", "plain", "nanogpt", "loop.py:autocast_mean",
         "--windows", "unequal", "--quiet", "--out", "out"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # nanogpt fails
    return done, folder / "out"


@pytest.mark.slow
def test_the_terminal_report_fits_120_columns(
    met: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Every stdout line of the report is at most 120 characters (nanoGPT's long resume reason
    made the per-loop table 600 wide); audit.md keeps the full per-loop table."""
    done, out = met
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    assert "fp16 overflow: skips the whole window" in done.stdout  # the facts are all there
    assert "| loop | version | model | float64 copy | reads window first |" in (
        out / "audit.md"
    ).read_text(encoding="utf-8")


@pytest.mark.slow
def test_a_pass_with_alarming_numbers_says_why(
    met: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """A passing row whose run in the audited dtype is far above its bound (a loop that computes
    in bfloat16 autocast) and whose max rel elem is >= 1 gets the reason beside it, on stdout
    and in audit.md's basis column: the verdict is the float64 run's, the excess is the run's
    own rounding, the max is on a small element."""
    done, out = met
    (row,) = [r for r in csv.DictReader((out / "audit.csv").read_text().splitlines())
              if r["loop"] == "loop.py:autocast_mean"]  # fmt: skip
    assert row["verdict"] == "pass" and float(row["err_over_bound"]) > 1, row
    assert float(row["max_rel_element_normal"]) >= 1, row
    why = " ".join(done.stdout.split())  # the lines are wrapped at 120
    assert "loop.py:autocast_mean / unequal: pass: the f64 run is within the bound" in why
    assert "is the float32 run's own forward/backward rounding, which no bound covers" in why
    assert "of the gradient's largest" in why
    markdown = (out / "audit.md").read_text(encoding="utf-8")
    (line,) = [
        x for x in markdown.splitlines() if x.startswith("| loop.py:autocast_mean | unequal")
    ]
    assert "which no bound covers" in line and "of the gradient's largest" in line


@pytest.mark.slow
def test_checked_versions_that_differ_are_said(
    met: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """A loop checked with torch 2.13.0 next to an installed torch 9.9.9 says the versions
    differ, on stdout and in audit.md's code paths."""
    done, out = met
    said = "checked: torch 2.13.0 (run here) (installed: torch 9.9.9: the versions differ)"
    assert said in " ".join(done.stdout.split())
    markdown = (out / "audit.md").read_text(encoding="utf-8")
    assert "- `plain` — plain PyTorch" in markdown and said in markdown
    assert "checked: n/a" in markdown  # the user loop names no versions: nothing to compare


@pytest.mark.slow
def test_the_printed_tables_and_audit_md_show_what_audit_csv_holds(tmp_path: Path) -> None:
    """What ``wacc audit`` prints and writes to audit.md, read back by column name, is what it
    writes to audit.csv, loop by loop and window by window (a failing loop, one that raises, a
    correct one, and the window with no target token)."""
    from tests.wacc.audit.test_report import check_tables, terminal_tables
    from tests.wacc.rendered import markdown_tables, section
    from wacc.audit.report import CELL_COLUMNS, RANK_COLUMNS

    done = _wacc("plain", "tests.wacc.audit.loops:equal_weighting", "tests.wacc.audit.loops:raises",
                 "--windows", "unequal", "zero", "--quiet", "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 1, done.stderr
    with (tmp_path / "audit.csv").open(newline="", encoding="utf-8") as handle:
        records = list(csv.DictReader(handle))
    assert len(records) == 6
    # Each loop imports and its facts are measured; only the run of `raises` raises.
    statuses = dict.fromkeys((r["loop"] for r in records), "ok")
    _, tables = terminal_tables(done.stdout.strip(), records, statuses)
    check_tables(tables, records, statuses, CELL_COLUMNS[:-1])  # the basis is audit.md's
    markdown = (tmp_path / "audit.md").read_text(encoding="utf-8")
    check_tables(
        [*markdown_tables(section(markdown, "## Per loop and window")),
         *markdown_tables(section(markdown, "## Per loop"))],
        records,
        statuses,
        CELL_COLUMNS[:2] + RANK_COLUMNS + CELL_COLUMNS[2:],
    )  # fmt: skip
