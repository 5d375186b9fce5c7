"""Replay a trace under one or more policies: build each policy's cost model and policy
objects, simulate, and write the per-step, per-instance and per-response results.

    from tltsim.sim.replay import RunSettings, simulate_policies, write_outputs
    results = simulate_policies(trace, ("nospec", "tlt"), RunSettings(sim=SimConfig(), policy="nospec"))
    write_outputs(Path("results/r"), trace, results, SimConfig())

``tltsim replay`` (``tltsim.cli.replay``) is the command line; ``tltsim sweep`` runs one
``RunSettings`` per sweep point. Outputs of ``write_outputs``: ``summary.json`` and
``summary.csv`` (one row per policy, speedup intervals included), ``steps.csv``,
``instances.csv``, ``timeline.parquet`` and ``responses.parquet``; ``tltsim report DIR`` draws
the figures.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from tltsim.cost.calibrated import (
    CalibratedCost,
    fit_domain_line,
    is_preset_file,
    preset_cost,
)
from tltsim.cost.measured import with_profile
from tltsim.cost.presets import CLUSTER_PRESETS
from tltsim.cost.roofline import RooflineCost
from tltsim.errors import UsageError
from tltsim.jsonio import write_json
from tltsim.policy import (
    POLICY_NAMES,
    SpecDecision,
    SpotTrainerConfig,
    SpotTrainerPolicy,
    TLTConfig,
    is_eagle_drafting,
    make_policy,
    tltbase_settings,
)
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import SimConfig
from tltsim.sim.history_acceptance import HistoryModel
from tltsim.sim.intervals import (
    DEFAULT_COST_ERROR,
    IntervalSpec,
    SpeedupInterval,
    accept_band,
    describe,
    parse_range,
    parse_seeds,
    speedup_intervals,
)
from tltsim.sim.metrics import SimResult, ideal_bound
from tltsim.sim.simulator import simulate
from tltsim.trace.schema import Trace

# Show a progress bar when a replay simulates at least this many responses (about a second).
PROGRESS_MIN_RESPONSES = 50_000
# --exact's per-iteration events cost about this many times the fast mode's per response (a
# 10k-response trace: 147 s against 2.5 s under --policy all, this 2-core CPU, session 36)
EXACT_COST_FACTOR = 60


def is_progress_quiet(
    trace: Trace, num_simulations: int, sim: SimConfig, history: HistoryModel | None = None
) -> bool:
    """No progress bar: a short replay (under about a second of work), or no terminal. A
    cluster-wide history index costs what --exact does (the history drafter's iterations run one
    event each while a sibling runs on another instance: 26 s against 0.35 s for 2 steps of a
    64-GPU servegen replay, session 38), so it is weighed as exact."""
    is_per_iteration = sim.exact or (history is not None and history.scope == "cluster")
    work = trace.num_responses * num_simulations * (EXACT_COST_FACTOR if is_per_iteration else 1)
    return work < PROGRESS_MIN_RESPONSES or not sys.stderr.isatty()


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ReplayConfig:
    """What ``tltsim replay`` runs (the cluster is ``SimConfig``)."""

    policy: str = field(
        default="all",
        metadata={
            "help": f"policies to simulate: comma-separated of {', '.join(POLICY_NAMES)}, or all",
            "metavar": "LIST",
        },
    )
    preset: str | None = field(
        default=None, metadata=_help("cluster preset: " + ", ".join(CLUSTER_PRESETS))
    )
    out: str | None = field(
        default=None,
        metadata={
            "help": "output directory (default results/replay-<trace stem>; a trace.json's: its directory's name)",
            "metavar": "DIR",
        },
    )
    max_steps: int | None = field(default=None, metadata=_help("replay only the first N steps"))
    is_spot_training: bool = field(
        default=True, metadata=_help("SD policies train their drafter on idle instances")
    )
    # 8_4_32: StaticSpec's default, the middle of TLT's default arms.
    static_strategy: str = field(
        default="8_4_32", metadata=_help("StaticSpec strategy DRAFTSTEPS_TOPK_VERIFYTOKENS")
    )
    # The speedup interval (tltsim.sim.intervals). Seeds and the acceptance band cost extra
    # simulations, so they are off unless asked for; the cost band is computed from each run's
    # own timeline (no extra simulation), so it is on by default.
    seeds: str | None = field(
        default=None,
        metadata={
            "help": "seeds to replay for the speedup interval, comma-separated; the first one's "
            "run is the point estimate (default: --seed only)",
            "metavar": "LIST",
        },
    )
    num_seeds: int = field(
        default=1,
        metadata=_help(
            "replay seeds --seed .. --seed+N-1 for the speedup interval (not with --seeds)"
        ),
    )
    accept_rate_range: str | None = field(
        default=None,
        metadata={
            "help": "LOW,HIGH: factors on the drafter's accept rates whose replays bound the "
            "speedup interval (e.g. 0.9,1.1); 'fit': the --drafter-dynamics fit's rates "
            "-/+ 1.96 standard errors (default: not included)",
            "metavar": "LOW,HIGH|fit",
        },
    )
    cost_error: float = field(
        default=DEFAULT_COST_ERROR,
        metadata=_help(
            "relative error of SD iteration seconds vs plain decoding in the speedup interval "
            "(0: not included; default from the measured fidelity errors, README)"
        ),
    )

    def __post_init__(self) -> None:
        policy_names(self.policy)
        if type(self.num_seeds) is not int or self.num_seeds < 1:
            raise ValueError(f"num_seeds must be a positive integer, got {self.num_seeds!r}")
        if self.seeds is not None:
            parse_seeds(self.seeds, 1, 0)
            if self.num_seeds != 1:
                raise ValueError("--seeds and --num-seeds: give one of them")
        else:
            parse_seeds(None, self.num_seeds, 0)  # the count; the range once --seed is known
        if self.accept_rate_range is not None and self.accept_rate_range.strip() != "fit":
            parse_range(self.accept_rate_range)
        if not 0.0 <= self.cost_error < 1.0:
            raise ValueError(f"cost_error must be in [0, 1), got {self.cost_error}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.preset is not None and self.preset not in CLUSTER_PRESETS:
            raise ValueError(
                f"unknown preset {self.preset!r}; expected one of {', '.join(CLUSTER_PRESETS)}"
            )
        if not SpecDecision.parse(self.static_strategy).enabled:
            raise ValueError("static_strategy must enable SD (use the nospec policy for 'off')")


def policy_names(spec: str) -> tuple[str, ...]:
    # "all" includes tltbase: the simulator models the history drafter (HistoryModel, #20).
    names = POLICY_NAMES if spec == "all" else tuple(n.strip() for n in spec.split(","))
    bad = [n for n in names if n not in POLICY_NAMES]  # (an empty item: nospec,,tlt)
    if bad or not names:
        raise ValueError(
            f"policy: expected a comma-separated list of {', '.join(POLICY_NAMES)} or 'all', got {spec!r}"
        )
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class RunSettings:
    """Everything one simulation needs besides the trace (also one sweep point)."""

    sim: SimConfig
    policy: str
    tlt: TLTConfig = TLTConfig()
    static_strategy: str = "8_4_32"
    drafter: DrafterDynamics = DrafterDynamics()
    spot: SpotTrainerConfig = SpotTrainerConfig()
    is_spot_training: bool = True
    profile: Path | None = None  # measured cost profile (tltrun profile); None: roofline
    history: HistoryModel = HistoryModel()  # the history drafter's acceptance (#20)
    # TLTConfig fields tltbase takes besides tltbase_settings' (replay: --tlt-strategies and
    # --tlt-bucket-starts where given and tlt is not replayed beside it, as tltrun train's
    # tltbase takes them), as (name, value) pairs
    tltbase_arms: tuple[tuple[str, Any], ...] = ()


def cost_model(sim: SimConfig) -> CalibratedCost | RooflineCost:
    """The cost model of ``sim``'s model, hardware and TP: calibrated where the GPU has a
    calibration or ``sim.hardware`` is a hardware preset file (``--hardware-file``), else the
    roofline (``tltsim.cost.calibrated.preset_cost``; bad names: UsageError)."""
    return preset_cost(sim.model, sim.hardware, tp=sim.tp)


def run_settings(
    settings: RunSettings, trace: Trace, progress: Any = None, cost: Any = None
) -> SimResult:
    """Build the cost model (unless ``cost``, built from ``settings`` by ``replay_cost``, is
    given: one ProfileCost then reports the extrapolations of all the simulations) and policy
    objects of ``settings`` and simulate ``trace``."""
    sim = settings.sim
    cost = cost if cost is not None else replay_cost(settings.sim, settings.profile)
    if settings.policy == "tlt":
        policy = make_policy("tlt", seed=sim.seed, **dataclasses.asdict(settings.tlt))
    elif settings.policy == "static":
        policy = make_policy("static", strategy=settings.static_strategy)
    elif settings.policy == "tltbase":
        policy = tltbase_policy(settings)
    else:
        policy = make_policy(settings.policy, seed=sim.seed)
    # spot training where the policy can draft with the EAGLE drafter (tltrun train's default,
    # TrainConfig.is_spot_harvesting): not TLTBase, nor a history-only tlt or static
    trainer = (
        SpotTrainerPolicy(settings.spot)
        if settings.is_spot_training
        and is_eagle_drafting(settings.policy, settings.tlt.drafters, settings.static_strategy)
        else None
    )
    return simulate(
        trace,
        sim,
        cost,
        policy,
        trainer,
        settings.drafter,
        progress=progress,
        history=settings.history,
    )


def fit_domain_note(trace: Trace, sim: SimConfig) -> str | None:
    """Where ``sim``'s hardware preset file was fitted on smaller batches or contexts than the
    trace runs (``fit_domain_line``); None for a GPU name or inside the fitted shapes."""
    if not is_preset_file(sim.hardware):
        return None
    # a step's responses spread over the instances (an instance's first batch)
    instances = sim.num_gpus // sim.tp
    most = max(-(-sum(len(p.responses) for p in s.prompts) // instances) for s in trace.steps)
    longest = max(
        p.prompt_tokens + max(r.tokens for r in p.responses) for s in trace.steps for p in s.prompts
    )
    return fit_domain_line(sim.hardware, min(most, sim.max_running_requests), longest)


def kv_overflow_lines(results: dict[str, SimResult], cost: Any) -> list[str]:
    """A line per policy whose instances held more KV tokens at once than fit on them (the
    GPUs' memory at vLLM's default gpu_memory_utilization of 0.9, less the target's and the
    drafter's weights: ``RooflineCost.kv_capacity_tokens``). The simulator admits up to
    --max-running-requests whatever their KV needs; a real engine queues or preempts there, so
    such step times are optimistic. None for a measured profile (its machine is not the
    preset's)."""
    if not isinstance(cost, RooflineCost):
        return []
    capacity = cost.kv_capacity_tokens()
    by_peak: dict[int, list[str]] = {}
    for name, result in results.items():
        peak = max((r.peak_kv_tokens for r in result.steps), default=0)
        if peak > capacity:
            by_peak.setdefault(peak, []).append(name)
    lines = []
    for peak, names in by_peak.items():
        lines.append(
            f"{', '.join(names)}: one instance held up to {peak:,} KV tokens at once, "
            f"{peak / max(capacity, 1):.1f}x the {capacity:,} that fit ({cost.model.name} at "
            f"TP {cost.tp} on {cost.hardware.name}, 90% of its memory less the weights): a "
            "real engine would queue or preempt requests there, so these step times are "
            "optimistic; lower --max-running-requests, or raise --tp"
        )
    return lines


def replay_cost(sim: SimConfig, profile: Path | None = None) -> Any:
    """The cost model of ``sim`` (``cost_model``), or a ProfileCost of ``profile`` falling back
    to it."""
    return with_profile(profile, cost_model(sim))


def tltbase_policy(settings: RunSettings) -> Any:
    """The TLTBase of ``settings`` (a ValueError for arms it cannot take)."""
    arms = dict(settings.tltbase_arms)
    return make_policy("tltbase", seed=settings.sim.seed, **tltbase_settings(settings.tlt), **arms)


def simulate_policies(
    trace: Trace, names: tuple[str, ...], base: RunSettings, cost: Any = None
) -> dict[str, SimResult]:
    """``base`` simulated under each policy of ``names`` (a progress bar for long replays);
    ``cost``: see ``run_settings``."""
    total = trace.num_steps * len(names)
    is_quiet = is_progress_quiet(trace, len(names), base.sim, base.history)
    results = {}
    with tqdm(total=total, desc="replay", unit="step", disable=is_quiet) as bar:
        for name in names:
            bar.set_postfix_str(name)
            results[name] = run_settings(
                dataclasses.replace(base, policy=name), trace, progress=bar.update, cost=cost
            )
    return results


# -- outputs ----------------------------------------------------------------------------------------


def interval_spec(
    replay: ReplayConfig,
    sim: SimConfig,
    drafter: DrafterDynamics,
    fit_path: Path | None = None,
    history: HistoryModel | None = None,
) -> IntervalSpec:
    """What ``replay``'s speedup interval includes; its first seed is the point estimate's, so a
    caller simulates the point at ``seeds[0]`` (``--seeds`` overrides ``--seed``). ``history``:
    the replay's history-drafter model, moved with the accept-rate band."""
    try:
        return IntervalSpec(
            seeds=parse_seeds(replay.seeds, replay.num_seeds, sim.seed),
            accept=accept_band(drafter, replay.accept_rate_range, fit_path, history),
            cost_error=replay.cost_error,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None


def replay_intervals(
    trace: Trace,
    names: tuple[str, ...],
    base: RunSettings,
    spec: IntervalSpec,
    point: dict[str, SimResult],
    cost: Any = None,
) -> dict[str, SpeedupInterval]:
    """Speedup intervals around ``point`` (``simulate_policies(trace, names, base)``); the extra
    simulations (other seeds, acceptance ends) record no timeline."""

    # the interval's simulations get their own bar (they ran after the point's bar showed
    # 100%, most of a seeded replay's time): nospec's other seeds, each speculating policy's
    # extra runs (IntervalSpec.num_extra_runs_per_policy); none, no bar
    num_runs = (len(spec.seeds) - 1) * ("nospec" in names) + spec.num_extra_runs_per_policy * sum(
        name != "nospec" for name in names
    )
    is_quiet = num_runs == 0 or is_progress_quiet(trace, num_runs, base.sim, base.history)
    with tqdm(
        total=num_runs * trace.num_steps, desc="intervals", unit="step", disable=is_quiet
    ) as bar:

        def simulate_one(
            name: str, seed: int, drafter: DrafterDynamics, history: HistoryModel | None
        ) -> SimResult:
            sim = dataclasses.replace(base.sim, seed=seed, is_timeline_recorded=False)
            settings = dataclasses.replace(
                base, policy=name, sim=sim, drafter=drafter, history=history or base.history
            )
            bar.set_postfix_str(f"{name} seed {seed}")
            return run_settings(settings, trace, progress=bar.update, cost=cost)

        return speedup_intervals(names, spec, base.drafter, point, simulate_one)


def comparison(
    results: dict[str, SimResult],
    sim: SimConfig,
    profile: Path | None = None,
    intervals: dict[str, SpeedupInterval] | None = None,
    cost: Any = None,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per-policy summary rows (speedup vs NoSpec when it ran, with its interval when
    ``intervals`` has one) and the mean ideal rollout time with its two terms (work bound,
    critical path) over the strategies every policy used (one lower bound for all of them)."""
    cost = cost if cost is not None else replay_cost(sim, profile)
    strategies = sorted(
        set().union(*(r.strategies_used for r in results.values())), key=lambda d: d.strategy
    )
    first = next(iter(results.values()))
    bounds = [
        ideal_bound(shares, cost, sim.max_running_requests, strategies) for shares in first.shares
    ]
    num = max(len(bounds), 1)
    ideal = {
        "mean_ideal_rollout_s": sum(b.rollout_s for b in bounds) / num,
        "mean_ideal_work_s": sum(b.work_s for b in bounds) / num,
        "mean_ideal_critical_path_s": sum(b.critical_path_s for b in bounds) / num,
    }
    mean_ideal = ideal["mean_ideal_rollout_s"]
    base = results.get("nospec")
    rows = []
    for name, result in results.items():
        row = result.summary()
        if base is not None:
            b = base.summary()
            row["speedup_vs_nospec"] = (
                b["mean_step_s"] / row["mean_step_s"] if row["mean_step_s"] > 0 else 0.0
            )
            row["rollout_speedup_vs_nospec"] = (
                b["mean_rollout_s"] / row["mean_rollout_s"] if row["mean_rollout_s"] > 0 else 0.0
            )
            row["bubble_reclaimed_gpu_s"] = b["idle_gpu_s"] - row["idle_gpu_s"]
        if intervals and name in intervals:
            band = intervals[name]
            row["speedup_vs_nospec_low"] = band.low
            row["speedup_vs_nospec_high"] = band.high
            row["speedup_interval_by_source"] = {k: list(v) for k, v in band.by_source.items()}
        # one bound for all policies (the strategies any of them used): the row's bound terms
        # are that one, as its ratio (they were the policy's own, beside the shared ratio)
        row.update(ideal)
        row["rollout_over_ideal"] = row["mean_rollout_s"] / mean_ideal if mean_ideal > 0 else 0.0
        rows.append(row)
    return rows, ideal


# What write_outputs writes into --out (summary.json last; remove_stale_outputs clears them first)
RESULT_FILES = (
    "summary.json",
    "summary.csv",
    "steps.csv",
    "instances.csv",
    "timeline.parquet",
    "responses.parquet",
)


def write_outputs(
    out: Path,
    trace: Trace,
    results: dict[str, SimResult],
    sim: SimConfig,
    profile: Path | None = None,
    intervals: dict[str, SpeedupInterval] | None = None,
    spec: IntervalSpec | None = None,
    cost: Any = None,
) -> dict[str, Any]:
    """Write the replay's files (module docstring) and return the summary. ``intervals`` and
    the ``spec`` they were computed under add each policy's speedup interval; ``cost``: see
    ``run_settings``."""
    rows, ideal = comparison(results, sim, profile, intervals, cost)
    summary = {
        "kind": "replay",
        "trace": trace.summary(),
        **ideal,
        "speedup_interval": describe(spec) if spec is not None and intervals else None,
        "policies": rows,
    }
    table = pd.DataFrame(rows)
    for column in ("strategies_used", "speedup_interval_by_source"):
        if column in table:
            table[column] = [json.dumps(v) for v in table[column]]
    table.to_csv(out / "summary.csv", index=False)
    frames = {"steps": [], "instances": [], "timeline": []}
    for name, result in results.items():
        frames["steps"].append(result.steps_frame().assign(policy=name))
        frames["instances"].append(result.instances_frame().assign(policy=name))
        frames["timeline"].append(result.timeline_frame().assign(policy=name))
    pd.concat(frames["steps"], ignore_index=True).to_csv(out / "steps.csv", index=False)
    pd.concat(frames["instances"], ignore_index=True).to_csv(out / "instances.csv", index=False)
    pd.concat(frames["timeline"], ignore_index=True).to_parquet(
        out / "timeline.parquet", index=False
    )
    responses = pd.DataFrame(
        {
            "step": [s.step for s in trace.steps for p in s.prompts for _ in p.responses],
            "prompt_tokens": [
                p.prompt_tokens for s in trace.steps for p in s.prompts for _ in p.responses
            ],
            "response_tokens": trace.response_lengths(),
        }
    )
    for name, result in results.items():
        responses[f"finish_s_{name}"] = pd.concat(
            [pd.Series(f) for f in result.finish_s], ignore_index=True
        )
    responses.to_parquet(out / "responses.parquet", index=False)
    write_json(out / "summary.json", summary)  # last: a replay killed before has none
    return summary
