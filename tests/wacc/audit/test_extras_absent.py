"""A framework that is not installed is a "not installed" row, never a crash (checked with the
framework hidden, so it holds whether or not the extra is installed here)."""

from __future__ import annotations

import os
import sys

import pytest

from wacc.audit.adapters import ADAPTERS
from wacc.audit.runner import run_audit
from wacc.audit.windows import build_window


@pytest.mark.parametrize(
    "loop", ["lightning", "lightning+wacc", "lightning-manual", "lightning-manual+wacc"]
)
def test_lightning_absent_is_a_not_installed_row(
    monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """With `lightning` unimportable (None in sys.modules: ModuleNotFoundError), the adapter
    reports "not installed" and the audit gives a row per window saying so, next to a loop that
    runs."""
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    adapter = ADAPTERS[loop]
    assert adapter.unavailable() == "not installed"
    result = run_audit([adapter, ADAPTERS["nanogpt"]], [build_window("equal")])
    assert [c.status for c in result.cells] == ["not installed", "ok"]
    assert result.facts[0].status == "not installed"


@pytest.mark.parametrize("loop", ["keras", "keras+wacc"])
def test_keras_absent_is_a_not_installed_row(monkeypatch: pytest.MonkeyPatch, loop: str) -> None:
    """With `keras` unimportable (None in sys.modules: its spec is not found), the Keras adapter
    reports "not installed" without trying an import, and the audit gives the row."""
    monkeypatch.setitem(sys.modules, "keras", None)
    adapter = ADAPTERS[loop]
    assert adapter.unavailable() == "not installed"
    result = run_audit([adapter], [build_window("equal")])
    assert [c.status for c in result.cells] == ["not installed"]


@pytest.mark.parametrize("loop", ["deepspeed", "deepspeed+wacc"])
def test_deepspeed_absent_is_a_quiet_not_installed_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], loop: str
) -> None:
    """With `deepspeed` unimportable, its adapter (whose import check runs on DeepSpeed's CPU
    accelerator) reports "not installed", prints nothing, leaves DS_ACCELERATOR as it was, and
    the audit gives a row per window saying so."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    adapter = ADAPTERS[loop]
    assert adapter.unavailable() == "not installed"
    assert "DS_ACCELERATOR" not in os.environ
    result = run_audit([adapter, ADAPTERS["nanogpt"]], [build_window("equal")])
    assert [c.status for c in result.cells] == ["not installed", "ok"]
    assert result.facts[0].status == "not installed"
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("loop", ["peft-lora-gpt2", "trl-sft", "trl-sft-packing"])
def test_hf_extras_absent_are_not_installed_rows(
    monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """With `peft` / `trl` unimportable, the PEFT and TRL adapters report "not installed"."""
    monkeypatch.setitem(sys.modules, "peft", None)
    monkeypatch.setitem(sys.modules, "trl", None)
    assert ADAPTERS[loop].unavailable() == "not installed"


@pytest.mark.parametrize("loop", ["torchtune", "torchtitan"])
def test_torchtune_and_torchtitan_absent_are_not_installed_rows(
    monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """With the package unimportable, torchtune's and torchtitan's adapters give a "not
    installed" row per window next to a loop that runs."""
    monkeypatch.setitem(sys.modules, loop, None)
    adapter = ADAPTERS[loop]
    assert adapter.unavailable() == "not installed"
    result = run_audit([adapter, ADAPTERS["nanogpt"]], [build_window("equal")])
    assert [c.status for c in result.cells] == ["not installed", "ok"]


def test_torchtune_next_to_a_torchao_without_nf4tensor_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchtune 0.6.1 next to a torchao without ``torchao.dtypes.nf4tensor`` (0.16 and later):
    the row names the module its import misses."""
    pytest.importorskip("torchtune", reason="torchtune not installed")
    for name in [n for n in sys.modules if n.startswith("torchtune")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao.dtypes.nf4tensor", None)
    status = ADAPTERS["torchtune"].unavailable()
    assert status == "not importable: ModuleNotFoundError: torchao.dtypes.nf4tensor"
