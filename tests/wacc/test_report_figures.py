"""The report's figures with many implementations of a user (``wacc report --impl`` repeated):
every one is drawn, each in a style of its own, and none makes the figure raise."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from wacc.report.figures import error_bound_figure, user_styles
from wacc.report.rows import Row
from wacc_ref import formats


def _row(name: str, dtype: str, ratio: float) -> Row:
    return Row(
        scenario_id="s", family="windows", implementation=name, device="cpu", work_dtype=dtype,
        grad_dtype=dtype, window_length=3, weight_skew=1.0, loss_scale=1.0, max_ulps=0.0,
        max_rel_error=0.0, max_ratio=ratio, verdict="pass", replay="",
    )  # fmt: skip


def test_every_user_gets_a_style_of_its_own_up_to_32() -> None:
    """The first 32 users have 32 distinct (colour, marker) pairs; more reuse them in order."""
    users = [f"mod:impl{i}" for i in range(40)]
    styles = user_styles(users)
    assert len(set(styles[u] for u in users[:32])) == 32
    assert styles[users[32]] == styles[users[0]]


def test_the_error_bound_figure_draws_thirty_users(tmp_path: Path) -> None:
    """30 --impl (a batch of planted bugs) draw a figure (once a KeyError at the 17th user,
    after the whole corpus had been judged: exit 3)."""
    users = [f"mod:impl{i}" for i in range(30)]
    rows = [
        _row(name, dtype, 0.5 if name.startswith("wacc") else 2.0)
        for name in ("wacc_torch", *users)
        for dtype in formats.WORK_DTYPES
    ]
    path = error_bound_figure(rows, tmp_path / "figure.png", users=users)
    with Image.open(path) as image:
        assert image.size[0] > 100 and image.size[1] > 100
