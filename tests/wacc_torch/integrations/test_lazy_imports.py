"""The integrations import their framework only when used: ``wacc_torch`` and the integration
modules import without it, and using one whose framework is missing raises one ImportError that
names the extra to install (checked in a fresh interpreter with the framework hidden, so it holds
whether or not the extra is installed here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.docs_support import ROOT

# integration module -> (framework module it needs, a use of the integration, the extra)
INTEGRATIONS = {
    "wacc_torch.integrations.lightning": ("lightning", "m.TokenWeightedAccumulation", "lightning"),
    "wacc_torch.integrations.deepspeed": ("deepspeed", "m.TokenWeightedEngine(None)", "deepspeed"),
    "wacc_torch.integrations.olmo_core": (
        "olmo_core",
        "m.TokenWeightedTransformerTrainModule",
        "olmo-core",
    ),
    "wacc_torch.integrations.keras": (
        "keras",
        "m.TokenWeightedTrainStep(steps=2, tokens=len)",
        "keras",
    ),
    "wacc_torch.integrations.torchtune": (
        "torchtune",
        "m.padded_collate_sft([{'tokens': [1], 'labels': [1]}])",
        "torchtune",
    ),
}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("module", INTEGRATIONS)
def test_importing_the_integration_imports_no_framework(module: str) -> None:
    """``import wacc_torch`` and ``import <integration>`` leave the framework unimported."""
    framework = INTEGRATIONS[module][0]
    code = (
        f"import sys, wacc_torch, {module}\n"
        f"sys.exit(any(m.split('.')[0] == {framework!r} for m in sys.modules))"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("module", INTEGRATIONS)
def test_a_missing_framework_is_one_import_error_naming_the_extra(module: str) -> None:
    """With the framework hidden (None in sys.modules), using the integration raises
    MissingFrameworkError, an ImportError whose message names ``wacc[<extra>]``."""
    framework, use, extra = INTEGRATIONS[module]
    code = (
        f"import sys\nsys.modules[{framework!r}] = None\n"
        f"import {module} as m\n"
        "from wacc_torch.integrations._framework import MissingFrameworkError\n"
        f"try:\n    {use}\nexcept MissingFrameworkError as e:\n"
        "    assert isinstance(e, ImportError); print(e)\n"
        "else:\n    sys.exit('no error')\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert f"pip install 'wacc[{extra}]'" in done.stdout and module in done.stdout
