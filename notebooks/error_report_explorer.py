# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Exploring a `wacc report`: dtype errors per implementation
#
# `python -m wacc report` judges a fixed, seeded corpus of scenarios on every shipped
# implementation and writes `divergence.csv`: one row per scenario x implementation x device,
# with the scenario's family, work and gradient dtypes, window length, weight skew and loss
# scale, the three metrics (max ulps against the bit-exact emulation, max relative error and
# max error/bound against the exact result) and the verdict of the three oracles (`pass` or
# `fail: emulation,bound,semantics`). Every failing row names a replay file under `scenarios/`.
#
# This notebook reads the report named by the environment variable `WACC_REPORT_DIR`
# (default `wacc-report`, where `wacc report` writes; a relative path is looked up in the
# working directory, then in its parent, the repository root when the notebook runs from
# `notebooks/`). If there is no report there, it makes a quick one in a temporary directory
# (`python -m wacc report --quick`, under a minute), so it always has data.

# %%
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import display

from wacc.judge.implementation import load_implementation
from wacc.judge.verdict import judge
from wacc.report.rows import IMPLEMENTATIONS
from wacc_ref.scenario import from_json

pd.set_option("display.width", 140)
pd.set_option("display.max_columns", 20)


def find_report(name: str) -> Path | None:
    """The report directory ``name`` (or ``../name`` for a relative one), if it has a CSV."""
    path = Path(name)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, Path.cwd().parent / path]
    return next((c for c in candidates if (c / "divergence.csv").is_file()), None)


requested = os.environ.get("WACC_REPORT_DIR", "wacc-report")
REPORT_DIR = find_report(requested)
if REPORT_DIR is None:
    REPORT_DIR = Path(tempfile.mkdtemp(prefix="wacc-report-"))
    print(f"no divergence.csv under {requested!r}: making a quick report in {REPORT_DIR}")
    subprocess.run(
        [sys.executable, "-m", "wacc", "report", "--quick", "--out", str(REPORT_DIR)],
        check=True,
        stdout=subprocess.DEVNULL,  # the headline table; index.md has it
    )
print(f"report: {REPORT_DIR}")

# %%
df = pd.read_csv(REPORT_DIR / "divergence.csv", keep_default_na=False)
df["passed"] = df["verdict"].eq("pass")
for metric in ("max_ulps", "max_rel_error_normal", "max_ratio"):
    df[metric] = df[metric].astype(float)  # "inf" parses as a float infinity
print(
    f"rows: {len(df)}, scenarios: {df['scenario_id'].nunique()}, "
    f"implementations: {df['implementation'].nunique()}, devices: {sorted(df['device'].unique())}"
)
display(df.head())

# %% [markdown]
# ## Filter
#
# Pandas queries answer the usual questions directly. Which float16 scenarios does the
# `S * W` shortcut (`scale_times_weight`) fail, and with what loss scales and window lengths?

# %%
fp16_shortcut = df.query("work_dtype == 'float16' and implementation == 'scale_times_weight'")
fp16_shortcut_failing = fp16_shortcut[~fp16_shortcut["passed"]]
print(f"scale_times_weight, float16: {len(fp16_shortcut_failing)} of {len(fp16_shortcut)} fail")
display(
    fp16_shortcut_failing[
        ["scenario_id", "family", "window_length", "loss_scale", "max_ratio", "verdict"]
    ]
)

# %% [markdown]
# Which oracle does each implementation fail, and how often? `emulation` alone is a different
# rounding order (bit differences within the error bound); `bound` is a result beyond the
# derived error bound; `semantics` is a wrong counter, error class, or resume.

# %%
oracles = df["verdict"].str.removeprefix("fail: ").where(~df["passed"], "").str.split(",")
for oracle in ("emulation", "bound", "semantics"):
    df[f"fails_{oracle}"] = oracles.apply(lambda names, o=oracle: o in names)
display(
    df.groupby("implementation")[["fails_emulation", "fails_bound", "fails_semantics"]]
    .sum()
    .reindex([name for name in IMPLEMENTATIONS if name in set(df["implementation"])])
)

# %% [markdown]
# ## Group: per work dtype x implementation
#
# The headline table of `index.md`, recomputed from the CSV: scenario counts, the failing
# share, and the worst of each metric.

# %%
DTYPES = ["float64", "float32", "float16", "bfloat16"]
IMPL_ORDER = [name for name in IMPLEMENTATIONS if name in set(df["implementation"])]
summary = (
    df.groupby(["work_dtype", "implementation"])
    .agg(
        scenarios=("scenario_id", "count"),
        failing=("passed", lambda passed: int((~passed).sum())),
        failing_share=("passed", lambda passed: float((~passed).mean())),
        max_ulps=("max_ulps", "max"),
        max_rel_error_normal=("max_rel_error_normal", "max"),
        max_ratio=("max_ratio", "max"),
    )
    .reindex(pd.MultiIndex.from_product([DTYPES, IMPL_ORDER]))
    .dropna(how="all")
)
display(summary)

# %%
share = summary["failing_share"].unstack().reindex(index=DTYPES, columns=IMPL_ORDER)
fig, ax = plt.subplots(figsize=(8, 3.8))
image = ax.imshow(share.to_numpy(dtype=float), cmap="Reds", vmin=0, vmax=1, aspect="auto")
ax.set_xticks(range(len(share.columns)), share.columns, rotation=20, ha="right")
ax.set_yticks(range(len(share.index)), share.index)
ax.set_xlabel("implementation")
ax.set_ylabel("work dtype")
for (row, col), value in np.ndenumerate(share.to_numpy(dtype=float)):
    if not np.isnan(value):
        ax.text(
            col,
            row,
            f"{value:.0%}",
            ha="center",
            va="center",
            color="white" if value > 0.6 else "black",
        )
fig.colorbar(image, ax=ax, label="share of scenarios failing (any oracle)")
ax.set_title("Failing share per work dtype x implementation")
fig.tight_layout()
plt.show()

# %% [markdown]
# The distance to the derived bound, per implementation: a correct implementation stays below
# 1 (the bound holds) everywhere. An infinite ratio (a NaN, an overflow or a zero where the
# true result is finite) is drawn on the top line, labelled `inf`; a finite ratio above `1e15`
# (an implementation can be off by 1e284 times its bound) on the line below it, labelled
# `≥1e15`; a ratio below `1e-6` (including 0, an exact result) on the bottom line.

# %%
CEILING, TOP, FLOOR = 1e18, 1e15, 1e-6  # where infinite, huge and tiny (or zero) ratios go
fig, ax = plt.subplots(figsize=(8, 4.2))
rng = np.random.default_rng(0)  # horizontal jitter only
for position, name in enumerate(IMPL_ORDER):
    ratios = df.loc[df["implementation"] == name, "max_ratio"].to_numpy(dtype=float)
    shown = np.where(np.isinf(ratios), CEILING, np.clip(ratios, FLOOR, TOP))
    ax.scatter(position + rng.uniform(-0.25, 0.25, len(shown)), shown, s=10, alpha=0.5)
ax.axhline(1.0, color="black", linestyle="--", label="error = bound")
ax.axhline(CEILING, color="grey", linestyle=":", label="infinite ratio")
ax.set_yscale("log")
ticks = [FLOOR, 1e-3, 1.0, 1e3, 1e6, 1e9, 1e12, TOP, CEILING]
ax.set_yticks(ticks, ["≤1e-6", "1e-3", "1", "1e3", "1e6", "1e9", "1e12", "≥1e15", "inf"])
ax.minorticks_off()
ax.set_xticks(range(len(IMPL_ORDER)), IMPL_ORDER, rotation=20, ha="right")
ax.set_ylabel("max error / bound per scenario (log scale)")
ax.set_title("Error against the exact result, relative to the derived bound")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The worst cases
#
# Failing rows ranked by error/bound, then relative error (infinite first).

# %%
failing = df[~df["passed"]]
worst = failing.sort_values(["max_ratio", "max_rel_error_normal"], ascending=False)
print(f"failing rows: {len(failing)} of {len(df)}")
COLUMNS = ["scenario_id", "implementation", "work_dtype", "grad_dtype", "loss_scale"]
display(worst[[*COLUMNS, "max_ulps", "max_rel_error_normal", "max_ratio", "verdict"]].head(10))

# %% [markdown]
# The worst *finite* miss of each failing implementation: how far beyond the bound it gets
# when it does not simply overflow.

# %%
finite = failing[np.isfinite(failing["max_ratio"])]
display(
    finite.loc[
        finite.groupby("implementation")["max_ratio"].idxmax(),
        [
            "implementation",
            "scenario_id",
            "work_dtype",
            "window_length",
            "weight_skew",
            "max_ratio",
            "verdict",
        ],
    ]
)

# %% [markdown]
# ## Replay one failing row
#
# Every failing row names its scenario file. Loading it with `wacc_ref.scenario.from_json` and
# judging it with `wacc.judge.verdict.judge` reproduces the verdict, step by step: the op and
# weight, the error class the reference and the implementation raised, and the three metrics. (The
# command line does the same: `python -m wacc replay FILE --impl FACTORY`.) The row replayed is
# a failing row of `pixparse_loop` (the `loss /= accum_steps` loop) in float16, the one with
# the shortest window (else the worst failing row of the report that this machine can run).

# %%
replayable = worst[worst["device"].eq("cpu") | torch.cuda.is_available()]  # runs here
candidates = replayable.query("implementation == 'pixparse_loop' and work_dtype == 'float16'")
row = candidates.sort_values("window_length").iloc[0] if len(candidates) else replayable.iloc[0]
scenario = from_json((REPORT_DIR / row["replay"]).read_text())
implementation = load_implementation(IMPLEMENTATIONS[row["implementation"]])
verdict = judge(implementation, scenario, device=row["device"])
print(
    f"replayed {row['replay']} on {row['implementation']} ({row['device']}): "
    f"D={scenario.work_dtype}, G={scenario.grad_dtype}, S={scenario.loss_scale!r}"
)
steps = pd.DataFrame(
    {
        "step": step.index,
        "op": step.op,
        "weight": step.weight,
        "error ref": step.expected_error or "-",
        "error impl": step.actual_error or "-",
        "max ulps": step.max_ulps,
        "max rel err": step.max_rel_error,
        "err/bound": step.max_ratio,
        "verdict": "FAIL " + ",".join(step.failed) if step.failed else "ok",
    }
    for step in verdict.steps
)
replayed = "fail: " + ",".join(verdict.failed_oracles) if verdict.failed else "pass"
print(
    f"csv verdict: {row['verdict']!r}, replayed verdict: {replayed!r}, "
    f"matches: {replayed == row['verdict']}"
)
assert replayed == row["verdict"]
display(steps)

# %%
for line in verdict.describe(limit=8):
    print(line)
