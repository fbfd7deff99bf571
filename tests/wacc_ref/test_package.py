"""The reference package as a whole: its public names and its independence from torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import wacc_ref


def test_no_reference_module_imports_torch() -> None:
    """Importing every module of wacc_ref in a fresh process loads no torch module at all."""
    code = (
        "import importlib, pkgutil, sys, wacc_ref; "
        "[importlib.import_module(m.name) for m in "
        "pkgutil.iter_modules(wacc_ref.__path__, 'wacc_ref.')]; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_public_names_resolve() -> None:
    """Every name in wacc_ref.__all__ exists (the thin API the suite and users rely on)."""
    missing = [name for name in wacc_ref.__all__ if not hasattr(wacc_ref, name)]
    assert not missing, missing
