"""The wheel, installed in a fresh virtual environment, works outside the repository: what the
README's CI recipe for another project relies on (the frozen corpus is package data, the
commands find nothing of this checkout)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "wacc", "wacc_ref", "wacc_torch")


def _run(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None,
         timeout: int = 900) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv holding only the wheel built from the sources (torch and the other
    dependencies reached through a .pth line to this environment's site-packages, which is not
    a site directory there, so this checkout's editable install is not seen)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in SOURCES:  # a copy: the build writes build/ and *.egg-info where it runs
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(origin, source / name)
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", root / "dist",
                 source, cwd=root)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (root / "dist").glob("wacc-*.whl")
    venv = root / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=root)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    put = _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
               wheel, cwd=root)  # fmt: skip
    assert put.returncode == 0, put.stdout + put.stderr
    purelib = sysconfig.get_paths()["purelib"]
    target = next((venv / "lib").glob("python3*/site-packages"))
    (target / "dependencies.pth").write_text(f"{purelib}\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    work = root / "elsewhere"
    work.mkdir()
    return work, env


@pytest.mark.slow  # builds a wheel, then a quick report and a shard of the gate (~2 min)
def test_the_installed_wheel_reports_and_gates_from_outside_the_repository(
    installed: tuple[Path, dict[str, str]],
) -> None:
    """``wacc`` from the wheel imports itself from the venv, not from this checkout; ``wacc
    report --quick`` writes a report and ``wacc gate --impl`` judges a shard of the frozen corpus
    (package data) in a folder that holds nothing of the repository; without a baseline the
    gate says where it looked."""
    work, env = installed
    where = _run("python", "-c", "import wacc, wacc_ref; print(wacc.__file__, wacc.__version__)",
                 cwd=work, env=env)  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert "/venv/lib/" in where.stdout and str(REPO) not in where.stdout, where.stdout
    report = _run("wacc", "report", "--quick", "--quiet", "--out", work / "report", cwd=work,
                  env=env)  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    assert (work / "report" / "index.md").is_file() and (
        work / "report" / "divergence.csv"
    ).is_file()
    impl = "wacc.implementation:wacc_torch_reproducible"
    shard = _run("wacc", "gate", "--quiet", "--impl", impl, "--shard", "7/40", "--results",
                 work / "shard.json", cwd=work, env=env)  # fmt: skip
    assert shard.returncode == 0, shard.stdout + shard.stderr
    assert (work / "shard.json").is_file()
    missing = _run("wacc", "gate", "--quiet", "--impl", impl, cwd=work, env=env)
    assert missing.returncode == 2 and "no gate file at 'reports/baseline.json'" in missing.stderr
