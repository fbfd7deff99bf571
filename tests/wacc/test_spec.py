"""``wacc.spec``: the one import rule for an IMPL and a user loop, through the real commands.

``module:attr`` imports from the working directory (as ``python -m``); ``path/file.py:attr``
loads the file with its own folder importable, so it imports its siblings.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from wacc.audit.protocol import user_adapter
from wacc.errors import UsageError
from wacc.spec import check_spec, import_target

REPO = Path(__file__).resolve().parents[2]

# A factory in a file that imports its sibling module (a user's project layout).
ACC = "from helper import make as make\n"
HELPER = "from wacc.implementation import wacc_torch_reproducible as make\n"


def _project(root: Path) -> Path:
    project = root / "project"
    project.mkdir()
    (project / "acc.py").write_text(ACC, encoding="utf-8")
    (project / "helper.py").write_text(HELPER, encoding="utf-8")
    return project


def _wacc(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing added by hand
    return subprocess.run(
        [sys.executable, "-m", "wacc", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip


QUICK = ("--dtype", "float32", "--family", "windows", "--examples", "3", "--quiet")


@pytest.mark.slow  # two `wacc check` runs (~10 s each: torch and the reference import)
def test_check_loads_a_file_that_imports_its_siblings_and_a_module_from_the_cwd(
    tmp_path: Path,
) -> None:
    """``wacc check path/acc.py:make`` from another folder imports ``acc.py``'s sibling
    ``helper``; ``wacc check acc:make`` in the project folder imports ``acc`` from there; both
    without PYTHONPATH."""
    project = _project(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    by_file = _wacc("check", str(project / "acc.py") + ":make", *QUICK, "--out",
                    str(tmp_path / "o1"), cwd=elsewhere)  # fmt: skip
    assert by_file.returncode == 0, by_file.stdout + by_file.stderr
    by_module = _wacc("check", "acc:make", *QUICK, "--out", str(tmp_path / "o2"), cwd=project)
    assert by_module.returncode == 0, by_module.stdout + by_module.stderr


def test_a_user_loop_follows_the_same_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``wacc audit``'s user loops: ``module:function`` from the working directory and
    ``path/file.py:function`` with its siblings importable, like an IMPL."""
    project = tmp_path / "loops"
    project.mkdir()
    (project / "loopfile.py").write_text("from loophelper import run\n", encoding="utf-8")
    (project / "loophelper.py").write_text(
        'def run(task):\n    """A loop for the import rule."""\n', encoding="utf-8"
    )
    (project / "loopmodule.py").write_text(
        'def run(task):\n    """Another loop."""\n', encoding="utf-8"
    )
    monkeypatch.setattr(sys, "path", list(sys.path))  # the rule edits the path: restore it
    monkeypatch.chdir(project)
    assert user_adapter("loopmodule:run").title == "Another loop."
    monkeypatch.chdir(tmp_path)
    assert (
        user_adapter(str(project / "loopfile.py") + ":run").title == "A loop for the import rule."
    )


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("nocolon", "must be 'module:attr' or 'path/file.py:attr'"),
        ("a:b:c", "must be 'module:attr'"),
        (":attr", "must be 'module:attr'"),
        ("missing_file.py:make", "file 'missing_file.py' does not exist"),
    ],
)
def test_malformed_specs_answer_without_importing(spec: str, fragment: str) -> None:
    """A malformed spec or a missing file is a UsageError naming it, before any import."""
    with pytest.raises(UsageError, match=fragment):
        check_spec(spec)


def test_import_errors_name_the_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that raises on import, a module that does not exist and a missing attribute are
    each one UsageError naming what failed."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n", encoding="utf-8")
    with pytest.raises(UsageError, match=r"importing '.*broken.py' failed: RuntimeError: boom"):
        import_target(f"{broken}:make")
    with pytest.raises(UsageError, match="cannot import module 'no_such_module_xyz'"):
        import_target("no_such_module_xyz:make")
    with pytest.raises(UsageError, match="'wacc.spec' has no attribute 'nothing'"):
        import_target("wacc.spec:nothing")


def test_two_files_each_get_their_own_sibling_of_the_same_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1/acc.py and v2/acc.py both `import parts` from their own folders: loaded one after the
    other in one process (two --impl of one report), each gets its own `parts`, never the
    first one's from sys.modules."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "parts", raising=False)  # restored (absent) afterwards
    for version in ("v1", "v2"):
        folder = tmp_path / version
        folder.mkdir()
        (folder / "parts.py").write_text(f"MARK = {version!r}\n", encoding="utf-8")
        (folder / "acc.py").write_text("from parts import MARK\n", encoding="utf-8")
    first = import_target(f"{tmp_path / 'v1' / 'acc.py'}:MARK")
    second = import_target(f"{tmp_path / 'v2' / 'acc.py'}:MARK")
    again = import_target(f"{tmp_path / 'v1' / 'acc.py'}:MARK")
    sys.modules.pop("parts", None)
    assert (first, second, again) == ("v1", "v2", "v1")


def test_a_user_files_failure_names_its_own_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An import that fails inside the user's file, and a factory that raises, are one
    UsageError naming the user's file and line (not wacc's)."""
    from wacc.judge.implementation import load_implementation

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "imports.py").write_text("\nimport no_such_sibling_xyz\n", encoding="utf-8")
    (tmp_path / "raises.py").write_text(
        "def make(dtype, scale):\n    raise ValueError('no such dtype here')\n", encoding="utf-8"
    )
    with pytest.raises(
        UsageError, match=r"No module named 'no_such_sibling_xyz' \(at imports.py:2\)"
    ):
        import_target(f"{tmp_path / 'imports.py'}:make")
    with pytest.raises(UsageError, match=r"no such dtype here \(at .*raises.py:2, in make\)"):
        load_implementation(f"{tmp_path / 'raises.py'}:make")


def test_a_syntax_error_names_the_users_file_not_the_import_machinery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that does not compile, loaded from the working directory: the one-line error
    names the file and line the compiler gives, never "<frozen importlib._bootstrap>" (a frame
    that is no file, which resolved under the working directory)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "syntax.py").write_text("def make(dtype, scale)\n    pass\n", encoding="utf-8")
    with pytest.raises(UsageError) as raised:
        import_target("syntax.py:make")
    assert str(raised.value).endswith("SyntaxError: expected ':' (syntax.py, line 1)"), raised.value
