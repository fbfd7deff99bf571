"""The pytest plugin (``pytest --wacc-impl``) in a real subprocess pytest run of a user project."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
_USER_TEST = "def test_users_own_test():\n    assert True\n"
# Every user project records whether the run imported torch (pytest_unconfigure runs after a
# usage error too).
_TORCH_CONFTEST = """\
import sys
from pathlib import Path


def pytest_unconfigure(config):
    Path(__file__).with_name("torch-imported").write_text(str("torch" in sys.modules))
"""
# With spy=True the families do not run: each item records what it would have run instead.
_SPY_CONFTEST = """\
import json

import pytest

import wacc.judge.engine

_ITEM = []


def pytest_runtest_setup(item):
    _ITEM[:] = [item]


def _spy(implementation, dtype, family, config, **kwargs):
    entry = {
        "nodeid": _ITEM[0].nodeid, "dtype": dtype, "family": family, "impl": implementation.spec,
        "device": config.device, "profile": config.profile, "seed": config.seed,
        "examples": config.examples, "oracles": list(config.oracles),
        "out": str(_ITEM[0].settings.out),
    }
    with Path(__file__).with_name("spy.jsonl").open("a", encoding="utf-8") as file:
        file.write(json.dumps(entry) + "\\n")
    return None


wacc.judge.engine.run_family = _spy
"""
_HALF_WRONG = """\
import torch

from tests.wacc.impls import double_unscale
from wacc.implementation import wacc_torch_loss_scaler, wacc_torch_reproducible


def make(dtype, loss_scale):
    \"\"\"wacc_torch, except in float16, where it divides by the loss scale twice.\"\"\"
    factory = double_unscale if dtype == torch.float16 else wacc_torch_reproducible
    return factory(dtype, loss_scale)


make.loss_scaler = wacc_torch_loss_scaler
"""


def _user_pytest(
    tmp_path: Path,
    *args: str,
    quiet: bool = True,
    cache: bool = False,
    spy: bool = False,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """pytest in a fresh project directory that has one test of its own and ``tests.wacc.impls``
    importable; the plugin arrives through its ``pytest11`` entry point."""
    (tmp_path / "test_mine.py").write_text(_USER_TEST, encoding="utf-8")
    conftest = _TORCH_CONFTEST + ("\n" + _SPY_CONFTEST if spy else "")
    (tmp_path / "conftest.py").write_text(conftest, encoding="utf-8")
    options = [*(["-q"] if quiet else []), *([] if cache else ["-p", "no:cacheprovider"])]
    return subprocess.run(
        [sys.executable, "-m", "pytest", *options, *args],
        cwd=cwd or tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _spied(tmp_path: Path) -> list[dict[str, Any]]:
    """What the spy recorded, one entry per wacc item that ran."""
    lines = (tmp_path / "spy.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def _torch_imported(tmp_path: Path) -> bool:
    return (tmp_path / "torch-imported").read_text(encoding="utf-8") == "True"


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
    assert "8 passed" in result.stdout  # the user's test + 6 families + the machine


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


def test_a_failure_shows_the_implementations_exception_text_and_where_it_was_raised(
    tmp_path: Path,
) -> None:
    """An implementation whose state_dict() raises outside §11 fails its item with the lines
    `wacc check` prints: the exception's own text and the file:line of the implementation's
    code that raised it, not only "got unexpected RuntimeError from state_dict()"."""
    import inspect

    from tests.wacc import impls

    result = _user_pytest(
        tmp_path,
        "--wacc-impl", "tests.wacc.impls:state_dict_raises", "--wacc-dtype", "float32",
        "--wacc-examples", "3", "--wacc-allow-missing", "checksum", "-k", "windows",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    source, first = inspect.getsourcelines(impls._StateDictRaises.state_dict)
    line = first + next(n for n, text in enumerate(source) if "raise RuntimeError" in text)
    raised = re.search(r"^  step \d+ raised RuntimeError: (.*)$", result.stdout, re.MULTILINE)
    assert raised is not None, result.stdout
    assert "state_dict cannot write a window with batches in it" in raised[1]
    assert re.search(rf"\(at \S*impls\.py:{line}, in state_dict\)", raised[1]), raised[1]


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
    assert "1 passed, 7 deselected" in allowed.stdout  # -k keeps the interruptions item only


_BAD_OPTIONS = [
    (["--wacc-impl", "nosuchmodule:make"], "no module named 'nosuchmodule'"),
    (["--wacc-impl", "nosuchpackage.sub:make"], "no module named 'nosuchpackage.sub'"),
    (["--wacc-impl", "notaspec"], "must be 'module:attr' or 'path/file.py:attr'"),
    (["--wacc-impl", "missing.py:make"], "implementation file 'missing.py' does not exist"),
    (["--wacc-examples", "0"], "--wacc-examples must be >= 1, got 0"),
    (["--wacc-examples", "-3"], "--wacc-examples must be >= 1, got -3"),
    (["--wacc-examples", "many"], "--wacc-examples must be an integer, got 'many'"),
    (["--wacc-seed", "abc"], "--wacc-seed must be an integer, got 'abc'"),
    (["--wacc-dtype", "float8"], "unknown dtype 'float8' (choose from float64, float32,"),
    (["--wacc-oracle", "loose"], "unknown oracle set 'loose' (choose from strict, bound)"),
    (["--wacc-profile", "fast"], "unknown profile 'fast'"),
    (["--wacc-device", "tpu"], "unknown device 'tpu' (choose from cpu, cuda)"),
    (["--wacc-allow-missing", "speed"], "unknown feature 'speed'"),
    # an existing file (issue 33: a FileExistsError traceback per failing item, not exit 4)
    (["--wacc-out", "test_mine.py"], "--wacc-out 'test_mine.py' exists and is not a folder"),
    (["--wacc-out", "test_mine.py/x"], "'test_mine.py' is a file, not a folder"),
]


@pytest.mark.parametrize(
    ("args", "message"), _BAD_OPTIONS, ids=[" ".join(args) for args, _ in _BAD_OPTIONS]
)
def test_a_bad_option_is_a_usage_error_before_collection(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """Like pytest's own usage errors: exit 4, one ``ERROR:`` line naming the problem, nothing
    collected or run, no traceback, and torch never imported to say so."""
    impl = [] if args[0] == "--wacc-impl" else ["--wacc-impl", "tests.wacc.impls:double_unscale"]
    result = _user_pytest(tmp_path, *impl, *args)
    assert result.returncode == 4, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "collected" not in result.stdout and "passed" not in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert not _torch_imported(tmp_path)


_BAD_INI = [
    ("wacc_impl = notaspec", "ini key wacc_impl: implementation 'notaspec' must be"),
    ("wacc_examples = 0", "ini key wacc_examples must be >= 1, got 0"),
    ("wacc_seed = 1.5", "ini key wacc_seed must be an integer, got '1.5'"),
    ("wacc_dtype =\n    float32\n    float8", "ini key wacc_dtype: unknown dtype 'float8'"),
    ("wacc_out = conftest.py", "conftest.py' exists and is not a folder"),
]


@pytest.mark.parametrize(
    ("line", "message"), _BAD_INI, ids=[line.split(" =")[0] for line, _ in _BAD_INI]
)
def test_a_bad_ini_key_is_a_usage_error_too(tmp_path: Path, line: str, message: str) -> None:
    """A bad value of an ini key is the same one-line usage error (exit 4) as the option's,
    naming the key."""
    impl = "" if line.startswith("wacc_impl") else "wacc_impl = tests.wacc.impls:double_unscale\n"
    (tmp_path / "pytest.ini").write_text(f"[pytest]\n{impl}{line}\n", encoding="utf-8")
    result = _user_pytest(tmp_path)
    assert result.returncode == 4, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert not _torch_imported(tmp_path)


@pytest.mark.parametrize(
    ("impl", "message"),
    [
        ("tests.wacc.impls:nosuch", "'tests.wacc.impls' has no attribute 'nosuch'"),
        ("tests.wacc.impls:factory_raises", "raised for (torch.float32, 1.0)"),
        ("broken.py:make", "importing 'broken.py' failed: SyntaxError"),
    ],
    ids=["missing-attribute", "factory-raises", "syntax-error"],
)
def test_an_impl_that_does_not_load_is_a_usage_error_before_collection(
    tmp_path: Path, impl: str, message: str
) -> None:
    """An IMPL whose module lacks the attribute, whose file does not compile or whose factory
    raises is loaded at session start (as `wacc check` does) and is pytest's usage error: exit
    4, one ERROR line naming it, nothing collected (it was a failure per item)."""
    (tmp_path / "broken.py").write_text("def make(:\n", encoding="utf-8")
    result = _user_pytest(tmp_path, "--wacc-impl", impl)
    assert result.returncode == 4, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "collected" not in result.stdout and "Traceback" not in result.stdout + result.stderr


def test_collection_counts_exactly_the_items_that_run(tmp_path: Path) -> None:
    """Each dtype x family is an item of its own: ``--collect-only`` lists them (without
    importing torch), ``collected N items`` counts them, and exactly those run, once each."""
    args = ["--wacc-impl", "wacc.implementation:wacc_torch_reproducible",
            "--wacc-dtype", "float32", "--wacc-dtype", "bfloat16"]  # fmt: skip
    listed = _user_pytest(tmp_path, "--collect-only", *args)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "15 tests collected" in listed.stdout and not _torch_imported(tmp_path)
    ids = [line for line in listed.stdout.splitlines() if line.startswith("::wacc::check[")]
    assert len(ids) == 14
    assert "::wacc::check[wacc.implementation:wacc_torch_reproducible-bfloat16-stateful]" in ids

    ran = _user_pytest(tmp_path, *args, quiet=False, spy=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "collected 15 items" in ran.stdout and "15 passed" in ran.stdout
    assert sorted(entry["nodeid"] for entry in _spied(tmp_path)) == sorted(ids)


def test_last_failed_reruns_only_the_failed_items(tmp_path: Path) -> None:
    """The items' node ids are stable, so ``--lf`` reruns the failed wacc item and nothing else:
    an implementation wrong in float16 only fails float16/windows and passes float32/windows;
    the rerun collects every item and runs float16/windows alone."""
    (tmp_path / "half_wrong.py").write_text(_HALF_WRONG, encoding="utf-8")
    args = ["--wacc-impl", "half_wrong.py:make", "--wacc-dtype", "float32",
            "--wacc-dtype", "float16", "--wacc-examples", "20", "-k", "windows", "-rA"]  # fmt: skip
    first = _user_pytest(tmp_path, *args, cache=True)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "1 failed, 1 passed" in first.stdout
    assert "PASSED ::wacc::check[half_wrong.py:make-float32-windows]" in first.stdout
    assert "FAILED ::wacc::check[half_wrong.py:make-float16-windows]" in first.stdout
    again = _user_pytest(tmp_path, "--lf", *args, cache=True, quiet=False)
    assert again.returncode == 1, again.stdout + again.stderr
    assert "run-last-failure: rerun previous 1 failure" in again.stdout
    assert "collected 15 items / 14 deselected / 1 selected" in again.stdout
    assert "FAILED ::wacc::check[half_wrong.py:make-float16-windows]" in again.stdout
    assert "float32-windows" not in again.stdout and "1 failed, 14 deselected" in again.stdout


_INI_FILES = {
    "pytest.ini": """\
[pytest]
wacc_impl = impl.py:make
wacc_dtype =
    float16
    bfloat16
wacc_profile = dev
wacc_seed = 1234
wacc_examples = 7
wacc_oracle = bound
wacc_device = cpu
wacc_out = divergences
""",
    "pyproject.toml": """\
[tool.pytest.ini_options]
wacc_impl = "impl.py:make"
wacc_dtype = ["float16", "bfloat16"]
wacc_profile = "dev"
wacc_seed = "1234"
wacc_examples = "7"
wacc_oracle = "bound"
wacc_device = "cpu"
wacc_out = "divergences"
""",
}


@pytest.mark.parametrize("ini_file", sorted(_INI_FILES))
def test_ini_keys_configure_the_items_and_options_override_them(
    tmp_path: Path, ini_file: str
) -> None:
    """Every option has an ini key (pytest.ini or pyproject.toml), and reaches the check as
    ``wacc check`` passes it (the seed included); a relative IMPL file or DIR of the ini file
    is relative to its directory; an option on the command line overrides its key."""
    (tmp_path / ini_file).write_text(_INI_FILES[ini_file], encoding="utf-8")
    (tmp_path / "impl.py").write_text(
        "from wacc.implementation import wacc_torch_reproducible as make\n", encoding="utf-8"
    )
    below = tmp_path / "below"  # run from a subdirectory: the paths stay the ini file's
    below.mkdir()
    from_ini = _user_pytest(tmp_path, "-k", "windows", "--wacc-allow-missing", "loss_scaler",
                            spy=True, cwd=below)  # fmt: skip
    assert from_ini.returncode == 0, from_ini.stdout + from_ini.stderr
    entries = _spied(tmp_path)
    assert [entry["dtype"] for entry in entries] == ["float16", "bfloat16"]
    for entry in entries:
        assert entry["impl"] == f"{tmp_path / 'impl.py'}:make"
        assert (entry["profile"], entry["seed"], entry["examples"]) == ("dev", 1234, 7)
        assert (entry["oracles"], entry["device"]) == (["bound", "semantics"], "cpu")
        assert entry["out"] == str(tmp_path / "divergences")

    (tmp_path / "spy.jsonl").unlink()
    overridden = _user_pytest(
        tmp_path,
        "-k", "windows", "--wacc-allow-missing", "loss_scaler", "--wacc-dtype", "float64",
        "--wacc-profile", "ci", "--wacc-seed", "99", "--wacc-examples", "3",
        "--wacc-oracle", "strict", "--wacc-out", "elsewhere",
        spy=True,
    )  # fmt: skip
    assert overridden.returncode == 0, overridden.stdout + overridden.stderr
    (entry,) = _spied(tmp_path)
    assert entry["dtype"] == "float64" and entry["out"] == "elsewhere"
    assert (entry["profile"], entry["seed"], entry["examples"]) == ("ci", 99, 3)
    assert len(entry["oracles"]) == 3


def test_the_seed_and_the_settings_are_in_the_header(tmp_path: Path) -> None:
    """The report header names what the wacc items run, the seed included, so that a run can
    be repeated: ``--wacc-seed N`` is Hypothesis' seed, as ``wacc check --seed N``."""
    args = ["--collect-only", "--wacc-impl", "tests.wacc.impls:double_unscale"]
    seeded = _user_pytest(tmp_path, *args, "--wacc-seed", "4321", quiet=False)
    assert seeded.returncode == 0, seeded.stdout + seeded.stderr
    assert "seed 4321" in seeded.stdout and "wacc: tests.wacc.impls:double_unscale" in seeded.stdout
    unseeded = _user_pytest(tmp_path, *args, quiet=False)
    assert "seed the profile's" in unseeded.stdout


def test_help_describes_every_option_and_ini_key(tmp_path: Path) -> None:
    """``pytest --help`` gives each ``--wacc-*`` option and each ``wacc_*`` ini key a help text
    (``--wacc-seed`` among them), without importing torch."""
    result = _user_pytest(tmp_path, "--help")
    assert result.returncode == 0, result.stdout + result.stderr
    names = ["impl", "dtype", "device", "oracle", "examples", "profile", "seed",
             "allow_missing", "out"]  # fmt: skip
    for name in names:
        flag = "--wacc-" + name.replace("_", "-")
        assert re.search(rf"{flag}=\S+\s+\w", result.stdout), flag
        assert re.search(rf"wacc_{name} \((string|linelist)\):\s+\w", result.stdout), name
    assert "Hypothesis seed" in result.stdout
    assert not _torch_imported(tmp_path)
