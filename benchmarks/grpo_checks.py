"""The targets ``benchmarks/bench_history.py --grpo`` checks over its GRPO runs, one table of
``bench_train``'s summary per seed (the same prompts, target and drafter in every run of a
seed, so runs are compared paired by seed, or by step):

* issue #20: the history drafter's accept length at step 0 (target >= 2) and TLT's bandit over
  both drafters (``tlt-mix``) against the better of the two alone, within noise
  (``history_accept_check``, ``mix_check``);
* issue #16: each run's reward per step against NoSpec's, within noise (``reward_checks``):
  lossless SD must not change what the policy learns.

Each prints one line with the numbers and "met" / "NOT met", and returns them for the JSON.
Not run directly; tests: ``python -m pytest tests/test_bench_history_ceiling.py -q``.
"""

from __future__ import annotations

import math
import statistics


def table_row(table: list[dict], run: str) -> float | None:
    """A run's step-0 accept length in bench_train's summary table; None when no SD iteration
    ran in that step (the batch never shrank to TLT's threshold)."""
    return next(t for t in table if t["run"] == run)["accept_len_per_step"][0]


def history_accept_check(summary: list[dict], per_seed: list[dict]) -> dict:
    """#20's first target, the history drafter's accept length at step 0 >= 2 (median over
    the seeds whose step 0 ran SD), printed met / NOT met: needs the tltbase run."""
    by = {r["run"]: r for r in summary}
    history_step0 = by["tltbase"]["accept_len_step0_median"]
    ceiling = statistics.median(s["history_ceiling_step0"] for s in per_seed)
    checks = {"history_accept_len_step0_ge_2": history_step0 is not None and history_step0 >= 2}
    num_seeds = by["tltbase"].get("accept_len_step0_num_seeds", len(per_seed))
    shown = "no SD iteration at step 0" if history_step0 is None else f"{history_step0:.2f}"
    if 0 < num_seeds < len(per_seed):
        shown += f" over the {num_seeds} of {len(per_seed)} seeds whose step 0 ran SD"
    print(
        f"history accept length at step 0 (median): {shown} (target >= 2): "
        f"{'met' if checks['history_accept_len_step0_ge_2'] else 'NOT met'}; the ceiling of any "
        f"point-mass draft from the prompt's group on the same rollouts (median): {ceiling:.2f}"
    )
    return checks


def mix_check(per_seed: list[dict]) -> dict:
    """#20's second target, TLT's bandit over both drafters (tlt-mix) >= the better of
    tltbase and tlt-spot alone, within noise, printed met / NOT met: needs the three runs."""
    # Paired by seed (same prompts, target and drafter): the mix minus the better of tltbase
    # and tlt-spot, and that difference's standard error from the two runs' step-to-step
    # spread (NoSpec's mean divides both, so its noise scales the small difference only and is
    # left out). Within noise: the median difference is no lower than -2 median standard
    # errors. Picking the better of two noisy runs per seed favours the single drafters.
    pairs = []
    for s in per_seed:
        rows = {t["run"]: t for t in s["table"]}
        best = max(("tltbase", "tlt-spot"), key=lambda r: rows[r]["rollout_speedup"])
        diff = rows["tlt-mix"]["rollout_speedup"] - rows[best]["rollout_speedup"]
        se = math.hypot(
            *(rows[r]["rollout_speedup"] * rows[r]["rollout_s_rel_se"] for r in ("tlt-mix", best))
        )
        pairs.append((s["seed"], best, diff, se))
    median_diff = statistics.median(d for _, _, d, _ in pairs)
    median_se = statistics.median(e for _, _, _, e in pairs)
    checks = {
        "mix_minus_better_alone": [
            {"seed": seed, "better_alone": best, "diff": d, "se": e} for seed, best, d, e in pairs
        ],
        "mix_ge_better_alone_within_noise": median_diff >= -2.0 * median_se,
    }
    print(
        "tlt-mix minus the better of tltbase and tlt-spot, rollout speedup, paired by seed: "
        + ", ".join(f"seed {seed} {d:+.2f} (vs {best}, se {e:.2f})" for seed, best, d, e in pairs)
        + f"; median {median_diff:+.2f} vs -2 x median se {-2.0 * median_se:.2f}: "
        + f"{'met' if checks['mix_ge_better_alone_within_noise'] else 'NOT met'} within noise"
    )
    return checks


def reward_checks(runs: tuple[str, ...], per_seed: list[dict]) -> dict:
    """#16's reward check: each run's reward curve against NoSpec's, within noise. Paired by
    step (the same prompts at the same step in every run of a seed): the mean over steps of
    the run's minus NoSpec's mean reward, with its standard error from the spread of those
    per-step differences. Within noise: the median difference over seeds is within 2 median
    standard errors of 0. A run whose curve rises or falls with NoSpec's passes; SD that
    changed what the policy samples would show as a difference in either direction."""
    checks = {}
    for name in runs:
        if name == "nospec":
            continue
        pairs = []
        for s in per_seed:
            rows = {t["run"]: t for t in s["table"]}
            diffs = [
                a - b
                for a, b in zip(
                    rows[name]["reward_per_step"], rows["nospec"]["reward_per_step"], strict=True
                )
            ]
            se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
            pairs.append({"seed": s["seed"], "diff": statistics.fmean(diffs), "se": se})
        median_diff = statistics.median(p["diff"] for p in pairs)
        median_se = statistics.median(p["se"] for p in pairs)
        checks[name] = {
            "per_seed": pairs,
            "median_diff": median_diff,
            "median_se": median_se,
            "within_noise": abs(median_diff) <= 2.0 * median_se,
        }
        print(
            f"{name} minus nospec, mean reward per step, paired by step: "
            + ", ".join(f"seed {p['seed']} {p['diff']:+.3f} (se {p['se']:.3f})" for p in pairs)
            + f"; median {median_diff:+.3f} vs 2 x median se {2.0 * median_se:.3f}: "
            + ("within noise" if checks[name]["within_noise"] else "NOT within noise")
        )
    return checks
