"""``tltsim fit`` and ``tltsim profile-info``, and the ``--profile`` / ``--drafter-dynamics``
helpers other subcommands (replay, compare) use (issue #7).

    tltsim fit runs/measured.json --out fitted_drafter.json [--strategy 4_1_4] [--fixed learn_tokens]
    tltsim profile-info profiles/cpu_torch.csv [--model Qwen2.5-0.5B|config.json] [--hardware H100-SXM|hw.json]

``tltsim.cli.main`` calls ``register``. For a subcommand that simulates::

    add_profile_args(parser)                       # --profile FILE, --drafter-dynamics FILE
    cost = cost_model_from_args(args, model_spec, hardware_spec, tp)   # RooflineCost or ProfileCost
    drafter = dataclass_from_args(DrafterDynamics, args, "drafter-", base=dynamics_from_args(args))
    ... simulate ...
    for line in extrapolation_lines(cost): print(line)

Errors are ``UsageError`` lines (``tltsim.cli.main.main`` exits 2).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from tltsim.cli.args import add_dataclass_args, check_out_file, dataclass_from_args
from tltsim.cli.table import format_fields, format_table
from tltsim.cost.calibrated import (
    CALIBRATIONS,
    PRESET_FORMAT,
    CalibratedCost,
    CalibrationParams,
    load_hardware_preset,
)
from tltsim.cost.measured import compare_to_roofline, summarize_comparison, with_profile
from tltsim.cost.profile import OPS, Profile, load_profile
from tltsim.cost.roofline import CostModel, RooflineCost
from tltsim.cost.specs import HARDWARE_PRESETS, MODEL_PRESETS, HardwareSpec, ModelSpec
from tltsim.errors import UsageError
from tltsim.fidelity.fit import (
    FitConfig,
    FitResult,
    fit_trace,
    load_dynamics,
    load_history,
    save_fit,
)
from tltsim.fidelity.fit_dynamics import DYNAMICS_FIELDS
from tltsim.fidelity.fit_history import LOGITS, HistoryFit
from tltsim.jsonio import typed_fields
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.history_acceptance import HistoryModel
from tltsim.trace.files import load_trace

# --- helpers for simulating subcommands -------------------------------------------------------


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    """``--profile FILE`` (measured cost profile) and ``--drafter-dynamics FILE`` (fit output)."""
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="PATH",
        help="measured cost profile CSV (tltrun profile); replaces the roofline, which still prices ops the profile lacks",
    )
    parser.add_argument(
        "--drafter-dynamics",
        type=Path,
        default=None,
        metavar="PATH",
        help="drafter dynamics fitted by tltsim fit --out; --drafter-* flags override its fields",
    )


def cost_model_from_args(
    args: argparse.Namespace, model_spec: ModelSpec, hardware_spec: HardwareSpec, tp: int
) -> CostModel:
    """The cost model a simulating subcommand should use: ``--profile`` if given, else roofline."""
    try:
        roofline = RooflineCost(model_spec, hardware_spec, tp=tp)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return with_profile(getattr(args, "profile", None), roofline)


def dynamics_from_args(args: argparse.Namespace) -> DrafterDynamics | None:
    """The fitted DrafterDynamics of ``--drafter-dynamics``, or None (defaults apply)."""
    path = getattr(args, "drafter_dynamics", None)
    return load_dynamics(path) if path is not None else None


def history_from_args(args: argparse.Namespace) -> HistoryModel | None:
    """The history drafter's model fitted beside the dynamics in ``--drafter-dynamics``, or
    None (HistoryModel defaults apply)."""
    path = getattr(args, "drafter_dynamics", None)
    return load_history(path) if path is not None else None


def extrapolation_lines(cost: Any) -> list[str]:
    """Lines saying where a ``ProfileCost`` left its measured grid (none for the roofline)."""
    report = getattr(cost, "extrapolation_report", None)
    if report is None:
        return []
    return ["profile: " + line for line in report()]


# --- tltsim fit ------------------------------------------------------------------------------------

PARAMETER_COLUMNS = {"name": "parameter", "value": "value", "stderr": "stderr", "status": "status"}
FIT_STEP_COLUMNS = {
    "step": "step",
    "num_verifies": "verifies",
    "accept_rate": "accept",
    "stderr": "stderr",
    "predicted": "predicted",
    "resid_over_se": "resid/se",
    "trained_tokens": "trained",
}
FIT_STEP_FORMATS = {
    "accept_rate": ".4f",
    "stderr": ".4f",
    "predicted": ".4f",
    "resid_over_se": ".2f",
}


def format_fit(result: FitResult, source: str) -> str:
    """The fit as printed by ``tltsim fit``: parameters, the per-step table, then the history
    drafter's model when the trace drafted from the history."""
    parts = [] if result.fit is None else [_format_dynamics(result, source)]
    if result.fit is None:
        parts.append(
            f"{source}: no EAGLE-drafter verifies: DrafterDynamics kept at its base values"
        )
    if result.history is not None:
        parts.append(format_history_fit(result.history))
    return "\n".join(parts)


def format_history_fit(fit: HistoryFit) -> str:
    """The history drafter's fitted ``HistoryModel`` (``tltsim.fidelity.fit_history``)."""
    rows = [
        {
            "name": name,
            "value": getattr(fit.model, name),
            "stderr": fit.stderr.get(name),
            "status": "fitted" if name in fit.stderr else "held: " + fit.held.get(name, ""),
        }
        for name in LOGITS + ("sibling_rate",)
    ]
    return "\n".join(
        [
            f"history drafter: {fit.num_responses:,} responses, {fit.num_verifies:,} verifies; "
            f"accept length measured {fit.mean_accept_len:.3f}, fitted model {fit.predicted_accept_len:.3f}",
            format_table(
                rows, PARAMETER_COLUMNS, {"value": ".6g", "stderr": ".3g"}, left=("name", "status")
            ),
        ]
    )


def _format_dynamics(result: FitResult, source: str) -> str:
    fit, steps = result.fit, result.steps
    observed = [s for s in steps if s.hists]
    stderr = dict(fit.stderr)
    if result.sibling_rate_se is not None:
        stderr["sibling_rate"] = result.sibling_rate_se
    parameters = [
        {
            "name": name,
            "value": getattr(result.dynamics, name),
            "stderr": stderr.get(name),
            "status": "fitted"
            if name in stderr
            else "held: " + fit.held.get(name, "no tree verifies in the trace"),
        }
        for name in DYNAMICS_FIELDS + ("sibling_rate",)
    ]
    rows = []
    for s, pred in zip(steps, fit.predicted, strict=True):
        row = {
            "step": s.step,
            "num_verifies": 0,
            "predicted": pred,
            "trained_tokens": s.trained_tokens,
        }
        if s.hists:  # steps without SD verifies have no measured acceptance
            resid = (s.accept_rate - pred) / s.stderr if s.stderr > 0 else 0.0
            row.update(
                num_verifies=s.num_verifies,
                accept_rate=s.accept_rate,
                stderr=s.stderr,
                resid_over_se=resid,
            )
        rows.append(row)
    return "\n".join(
        [
            f"{source}: {len(steps)} steps, {len(observed)} with SD verifies ({sum(s.num_verifies for s in observed):,} verifies), "
            f"{sum(s.trained_tokens for s in steps):,} drafter tokens trained",
            format_table(
                parameters,
                PARAMETER_COLUMNS,
                {"value": ".6g", "stderr": ".3g"},
                left=("name", "status"),
            ),
            _chi2_line(fit.chi2_per_dof, len(observed), len(fit.fitted)),
            format_table(rows, FIT_STEP_COLUMNS, FIT_STEP_FORMATS),
        ]
    )


def _chi2_line(chi2_per_dof: float, num_steps: int, num_fitted: int) -> str:
    counts = f"{num_steps} steps, {num_fitted} parameters"
    if not math.isfinite(chi2_per_dof):  # as many parameters as steps: an exact fit
        return f"chi2 per degree of freedom: - (no degree of freedom left: {counts})"
    return f"chi2 per degree of freedom: {chi2_per_dof:.3g} ({counts})"


def _cmd_fit(args: argparse.Namespace) -> int:
    config = dataclass_from_args(FitConfig, args)
    if args.out is not None:
        check_out_file(args.out)
    trace = load_trace(args.trace)
    base = load_dynamics(args.base) if args.base is not None else None
    history_base = load_history(args.base) if args.base is not None else None
    result = fit_trace(trace, config, str(args.trace), base, history_base)
    print(format_fit(result, str(args.trace)))
    if args.out is not None:
        save_fit(result, args.out, str(args.trace), config)
        print(f"wrote {args.out} (use it with --drafter-dynamics)")
    return 0


# --- tltsim profile-info -----------------------------------------------------------------------


def _model_spec(arg: str | None, profile: Profile) -> ModelSpec | None:
    source = arg if arg is not None else profile.meta.get("model")
    if isinstance(source, dict):
        try:
            return ModelSpec.from_hf_config(
                source, name=str(source.get("_name_or_path", "profiled model"))
            )
        except ValueError as err:
            raise UsageError(f"{profile.source}: sidecar field 'model': {err}") from None
    if source is not None and not isinstance(source, str):  # a sidecar's list, number, ...
        raise UsageError(
            f"{profile.source}: sidecar field 'model': expected a preset name or a config.json "
            f"object, got {type(source).__name__}"
        )
    if source is None or source in MODEL_PRESETS:
        return MODEL_PRESETS.get(source) if source else None
    if arg is not None:
        try:
            return ModelSpec.from_hf_config_file(arg)
        except ValueError as err:
            raise UsageError(
                f"--model: not a preset ({', '.join(MODEL_PRESETS)}) and {err}"
            ) from None
    return None


def profile_tp(arg: int | None, profile: Profile) -> int:
    """``--tp``, else the sidecar's ``tp`` (default 1); at least 1 either way."""
    tp = arg if arg is not None else profile.meta.get("tp", 1)
    if type(tp) is not int or tp < 1:
        where = "--tp" if arg is not None else f"{profile.source}: sidecar field 'tp'"
        raise UsageError(f"{where}: expected an integer >= 1, got {tp!r}")
    return tp


def _hardware_spec(arg: str | None, profile: Profile) -> HardwareSpec | None:
    return _hardware_and_calibration(arg, profile)[0]


def _hardware_and_calibration(
    arg: str | None, profile: Profile
) -> tuple[HardwareSpec | None, CalibrationParams | None]:
    """The GPU (a preset, a JSON file of HardwareSpec fields or a ``tltsim calibrate`` preset
    file) and its calibration (the preset file's, else the shipped one, else None)."""
    source = arg if arg is not None else profile.meta.get("hardware")
    if source is not None and not isinstance(source, str):  # a sidecar's list, object, ...
        raise UsageError(
            f"{profile.source}: sidecar field 'hardware': expected a preset name, got "
            f"{type(source).__name__}"
        )
    if source in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[source], CALIBRATIONS.get(source)
    if arg is None:
        return None, None
    path = Path(arg)
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(fields, dict) and fields.get("format") == PRESET_FORMAT:
            return load_hardware_preset(path)
        if not isinstance(fields, dict):
            raise TypeError(
                f"expected an object of HardwareSpec fields, got {type(fields).__name__}"
            )
        # each field's type first (true for a number was written out, and replay refused it)
        return HardwareSpec(**typed_fields(HardwareSpec, fields, f"{path}")), None
    except UsageError as err:
        raise UsageError(f"--hardware {arg}: {err}") from None
    except (OSError, TypeError, ValueError, RecursionError) as err:  # JSON/Unicode errors too
        raise UsageError(
            f"--hardware {arg}: not a preset ({', '.join(HARDWARE_PRESETS)}) nor a JSON file of HardwareSpec fields ({err})"
        ) from None


def _values(values: list[float]) -> str:
    found = sorted(set(values))
    shown = ", ".join(f"{v:g}" for v in found[:8])
    return shown + (f", ... ({len(found)} values)" if len(found) > 8 else "")


GRID_COLUMNS = {
    "op": "op",
    "num_points": "points",
    "batch": "batch",
    "tokens_per_seq": "tokens_per_seq",
    "context_per_seq": "context/seq",
}


def grid_table(profile: Profile) -> str:
    """Per op: how many points, and the values measured on each axis (``-``: not measured)."""
    rows = []
    for op in OPS:
        points = profile.rows_of(op)
        row: dict[str, Any] = {"op": op, "num_points": len(points)}
        if points:
            row.update(
                batch=_values([r.batch for r in points]),
                tokens_per_seq=_values([r.tokens_per_seq for r in points]),
                context_per_seq=_values([r.context_tokens / r.batch for r in points]),
            )
        rows.append(row)
    return format_table(
        rows, GRID_COLUMNS, left=("op", "batch", "tokens_per_seq", "context_per_seq")
    )


def _cmd_profile_info(args: argparse.Namespace) -> int:
    profile = load_profile(args.file)
    meta = {k: v for k, v in profile.meta.items() if k not in ("format", "version", "model")}
    print(f"{profile.source}: {len(profile.rows)} measured points")
    print(format_fields(meta))
    print(grid_table(profile))
    model = _model_spec(args.model, profile)
    hardware, calibration = _hardware_and_calibration(args.hardware, profile)
    if model is None or hardware is None:
        print("(no roofline comparison: pass --model and --hardware, presets or files)")
        return 0
    tp = profile_tp(args.tp, profile)
    try:
        roofline = RooflineCost(model, hardware, tp=tp)
        calibrated = (
            CalibratedCost(model, hardware, params=calibration, tp=tp)
            if calibration is not None
            else None
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    summary = summarize_comparison(compare_to_roofline(profile, roofline))
    print(f"measured / roofline ({model.name} on {hardware.name}, tp={tp}):")
    print(
        format_table(
            summary.to_dict("records"), list(summary.columns), left=("op",), float_format=".3g"
        )
    )
    if calibrated is None:
        print(
            f"(no calibrated comparison: {hardware.name} has no calibration; tltsim calibrate makes one)"
        )
        return 0
    print(f"roofline vs calibrated vs measured, median seconds per op ({calibration.source}):")
    print(
        format_table(
            three_way_rows(profile, roofline, calibrated),
            THREE_WAY_COLUMNS,
            left=("op",),
            float_format=".4g",
        )
    )
    return 0


THREE_WAY_COLUMNS = {
    "op": "op",
    "num_points": "points",
    "measured_s": "measured_s",
    "roofline_s": "roofline_s",
    "calibrated_s": "calibrated_s",
    "roofline_ratio": "measured/roofline",
    "calibrated_ratio": "measured/calibrated",
    "calibrated_max_error": "calibrated max |err|",
}


def three_way_rows(
    profile: Profile, roofline: CostModel, calibrated: CostModel
) -> list[dict[str, Any]]:
    """Per op: median measured, roofline and calibrated seconds, the median measured / model
    ratios, and the calibrated model's largest relative error on that op."""
    frame = compare_to_roofline(profile, roofline).rename(columns={"ratio": "roofline_ratio"})
    other = compare_to_roofline(profile, calibrated)
    frame["calibrated_s"] = other["roofline_s"]
    frame["calibrated_ratio"] = other["ratio"]
    frame["calibrated_error"] = (frame["calibrated_s"] / frame["seconds"] - 1).abs()
    rows = []
    for op in OPS:
        part = frame[frame.op == op]
        if len(part):
            rows.append(
                {
                    "op": op,
                    "num_points": len(part),
                    "measured_s": part.seconds.median(),
                    "roofline_s": part.roofline_s.median(),
                    "calibrated_s": part.calibrated_s.median(),
                    "roofline_ratio": part.roofline_ratio.median(),
                    "calibrated_ratio": part.calibrated_ratio.median(),
                    "calibrated_max_error": f"{100 * part.calibrated_error.max():.1f}%",
                }
            )
    return rows


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fit`` and ``profile-info`` to the ``tltsim`` command line."""
    fit = subparsers.add_parser(
        "fit",
        help="fit drafter-dynamics parameters to a measured trace",
        description="Fit DrafterDynamics (acceptance vs drafter training tokens, drift per RL step) and, from history-drafter arms, the HistoryModel to a measured run's accept histograms; method and trace contract: tltsim/fidelity/fit.py and fit_history.py docstrings.",
    )
    fit.add_argument(
        "trace",
        type=Path,
        help="measured tlt-trace (tltrun writes accept_hist and measured blocks)",
    )
    fit.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the fitted parameters as JSON (for --drafter-dynamics)",
    )
    fit.add_argument(
        "--base",
        type=Path,
        default=None,
        metavar="PATH",
        help="drafter-dynamics JSON whose values the held parameters keep (default: DrafterDynamics defaults)",
    )
    add_dataclass_args(fit, FitConfig)
    fit.set_defaults(func=_cmd_fit)

    info = subparsers.add_parser(
        "profile-info",
        help="print a measured profile's grid and how far the roofline and calibrated models are from it",
        description="Load and validate a profile CSV (schema: tltsim/cost/profile.py docstring); print its grid and, per op, measured / roofline seconds, then roofline vs calibrated vs measured seconds when the GPU has a calibration (shipped, or a tltsim calibrate preset file given as --hardware).",
    )
    info.add_argument("file", type=Path, help="profile CSV (its sidecar JSON next to it)")
    info.add_argument(
        "--model",
        default=None,
        metavar="NAME|PATH",
        help="model preset or config.json (default: the sidecar's model)",
    )
    info.add_argument(
        "--hardware",
        default=None,
        metavar="NAME|PATH",
        help="GPU preset, JSON file of HardwareSpec fields, or tltsim calibrate preset file (default: the sidecar's hardware, if a preset)",
    )
    info.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="TP degree of the roofline (default: the sidecar's tp)",
    )
    info.set_defaults(func=_cmd_profile_info)


__all__ = [
    "add_profile_args",
    "cost_model_from_args",
    "dynamics_from_args",
    "extrapolation_lines",
    "grid_table",
    "register",
]
