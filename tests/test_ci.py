"""CI (.ci/run) begins with the README's Quickstart as written, read from README.md, and reruns
what that run skipped once the extras are in (tests/record_skipped.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_support import README, ROOT, quickstart

CI = ROOT / ".ci" / "run"


def _quickstart_of(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / ".ci" / "run"), "--quickstart"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_ci_runs_the_readme_quickstart_block_as_written() -> None:
    """What .ci/run runs first is the README's Quickstart block, character for character."""
    done = _quickstart_of(ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == quickstart(README)


def test_ci_reads_the_block_from_the_readme_it_sits_next_to(tmp_path: Path) -> None:
    """.ci/run holds no copy of the commands: next to a README with other Quickstart commands it
    runs those, and next to a README without a Quickstart block it stops (exit 1, one line)."""
    (tmp_path / ".ci").mkdir()
    shutil.copy2(CI, tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(
        "# x\n\n## Quickstart\n\n```sh\nnot this\n```\n\n```bash\necho one && echo two\n"
        "pytest -x   # a comment\n```\n\n```bash\nnor this\n```\n\n## Next\n",
        encoding="utf-8",
    )
    done = _quickstart_of(tmp_path)
    assert (done.returncode, done.stdout) == (0, "echo one && echo two\npytest -x   # a comment\n")
    (tmp_path / "README.md").write_text(
        "# x\n\n## Quickstart\n\nno block\n\n## Next\n\n```bash\nlater\n```\n", encoding="utf-8"
    )
    done = _quickstart_of(tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Quickstart" in done.stderr


def test_ci_runs_the_quickstart_first_in_its_fresh_venv_then_the_extras() -> None:
    """In .ci/run the Quickstart runs (with the skip list on) right after the fresh venv is
    activated, before any other install or test; then the extras are installed, the skipped
    tests rerun, the docs built strictly, the mutation smoke sample and the gate."""
    lines = [line.strip() for line in CI.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]

    def first(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    run_quickstart = first('bash -euo pipefail -c "$quickstart"')
    assert "WACC_RECORD_SKIPPED=" in lines[run_quickstart]
    assert first("python3 -m venv .venv") < first(". .venv/bin/activate") < run_quickstart
    before = lines[:run_quickstart]
    assert not any("pip install" in line or "pytest" in line for line in before)
    order = [
        run_quickstart,
        first('pip install -q -c .ci/constraints.txt -e ".[dev,frameworks,mutation,docs]"'),
        first('python -m pytest -n auto --dist loadfile "${rerun[@]}"'),
        first("mkdocs build --strict"),
        first("python -m mutation smoke"),
        first("wacc gate --quiet --merge"),
    ]
    assert order == sorted(order)
    # MkDocs 1.6 counts no warnings under --quiet: --strict would then pass a broken link.
    assert "--quiet" not in lines[first("mkdocs build --strict")]
    assert sum("pytest" in line for line in lines[run_quickstart + 1 :]) == 1


@pytest.mark.slow  # a pytest run with two xdist workers (~40 s here)
def test_skipped_tests_and_modules_are_listed_for_the_rerun(tmp_path: Path) -> None:
    """Under pytest with xdist (as CI runs it), WACC_RECORD_SKIPPED receives the id of a module
    skipped at collection by a missing import, of a skipped test and of a test skipped in a
    fixture; not a passing test, an xfail or a failing one."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "from tests.record_skipped import pytest_collectreport, pytest_runtest_logreport\n",
        encoding="utf-8",
    )
    (suite / "test_extra.py").write_text(
        "import pytest\n\npytest.importorskip('wacc_no_such_extra')\n\n\n"
        "def test_never() -> None:\n    pass\n",
        encoding="utf-8",
    )
    (suite / "test_mixed.py").write_text(
        "import pytest\n\n\n@pytest.fixture\ndef needs() -> None:\n    pytest.skip('absent')\n\n\n"
        "def test_runs() -> None:\n    pass\n\n\n"
        "def test_skips() -> None:\n    pytest.skip('no extra')\n\n\n"
        "def test_fixture_skips(needs: None) -> None:\n    pass\n\n\n"
        "@pytest.mark.xfail(strict=True)\ndef test_xfails() -> None:\n    raise ValueError\n\n\n"
        "def test_fails() -> None:\n    raise ValueError\n",
        encoding="utf-8",
    )
    listed = tmp_path / "skipped.txt"
    env = {**os.environ, "WACC_RECORD_SKIPPED": str(listed), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-q", str(suite)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr  # test_fails, and nothing else broke
    assert "1 failed, 1 passed, 3 skipped, 1 xfailed" in done.stdout, done.stdout
    assert set(listed.read_text(encoding="utf-8").splitlines()) == {
        "suite/test_extra.py",
        "suite/test_mixed.py::test_skips",
        "suite/test_mixed.py::test_fixture_skips",
    }
