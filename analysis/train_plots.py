"""Figures of ``tltrun train`` runs (each run directory holds log.jsonl and config.json):

* ``reward.png``: mean reward per RL step, one line per run, and dashed the held-out
  evaluation's mean reward where the run evaluated (``--eval-every``);
* ``accept_len.png``: mean accept length per step (tokens per verify incl. the bonus token),
  one line per run whose rollouts used SD; a spot-trained and a frozen-drafter run of the same
  policy side by side show what spot training buys once the policy moves;
* ``step_time.png``: stacked mean seconds per step per run: rollout, actor update, and the rest
  (syncs and the rest of the step); ``step_s`` ends before the step's record and
  checkpoint are written, so neither is in it (a checkpoint step at 7B takes longer than the
  bar). Spot drafter training happens inside the rollout's idle time, so it is drawn as a
  hatched bar beside, not stacked.

Run: ``tltrun report RUN_DIR [RUN_DIR ...] [--out DIR]``; ``report()`` returns the written
paths.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from analysis import ReportError
from tltsim.errors import InputWarning  # noqa: E402
from tltsim.jsonio import parse_json, read_json, read_text  # noqa: E402
from tltsim.policy import is_eagle_drafting  # noqa: E402

# what every log.jsonl row of tltrun train holds and the figures read (numbers)
PLOTTED_KEYS = ("step", "reward_mean", "accept_len", "rollout_s", "train_s", "step_s",
                "drafter_train_s")  # fmt: skip


def load_run(run: str | Path) -> tuple[str, list[dict]]:
    """(label, log rows). Label: the run directory name + policy (+ whether its EAGLE drafter
    is spot-trained or frozen, where the run has one), as the run's settings now are (a resume
    with --override-config changes them: config_history.jsonl; a policy changed mid-run is
    shown as 'nospec -> static @2'). A torn last line (a run killed mid-append) is dropped
    with a warning, as a resume drops it; anything else not as ``tltrun train`` writes it is
    one ValueError naming the file, the line and the key."""
    path = Path(run)
    log_file = path / "log.jsonl"
    if not log_file.is_file():
        raise ReportError(f"{path}: no log.jsonl (not a tltrun train output directory)")
    rows = []
    lines = read_text(log_file, "tltrun train log").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if number == len(lines) and rows and not _is_json(line):  # (alone: not valid JSON)
            warnings.warn(
                f"{log_file}:{number}: dropped a torn last line (a killed run's)",
                InputWarning,
                stacklevel=2,
            )
            continue
        rows.append(_checked_row(parse_json(line, f"{log_file}:{number}"), log_file, number))
    if not rows:
        raise ReportError(f"{log_file}: no steps logged yet")
    name = path.resolve().name
    config = path / "config.json"
    if not config.is_file():
        return name, rows
    train = read_json(config, "tltrun train config").get("train")
    if not isinstance(train, dict) or not {"policy", "is_spot_training"} <= set(train):
        raise ReportError(f"{config}: no train settings (not a tltrun train config.json)")
    policy = train["policy"]
    for step, diff in _overrides(path / "config_history.jsonl"):
        for key, (before, after) in diff.items():
            field = key.removeprefix("train.")
            if key.startswith("train.") and field in train:
                train[field] = after
                if field == "policy" and before != after:
                    policy = f"{policy} -> {after} @{step}"
    drafters = train.get("tlt_drafters", ["eagle"])
    if train["policy"] in ("nospec", "tltbase") or "eagle" not in drafters:
        return f"{name} ({policy})", rows  # no learned drafter to train or freeze
    spot = "spot" if _is_spot_harvesting(train) else "frozen drafter"
    return f"{name} ({policy}, {spot})", rows


def _is_spot_harvesting(train: dict) -> bool:
    """``tltrun.train.config.TrainConfig.is_spot_harvesting`` from config.json's settings (this
    package reads result files, not tltrun): is_spot_training, where None (the default) means
    on for a policy that drafts with the EAGLE drafter (``tltsim.policy.is_eagle_drafting``);
    never with one worker."""
    if train.get("num_workers", 2) < 2:
        return False
    if train["is_spot_training"] is not None:
        return bool(train["is_spot_training"])
    return is_eagle_drafting(
        train["policy"],
        train.get("tlt_drafters", ["eagle"]),
        str(train.get("static_strategy", "off")),
    )


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _overrides(history: Path) -> list[tuple[int, dict]]:
    """(step, diff) of each resume that changed settings (``--override-config``), in order."""
    if not history.is_file():
        return []
    out = []
    for number, line in enumerate(read_text(history, "config history").splitlines(), 1):
        if not line.strip():
            continue
        entry = parse_json(line, f"{history}:{number}")
        diff = entry.get("diff") if isinstance(entry, dict) else None
        if not isinstance(diff, dict) or not all(
            isinstance(v, list) and len(v) == 2 for v in diff.values()
        ):
            raise ReportError(f"{history}:{number}: expected {{'step', 'diff'}} as tltrun writes")
        out.append((entry.get("step", "?"), diff))
    return out


def unique_labels(runs: list[tuple[str, list[dict]]], dirs: list) -> list[tuple[str, list[dict]]]:
    """Runs whose labels repeat (two directories both named ``rl``) are told apart by their
    parent directory's name too."""
    labels = [label for label, _ in runs]
    out = []
    for (label, rows), run in zip(runs, dirs, strict=True):
        if labels.count(label) > 1:
            label = f"{Path(run).resolve().parent.name}/{label}"
        out.append((label, rows))
    return out


def _checked_row(row: object, log_file: Path, number: int) -> dict:
    if not isinstance(row, dict):
        raise ReportError(f"{log_file}:{number}: expected a JSON object (one step), got {row!r}")
    for key in PLOTTED_KEYS:
        if key not in row:
            raise ReportError(f"{log_file}:{number}: no {key!r} (not a tltrun train log row)")
        if type(row[key]) not in (int, float):
            raise ReportError(f"{log_file}:{number}: {key!r}: expected a number, got {row[key]!r}")
    return row


def _reward(runs, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (label, rows) in enumerate(runs):
        color = f"C{i}"
        # the reward function's own score, as evaluation reports it (reward_mean is shaped by
        # --overlong-*/--format-penalty: -0.61 beside an eval 0.11 on one axis); logs older
        # than the column have only the shaped mean
        is_raw = all(type(r.get("reward_raw_mean")) in (int, float) for r in rows)
        key = "reward_raw_mean" if is_raw else "reward_mean"
        ax.plot(
            [r["step"] for r in rows],
            [r[key] for r in rows],
            marker="o",
            color=color,
            label=f"{label}: rollouts",
        )
        evals = [r for r in rows if "eval_reward_mean" in r]
        if evals:  # the held-out set, after the step's update (--eval-every)
            ax.plot(
                [r["step"] for r in evals],
                [r["eval_reward_mean"] for r in evals],
                marker="s",
                linestyle="--",
                color=color,
                label=f"{label}: eval",
            )
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, out / "reward.png")


def _accept(runs, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, rows in runs:
        if any(r["accept_len"] > 0 for r in rows):
            # 0.0 is the log's "no SD iteration in this step": a gap in the line, not a point
            accept = [r["accept_len"] if r["accept_len"] > 0 else float("nan") for r in rows]
            ax.plot([r["step"] for r in rows], accept, marker="o", label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel("accept length (tokens / verify)")
    if ax.get_lines():
        ax.legend(fontsize=7)
    else:  # no run speculated (NoSpec runs only): say so instead of an empty legend
        ax.text(0.5, 0.5, "no SD iterations in these runs", ha="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    return _save(fig, out / "accept_len.png")


def _step_time(runs, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [label for label, _ in runs]
    x = range(len(runs))
    mean = [
        {
            k: sum(r[k] for r in rows) / len(rows)
            for k in ("rollout_s", "train_s", "step_s", "drafter_train_s")
        }
        for _, rows in runs
    ]
    rollout = [m["rollout_s"] for m in mean]
    train = [m["train_s"] for m in mean]
    # evaluation steps' eval_s, averaged over every step (it was counted as "other")
    evaluation = [
        sum(r["eval_s"] for r in rows if type(r.get("eval_s")) in (int, float)) / len(rows)
        for _, rows in runs
    ]
    # the drafter's training and sync past the rollout's end (deterministic mode's wait for
    # its spot budgets; else the preempted update and the broadcast): it was "other"
    spot_wait = [
        sum(r["spot_wait_s"] for r in rows if type(r.get("spot_wait_s")) in (int, float))
        / len(rows)
        for _, rows in runs
    ]
    other = [max(m["step_s"] - m["rollout_s"] - m["train_s"] - e - w, 0.0)
             for m, e, w in zip(mean, evaluation, spot_wait, strict=True)]  # fmt: skip
    below = [a + b for a, b in zip(rollout, train, strict=True)]
    ax.bar([i - 0.2 for i in x], rollout, width=0.4, label="rollout")
    ax.bar([i - 0.2 for i in x], train, width=0.4, bottom=rollout, label="actor update")
    if any(evaluation):
        ax.bar([i - 0.2 for i in x], evaluation, width=0.4, bottom=below, label="evaluation")
        below = [a + b for a, b in zip(below, evaluation, strict=True)]
    if any(spot_wait):
        ax.bar([i - 0.2 for i in x], spot_wait, width=0.4, bottom=below,
               label="drafter sync / spot wait after the rollout")  # fmt: skip
        below = [a + b for a, b in zip(below, spot_wait, strict=True)]
    ax.bar([i - 0.2 for i in x], other, width=0.4, bottom=below, label="other")
    ax.bar(
        [i + 0.2 for i in x],
        [m["drafter_train_s"] for m in mean],
        width=0.4,
        hatch="//",
        fill=False,
        label="spot drafter training (on idle workers, during the rollout and the wait)",
    )
    ax.set_xticks(list(x), names, rotation=15, fontsize=7)
    ax.set_ylabel("seconds per RL step")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # (it covered the bars)
    return _save(fig, out / "step_time.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # (a legend beside the axes is kept)
    plt.close(fig)
    return path


def report(run_dirs: list[str], out: str | None = None, prepare_out=None) -> list[Path]:
    """The figures of the runs into ``out`` (default: the first run's directory), created
    by ``prepare_out(path)`` (the CLI's checks) only once every run has been read (a refused
    report left an empty --out behind)."""
    seen: dict[Path, str] = {}
    for run in run_dirs:  # (one run twice drew two identical curves under one label)
        if Path(run).resolve() in seen:
            raise ReportError(f"{run}: given twice (as {seen[Path(run).resolve()]})")
        seen[Path(run).resolve()] = run
    runs = unique_labels([load_run(r) for r in run_dirs], list(run_dirs))
    lengths = {label: len(rows) for label, rows in runs}
    if len(set(lengths.values())) > 1:  # the step-time bars average different steps
        warnings.warn(
            "runs of different lengths ("
            + ", ".join(f"{label}: {n} steps" for label, n in lengths.items())
            + "): each figure's means cover each run's own steps",
            InputWarning,
            stacklevel=2,
        )
    dest = Path(out) if out else Path(run_dirs[0])
    if prepare_out is not None:
        prepare_out(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return [_reward(runs, dest), _accept(runs, dest), _step_time(runs, dest)]
