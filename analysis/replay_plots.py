"""Figures of a ``tltsim replay`` output directory (PNG, matplotlib Agg).

    python -c "from analysis.replay_plots import draw_all; draw_all('results/replay-x')"
    (or: tltsim report results/replay-x)

Reads ``steps.csv``, ``timeline.parquet``, ``responses.parquet`` and ``summary.json`` (speedups
and their intervals); writes to ``DIR/plots/``: length_cdf, gantt_slowest_step,
active_requests, step_breakdown, step_time_per_policy (with each policy's speedup and its
interval as an error bar), accept_length.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis import ReportError, step_axis
from tltsim.sim.intervals import described_sources

PHASE_COLORS = {
    "prefill": "#8c564b",
    "decode": "#1f77b4",
    "reprefill": "#9467bd",
    "sd": "#2ca02c",
    "spot_train": "#ff7f0e",
    "idle": "#d9d9d9",
    "checkpoint": "#bcbd22",
    "train": "#7f7f7f",
}
# every policy its own (tltbase had none: matplotlib's first default, NoSpec's blue)
POLICY_COLORS = {"nospec": "#1f77b4", "static": "#ff7f0e", "tlt": "#2ca02c", "tltbase": "#d62728"}


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    # tight: a colour bar's label or a legend below the axes was cut at the figure's edge
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def length_cdf(responses: pd.DataFrame, path: Path) -> Path:
    """Response-length CDF on a log x axis, median / p99 / max marked."""
    lengths = np.sort(responses["response_tokens"].to_numpy())
    cdf = np.arange(1, lengths.size + 1) / lengths.size
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(lengths, cdf, color="#1f77b4", lw=2, label=f"{lengths.size:,} responses")
    marks = {"median": np.median(lengths), "p99": np.quantile(lengths, 0.99), "max": lengths.max()}
    for (name, value), color in zip(marks.items(), ("#2ca02c", "#ff7f0e", "#d62728"), strict=True):
        ax.axvline(value, color=color, ls="--", lw=1.2, label=f"{name}: {value:,.0f} tokens")
    ax.set_xscale("log")
    ax.set_xlabel("response length (tokens, log scale)")
    ax.set_ylabel("fraction of responses")
    ax.set_title("Response-length CDF: the long tail")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower right")
    return _save(fig, path)


def slowest_step(steps: pd.DataFrame) -> int:
    """The step with the longest rollout under the first policy listed (NoSpec when present)."""
    first = "nospec" if (steps.policy == "nospec").any() else steps.policy.iloc[0]
    rows = steps[steps.policy == first]
    return int(rows.loc[rows.rollout_s.idxmax(), "step"])


def merge_phases(seg: pd.DataFrame) -> pd.DataFrame:
    """Join consecutive segments of one instance in the same phase (one bar per stretch)."""
    seg = seg.sort_values(["instance", "start_s"])
    inst, phase = seg.instance.to_numpy(), seg.phase.to_numpy()
    start, end = seg.start_s.to_numpy(), seg.end_s.to_numpy()
    new = np.ones(len(seg), dtype=bool)
    new[1:] = (inst[1:] != inst[:-1]) | (phase[1:] != phase[:-1]) | (start[1:] > end[:-1] + 1e-9)
    group = np.cumsum(new) - 1
    ends = np.zeros(group[-1] + 1 if len(group) else 0)
    np.maximum.at(ends, group, end)
    return pd.DataFrame(
        {"instance": inst[new], "phase": phase[new], "start_s": start[new], "end_s": ends}
    )


def gantt(timeline: pd.DataFrame, step: int, path: Path) -> Path:
    """Per-instance busy/idle bars of one step, one panel per policy."""
    policies = list(dict.fromkeys(timeline.policy))
    rows = timeline[timeline.step == step]
    num_instances = int(rows.instance.max()) + 1
    fig, axes = plt.subplots(
        len(policies),
        1,
        figsize=(10, 1.2 + min(8, 0.12 * num_instances + 1.2) * len(policies)),
        squeeze=False,
        sharex=True,
    )
    for ax, policy in zip(axes[:, 0], policies, strict=True):
        seg = merge_phases(rows[rows.policy == policy])
        for phase, color in PHASE_COLORS.items():
            part = seg[seg.phase == phase]
            if len(part):
                ax.barh(
                    part.instance,
                    part.end_s - part.start_s,
                    left=part.start_s,
                    height=0.8,
                    color=color,
                    label=phase,
                    linewidth=0,
                )
        ax.set_ylabel("instance")
        ax.set_title(f"{policy}: step {step}")
        ax.set_ylim(-0.5, num_instances - 0.5)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds since the step's rollout began")
    handles, labels = {}, []
    for ax in axes[:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    labels = list(handles)
    fig.legend(
        [handles[lab] for lab in labels], labels, loc="lower center", ncol=len(labels), fontsize=8
    )
    fig.suptitle(f"Per-instance timeline of the slowest step (step {step})")
    # room at the top for the suptitle (it overlapped the first panel's title)
    fig.tight_layout(rect=(0, 0.04, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def active_over_time(seg: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Total active requests over the cluster as a step function of time (busy segments)."""
    busy = seg[seg.phase.isin(["prefill", "decode", "sd", "reprefill"])]
    times = np.concatenate([busy.start_s.to_numpy(), busy.end_s.to_numpy()])
    deltas = np.concatenate([busy.num_active.to_numpy(), -busy.num_active.to_numpy()])
    times = np.round(times, 9)  # a segment's end and the next one's start may differ by rounding
    order = np.argsort(times, kind="stable")
    times, level = times[order], np.cumsum(deltas[order])
    last = np.append(times[1:] != times[:-1], True)  # the level after all changes at one time
    return times[last], level[last]


def active_requests(timeline: pd.DataFrame, step: int, path: Path) -> Path:
    """Active requests over time in one step, per policy, with the SD switch marked."""
    rows = timeline[timeline.step == step]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for policy in dict.fromkeys(rows.policy):
        seg = rows[rows.policy == policy]
        t, active = active_over_time(seg)
        color = POLICY_COLORS.get(policy)
        ax.step(t, active, where="post", color=color, lw=1.6, label=policy)
        switch = seg[seg.phase.isin(["reprefill", "sd"])].groupby("instance").start_s.min()
        if len(switch):
            ax.axvline(
                switch.min(),
                color=color,
                ls="--",
                lw=1,
                label=f"{policy}: SD on (first instance, {switch.min():.1f} s)",
            )
            ax.axvline(
                switch.median(),
                color=color,
                ls=":",
                lw=1,
                label=f"{policy}: SD on (median instance, {switch.median():.1f} s)",
            )
    ax.set_yscale("symlog", linthresh=10)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since the step's rollout began")
    ax.set_ylabel("active requests, all instances (linear below 10, log above)")
    ax.set_title(f"Active requests over time, step {step}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def step_breakdown(steps: pd.DataFrame, path: Path) -> Path:
    """Stacked step time per step: rollout until the first instance idles, the rest of the
    rollout (the tail), checkpoint and actor update; one panel per policy."""
    policies = list(dict.fromkeys(steps.policy))
    fig, axes = plt.subplots(
        len(policies),
        1,
        figsize=(9, 2.6 * len(policies) + 0.6),
        squeeze=False,
        sharex=True,
        sharey=True,
    )
    for ax, policy in zip(axes[:, 0], policies, strict=True):
        s = steps[steps.policy == policy]
        parts = {
            "rollout, all instances busy": s.first_idle_s,
            "rollout, waiting for the tail": s.rollout_s - s.first_idle_s,
            "drafter checkpoint": s.checkpoint_s,
            "actor update (training)": s.train_s,
        }
        bottom = np.zeros(len(s))
        for (label, values), color in zip(
            parts.items(), ("#1f77b4", "#d62728", "#bcbd22", "#7f7f7f"), strict=True
        ):
            ax.bar(s.step, values, bottom=bottom, color=color, label=label, width=0.8)
            bottom += values.to_numpy()
        ax.set_ylabel("seconds")
        ax.set_title(f"{policy}: step-time breakdown")
    step_axis(axes[-1, 0], steps.step)
    axes[0, 0].legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def step_time_per_policy(steps: pd.DataFrame, path: Path, summary: dict | None = None) -> Path:
    """Step time per RL step of each policy with the ideal rollout; beside it, when ``summary``
    (``summary.json``) has speedups vs NoSpec, each policy's speedup with its interval as an
    error bar."""
    policies = summary["policies"] if summary else []
    has_speedup = any("speedup_vs_nospec" in row for row in policies)
    if has_speedup:
        fig, (ax, right) = plt.subplots(
            1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]}
        )
    else:
        fig, ax = plt.subplots(figsize=(9, 4.5))
    for policy in dict.fromkeys(steps.policy):
        s = steps[steps.policy == policy]
        ax.plot(
            s.step,
            s.step_s,
            marker="o",
            ms=3,
            color=POLICY_COLORS.get(policy),
            label=f"{policy} (mean {s.step_s.mean():,.1f} s)",
        )
    ideal = steps.groupby("step").ideal_rollout_s.min()
    ax.plot(
        ideal.index,
        ideal.values,
        color="black",
        ls=":",
        marker="_",  # (a run of one step drew no line: the marker shows it)
        label="ideal rollout (lower bound: max(work bound, critical path))",
    )
    step_axis(ax, steps.step)
    ax.set_ylabel("step time (seconds)")
    ax.set_title("Step time per policy")
    ax.grid(alpha=0.3)
    # below the axes: inside, it covered the slowest policy's curve
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    if has_speedup:
        speedup_bars(right, policies, summary.get("speedup_interval"))
    return _save(fig, path)


def speedup_bars(ax: plt.Axes, policies: list[dict], interval: dict | None) -> None:
    """Each policy's mean step-time speedup vs NoSpec, its interval as an error bar."""
    rows = [r for r in policies if "speedup_vs_nospec" in r]
    x = np.arange(len(rows))
    values = np.array([r["speedup_vs_nospec"] for r in rows])
    low = np.array([r.get("speedup_vs_nospec_low", r["speedup_vs_nospec"]) for r in rows])
    high = np.array([r.get("speedup_vs_nospec_high", r["speedup_vs_nospec"]) for r in rows])
    ax.bar(x, values, color=[POLICY_COLORS.get(r["policy"], "#7f7f7f") for r in rows])
    ax.errorbar(
        x, values, yerr=[values - low, high - values], fmt="none", ecolor="black", capsize=4
    )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, [r["policy"] for r in rows])
    ax.set_ylabel("step-time speedup vs NoSpec")
    sources = ",\n".join(described_sources(interval)) or "nothing (one simulation)"
    ax.set_title(f"Speedup vs NoSpec, min-max over\n{sources}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def accept_length(steps: pd.DataFrame, path: Path, learned: set[str] | None = None) -> Path:
    """Mean accept length per step of each speculating policy; on the right, the learned
    (EAGLE) drafter's acceptance of the policies in ``learned`` that draft with it (None:
    all but tltbase; tltbase's history drafter is not that drafter)."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    right = ax.twinx()
    # the drafter's curves of static and tlt nearly coincide (one drafter, trained on what
    # each rollout generated): wider and dashed under narrower and dotted, both stay visible
    styles = iter([("--", 3.0), (":", 2.0), ("-.", 1.2), ("-", 0.8)] * 4)
    for policy in dict.fromkeys(steps.policy):
        s = steps[steps.policy == policy]
        if s.sd_verifies.sum() == 0:
            continue
        color = POLICY_COLORS.get(policy)
        ax.plot(
            s.step,
            s.mean_accept_len,
            marker="o",
            ms=3,
            color=color,
            label=f"{policy}: mean accept length",
        )
        if policy in (learned if learned is not None else set(POLICY_COLORS) - {"tltbase"}):
            ls, lw = next(styles)
            right.plot(s.step, s.drafter_acceptance, color=color, ls=ls, lw=lw, marker="x", ms=3,
                       label=f"{policy}: EAGLE drafter per-token acceptance")  # fmt: skip
    step_axis(ax, steps.step)
    ax.set_ylabel("tokens per request per verify (incl. bonus)")
    right.set_ylabel("per-token acceptance")
    right.set_ylim(0, 1)
    ax.set_title("Accept length over RL steps")
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower left")
    return _save(fig, path)


def draw_all(out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    plots = fresh_plots_dir(out_dir)
    steps = pd.read_csv(out_dir / "steps.csv")
    missing = {"policy", "step", "sd_verifies"} - set(steps.columns)
    if missing:
        raise ReportError(
            f"{out_dir / 'steps.csv'}: not tltsim replay's (no column {min(missing)!r})"
        )
    responses = pd.read_parquet(out_dir / "responses.parquet")
    timeline = pd.read_parquet(out_dir / "timeline.parquet")
    written = [
        length_cdf(responses, plots / "length_cdf.png"),
        step_breakdown(steps, plots / "step_breakdown.png"),
    ]
    if len(timeline):
        step = slowest_step(steps)
        written.append(gantt(timeline, step, plots / "gantt_slowest_step.png"))
        written.append(active_requests(timeline, step, plots / "active_requests.png"))
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    written.append(step_time_per_policy(steps, plots / "step_time_per_policy.png", summary))
    if steps.sd_verifies.sum() > 0:
        learned = _learned_drafter_policies(out_dir / "config.json")
        written.append(accept_length(steps, plots / "accept_length.png", learned))
    return written


def fresh_plots_dir(out_dir: Path) -> Path:
    """``out_dir/plots``, without the figures an earlier report drew there (a rerun into the
    same --out with fewer policies left figures of the old results beside the new ones)."""
    plots = out_dir / "plots"
    plots.mkdir(exist_ok=True)
    for old in plots.glob("*.png"):
        old.unlink()
    return plots


def _learned_drafter_policies(config_path: Path) -> set[str] | None:
    """The replayed policies that draft with the learned (EAGLE) drafter, from the replay's
    config.json (None: not readable; accept_length's default)."""
    try:
        config = json.loads(config_path.read_text())
        strategy = str(config["replay"].get("static_strategy") or "")
        drafters = config["tlt"].get("drafters") or ["eagle"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    learned = set()
    if not strategy.startswith("history:"):
        learned.add("static")
    if "eagle" in drafters:
        learned.add("tlt")
    return learned
