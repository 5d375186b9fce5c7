"""Figures of a ``tltsim sweep`` output directory (PNG, matplotlib Agg).

    python -c "from analysis.sweep_plots import draw_all; draw_all('results/sweep-x')"
    (or: tltsim report results/sweep-x)

Reads ``sweep.parquet`` and ``summary.json``. Speedup vs NoSpec (mean over seeds, other settings
averaged) against the settings the sweep varied: bars when none varies, lines (one per policy)
for one setting, a heat map per policy over the first two otherwise (cells averaged over a third
and later ones, as its titles say). The highest mean is marked (over the settings averaged:
the sweep's best single point is summary.json's ``best``). A numeric setting with more
than ``MAX_CATEGORIES`` values (a ``[random]`` section draws a new one per point) is drawn as a
scatter of the points instead: as heat-map categories it gave a grid of ~100 x 150 mostly empty
cells with unreadable tick labels, and its lines zigzagged between single draws.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis import ReportError
from analysis.replay_plots import POLICY_COLORS, _save, fresh_plots_dir  # noqa: E402
from tltsim.sim.sweep import setting_matters  # noqa: E402

MAX_CATEGORIES = 12  # distinct values of a setting drawn as categories (cells, line points)


def _speculating(table: pd.DataFrame) -> pd.DataFrame:
    return table[table.policy != "nospec"]


def _is_continuous(table: pd.DataFrame, setting: str) -> bool:
    """A numeric setting with more values than categories can show (random draws)."""
    column = _speculating(table)[setting].dropna()
    return pd.api.types.is_numeric_dtype(column) and column.nunique() > MAX_CATEGORIES


def speedup_bars(table: pd.DataFrame, path: Path) -> Path:
    rows = (
        _speculating(table).groupby("policy")["speedup_vs_nospec"].agg(["mean", "std"]).fillna(0.0)
    )
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = [POLICY_COLORS.get(p, "#1f77b4") for p in rows.index]
    ax.bar(rows.index, rows["mean"], yerr=rows["std"], color=colors, capsize=4)
    best = rows["mean"].idxmax()
    ax.annotate(
        "highest mean",
        (list(rows.index).index(best), rows.loc[best, "mean"]),
        ha="center",
        va="bottom",
        xytext=(0, 8),
        textcoords="offset points",
    )
    ax.axhline(1.0, color="black", lw=1, ls=":")
    ax.set_ylabel("step-time speedup vs NoSpec")
    # every point of a policy: its seeds and whatever settings the sweep varied
    ax.set_title("Sweep: speedup per policy\n(mean and std over seeds and settings)")
    return _save(fig, path)


def speedup_lines(table: pd.DataFrame, setting: str, path: Path) -> Path:
    spec = _speculating(table)
    is_scatter = _is_continuous(table, setting)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    best_val, best_at = -np.inf, None
    for policy in dict.fromkeys(spec.policy):
        rows = (
            spec[spec.policy == policy]
            .groupby(setting)["speedup_vs_nospec"]
            .agg(["mean", "std"])
            .fillna(0.0)
        )
        if rows.empty:  # no point of this policy sets it (a grid + random sweep): no line
            continue
        x = rows.index.to_numpy()
        if pd.api.types.is_bool_dtype(rows.index):  # on/off, not a 0..1 axis ticked at 0.2
            x = np.where(x, "on", "off")
        matters = setting_matters(policy, setting)
        label = policy if matters else f"{policy} (does not read {setting})"
        if is_scatter:  # one point per drawn value: no line joins unrelated draws
            ax.plot(x, rows["mean"], marker="o", ms=3, ls="none", alpha=0.7,
                    color=POLICY_COLORS.get(policy), label=label)  # fmt: skip
        else:
            ax.errorbar(x, rows["mean"], yerr=rows["std"], marker="o", capsize=3,
                        color=POLICY_COLORS.get(policy), ls="-" if matters else ":",
                        label=label)  # fmt: skip
        if not matters:  # its flat line is no best value of the setting (the summary's rule)
            continue
        i = int(np.argmax(rows["mean"].to_numpy()))
        if rows["mean"].iloc[i] > best_val:
            best_val, best_at = rows["mean"].iloc[i], (x[i], policy)
    if best_at is not None:
        ax.plot(
            [best_at[0]],
            [best_val],
            marker="*",
            ms=18,
            color="gold",
            mec="black",
            ls="none",
            # a string setting (static_strategy, preset) has no 'g' format: the report failed;
            # the mean over the other settings: not the sweep's best point (summary.json's)
            label=f"highest mean: {best_at[1]}, {setting}={_shown(best_at[0])} ({best_val:.2f}x)",
        )
    ax.axhline(1.0, color="black", lw=1, ls=":")
    ax.set_xlabel(setting)
    ax.set_ylabel("step-time speedup vs NoSpec")
    over = "mean over seeds and the other settings" + ("" if is_scatter else ", and std")
    ax.set_title(f"Sweep: speedup vs {setting}\n({over})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def speedup_surface(
    table: pd.DataFrame, x: str, y: str, path: Path, averaged: tuple[str, ...] = ()
) -> Path | None:
    """A heat map per policy over settings ``x`` and ``y``: each cell the mean over seeds and
    over the ``averaged`` settings the sweep also varied (said in the titles, so that a cell is
    not read as one setting's result). Only points that set both settings count: a sweep whose
    grid sets one and whose random draws set the other has none (None: no heat map), and a
    policy with none gets no panel (its empty grid failed the whole report)."""
    spec = _speculating(table)
    over = ", ".join(("seeds", *averaged))
    if _is_continuous(table, x) or _is_continuous(table, y):
        return _speedup_scatter(spec, x, y, path, over)
    grids = {}
    for p in dict.fromkeys(spec.policy):
        grid = spec[spec.policy == p].pivot_table(
            index=y, columns=x, values="speedup_vs_nospec", aggfunc="mean"
        )
        if grid.size and np.isfinite(grid.to_numpy(dtype=float)).any():
            grids[p] = grid
    if not grids:
        return None
    policies = list(grids)
    fig, axes = plt.subplots(1, len(policies), figsize=(5.5 * len(policies), 4.5), squeeze=False)
    vmin = min(float(np.nanmin(g.to_numpy())) for g in grids.values())
    vmax = max(float(np.nanmax(g.to_numpy())) for g in grids.values())
    best_policy = max(grids, key=lambda p: np.nanmax(grids[p].to_numpy()))
    for ax, policy in zip(axes[0], policies, strict=True):
        grid = grids[policy]
        im = ax.imshow(
            grid.to_numpy(), origin="lower", aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax
        )
        ax.set_xticks(
            range(grid.shape[1]),
            [f"{v:g}" if isinstance(v, float) else str(v) for v in grid.columns],
        )
        ax.set_yticks(
            range(grid.shape[0]), [f"{v:g}" if isinstance(v, float) else str(v) for v in grid.index]
        )
        for (i, j), value in np.ndenumerate(grid.to_numpy()):
            if np.isfinite(value):  # dark text on viridis' bright (yellow) end, light elsewhere
                bright = vmax > vmin and (value - vmin) / (vmax - vmin) > 0.6
                color = "black" if bright else "white"
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", color=color, fontsize=8)
        if policy == best_policy:
            i, j = np.unravel_index(np.nanargmax(grid.to_numpy()), grid.shape)
            best = f"highest mean over {', '.join(averaged)}" if averaged else "highest"
            # in the cell's corner: a star on the cell hid its value
            ax.plot([j - 0.32], [i + 0.3], marker="*", ms=14, color="red", mec="white",
                    ls="none", label=best)  # fmt: skip
            # below the axes: inside, it covered the top-right cell
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize=8)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(f"{policy}: speedup vs NoSpec\n(mean over {over})")
        fig.colorbar(im, ax=ax, label="speedup (x)")
    return _save(fig, path)


def _speedup_scatter(spec: pd.DataFrame, x: str, y: str, path: Path, over: str) -> Path | None:
    """``speedup_surface`` for settings with many values: each (x, y) a point coloured by its
    speedup (mean over ``over``), one panel per policy."""
    points = {
        p: spec[spec.policy == p].groupby([x, y])["speedup_vs_nospec"].mean().dropna()
        for p in dict.fromkeys(spec.policy)
    }
    points = {p: v for p, v in points.items() if len(v)}
    if not points:
        return None
    fig, axes = plt.subplots(1, len(points), figsize=(5.5 * len(points), 4.5), squeeze=False)
    vmin = min(float(v.min()) for v in points.values())
    vmax = max(float(v.max()) for v in points.values())
    best_policy = max(points, key=lambda p: points[p].max())
    for ax, (policy, values) in zip(axes[0], points.items(), strict=True):
        xs = values.index.get_level_values(0).to_numpy()
        ys = values.index.get_level_values(1).to_numpy()
        dots = ax.scatter(xs, ys, c=values.to_numpy(), cmap="viridis", vmin=vmin, vmax=vmax, s=18)
        if policy == best_policy:
            at = values.idxmax()
            ax.plot([at[0]], [at[1]], marker="*", ms=20, color="gold", mec="black", ls="none",
                    label=f"best ({values.max():.2f}x)")  # fmt: skip
            ax.legend(loc="upper right", fontsize=8)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        shown = textwrap.fill(f"(each point: mean over {over})", 48)  # a long list was clipped
        ax.set_title(f"{policy}: speedup vs NoSpec\n{shown}", fontsize=10)
        ax.grid(alpha=0.3)
        fig.colorbar(dots, ax=ax, label="speedup (x)")
    return _save(fig, path)


def draw_all(out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    plots = fresh_plots_dir(out_dir)
    table = pd.read_parquet(out_dir / "sweep.parquet")
    varying = json.loads((out_dir / "summary.json").read_text())["varying"]
    if not len(_speculating(table)):
        raise ReportError(
            f"{out_dir}: the sweep has no speculating policy, nothing to compare with NoSpec"
        )
    written = [speedup_bars(table, plots / "speedup_per_policy.png")]
    if len(varying) == 1:
        written.append(speedup_lines(table, varying[0], plots / f"speedup_vs_{varying[0]}.png"))
    elif len(varying) >= 2:
        surface = speedup_surface(
            table,
            varying[0],
            varying[1],
            plots / f"speedup_{varying[0]}_x_{varying[1]}.png",
            tuple(varying[2:]),
        )
        written += [surface] if surface is not None else []
        for setting in varying:
            written.append(speedup_lines(table, setting, plots / f"speedup_vs_{setting}.png"))
    return written


def _shown(value) -> str:
    return format(value, "g") if isinstance(value, int | float) else str(value)
