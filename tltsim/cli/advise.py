"""``tltsim advise``: "should I use TLT on this workload, and with which settings?" (issue #21).

    tltsim advise traces/synth_reasoning_rl.json --preset h100x8-qwen7b
    tltsim advise my_trace.json --preset h100x64-qwen7b --hardware-file h100.json --num-seeds 3
    tltsim advise my_trace.json --preset h100x8-qwen7b --model ~/models/Qwen3-4B --num-gpus 16

Runs the sweep a user would run (``tltsim.sim.sweep``: TLTAdaptive's threshold x strategy set x
spot training on/off, each against NoSpec, over ``--num-seeds`` seeds), takes the setting with
the best mean step speedup, and replays it against NoSpec for its speedup interval
(``tltsim.sim.intervals``: the seeds, the accept-rate band and the cost model's calibration
error). Prints one recommendation: the expected step speedup with its interval, the fraction of
decode time SD is on, the idle GPU-seconds reclaimed per step, and the settings as a ready
``tltrun train`` config block (keys = ``tltrun.train.config.TrainConfig`` field names) and a
fastrl-style block (keys as cited in ``tltsim.policy.tlt_config.TLTConfig``). The output directory
(default ``results/advise-<trace stem>``) gets ``advise.json`` (everything printed, resolved
settings included), ``train.toml``, ``fastrl.yaml`` and the sweep's own directory
(``sweep.toml`` + its outputs: rerun or extend it with ``tltsim sweep``).

Strategy sets (each has four verify-token sizes, one per default bandit bucket 1, 2-4, 5-20, 21+):
``fastrl`` TLT's public trees 8_4_{48,32,16,8}; ``small-trees`` 8_4_{32,16,8} + chain 4_1_4;
``chains`` 4_1_4, 3_1_3, 2_1_2, 1_1_1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tltsim.cli.args import add_dataclass_args, check_out_dir, dataclass_from_args
from tltsim.cost.presets import CLUSTER_PRESETS, apply_preset
from tltsim.cost.specs import HARDWARE_PRESETS, is_model_path
from tltsim.errors import InputWarning, UsageError
from tltsim.jsonio import remove_stale_outputs, write_json
from tltsim.policy import SpotTrainerConfig, TLTConfig
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import MAX_SIMULATIONS, SimConfig
from tltsim.sim.history_acceptance import HistoryModel
from tltsim.sim.intervals import (
    DEFAULT_COST_ERROR,
    IntervalSpec,
    accept_band,
    describe,
    described_sources,
)
from tltsim.sim.replay import (
    RunSettings,
    comparison,
    cost_model,
    fit_domain_note,
    kv_overflow_lines,
    replay_intervals,
    simulate_policies,
)
from tltsim.sim.sweep import run_sweep
from tltsim.trace.files import load_trace, trace_stem
from tltsim.trace.schema import Trace

STRATEGY_SETS: dict[str, tuple[str, ...]] = {
    "fastrl": TLTConfig().strategies,  # mit-han-lab/fastrl's public configuration
    "small-trees": ("8_4_32", "8_4_16", "8_4_8", "4_1_4"),
    "chains": ("4_1_4", "3_1_3", "2_1_2", "1_1_1"),
}


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, kw_only=True)
class AdviseConfig:
    """What ``tltsim advise`` sweeps and how it reports (one flag per field)."""

    preset: str = field(
        default="h100x8-qwen7b", metadata=_help("cluster preset: " + ", ".join(CLUSTER_PRESETS))
    )
    # the user's own cluster and model over the preset's (a preset's 8 or 64 GPUs, Qwen2.5-7B)
    model: str | None = field(
        default=None,
        metadata=_help(
            "target model over the preset's: a preset name, or a Hugging Face config.json or "
            "model directory"
        ),
    )
    hardware: str | None = field(
        default=None,
        metadata=_help("GPU over the preset's: " + ", ".join(HARDWARE_PRESETS)),
    )
    num_gpus: int | None = field(default=None, metadata=_help("GPUs over the preset's"))
    tp: int | None = field(default=None, metadata=_help("tensor-parallel degree over the preset's"))
    # 16, 32, 64: TLT's default threshold (32, fastrl bs_threshold) and one bucket either side.
    thresholds: tuple[int, ...] = field(
        default=(16, 32, 64), metadata=_help("TLT thresholds to try (SD off above this batch)")
    )
    strategy_sets: tuple[str, ...] = field(
        default=("fastrl", "chains"),
        metadata=_help("strategy sets to try: " + ", ".join(STRATEGY_SETS)),
    )
    num_seeds: int = field(
        default=2, metadata=_help("seeds per setting (>= 2 adds the seeds to each interval)")
    )
    max_steps: int | None = field(default=None, metadata=_help("use only the first N steps"))
    accept_rate_range: str = field(
        default="0.9,1.1",
        metadata={
            "help": "accept-rate factors LOW,HIGH for the interval, or none",
            "metavar": "LOW,HIGH",
        },
    )
    cost_error: float = field(
        default=DEFAULT_COST_ERROR,
        metadata=_help("relative error of SD iteration seconds in the interval (0: none)"),
    )
    # all cores, as tltsim sweep (its sweep ran serially: 84 s of a 112 s advise on 2 cores)
    workers: int | None = field(
        default=None, metadata=_help("sweep worker processes (default: all cores)")
    )
    out: str | None = field(
        default=None,
        metadata={
            "help": "output directory (default results/advise-<trace stem>; a trace.json's: its directory's name)",
            "metavar": "DIR",
        },
    )

    def __post_init__(self) -> None:
        if self.preset not in CLUSTER_PRESETS:
            raise ValueError(
                f"--preset {self.preset!r}: expected one of {', '.join(CLUSTER_PRESETS)}"
            )
        # (the sweep's table holds int64: a larger one failed after advise wrote sweep.toml)
        if not self.thresholds or any(not 1 <= t <= 2**63 - 1 for t in self.thresholds):
            raise ValueError(
                f"--thresholds: expected integers in [1, 2^63 - 1], got {self.thresholds}"
            )
        bad = [s for s in self.strategy_sets if s not in STRATEGY_SETS]
        if bad or not self.strategy_sets:
            raise ValueError(
                f"--strategy-sets: unknown {', '.join(bad) or '(none)'}; expected some of {', '.join(STRATEGY_SETS)}"
            )
        if self.num_seeds < 1 or (self.workers is not None and self.workers < 1):
            raise ValueError("--num-seeds and --workers must be >= 1")
        if any(n is not None and n < 1 for n in (self.num_gpus, self.tp)):
            raise ValueError("--num-gpus and --tp must be >= 1")
        # the sweep: thresholds x strategy sets x spot training on/off, each per seed
        num_simulations = len(self.thresholds) * len(self.strategy_sets) * 2 * self.num_seeds
        if num_simulations > MAX_SIMULATIONS:
            raise ValueError(
                f"--num-seeds {self.num_seeds}: {num_simulations} simulations, at most "
                f"{MAX_SIMULATIONS}"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.max_steps}")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``tltsim advise``."""
    p = sub.add_parser(
        "advise",
        help="sweep TLT's settings on a trace and recommend one, with its speedup interval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", type=Path, help="tlt-trace file (.json, .json.gz, .csv, .parquet)")
    add_dataclass_args(p, AdviseConfig)
    p.add_argument(
        "--hardware-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="hardware preset file (tltsim calibrate --out) replacing the preset's GPU",
    )
    p.set_defaults(func=cmd_advise)


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes, except that characters beyond U+FFFF stay as they
    are (JSON's surrogate-pair escapes are not valid TOML)."""
    return json.dumps(text, ensure_ascii=False)


def cluster_overrides(config: AdviseConfig) -> dict[str, Any]:
    """The SimConfig fields ``config`` sets over its preset (a model path made absolute: the
    sweep resolves paths beside its spec)."""
    fields = {"model": config.model, "hardware": config.hardware, "num_gpus": config.num_gpus,
              "tp": config.tp}  # fmt: skip
    if config.model is not None and is_model_path(config.model):
        fields["model"] = str(Path(config.model).resolve())
    return {k: v for k, v in fields.items() if v is not None}


def sweep_toml(trace: Path, config: AdviseConfig, hardware: str | None) -> str:
    """The sweep spec a user would write for this question (TOML)."""
    fixed: dict[str, Any] = {"preset": config.preset, "policy": "tlt"}
    if hardware is not None:
        fixed["hardware"] = hardware
    fixed.update(cluster_overrides(config))
    lines = [
        f"trace = {_toml_string(str(trace.resolve()))}",
        f"seeds = {json.dumps(list(range(config.num_seeds)))}",
    ]
    if config.max_steps is not None:
        lines.append(f"max_steps = {config.max_steps}")
    lines.append("[fixed]")
    lines += [
        f"{k} = {_toml_string(v) if isinstance(v, str) else json.dumps(v)}"
        for k, v in fixed.items()
    ]
    lines.append("[grid]")
    lines.append(f'"tlt.threshold" = {json.dumps(list(config.thresholds))}')
    lines.append(
        f'"tlt.strategies" = {json.dumps([list(STRATEGY_SETS[s]) for s in config.strategy_sets])}'
    )
    lines.append("spot_training = [true, false]")
    return "\n".join(lines) + "\n"


def best_settings(summary: dict[str, Any], config: AdviseConfig) -> tuple[TLTConfig, bool]:
    """The sweep's best point as (TLTConfig, spot training on). The summary names only the
    settings that varied; one the sweep held at a single value is ``config``'s (its one
    threshold or strategy set), never TLTConfig's default."""
    best = summary["best"]
    if not best:
        raise UsageError("advise: the sweep produced no speculating point")
    threshold = int(best.get("tlt.threshold", config.thresholds[0]))
    if "tlt.strategies" in best:
        strategies = tuple(str(best["tlt.strategies"]).split(","))
    else:
        strategies = STRATEGY_SETS[config.strategy_sets[0]]
    tlt = dataclasses.replace(TLTConfig(), threshold=threshold, strategies=tuple(strategies))
    return tlt, bool(best.get("is_spot_training", True))


def train_toml(tlt: TLTConfig, is_spot_training: bool) -> str:
    """A ``tltrun train`` config block; keys are TrainConfig field names."""
    return "\n".join(
        [
            'policy = "tlt"',
            f"tlt_threshold = {tlt.threshold}",
            f"tlt_strategies = {json.dumps(list(tlt.strategies))}",
            f"tlt_bucket_starts = {json.dumps(list(tlt.bucket_starts))}",
            f"tlt_drafters = {json.dumps(list(tlt.drafters))}",
            f"is_spot_training = {'true' if is_spot_training else 'false'}",
        ]
    )


def fastrl_yaml(tlt: TLTConfig, is_spot_training: bool) -> str:
    """The ``speculative`` section of fastrl's Hydra config (mit-han-lab/fastrl,
    verl/trainer/config/fastrl_trainer.yaml at bce3df7): SD settings under ``eagle`` (the first
    strategy as spec_steps/spec_topk/spec_verify_tokens, which fastrl appends to mab_configs;
    the others quoted, as YAML reads 8_4_32 unquoted as the integer 8432), drafter training
    under ``train`` (enable_drafter_training; training_interval_steps 1: fastrl collects the
    drafter's data every that many RL steps, ray_trainer.py, and TLT as simulated trains every
    step). What fastrl cannot set is said in comments."""
    first = tlt.strategies[0].split("_")
    lines = [
        "speculative:",
        "  enable: true",
        '  spec_strategy: "eagle"',
        f"  bs_threshold: {tlt.threshold}",
        "  eagle:",
        f"    spec_steps: {first[0]}",
        f"    spec_topk: {first[1]}",
        f"    spec_verify_tokens: {first[2]}",
        '    tune_algorithm: "BEG"',
        f"    mab_configs: {json.dumps(list(tlt.strategies[1:]))}",
        f"    mab_bs_threshold: {json.dumps(list(tlt.bucket_starts))}",
        "  train:",
        f"    enable_drafter_training: {'true' if is_spot_training else 'false'}",
    ]
    if is_spot_training:
        lines.append("    training_interval_steps: 1")
    # fastrl hard-codes its SD warm-up (10 checks, eagle_worker.py) and has no history drafter
    lines.append(f"# SD warm-up checks: {tlt.warmup_checks} (a constant in fastrl: 10)")
    if tlt.drafters != ("eagle",):
        lines.append(f"# drafters {','.join(tlt.drafters)}: fastrl drafts with EAGLE only")
    return "\n".join(lines)


def recommend(
    trace: Trace, sim: SimConfig, tlt: TLTConfig, is_spot_training: bool, spec: IntervalSpec
) -> dict[str, Any]:
    """NoSpec and the chosen TLT setting replayed at ``spec``'s first seed, with the speedup
    interval over ``spec``; the summary row of TLT (``tltsim.sim.replay.comparison``)."""
    names = ("nospec", "tlt")
    base = RunSettings(
        sim=dataclasses.replace(sim, seed=spec.seeds[0], is_timeline_recorded=False),
        policy="nospec",
        tlt=tlt,
        spot=SpotTrainerConfig(),
        is_spot_training=is_spot_training,
    )
    results = simulate_policies(trace, names, base)
    for line in kv_overflow_lines(results, cost_model(base.sim)):
        warnings.warn(line, InputWarning, stacklevel=2)
    intervals = replay_intervals(trace, names, base, spec, results)
    rows, ideal = comparison(results, base.sim, None, intervals)
    row = next(r for r in rows if r["policy"] == "tlt")
    return {**row, **ideal, "num_steps": trace.num_steps}


# what an advice writes besides its sweep (advise.json last)
RESULT_FILES = ("train.toml", "fastrl.yaml", "advise.json")


def cmd_advise(args: argparse.Namespace) -> int:
    try:
        config = dataclass_from_args(AdviseConfig, args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    hardware = None
    if args.hardware_file is not None:
        from tltsim.cli.replay import hardware_file_name

        if config.hardware is not None:  # (replay warns and takes the file; here: one of them)
            raise UsageError(
                f"--hardware {config.hardware} and --hardware-file {args.hardware_file}: give "
                "one (the file names its GPU)"
            )

        hardware = hardware_file_name(args.hardware_file)
    spec = interval_spec(config)  # a bad band or cost error is refused before the sweep runs
    try:  # and a bad model or cluster (the sweep would name its own spec file, not the flag)
        sim = dataclasses.replace(
            apply_preset(SimConfig(), config.preset), **cluster_overrides(config)
        )
        if hardware is not None:
            sim = dataclasses.replace(sim, hardware=hardware)
        cost = cost_model(sim)
    except (ValueError, UsageError) as err:  # named by the flags that made the cluster
        given = {"preset": config.preset, **cluster_overrides(config)}
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
        raise UsageError(f"advise {flags}: {err}") from None
    trace = load_trace(args.trace)
    if config.max_steps is not None:
        trace = Trace(meta=trace.meta, steps=trace.steps[: config.max_steps])
    out = Path(config.out or Path("results") / f"advise-{trace_stem(args.trace)}")
    check_out_dir(out, kind="advise")
    out.mkdir(parents=True, exist_ok=True)
    # an earlier advice is removed first: an interrupted run left it beside the new sweep.toml
    remove_stale_outputs(out, RESULT_FILES)
    spec_path = out / "sweep.toml"
    # the spec resolves a relative preset file beside itself: written absolute, as the trace
    spec_path.write_text(
        sweep_toml(args.trace, config, None if hardware is None else str(Path(hardware).resolve())),
        encoding="utf-8",
    )
    outcome = run_sweep(spec_path, out / "sweep", config.workers)
    summary = json.loads((outcome.out / "summary.json").read_text())
    tlt, is_spot = best_settings(summary, config)
    row = recommend(trace, sim, tlt, is_spot, spec)
    report = {
        "kind": "advise",
        "trace": str(args.trace),
        "config": config,
        "sim": sim,
        # the model and GPU as priced (a path alone does not say which config it held)
        "model": dataclasses.asdict(cost.model),
        "hardware": dataclasses.asdict(cost.hardware),
        "recommendation": {
            "tlt": tlt,
            "is_spot_training": is_spot,
            "speedup_vs_nospec": row["speedup_vs_nospec"],
            "speedup_vs_nospec_low": row.get("speedup_vs_nospec_low"),
            "speedup_vs_nospec_high": row.get("speedup_vs_nospec_high"),
            "sd_on_fraction": row["sd_on_fraction"],
            "idle_gpu_s_reclaimed_per_step": row["bubble_reclaimed_gpu_s"] / row["num_steps"],
            "drafter_train_gpu_s_per_step": row["drafter_train_gpu_s"] / row["num_steps"],
            "mean_step_s": row["mean_step_s"],
            "rollout_over_ideal": row["rollout_over_ideal"],
        },
        "speedup_interval": describe(spec),
        "sweep": {
            "dir": str(outcome.out),
            "best": summary["best"],
            "runner_up": summary["runner_up"],
            "is_best_distinguishable": summary["is_best_distinguishable"],
            "speedup_interval_over_seeds": summary["speedup_interval_over_seeds"],
        },
        "notes": notes(trace, sim),
        "train_toml": train_toml(tlt, is_spot),
        "fastrl_yaml": fastrl_yaml(tlt, is_spot),
    }
    (out / "train.toml").write_text(report["train_toml"] + "\n")
    (out / "fastrl.yaml").write_text(report["fastrl_yaml"] + "\n")
    write_json(out / "advise.json", report)  # last: the mark of a finished advice
    print(format_advice(report, out))
    return 0


def notes(trace: Trace, sim: SimConfig) -> list[str]:
    """What the recommendation cannot tell from this trace, and where a calibrated preset
    file extrapolates (``fit_domain_note``)."""
    num_steps = trace.num_steps
    first = DrafterDynamics().first_step_training_shows()  # the sweep's (default) dynamics
    said = [] if (line := fit_domain_note(trace, sim)) is None else [line]
    if first is not None and num_steps > first:
        return said
    return [
        f"in {num_steps} step{'s' * (num_steps != 1)} spot training cannot raise the drafter's "
        "acceptance (it starts fully trained, and what a step trains serves the next step once "
        f"the target has moved): spot training on/off here weighs its checkpoint cost alone "
        f"({sim.spot_checkpoint_s:g} s a step)"
        + ("" if first is None else f"; replay {first + 1} or more steps to judge it"),
        *said,
    ]


def interval_spec(config: AdviseConfig) -> IntervalSpec:
    """The recommendation's interval: seeds, ``--accept-rate-range`` and ``--cost-error``."""
    if config.accept_rate_range.strip() == "fit":
        raise UsageError(
            "--accept-rate-range fit: advise takes LOW,HIGH or none (a band fitted by tltsim "
            "fit is replay's: tltsim replay --drafter-dynamics FILE --accept-rate-range fit)"
        )
    try:
        accept = (
            None
            if config.accept_rate_range == "none"
            else accept_band(DrafterDynamics(), config.accept_rate_range, None, HistoryModel())
        )
    except ValueError as err:  # accept_band's message offers 'fit', which advise does not take
        reason = str(err).replace(" or 'fit'", "")
        raise UsageError(
            f"--accept-rate-range {config.accept_rate_range!r}: expected LOW,HIGH (e.g. 0.9,1.1) "
            f"or none ({reason})"
        ) from None
    try:
        return IntervalSpec(
            seeds=tuple(range(config.num_seeds)), accept=accept, cost_error=config.cost_error
        )
    except ValueError as err:
        raise UsageError(str(err)) from None


def idle_line(r: dict[str, Any]) -> str:
    """The idle GPU-seconds TLT saves per step against NoSpec, said as a loss when negative (a
    slower TLT run idles more GPUs for longer, and "reclaimed -12.0" reads like a gain)."""
    reclaimed = r["idle_gpu_s_reclaimed_per_step"]
    if round(reclaimed, 1) == 0:  # (-0.04 read "0.0 MORE than NoSpec")
        return "idle GPU-seconds per step: as NoSpec's"
    if reclaimed >= 0:
        return f"idle GPU-seconds reclaimed per step: {reclaimed:,.1f}"
    return f"idle GPU-seconds per step: {-reclaimed:,.1f} MORE than NoSpec"


def format_advice(report: dict[str, Any], out: Path) -> str:
    """The printed recommendation."""
    from tltsim.cli.sweep import distinguishable_line

    r = report["recommendation"]
    tlt: TLTConfig = r["tlt"]
    interval = ""
    if r["speedup_vs_nospec_low"] is not None:
        interval = f" [{r['speedup_vs_nospec_low']:.2f}-{r['speedup_vs_nospec_high']:.2f}]"
    sources = "; ".join(described_sources(report["speedup_interval"])) or "nothing"
    low, high = r["speedup_vs_nospec_low"], r["speedup_vs_nospec_high"]
    low = r["speedup_vs_nospec"] if low is None else low
    high = r["speedup_vs_nospec"] if high is None else high
    if low > 1.0:
        verdict = "use TLT"
    elif high < 1.0:  # the whole interval below NoSpec: it would slow the run down
        verdict = (
            "do not use TLT: its best setting is slower than NoSpec on this workload "
            "(the config blocks below are for reference only)"
        )
    else:
        verdict = "TLT does not reliably pay on this workload"
    sim: SimConfig = report["sim"]
    model = report["model"]["name"]  # as priced: a config.json's is its directory's name
    hardware = report["hardware"]["name"]  # a preset file's GPU, not the file's name
    return "\n".join(
        [
            f"simulated: {model} on {sim.num_gpus} x {hardware} (TP {sim.tp})",
            f"recommendation: {verdict}",
            f"  threshold {tlt.threshold}, strategies {','.join(tlt.strategies)} "
            f"(buckets from {','.join(map(str, tlt.bucket_starts))}), spot training "
            f"{'on' if r['is_spot_training'] else 'off'}",
            f"  expected step speedup vs NoSpec: {r['speedup_vs_nospec']:.2f}x{interval} "
            f"(seed {report['speedup_interval']['seeds'][0]}'s replay; interval: min-max over "
            f"{sources})",
            f"  SD on for {100 * r['sd_on_fraction']:.0f}% of decode time; {idle_line(r)} "
            f"(drafter training used {r['drafter_train_gpu_s_per_step']:,.1f})",
            distinguishable_line(report["sweep"]),
            *(f"  note: {n}" for n in report["notes"]),
            "",
            "tltrun train config (TOML):",
            report["train_toml"],
            "",
            "fastrl-style config (YAML):",
            report["fastrl_yaml"],
            "",
            f"wrote {out}/: advise.json train.toml fastrl.yaml sweep.toml sweep/",
        ]
    )
