"""Comparing finished ``tltrun train`` runs of the same prompts and seed: per run, seconds per
step and speedups against a baseline run (usually NoSpec), read back from each run's directory
(``log.jsonl`` and the measured trace ``trace.json``). The rollout speedup is wall time of the
slower worker, prefill included; the decode speedup is what a decode microbenchmark measures
(``benchmarks/bench_spec.py``), and the prefill share says how much of the engine's time SD
cannot shorten. ``benchmarks/bench_train.py`` and ``benchmarks/bench_history.py`` print these.

Runs timed at different times on a shared machine may not have had the same machine: the
target's prefill is the same work in every run of the same prompts and seed (SD does not touch
it), so its seconds against the baseline's (``prefill_time_ratio``) say how much slower the
machine was during a run; ``drift_warnings`` names the runs whose ratio leaves
``DRIFT_TOLERANCE``."""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_log(run_dir: str | Path) -> list[dict]:
    """The run's ``log.jsonl`` rows, one per step."""
    text = (Path(run_dir) / "log.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line]


ENGINE_KEYS = ("prefill_s", "drafter_prefill_s", "decode_s", "decode_tokens")


def engine_totals(run_dir: str | Path) -> dict | None:
    """The engine's own seconds and decode tokens over the run, summed over steps and workers,
    from the measured trace (``trace.json``): prefill (target and drafter) and decode apart,
    which the rollout's wall time mixes. None when the trace lacks them (the vLLM backend
    measures no prefill) or is missing."""
    path = Path(run_dir) / "trace.json"
    if not path.is_file():
        return None
    steps = [s.get("measured", {}) for s in json.loads(path.read_text()).get("steps", [])]
    if not steps or any(s.get(k) is None for s in steps for k in ENGINE_KEYS):
        return None
    return {k: float(sum(s[k] for s in steps)) for k in ENGINE_KEYS}


def engine_split(res: dict, base: dict | None) -> tuple[float | None, float | None]:
    """(decode speedup vs ``base``: decode tokens per decode second, the quantity
    bench_spec.py measures; prefill share of the engine's seconds, which SD leaves as is)."""
    eng = res.get("engine")
    if not eng or eng["decode_s"] <= 0:
        return None, None
    prefill = eng["prefill_s"] + eng["drafter_prefill_s"]
    share = prefill / (prefill + eng["decode_s"])
    if not base or base["decode_s"] <= 0 or base["decode_tokens"] <= 0:
        return None, share
    rate = eng["decode_tokens"] / eng["decode_s"]
    return rate / (base["decode_tokens"] / base["decode_s"]), share


# The target-prefill seconds of runs that alternated chunk by chunk on the 2-core machine stayed
# within 0.90-1.11 of NoSpec's (bench_history's hanoi and built-in runs, 3 seeds each, 20 steps);
# runs made hours after their NoSpec run reached 1.21-1.26 (README, bench_history row). Beyond
# this factor either way a speedup measures the machine as much as the engine; a smaller drift
# (one such run: 1.13) goes unflagged.
DRIFT_TOLERANCE = 1.15


def prefill_time_ratio(res: dict, base: dict | None) -> float | None:
    """A run's target-prefill seconds over the baseline's (the same prompts, the same work):
    above 1, the machine was slower during the run. None without both engine totals."""
    eng = res.get("engine")
    if not eng or not base or base["prefill_s"] <= 0:
        return None
    return eng["prefill_s"] / base["prefill_s"]


def drift_warnings(table: list[dict], tolerance: float = DRIFT_TOLERANCE) -> list[str]:
    """One line per run of ``compare_runs``' table whose target prefill took more than
    ``tolerance`` times the baseline's, or less than its inverse."""
    lines = []
    for row in table:
        ratio = row.get("prefill_time_ratio")
        if ratio is not None and not 1 / tolerance <= ratio <= tolerance:
            lines.append(
                f"warning: {row['run']}: the target's prefill (the same work in every run) took "
                f"{ratio:.2f}x the baseline's seconds: the machine's speed moved between the "
                f"runs, so its speedups are not comparable (run the contenders alternating, "
                f"at the same time)"
            )
    return lines


def tokens_per_s(res: dict) -> float:
    """Response tokens per rollout second: sampled runs diverge in length, so seconds per
    step alone compare different amounts of work."""
    n = res["config"]["prompts_per_step"] * res["config"]["group_size"]
    tokens = sum(r["response_tokens_mean"] * n for r in res["log"])
    return tokens / sum(r["rollout_s"] for r in res["log"])


def relative_se(values: list[float]) -> float:
    """Standard error of the mean of ``values`` relative to the mean (step-to-step spread)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2 or mean <= 0:
        return 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(var / n) / mean


def compare_runs(results: dict, base: str = "nospec") -> list[dict]:
    """One row per run of ``results`` (name -> {"config": TrainConfig fields, "log": its
    log.jsonl rows, "engine": ``engine_totals``}): seconds per step and speedups vs ``base``
    (rollout, with its standard error over the steps; end-to-end step, response-token rate,
    decode rate), prefill share, the target-prefill time against the base's (machine drift),
    accept length per step, reward, spot-training and idle seconds."""
    base_rate = tokens_per_s(results[base])
    base_log = results[base]["log"]
    base_engine = results[base].get("engine")
    base_rollout = sum(r["rollout_s"] for r in base_log) / len(base_log)
    base_rel_se = relative_se([r["rollout_s"] for r in base_log])
    base_step = sum(r["step_s"] for r in base_log) / len(base_log)
    table = []
    for name, res in results.items():
        log = res["log"]
        rollout = sum(r["rollout_s"] for r in log) / len(log)
        rel_se = relative_se([r["rollout_s"] for r in log])
        speedup = base_rollout / rollout
        step = sum(r["step_s"] for r in log) / len(log)
        rate = tokens_per_s(res)
        decode_speedup, prefill_share = engine_split(res, base_engine)
        rewards = [r["reward_mean"] for r in log]
        table.append(
            {
                "run": name,
                "rollout_s_per_step": rollout,
                "step_s": step,
                "rollout_speedup": speedup,
                # standard error of mean(base) / mean(run) from the steps' spread (delta
                # method: relative errors in quadrature); the seeds' range shows the rest
                "rollout_speedup_se": 0.0
                if name == base
                else speedup * math.hypot(rel_se, base_rel_se),
                "rollout_s_rel_se": rel_se,
                "step_speedup": base_step / step,
                "rollout_tokens_per_s": rate,
                "token_rate_speedup": rate / base_rate,
                "decode_speedup": decode_speedup,
                "prefill_share": prefill_share,
                "prefill_time_ratio": prefill_time_ratio(res, base_engine),
                # the log's 0.0 is "no SD iteration in this step": None here, shown as -
                "accept_len_last": log[-1]["accept_len"] or None,
                "accept_len_per_step": [r["accept_len"] or None for r in log],
                "reward_per_step": rewards,
                "reward_mean_all": sum(rewards) / len(rewards),
                "reward_last": rewards[-1],
                "drafter_train_s": sum(r["drafter_train_s"] for r in log),
                "idle_worker_s": sum(r["idle_worker_s"] for r in log),
            }
        )
    return table


COLUMNS = {
    "run": "run",
    "rollout_s_per_step": "rollout s",
    "step_s": "step s",
    "rollout_speedup": "rollout x",
    "rollout_speedup_se": "+-",
    "step_speedup": "step x",
    "token_rate_speedup": "tok/s x",
    "decode_speedup": "decode x",
    "prefill_share": "prefill %",
    "prefill_time_ratio": "prefill t",
    "accept_len_last": "accept(last)",
    "reward_mean_all": "reward(all)",
    "reward_last": "reward(last)",
    "drafter_train_s": "spot s",
    "idle_worker_s": "idle s",
}
FORMATS = {
    "decode_speedup": ".2f",
    "prefill_share": "{:.0%}",
    "prefill_time_ratio": ".2f",
    "reward_mean_all": ".3f",
    "reward_last": ".3f",
    "drafter_train_s": ".1f",
    "idle_worker_s": ".1f",
}
