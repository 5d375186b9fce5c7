"""``tltsim compare``: replay measured runs in the simulator with a measured cost profile and put
simulated and measured step times side by side, with their errors (issue #7, part 4).

    tltsim compare runs/fid/trace_nospec.json runs/fid/trace_tlt.json --profile profiles/cpu.csv
    tltsim compare runs/rl/trace.json --profile profiles/cpu.csv --out results/compare-rl

Each trace is one policy's measured run (``tltrun bench`` / ``tltrun train`` / the fidelity
benchmark write them). It is replayed with the same lengths, placement (instances and which
prompts ran where), batching cap, policy object and accept lengths (each step's measured
histogram per strategy; ``tltsim.fidelity.measured_run`` lists what the trace must record; with
``--drafter-dynamics`` the fitted acceptance model instead), on the cost model of ``--profile``
(``tltsim.cost.measured.ProfileCost``; ``--hardware PRESET`` adds a roofline fallback for ops
the profile lacks).

How: each instance is simulated on its own (``simulate`` with one instance and that instance's
prompts, every step in order, its own policy object, as each engine drives its own): nothing in
a rollout couples instances except the barrier, and the step's simulated rollout is the slowest
instance. Spot drafter training is not scheduled (the replayed acceptance already contains its
effect; with ``--drafter-dynamics`` the model learns each step's measured trained tokens,
``TrainedAsMeasured``). Exact mode (one event and one policy call per iteration, as the engine) is the default.
Training is priced per worker, as tltrun trains: each worker its own rollouts' tokens, the step
waiting for the one that served the most (``measured.instance_prompts``; even without it).
A trace measured on other hardware than the profile (``measured.hardware`` vs the sidecar's
``hardware``: another GPU, another CPU or torch thread count) is one warning, as is a run whose
steps rolled out other prompts than the baseline's (another seed or data) or another model.

Printed and written to ``--out`` (default ``results/compare-<first trace stem>``):
``steps.csv`` (per trace and step: measured and simulated rollout, train, prefill, SD and
re-prefill seconds, accept length, and the absolute % errors), ``speedups.csv`` (per policy and
step: measured and simulated speedup over ``--baseline``), ``summary.json`` (median and p90 of
the per-step errors, whole-run speedups), ``config.json``, ``parity.png``, ``steps.png``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tltsim.cost.measured import ProfileCost
from tltsim.cost.profile import Profile, ProfileError, load_profile
from tltsim.cost.roofline import RooflineCost
from tltsim.cost.specs import HARDWARE_PRESETS, ModelSpec
from tltsim.errors import UsageError
from tltsim.fidelity.compare_warnings import (
    warn_other_machine,
    warn_other_update,
    warn_other_work,
)
from tltsim.fidelity.measured_run import MeasuredRun, measured_run
from tltsim.jsonio import write_json
from tltsim.policy import make_policy
from tltsim.sim.acceptance import DrafterDynamics, DrafterState
from tltsim.sim.config import SimConfig
from tltsim.sim.history_acceptance import HistoryModel
from tltsim.sim.simulator import simulate
from tltsim.trace.files import load_trace


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class CompareConfig:
    """Settings of ``tltsim compare`` (one flag per field)."""

    profile: str = field(
        default="", metadata={"help": "measured cost profile CSV (required)", "metavar": "PATH"}
    )
    out: str | None = field(
        default=None,
        metadata={
            "help": "output directory (default results/compare-<trace stem>; a trace.json's: its directory's name)",
            "metavar": "DIR",
        },
    )
    baseline: str = field(
        default="nospec", metadata=_help("policy the speedups are relative to (if compared)")
    )
    max_running_requests: int | None = field(
        default=None,
        metadata=_help(
            "batching cap per instance (default: the one each trace records; given, it replaces that)"
        ),
    )
    hardware: str | None = field(
        default=None,
        metadata=_help("GPU preset of a roofline fallback for ops the profile lacks"),
    )
    exact: bool = field(default=True, metadata=_help("one simulated event per iteration"))
    seed: int = field(default=0, metadata=_help("seed of the simulated accept lengths"))

    def __post_init__(self) -> None:
        if not self.profile:
            raise ValueError("--profile is required")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.hardware is not None and self.hardware not in HARDWARE_PRESETS:
            raise ValueError(
                f"hardware {self.hardware!r}: expected one of {', '.join(HARDWARE_PRESETS)}"
            )
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def profile_cost(profile: Profile, hardware: str | None) -> ProfileCost:
    """The profile's cost model; with ``hardware`` a roofline of the profiled model (from the
    sidecar's ``model`` config) prices the ops the profile lacks."""
    fallback = None
    if hardware is not None:
        model = profile.meta.get("model")
        if not isinstance(model, dict):
            raise UsageError(
                f"{profile.source}: sidecar field 'model' is not a config.json object; the roofline fallback needs it"
            )
        try:
            spec = ModelSpec.from_hf_config(model, name="profiled model")
            fallback = RooflineCost(spec, HARDWARE_PRESETS[hardware], tp=int(profile.meta["tp"]))
        except ValueError as err:
            raise UsageError(f"{profile.source}: {err}") from None
    try:
        return ProfileCost(profile, fallback=fallback, is_warned=False)
    except ProfileError as err:  # (it said "or give a fallback cost model", no flag)
        raise UsageError(
            f"{str(err).removesuffix(')')}: --hardware GPU prices them by a roofline of the "
            "profiled model)"
        ) from None


# --- simulating one measured run ---------------------------------------------------------------


def _step_rows(run: MeasuredRun, per_instance: list[Any], cost: ProfileCost) -> list[dict]:
    """Per step: measured and simulated figures (instances summed, rollout = slowest)."""
    rows = []
    n = run.num_instances
    for k, step in enumerate(run.trace.steps):
        recs = [result.steps[k] for result in per_instance]
        m = step.measured
        train_s = _train_s(step, n, cost)
        sd_tokens, verifies = sum(r.sd_tokens for r in recs), sum(r.sd_verifies for r in recs)
        busy = sum(r.busy_gpu_s for r in recs) / int(cost.profile.meta["tp"])  # instance-s
        decode, reprefill = (
            sum(r.decode_instance_s for r in recs),
            sum(r.reprefill_instance_s for r in recs),
        )
        rows.append(
            {
                "trace": run.source,
                "policy": run.policy,
                "step": step.step,
                "num_instances": n,
                "measured_rollout_s": float(m.rollout_s),
                "sim_rollout_s": max(r.rollout_s for r in recs),
                "measured_train_s": _number(m.train_s),
                "sim_train_s": train_s,
                "measured_prefill_s": _number(m.prefill_s),
                "sim_prefill_s": busy - decode - reprefill,
                "measured_sd_s": _number(m.sd_s),
                "sim_sd_s": sum(r.sd_instance_s for r in recs),
                "measured_reprefill_s": _number(m.drafter_prefill_s),
                "sim_reprefill_s": reprefill,
                "measured_accept_len": _number(m.mean_accept_len),
                "sim_accept_len": sd_tokens / verifies if verifies else 0.0,
                "replayed_accept_rate": run.acceptance.rates[k],
            }
        )
    return rows


def _train_s(step: Any, num_instances: int, cost: ProfileCost) -> float:
    """The step's training phase: each worker trains the sequences it rolled out (tltrun's GRPO
    all-reduces gradients, it does not rebalance data), so the slowest is the one that served
    the most tokens (``measured.instance_prompts``; a placement of --prompt-split 1,3 gives one
    worker 3/4 of them). Without a recorded placement, as tltsim.sim.simulator prices it: the
    tokens split evenly (data parallel over the instances)."""

    def tokens_of(prompts: list[Any]) -> tuple[int, int]:
        tokens = sum(
            p.prompt_tokens * len(p.responses) + sum(p.response_lengths()) for p in prompts
        )
        return tokens, sum(len(p.responses) for p in prompts)

    owners = step.measured.instance_prompts if step.measured is not None else None
    if owners:
        by_id = {p.id: p for p in step.prompts}
        shares = [tokens_of([by_id[pid] for pid in owner]) for owner in owners]
        return max(cost.train_s(tokens, tokens / seqs) for tokens, seqs in shares if seqs)
    tokens, seqs = tokens_of(list(step.prompts))
    return cost.train_s(int(round(tokens / num_instances)), tokens / seqs)


def _number(value: float | None) -> float:
    """A recorded number as float; nan where the block did not record it."""
    return math.nan if value is None else float(value)


@dataclass(frozen=True)
class TrainedAsMeasured(DrafterDynamics):
    """``--drafter-dynamics`` on a measured run: the model, trained after each step's rollout on
    the tokens the run's drafter was trained on in that step (the step's measured
    ``drafter_trained_tokens``; the drafter is the cluster's, so every instance sees all of
    them), then drifting with the update: ``tltsim.fidelity.fit_dynamics.predict``'s recursion,
    which fitted the model. Without it the simulated drafter never learned and only drifted."""

    trained_tokens: tuple[int, ...] = ()  # per simulated step

    def after_rl_step(self, state: DrafterState) -> DrafterState:
        k = state.num_rl_steps  # the step that just ended
        if k < len(self.trained_tokens) and self.trained_tokens[k]:
            state = self.after_training(state, self.trained_tokens[k])
        return super().after_rl_step(state)


def trained_as_measured(run: MeasuredRun, drafter: DrafterDynamics) -> TrainedAsMeasured:
    tokens = tuple(int(s.measured.drafter_trained_tokens or 0) for s in run.trace.steps)
    return TrainedAsMeasured(**dataclasses.asdict(drafter), trained_tokens=tokens)


def simulate_run(
    run: MeasuredRun,
    cost: ProfileCost,
    cfg: CompareConfig,
    drafter: DrafterDynamics | None,
    history: HistoryModel | None = None,
) -> tuple[list[dict], list[SimConfig]]:
    """Simulate every instance of ``run`` on its own; per-step rows and the configs used.
    ``drafter`` (fitted dynamics) replaces the measured acceptance; the history drafter's model
    is then ``history`` (fitted beside them), else the run's own fit (it fell back to the
    simulator's defaults: a fitted 4.2 tokens per verify simulated as 1.3-1.8)."""
    results, configs = [], []
    dynamics = run.acceptance if drafter is None else trained_as_measured(run, drafter)
    if drafter is not None:
        history = history or run.acceptance.history
    for i in range(run.num_instances):
        cap = run.max_running_requests or run.max_share(i)
        tp = int(cost.profile.meta["tp"])  # one profile describes one engine instance
        sim = SimConfig(
            model="profiled",
            hardware="profiled",
            num_gpus=tp,
            tp=tp,
            max_running_requests=cap,
            share_prompts=run.share_prompts,
            prefix_block_tokens=run.prefix_block_tokens,
            exact=cfg.exact,
            is_timeline_recorded=False,
            seed=cfg.seed + i,
        )
        policy = make_policy(run.policy, seed=run.policy_seed, **run.settings)
        results.append(
            simulate(run.instance_trace(i), sim, cost, policy, None, dynamics, history=history)
        )
        configs.append(sim)
    return _step_rows(run, results, cost), configs


# --- errors and speedups -------------------------------------------------------------------------


def abs_pct_error(sim: pd.Series, measured: pd.Series) -> pd.Series:
    return 100.0 * (sim - measured).abs() / measured


def speedups(steps: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Per policy other than ``baseline`` and common step: measured and simulated rollout
    speedup (baseline seconds / policy seconds), and the step speedup with training when both
    runs measured it."""
    if baseline not in set(steps.policy):
        return pd.DataFrame()
    base = steps[steps.policy == baseline].set_index("step")
    rows = []
    for policy, frame in steps[steps.policy != baseline].groupby("policy", sort=False):
        for _, r in frame.iterrows():
            if r.step not in base.index:
                continue
            b = base.loc[r.step]
            row = {"policy": policy, "step": r.step}
            for kind in ("measured", "sim"):
                row[f"{kind}_speedup"] = b[f"{kind}_rollout_s"] / r[f"{kind}_rollout_s"]
                whole = b[f"{kind}_rollout_s"] + b[f"{kind}_train_s"]
                row[f"{kind}_step_speedup"] = whole / (
                    r[f"{kind}_rollout_s"] + r[f"{kind}_train_s"]
                )
            rows.append(row)
    out = pd.DataFrame(rows)
    if not out.empty:
        out["speedup_err_pct"] = abs_pct_error(out.sim_speedup, out.measured_speedup)
        out["step_speedup_err_pct"] = abs_pct_error(out.sim_step_speedup, out.measured_step_speedup)
    return out


def _stats(values: pd.Series) -> dict[str, float | None]:
    v = values.dropna()
    if v.empty:
        return {"median": None, "p90": None, "num_steps": 0}
    return {
        "median": float(v.median()),
        "p90": float(np.percentile(v, 90)),
        "num_steps": int(v.size),
    }


def summarize(steps: pd.DataFrame, ups: pd.DataFrame, baseline: str) -> dict[str, Any]:
    """Median / p90 of the per-step errors per policy and overall, and whole-run speedups."""
    out: dict[str, Any] = {"kind": "compare", "policies": {}}
    for policy, f in steps.groupby("policy", sort=False):
        out["policies"][policy] = {
            "rollout_err_pct": _stats(f.rollout_err_pct),
            "train_err_pct": _stats(f.train_err_pct),
            "measured_rollout_s": float(f.measured_rollout_s.sum()),
            "sim_rollout_s": float(f.sim_rollout_s.sum()),
        }
    out["rollout_err_pct"] = _stats(steps.rollout_err_pct)
    out["train_err_pct"] = _stats(steps.train_err_pct)
    out["speedups"] = {}
    base = steps[steps.policy == baseline].set_index("step")
    for policy, f in ups.groupby("policy", sort=False) if not ups.empty else ():
        mine = steps[(steps.policy == policy) & steps.step.isin(f.step)]
        b = base.loc[f.step]
        measured = b.measured_rollout_s.sum() / mine.measured_rollout_s.sum()
        sim = b.sim_rollout_s.sum() / mine.sim_rollout_s.sum()
        out["speedups"][policy] = {
            "baseline": baseline,
            "measured_speedup": float(measured),
            "sim_speedup": float(sim),
            "speedup_err_pct": float(100 * abs(sim - measured) / measured),
            "per_step_err_pct": _stats(f.speedup_err_pct),
        }
    return out


# --- the command -----------------------------------------------------------------------------------


def compare(
    paths: list[Path],
    cfg: CompareConfig,
    tlt: dict[str, Any] | None = None,
    drafter: DrafterDynamics | None = None,
    history: HistoryModel | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """Simulate every measured trace; (steps, speedups, summary, resolved config). ``tlt``:
    TLTConfig fields that replace those each run recorded (``--tlt-*``); ``drafter`` and
    ``history``: a ``tltsim fit`` file's dynamics and history model (``simulate_run``)."""
    profile = load_profile(cfg.profile)
    cost = profile_cost(profile, cfg.hardware)
    rows, runs, seen, measured = [], [], {}, {}
    for path in paths:
        run = measured_run(load_trace(path), str(path), cfg.max_running_requests, tlt)
        # one run per policy: speedups pair each policy's steps with the baseline's (two
        # baselines made the pairing ambiguous: an internal error)
        if run.policy in seen:
            raise UsageError(
                f"{path}: measures policy {run.policy!r}, as {seen[run.policy]} does; compare "
                "one run per policy (compare the other run in a second call)"
            )
        seen[run.policy], measured[run.policy] = path, run
        if run.clock != profile.meta.get("clock", "wall"):
            raise UsageError(
                f"{path}: measured in {run.clock} seconds but the profile {profile.source} in {profile.meta.get('clock', 'wall')} seconds (measure both with the same clock)"
            )
        warn_other_machine(run, profile, path)
        warn_other_update(run, profile, path)
        step_rows, sims = simulate_run(run, cost, cfg, drafter, history)
        rows += step_rows
        runs.append(
            {
                "trace": str(path),
                "policy": run.policy,
                "settings": run.settings,
                "policy_seed": run.policy_seed,
                "num_instances": run.num_instances,
                "max_running_requests": run.max_running_requests,
                "acceptance": dataclasses.asdict(run.acceptance) if drafter is None else None,
                "sim": [dataclasses.asdict(s) for s in sims],
            }
        )
    if cfg.baseline in measured:
        for policy, run in measured.items():
            if policy != cfg.baseline:
                base = measured[cfg.baseline]
                warn_other_work(run, seen[policy], base, seen[cfg.baseline])
    steps = pd.DataFrame(rows)
    steps["rollout_err_pct"] = abs_pct_error(steps.sim_rollout_s, steps.measured_rollout_s)
    steps["train_err_pct"] = abs_pct_error(steps.sim_train_s, steps.measured_train_s)
    ups = speedups(steps, cfg.baseline)
    summary = summarize(steps, ups, cfg.baseline)
    summary["profile_extrapolation"] = cost.extrapolation_report()
    config = {
        "kind": "compare",
        "compare": dataclasses.asdict(cfg),
        "profile": {k: v for k, v in profile.meta.items() if k != "config"},
        "drafter_dynamics": dataclasses.asdict(drafter) if drafter is not None else None,
        "history_model": dataclasses.asdict(history) if history is not None else None,
        "runs": runs,
    }
    return steps, ups, summary, config


def write_outputs(
    out: Path, steps: pd.DataFrame, ups: pd.DataFrame, summary: dict[str, Any], config: dict
) -> list[Path]:
    from analysis.fidelity_plots import parity_plot, steps_plot  # matplotlib only here

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config)
    steps.to_csv(out / "steps.csv", index=False)
    ups.to_csv(out / "speedups.csv", index=False)
    write_json(out / "summary.json", summary)
    return [parity_plot(steps, out / "parity.png"), steps_plot(steps, ups, out / "steps.png")]


__all__ = [
    "CompareConfig",
    "compare",
    "simulate_run",
    "speedups",
    "summarize",
]
