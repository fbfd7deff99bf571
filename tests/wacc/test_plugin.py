"""The pytest plugin (``pytest --wacc-impl``) in a real subprocess pytest run of a user project."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_USER_TEST = "def test_users_own_test():\n    assert True\n"


def _user_pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest in a fresh project directory that has one test of its own and ``tests.wacc.impls``
    importable; the plugin arrives through its ``pytest11`` entry point."""
    (tmp_path / "test_mine.py").write_text(_USER_TEST, encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_without_the_option_the_plugin_adds_nothing(tmp_path: Path) -> None:
    """A plain pytest run of the user's project runs only the user's test."""
    result = _user_pytest(tmp_path)
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout


def test_a_correct_implementation_passes_inside_the_users_run(tmp_path: Path) -> None:
    """With --wacc-impl of wacc_torch every wacc item passes next to the user's own test."""
    result = _user_pytest(
        tmp_path,
        "--wacc-impl", "wacc.implementation:wacc_torch_reproducible",
        "--wacc-dtype", "bfloat16", "--wacc-examples", "10",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 passed" in result.stdout  # the user's test + 5 families + the machine


def test_a_buggy_implementation_fails_with_a_replay_command(tmp_path: Path) -> None:
    """A buggy implementation fails its wacc items with the shrunk divergence and a replay line."""
    out = tmp_path / "divergences"
    result = _user_pytest(
        tmp_path,
        "--wacc-impl", "tests.wacc.impls:double_unscale",
        "--wacc-dtype", "float32", "--wacc-examples", "20", "--wacc-out", str(out),
        "-k", "windows",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed" in result.stdout and "diverges from the reference" in result.stdout
    assert "replay: wacc replay" in result.stdout and list(out.glob("divergence-*.json"))
    assert "Traceback" not in result.stdout


def test_records_without_integrity_fail_unless_allowed_in_the_plugin_too(tmp_path: Path) -> None:
    """The plugin judges the checksum feature like ``wacc check``: each wacc item of an
    implementation whose records refuse no changed value fails with the one unsupported line,
    naming ``--wacc-allow-missing checksum``; with that option the items pass."""
    common = ["--wacc-impl", "tests.wacc.impls:opaque_unchecked", "--wacc-dtype", "float32",
              "--wacc-examples", "10", "-k", "interruptions"]  # fmt: skip
    refused = _user_pytest(tmp_path, *common)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "1 failed" in refused.stdout and "Traceback" not in refused.stdout
    assert "unsupported: checksum: records of its own layout carry no integrity" in refused.stdout
    assert "(allow with --wacc-allow-missing checksum)" in refused.stdout
    allowed = _user_pytest(tmp_path, *common, "--wacc-allow-missing", "checksum")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "1 passed, 6 deselected" in allowed.stdout  # -k keeps the interruptions item only
