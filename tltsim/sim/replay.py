"""``tltsim replay``: simulate a trace under one or more policies and write the results.

    tltsim replay traces/synth_reasoning_rl.json --preset h100x8-qwen7b
    tltsim replay traces/servegen_r1_rl.json --num-gpus 64 --policy nospec,tlt --out results/r1
    tltsim report results/r1

Flags map 1:1 onto ``SimConfig`` (cluster), ``ReplayConfig`` (what to run), ``TLTConfig``
(``--tlt-*``), ``DrafterDynamics`` (``--drafter-*``) and ``SpotTrainerConfig`` (``--spot-*``).
``--profile FILE`` (``tltrun profile``) replaces the roofline by the measured profile, which the
roofline still backs for ops the profile lacks; ``--drafter-dynamics FILE`` (``tltsim fit``)
sets the ``--drafter-*`` defaults.
``--preset`` fills the cluster fields first; explicit flags override it. The output directory
(default ``results/replay-<trace stem>``) gets ``config.json`` (everything resolved),
``summary.json``, ``steps.csv``, ``instances.csv``, ``timeline.parquet`` and
``responses.parquet``; ``tltsim report DIR`` draws the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from tltsim.sim.acceptance import DrafterDynamics
from tltsim.cli.fidelity import (
    add_profile_args,
    dynamics_from_args,
    extrapolation_lines,
    with_profile,
)
from tltsim.cli.args import UsageError, add_dataclass_args, dataclass_from_args, write_json
from tltsim.cost.roofline import RooflineCost
from tltsim.sim.metrics import SimResult, ideal_rollout_s
from tltsim.policy import (
    POLICY_NAMES,
    SpecDecision,
    SpotTrainerConfig,
    SpotTrainerPolicy,
    TLTConfig,
    make_policy,
)
from tltsim.cost.presets import CLUSTER_PRESETS, apply_preset
from tltsim.sim.simulator import SimConfig, simulate
from tltsim.cost.specs import get_hardware, get_model
from tltsim.trace.schema import Trace, load_trace

# Show a progress bar when a replay simulates at least this many responses (about a second).
PROGRESS_MIN_RESPONSES = 50_000


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ReplayConfig:
    """What ``tltsim replay`` runs (the cluster is ``SimConfig``)."""

    policy: str = field(
        default="all", metadata=_help("comma-separated of " + ", ".join(POLICY_NAMES) + ", or all")
    )
    preset: str | None = field(
        default=None, metadata=_help("cluster preset: " + ", ".join(CLUSTER_PRESETS))
    )
    out: str | None = field(
        default=None, metadata=_help("output directory (default results/replay-<trace stem>)")
    )
    max_steps: int | None = field(default=None, metadata=_help("replay only the first N steps"))
    is_spot_training: bool = field(
        default=True, metadata=_help("SD policies train their drafter on idle instances")
    )
    # 8_4_32: StaticSpec's default, the middle of TLT's default arms.
    static_strategy: str = field(
        default="8_4_32", metadata=_help("StaticSpec strategy DRAFTSTEPS_TOPK_VERIFYTOKENS")
    )

    def __post_init__(self) -> None:
        policy_names(self.policy)
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.preset is not None and self.preset not in CLUSTER_PRESETS:
            raise ValueError(
                f"unknown preset {self.preset!r}; expected one of {', '.join(CLUSTER_PRESETS)}"
            )
        if not SpecDecision.parse(self.static_strategy).enabled:
            raise ValueError("static_strategy must enable SD (use the nospec policy for 'off')")


def policy_names(spec: str) -> tuple[str, ...]:
    names = (
        POLICY_NAMES if spec == "all" else tuple(n.strip() for n in spec.split(",") if n.strip())
    )
    bad = [n for n in names if n not in POLICY_NAMES]
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


def cost_model(sim: SimConfig) -> RooflineCost:
    """The roofline cost model of ``sim``'s model, hardware and TP (bad names: UsageError)."""
    try:
        return RooflineCost(get_model(sim.model), get_hardware(sim.hardware), tp=sim.tp)
    except ValueError as err:
        raise UsageError(str(err)) from None


def run_settings(settings: RunSettings, trace: Trace, progress: Any = None) -> SimResult:
    """Build the cost model and policy objects of ``settings`` and simulate ``trace``."""
    sim = settings.sim
    cost = with_profile(settings.profile, cost_model(sim))
    if settings.policy == "tlt":
        policy = make_policy("tlt", seed=sim.seed, **dataclasses.asdict(settings.tlt))
    elif settings.policy == "static":
        policy = make_policy("static", strategy=settings.static_strategy)
    else:
        policy = make_policy(settings.policy, seed=sim.seed)
    is_spec = settings.policy != "nospec"
    trainer = SpotTrainerPolicy(settings.spot) if is_spec and settings.is_spot_training else None
    return simulate(trace, sim, cost, policy, trainer, settings.drafter, progress=progress)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="simulate a trace under one or more policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", type=Path, help="tlt-trace file (.json, .json.gz, .csv, .parquet)")
    add_dataclass_args(p, ReplayConfig)
    add_dataclass_args(p, SimConfig)
    add_dataclass_args(p, TLTConfig, prefix="tlt-")
    add_dataclass_args(p, DrafterDynamics, prefix="drafter-")
    add_dataclass_args(p, SpotTrainerConfig, prefix="spot-")
    add_profile_args(p)  # --profile, --drafter-dynamics
    p.set_defaults(func=cmd_replay)


def resolve(
    args: argparse.Namespace,
) -> tuple[ReplayConfig, SimConfig, TLTConfig, DrafterDynamics, SpotTrainerConfig]:
    replay = dataclass_from_args(ReplayConfig, args)
    base = apply_preset(SimConfig(), replay.preset) if replay.preset else SimConfig()
    sim = dataclass_from_args(SimConfig, args, base=base)
    tlt = dataclass_from_args(TLTConfig, args, prefix="tlt-")
    drafter = dataclass_from_args(
        DrafterDynamics, args, prefix="drafter-", base=dynamics_from_args(args)
    )
    spot = dataclass_from_args(SpotTrainerConfig, args, prefix="spot-")
    return replay, sim, tlt, drafter, spot


def cmd_replay(args: argparse.Namespace) -> int:
    replay, sim, tlt, drafter, spot = resolve(args)
    profile = getattr(args, "profile", None)
    cost = with_profile(profile, cost_model(sim))
    trace = load_trace(args.trace)
    if replay.max_steps is not None:
        trace = Trace(meta=trace.meta, steps=trace.steps[: replay.max_steps])
    out = (
        Path(replay.out)
        if replay.out
        else Path("results") / f"replay-{args.trace.name.split('.')[0]}"
    )
    out.mkdir(parents=True, exist_ok=True)
    names = policy_names(replay.policy)
    config = {
        "kind": "replay",
        "trace": str(args.trace),
        "replay": replay,
        "sim": sim,
        "tlt": tlt,
        "drafter": drafter,
        "spot": spot,
        "cost_model": {
            "model": dataclasses.asdict(cost_model(sim).model),
            "hardware": dataclasses.asdict(cost_model(sim).hardware),
            "tp": sim.tp,
            "profile": None if profile is None else str(profile),
        },
    }
    write_json(out / "config.json", config)
    results = _simulate_all(
        trace,
        names,
        RunSettings(
            sim,
            names[0],
            tlt,
            replay.static_strategy,
            drafter,
            spot,
            replay.is_spot_training,
            profile,
        ),
    )
    write_outputs(out, trace, results, sim, profile)
    print_report(results, out, profile=profile)
    for line in extrapolation_lines(cost):
        print(line)
    return 0


def _simulate_all(trace: Trace, names: tuple[str, ...], base: RunSettings) -> dict[str, SimResult]:
    total = trace.num_steps * len(names)
    is_quiet = trace.num_responses * len(names) < PROGRESS_MIN_RESPONSES or not sys.stderr.isatty()
    results = {}
    with tqdm(total=total, desc="replay", unit="step", disable=is_quiet) as bar:
        for name in names:
            bar.set_postfix_str(name)
            results[name] = run_settings(
                dataclasses.replace(base, policy=name), trace, progress=bar.update
            )
    return results


# -- outputs ----------------------------------------------------------------------------------------


def comparison(
    results: dict[str, SimResult], sim: SimConfig, profile: Path | None = None
) -> tuple[list[dict[str, Any]], float]:
    """Per-policy summary rows (speedup vs NoSpec when it ran) and the mean ideal rollout time
    over the strategies every policy used (one lower bound for all of them)."""
    cost = with_profile(profile, cost_model(sim))
    strategies = sorted(
        set().union(*(r.strategies_used for r in results.values())), key=lambda d: d.strategy
    )
    first = next(iter(results.values()))
    ideal = [
        ideal_rollout_s(shares, cost, sim.max_running_requests, strategies)
        for shares in first.shares
    ]
    mean_ideal = sum(ideal) / len(ideal) if ideal else 0.0
    base = results.get("nospec")
    rows = []
    for result in results.values():
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
        row["rollout_over_ideal"] = row["mean_rollout_s"] / mean_ideal if mean_ideal > 0 else 0.0
        rows.append(row)
    return rows, mean_ideal


def write_outputs(
    out: Path,
    trace: Trace,
    results: dict[str, SimResult],
    sim: SimConfig,
    profile: Path | None = None,
) -> dict[str, Any]:
    rows, mean_ideal = comparison(results, sim, profile)
    summary = {
        "kind": "replay",
        "trace": trace.summary(),
        "mean_ideal_rollout_s": mean_ideal,
        "policies": rows,
    }
    write_json(out / "summary.json", summary)
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
    return summary


def _fmt(frame: pd.DataFrame) -> str:
    return frame.to_string(index=False, float_format=lambda v: f"{v:,.2f}")


def print_report(
    results: dict[str, SimResult], out: Path, max_rows: int = 12, profile: Path | None = None
) -> None:
    """Per-step table (first and last steps when long) and the summary / side-by-side table."""
    names = list(results)
    first = results[names[0]]
    if len(names) == 1:
        f = first.steps_frame()
        table = pd.DataFrame(
            {
                "step": f.step,
                "rollout_s": f.rollout_s,
                "train_s": f.train_s,
                "step_s": f.step_s,
                "rollout_%": 100 * f.rollout_s / f.step_s,
                "bubble_%": 100 * f.bubble_gpu_s / (f.rollout_s * first.config.num_gpus),
                "max_tail_s": f.max_tail_s,
                "tokens": f.tokens_generated,
            }
        )
    else:
        table = pd.DataFrame({"step": first.steps_frame().step})
        for name in names:
            table[f"{name}_step_s"] = results[name].steps_frame().step_s
    if len(table) > max_rows:
        print(
            f"per step ({len(table)} steps; first and last {max_rows // 2}; all in {out / 'steps.csv'}):"
        )
        table = pd.concat([table.head(max_rows // 2), table.tail(max_rows // 2)])
    else:
        print("per step:")
    print(_fmt(table))
    rows, mean_ideal = comparison(results, first.config, profile)
    cols = {
        "policy": "policy",
        "mean_step_s": "step_s",
        "mean_rollout_s": "rollout_s",
        "rollout_share": "rollout_share",
        "bubble_fraction": "bubble_frac",
        "speedup_vs_nospec": "speedup",
        "bubble_reclaimed_gpu_s": "reclaimed_gpu_s",
        "drafter_train_gpu_s": "drafter_gpu_s",
        "mean_accept_len": "accept_len",
        "sd_on_fraction": "sd_on_frac",
        "rollout_over_ideal": "rollout/ideal",
    }
    frame = pd.DataFrame(rows)
    frame = frame[[c for c in cols if c in frame]].rename(columns=cols)
    print(
        f"\nsummary (ideal rollout, the work spread perfectly with no tail: {mean_ideal:,.2f} s per step):"
    )
    print(_fmt(frame))
    print(
        f"\nwrote {out}/: config.json summary.json steps.csv instances.csv timeline.parquet responses.parquet"
    )
