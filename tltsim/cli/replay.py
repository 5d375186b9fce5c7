"""``tltsim replay``: simulate a trace under one or more policies and write the results.

    tltsim replay traces/synth_reasoning_rl.json --preset h100x8-qwen7b
    tltsim replay traces/servegen_r1_rl.json --num-gpus 64 --policy nospec,tlt --out results/r1
    tltsim report results/r1

Flags map 1:1 onto ``SimConfig`` (cluster; ``--spot-startup-s``, ``--spot-checkpoint-s`` and
``--drafter-update-tokens`` are its fields too), ``ReplayConfig`` (what to run), ``TLTConfig``
(``--tlt-*``), ``DrafterDynamics`` (``--drafter-*``), ``SpotTrainerConfig`` (``--spot-*``) and
``HistoryModel`` (``--history-*``), besides the file flags ``--profile``,
``--drafter-dynamics`` and ``--hardware-file``.
``--profile FILE`` (``tltrun profile``) replaces the roofline by the measured profile, which the
roofline still backs for ops the profile lacks; ``--drafter-dynamics FILE`` (``tltsim fit``)
sets the ``--drafter-*`` defaults. ``tltbase`` takes TLT's switch and bandit settings and
``--tlt-history-strategies``; ``--tlt-strategies`` / ``--tlt-bucket-starts`` too (as ``tltrun
train --policy tltbase`` does) unless ``tlt`` is replayed beside it, whose EAGLE arms they are.
``--preset`` fills the cluster fields first; explicit flags override it. The output directory
(default ``results/replay-<trace stem>``) gets ``config.json`` (everything resolved),
``summary.json`` and ``summary.csv``, ``steps.csv``, ``instances.csv``, ``timeline.parquet`` and
``responses.parquet``; ``tltsim report DIR`` draws the figures.

Each speedup vs NoSpec comes with an interval (``tltsim.sim.intervals``), min-max over what
was asked for: ``--seeds 0,1,2`` / ``--num-seeds N`` (a replay per seed),
``--accept-rate-range 0.9,1.1`` or ``fit`` (replays at both ends of the acceptance model's
uncertainty) and ``--cost-error 0.1`` (SD iteration seconds -/+ 10%, on by default: it needs no
extra simulation). Printed as ``1.84x [1.71-1.95]``; without ``nospec`` in ``--policy`` there
is none (a warning says so where seeds or an acceptance range were asked for).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import warnings
from pathlib import Path
from typing import Any

import pandas as pd

from tltsim.cli.args import add_dataclass_args, check_out_dir, dataclass_from_args, given_fields
from tltsim.cli.fidelity import (
    add_profile_args,
    dynamics_from_args,
    extrapolation_lines,
    history_from_args,
)
from tltsim.cli.table import format_table
from tltsim.cost.calibrated import (
    CalibratedCost,
    is_preset_file,
    load_hardware_preset,
)
from tltsim.cost.measured import profile_gaps
from tltsim.cost.presets import apply_preset
from tltsim.cost.profile import load_profile
from tltsim.errors import InputWarning, UsageError
from tltsim.jsonio import remove_stale_outputs, write_json
from tltsim.policy import SpotTrainerConfig, TLTConfig
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import SimConfig
from tltsim.sim.history_acceptance import HistoryModel
from tltsim.sim.intervals import describe, described_sources
from tltsim.sim.metrics import SimResult
from tltsim.sim.replay import (
    RESULT_FILES,
    ReplayConfig,
    RunSettings,
    cost_model,
    fit_domain_note,
    interval_spec,
    kv_overflow_lines,
    policy_names,
    replay_cost,
    replay_intervals,
    simulate_policies,
    tltbase_policy,
    write_outputs,
)
from tltsim.trace.files import load_trace, trace_stem
from tltsim.trace.schema import Trace

# Summary columns: result key -> printed title.
SUMMARY_COLUMNS = {
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
OUTPUT_FILES = (
    "config.json summary.json summary.csv steps.csv instances.csv timeline.parquet "
    "responses.parquet"
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``tltsim replay``."""
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
    add_dataclass_args(p, HistoryModel, prefix="history-")  # the history drafter (#20)
    add_dataclass_args(p, SpotTrainerConfig, prefix="spot-")
    add_profile_args(p)  # --profile, --drafter-dynamics
    p.add_argument(
        "--hardware-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="hardware preset file (tltsim calibrate --out): the calibrated GPU replaces --hardware",
    )
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
    if _is_priced_by_profile(args):
        warnings.warn(
            f"--hardware-file {args.hardware_file}: not used: --profile {args.profile} measures "
            "every op a replay prices (a hardware file prices the ops a profile lacks)",
            InputWarning,
            stacklevel=2,
        )
    elif getattr(args, "hardware_file", None) is not None:
        sim = dataclasses.replace(sim, hardware=hardware_file_name(args.hardware_file))
        named = load_hardware_preset(args.hardware_file)[0].name
        if getattr(args, "hardware", None) not in (None, named):  # (the file won, unsaid)
            warnings.warn(
                f"--hardware {args.hardware}: --hardware-file {args.hardware_file} is a {named} "
                f"calibration, which replaces it: simulated on {named}",
                InputWarning,
                stacklevel=2,
            )
    profile = getattr(args, "profile", None)
    # one cost model for every simulation below, so that its extrapolation report covers them
    cost = replay_cost(sim, profile)
    trace = load_trace(args.trace)
    if replay.max_steps is not None:
        trace = Trace(meta=trace.meta, steps=trace.steps[: replay.max_steps])
    out = Path(replay.out) if replay.out else Path("results") / f"replay-{trace_stem(args.trace)}"
    names = policy_names(replay.policy)
    history = dataclass_from_args(
        HistoryModel, args, prefix="history-", base=history_from_args(args)
    )
    spec = interval_spec(replay, sim, drafter, getattr(args, "drafter_dynamics", None), history)
    if "nospec" not in names and (
        replay.seeds or replay.num_seeds > 1 or replay.accept_rate_range is not None
    ):
        warnings.warn(
            "--seeds/--num-seeds/--accept-rate-range give the speedup's interval against nospec, "
            f"which --policy {replay.policy} leaves out: no interval is computed",
            InputWarning,
            stacklevel=2,
        )
    # tltbase takes --tlt-strategies / --tlt-bucket-starts as tltrun train's does (where given),
    # unless tlt is replayed beside it (they are then tlt's EAGLE arms); checked here
    given = given_fields(TLTConfig, args, prefix="tlt-")
    tltbase_arms = tuple(
        (name, getattr(tlt, name))
        for name in ("strategies", "bucket_starts")
        if name in given and "tlt" not in names
    )
    if "tltbase" in names:
        try:
            tltbase_policy(RunSettings(sim, "tltbase", tlt, tltbase_arms=tltbase_arms))
        except ValueError as err:
            raise UsageError(f"--policy tltbase: {err}") from None
    check_out_dir(
        out, kind="replay"
    )  # after every check of the input (a refused replay left it empty)
    remove_stale_outputs(out, RESULT_FILES)
    sim = dataclasses.replace(sim, seed=spec.seeds[0])  # the point estimate's seed
    config = {
        "kind": "replay",
        "trace": str(args.trace),
        "replay": replay,
        "sim": sim,
        "tlt": tlt,
        "drafter": drafter,
        "history": history,
        "spot": spot,
        # the fitted file itself (its standard errors set --accept-rate-range fit's band)
        "drafter_dynamics_file": (
            None
            if getattr(args, "drafter_dynamics", None) is None
            else _file_record(Path(args.drafter_dynamics))
        ),
        "cost_model": cost_record(sim, profile),
        # speedups are against nospec: without it none is computed (intervals.speedup_intervals)
        "speedup_interval": describe(spec) if "nospec" in names else None,
    }
    write_json(out / "config.json", config)
    settings = RunSettings(
        sim,
        names[0],
        tlt,
        replay.static_strategy,
        drafter,
        spot,
        replay.is_spot_training,
        profile,
        history=history,
        tltbase_arms=tltbase_arms,
    )
    results = simulate_policies(trace, names, settings, cost)
    for line in kv_overflow_lines(results, cost):
        warnings.warn(line, InputWarning, stacklevel=2)
    intervals = replay_intervals(trace, names, settings, spec, results, cost)
    summary = write_outputs(out, trace, results, sim, profile, intervals, spec, cost)
    print(simulated_line(sim, trace, profile))
    print(format_report(results, summary, out))
    if _has_measured_acceptance(trace) and getattr(args, "drafter_dynamics", None) is None:
        print(  # (hunt: a measured run's 1.08 replayed as the defaults' 4.47, unsaid)
            "note: the trace's measured acceptance is not replayed (the default dynamics are): "
            "tltsim fit it and replay with --drafter-dynamics, or tltsim compare it"
        )
    for line in extrapolation_lines(cost):
        print(line)
    line = fit_domain_note(trace, sim)
    if line is not None:
        print(line)
    return 0


def _is_priced_by_profile(args: argparse.Namespace) -> bool:
    """A --hardware-file beside a --profile that measures every op (hunt: its fit warnings and
    extrapolation notes were said of a file that priced nothing)."""
    if getattr(args, "hardware_file", None) is None or getattr(args, "profile", None) is None:
        return False
    return not profile_gaps(load_profile(args.profile))["ops_not_measured"]


def cost_record(sim: SimConfig, profile: Path | None) -> dict[str, Any]:
    """The cost model as it ran, for config.json: the model and hardware specs, the calibration
    a calibrated GPU or --hardware-file applies (its numbers, not only the roofline fractions
    it replaces), and the files read with their sha256 (a path alone does not say which
    calibration or profile a result came from)."""
    model = cost_model(sim)
    record: dict[str, Any] = {
        "model": dataclasses.asdict(model.model),
        "hardware": dataclasses.asdict(model.hardware),
        "tp": sim.tp,
        "calibration": (
            dataclasses.asdict(model.params) if isinstance(model, CalibratedCost) else None
        ),
        "profile": None if profile is None else _profile_record(Path(profile)),
    }
    if is_preset_file(sim.hardware):
        record["hardware_file"] = _file_record(Path(sim.hardware))
    return record


def _profile_record(path: Path) -> dict[str, Any]:
    """The profile's file record and its gaps (a run that did not end, ops it lacks)."""
    return {**_file_record(path), **profile_gaps(load_profile(path))}


def _file_record(path: Path) -> dict[str, str]:
    return {
        "path": str(path.resolve()),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


def hardware_file_name(path: Path) -> str:
    """``path`` checked as a hardware preset file (one-line error if not), as the ``hardware``
    name SimConfig carries to ``tltsim.cost.calibrated.preset_cost``."""
    if not is_preset_file(str(path)):
        raise UsageError(
            f"--hardware-file {path}: expected a .json hardware preset (tltsim calibrate --out)"
        )
    load_hardware_preset(path)
    return str(path)


def step_rows(results: dict[str, SimResult]) -> list[dict[str, Any]]:
    """Per-step rows: one policy's time breakdown, or several policies' step times side by side."""
    names = list(results)
    first = results[names[0]]
    f = first.steps_frame()
    if len(names) == 1:
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
        table = pd.DataFrame({"step": f.step})
        for name in names:
            table[f"{name}_step_s"] = results[name].steps_frame().step_s
    return table.to_dict("records")


def simulated_line(sim: SimConfig, trace: Trace, profile: Path | None = None) -> str:
    """What was simulated, and the model the trace's lengths came from where its meta names
    another (a 70B run's lengths priced as the default 7B model said nothing); with a profile,
    whose times they are (the line named the preset's GPU for a CPU profile's times)."""
    cost = cost_model(sim)
    model, hardware = cost.model.name, cost.hardware.name  # a preset file's GPU, not its name
    line = f"simulated: {model} on {sim.num_gpus} x {hardware} (TP {sim.tp})"
    if profile is not None:
        machine = load_profile(profile).meta.get("hardware")
        on = f", measured on {machine}" if isinstance(machine, str) and machine else ""
        line += f", times from profile {profile}{on}"
    recorded = trace.meta.get("model")
    # by name: a model directory's path recorded by tltrun is the --model given (hunt)
    if isinstance(recorded, str) and recorded and Path(recorded).name != Path(model).name:
        line += f"; the trace's meta names model {recorded!r} (--model sets the one priced)"
    return line


def _has_measured_acceptance(trace: Trace) -> bool:
    """A measured run's trace (tltrun train/bench): per-response accept histograms."""
    return any(
        s.measured is not None and s.measured.response_accept_hist_by_strategy for s in trace.steps
    )


def _footnote(columns: dict[str, Any], num_steps: int) -> str:
    """What the summary's columns are, of those it shows (a tlt-only table has no
    reclaimed_gpu_s, and said it had)."""
    totals = [c for c in ("reclaimed_gpu_s", "drafter_gpu_s") if c in columns.values()]
    over = f"the {num_steps} steps" if num_steps != 1 else "the 1 step"
    return f"(step_s, rollout_s: means per step{'; ' if totals else ''}" + (
        f"{', '.join(totals)}: total{'s' if len(totals) > 1 else ''} over {over})"
        if totals
        else ")"
    )


def format_report(
    results: dict[str, SimResult], summary: dict[str, Any], out: Path, max_rows: int = 12
) -> str:
    """Per-step table (first and last steps when long) and the summary / side-by-side table of
    ``summary`` (``tltsim.sim.replay.write_outputs``' return value)."""
    rows = step_rows(results)
    if len(rows) > max_rows:
        half = max_rows // 2
        title = f"per step ({len(rows)} steps; first and last {half}; all in {out / 'steps.csv'}):"
        rows = rows[:half] + rows[-half:]
    else:
        title = "per step:"
    policies = [with_speedup_text(row) for row in summary["policies"]]
    columns = {k: v for k, v in SUMMARY_COLUMNS.items() if any(k in row for row in policies)}
    return "\n".join(
        [
            title,
            format_table(rows, list(rows[0]) if rows else ["step"], float_format=",.2f"),
            "",
            "summary (ideal rollout, per step the larger of the work spread perfectly and the "
            f"longest response alone: {summary['mean_ideal_rollout_s']:,.2f} s per step; work "
            f"bound {summary['mean_ideal_work_s']:,.2f} s, critical path "
            f"{summary['mean_ideal_critical_path_s']:,.2f} s):",
            format_table(policies, columns, left=("policy",), float_format=",.2f"),
            _footnote(columns, summary["policies"][0]["num_steps"]),
            *interval_lines(summary.get("speedup_interval")),
            "",
            f"wrote {out}/: {OUTPUT_FILES}",
        ]
    )


def with_speedup_text(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its speedup as text, ``1.84x [1.71-1.95]`` when it has an interval."""
    if "speedup_vs_nospec" not in row:
        return row
    text = f"{row['speedup_vs_nospec']:.2f}x"
    if "speedup_vs_nospec_low" in row:
        text += f" [{row['speedup_vs_nospec_low']:.2f}-{row['speedup_vs_nospec_high']:.2f}]"
    return row | {"speedup_vs_nospec": text}


def interval_lines(described: dict[str, Any] | None) -> list[str]:
    """What the speedup intervals include (``tltsim.sim.intervals.describe``)."""
    parts = described_sources(described)
    return [f"speedup interval: min-max over {'; '.join(parts)}"] if parts else []
