"""Figures of ``tltsim compare`` (PNG, matplotlib Agg): simulated vs measured.

    python -c "import pandas as pd; from analysis.fidelity_plots import parity_plot; \\
        parity_plot(pd.read_csv('results/compare-x/steps.csv'), 'parity.png')"

* ``parity_plot``: one point per (trace, step), measured seconds on x, simulated on y, rollout
  (circles) and training (squares, when measured), coloured by policy, with the y = x line and
  a +-5% band (the torch-backend target of issue #7).
* ``steps_plot``: per step, measured (solid) and simulated (dashed) rollout seconds per policy;
  below, the measured and simulated speedup over the baseline when one was compared.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis import step_axis  # noqa: E402

POLICY_COLORS = {"nospec": "#1f77b4", "static": "#ff7f0e", "tlt": "#2ca02c"}
BAND = 0.05  # issue #7's torch target: per-step rollout error <= 5%


def _color(policy: str) -> str:
    return POLICY_COLORS.get(policy, "#7f7f7f")


def _save(fig: plt.Figure, path: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def parity_plot(steps: pd.DataFrame, path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    values = []
    for policy, f in steps.groupby("policy", sort=False):
        ax.scatter(
            f.measured_rollout_s, f.sim_rollout_s, color=_color(policy), label=f"{policy} rollout"
        )
        values += [*f.measured_rollout_s, *f.sim_rollout_s]
        trained = f.dropna(subset=["measured_train_s"])
        if not trained.empty:
            ax.scatter(
                trained.measured_train_s,
                trained.sim_train_s,
                color=_color(policy),
                marker="s",
                facecolors="none",
                label=f"{policy} train",
            )
            values += [*trained.measured_train_s, *trained.sim_train_s]
    lo, hi = min(values) * 0.8, max(values) * 1.25
    line = np.geomspace(lo, hi, 50)
    ax.plot(line, line, color="black", lw=1, label="simulated = measured")
    ax.fill_between(
        line, line * (1 - BAND), line * (1 + BAND), color="black", alpha=0.1, label="+-5%"
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured seconds")
    ax.set_ylabel("simulated seconds")
    ax.set_title("Simulated vs measured, per step")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def steps_plot(steps: pd.DataFrame, ups: pd.DataFrame, path: str | Path) -> Path:
    num_rows = 2 if not ups.empty else 1
    fig, axes = plt.subplots(num_rows, 1, figsize=(7.5, 3.6 * num_rows), squeeze=False)
    ax = axes[0, 0]
    for policy, f in steps.groupby("policy", sort=False):
        ax.plot(
            f.step, f.measured_rollout_s, "o-", color=_color(policy), label=f"{policy} measured"
        )
        ax.plot(f.step, f.sim_rollout_s, "x--", color=_color(policy), label=f"{policy} simulated")
    step_axis(ax, steps.step)
    ax.set_ylabel("rollout seconds")
    ax.set_title("Rollout time per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if not ups.empty:
        ax = axes[1, 0]
        for policy, f in ups.groupby("policy", sort=False):
            ax.plot(
                f.step, f.measured_speedup, "o-", color=_color(policy), label=f"{policy} measured"
            )
            ax.plot(f.step, f.sim_speedup, "x--", color=_color(policy), label=f"{policy} simulated")
        ax.axhline(1.0, color="black", lw=0.8)
        step_axis(ax, ups.step)
        ax.set_ylabel("rollout speedup over baseline")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)
