"""``tltsim calibrate``: fit the calibrated GPU cost model to a measured profile (issue #21).

    tltrun profile --device cuda --out profiles/h100_qwen7b.csv          # measure (on the GPU)
    tltsim calibrate profiles/h100_qwen7b.csv --hardware H100-SXM --model Qwen2.5-7B --out h100.json
    tltsim replay traces/synth_reasoning_rl.json --preset h100x8-qwen7b --hardware-file h100.json

The profile is a tlt-profile CSV (``tltsim.cost.profile``); its ``decode``, ``verify`` and
``drafter`` rows are fitted (scipy least squares on log seconds: the ``fit`` extra). Fields not
in ``--fit`` keep the GPU's shipped calibration (``tltsim.cost.calibrated.CALIBRATIONS``) or its
roofline limit. The output is a hardware preset file (datasheet fields + calibration + what it
was fitted to and how well) that ``replay --hardware-file`` and ``profile-info --hardware`` read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from tltsim.cli.args import check_out_file
from tltsim.cli.table import format_table
from tltsim.cost.calibrate import (
    BOUNDS,
    DEFAULT_FIT_FIELDS,
    FIT_OPS,
    CalibrationFit,
    fit_calibration,
)
from tltsim.cost.calibrated import (
    CALIBRATIONS,
    MAX_MEDIAN_FIT_ERROR,
    PRESET_FORMAT,
    CalibratedCost,
    CalibrationParams,
    is_preset_file,
    load_hardware_preset,
    save_hardware_preset,
)
from tltsim.cost.measured import INCOMPLETE_MARKS, compare_to_roofline
from tltsim.cost.profile import FORMAT as PROFILE_FORMAT
from tltsim.cost.profile import Profile, load_profile, sidecar_path
from tltsim.cost.specs import HardwareSpec, ModelSpec
from tltsim.errors import InputWarning, UsageError

PARAM_COLUMNS = {"name": "parameter", "value": "value", "status": "status"}
ERROR_COLUMNS = {
    "op": "op",
    "num_points": "points",
    "median_abs_error": "median |err|",
    "max_abs_error": "max |err|",
}


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``tltsim calibrate``."""
    p = sub.add_parser(
        "calibrate",
        help="fit the calibrated GPU cost model to a measured profile; write a hardware preset file",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "profile", type=Path, help="profile CSV (tltrun profile; its sidecar JSON next to it)"
    )
    p.add_argument(
        "--hardware",
        default=None,
        metavar="NAME|PATH",
        help="GPU preset or JSON file of HardwareSpec fields (default: the sidecar's hardware, a "
        "preset or the device name of a preset's exact variant, e.g. 'NVIDIA H200')",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="NAME|PATH",
        help="model preset or config.json (default: the sidecar's model)",
    )
    p.add_argument(
        "--tp", type=int, default=None, metavar="N", help="TP degree (default: the sidecar's tp)"
    )
    p.add_argument(
        "--fit",
        default=",".join(DEFAULT_FIT_FIELDS),
        metavar="LIST",
        help=f"calibration fields to fit, comma-separated, among {', '.join(BOUNDS)} "
        f"(default: {','.join(DEFAULT_FIT_FIELDS)}; the others keep the GPU's calibration)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="PATH",
        help="hardware preset file to write (default: <profile stem>-hardware.json beside the profile)",
    )
    p.set_defaults(func=cmd_calibrate)


def check_sidecar_agrees(
    args: argparse.Namespace, profile: Profile, model: ModelSpec, hardware: HardwareSpec
) -> None:
    """A ``--model`` of other shapes than the model the sidecar describes is refused (the fit
    would explain one model's times with another's bytes and FLOPs); a ``--hardware`` whose
    name the sidecar's device name does not contain gets a note (device names vary:
    'NVIDIA H100 80GB HBM3' is the H100-SXM preset)."""
    from tltsim.cli.profile_info import model_of_profile

    if args.model is not None and isinstance(profile.meta.get("model"), dict | str):
        measured = model_of_profile(None, profile)
        shapes = measured.shape_differences(model) if measured is not None else []
        if shapes:
            raise UsageError(
                f"--model {args.model}: not the model the profile measured "
                f"({args.profile}'s sidecar: {'; '.join(shapes)}); leave --model out to use "
                "the sidecar's"
            )
    device = profile.meta.get("hardware")
    family = hardware.name.split("-")[0].casefold()
    if args.hardware is not None and isinstance(device, str) and family not in device.casefold():
        print(
            f"note: --hardware {hardware.name}, but the profile was measured on {device!r} "
            "(the sidecar's device name)"
        )


def _check_not_a_sidecar(out: Path, profile: Path) -> None:
    """``--out h200.json`` beside ``h200.csv`` would replace the profile's own sidecar (its
    hardware, software and model record) with the preset: the profile could not be read again."""
    is_own = out.resolve() == sidecar_path(profile).resolve()
    try:
        is_other = json.loads(out.read_text(encoding="utf-8")).get("format") == PROFILE_FORMAT
    except (OSError, ValueError, AttributeError):
        is_other = False
    if is_own or is_other:
        raise UsageError(
            f"--out {out}: that is the sidecar of profile "
            f"{profile if is_own else out.with_suffix('.csv')}, which it would overwrite; name "
            f"another file (default {profile.stem}-hardware.json)"
        )


def _warn_at_bounds(fit: CalibrationFit) -> None:
    """One warning line naming the fitted parameters that ended on a bound of ``BOUNDS``: the
    curves' form did not fit this profile (a CPU profile sets every fraction to its floor), and
    the preset then mis-prices what it was fitted to."""
    values = dataclasses.asdict(fit.params)
    pinned = []
    for name in fit.fitted:
        lo, hi = BOUNDS[name]
        value = values[name]
        tol = 1e-6 * max(abs(lo), abs(hi))
        if value <= lo + tol or value >= hi - tol:
            pinned.append(f"{name} = {value:g} ({'lower' if value <= lo + tol else 'upper'})")
    if pinned:
        warnings.warn(
            f"fitted parameters at a bound: {', '.join(pinned)}; the calibrated curves do not "
            f"fit this profile (median |error| {100 * fit.median_abs_error:.1f}%): check the "
            "fit error below before using the preset",
            InputWarning,
            stacklevel=2,
        )


def _is_calibrated_preset(hardware: str) -> bool:
    """Whether ``--hardware`` names a calibrate --out file (not plain HardwareSpec fields)."""
    if not is_preset_file(hardware):
        return False
    try:
        return json.loads(Path(hardware).read_text(encoding="utf-8")).get("format") == PRESET_FORMAT
    except (OSError, ValueError, AttributeError):
        return False  # hardware_of_profile has named what is wrong with it


def fit_domain(fit: CalibrationFit) -> dict[str, Any]:
    """The batches and per-sequence contexts the fitted points span (outside them the preset
    extrapolates; it records them)."""
    batches = sorted({r.batch for r in fit.rows})
    contexts = [r.context_tokens / max(r.batch, 1) for r in fit.rows]
    return {"batches": batches, "min_context_tokens": min(contexts),
            "max_context_tokens": max(contexts)}  # fmt: skip


def _warn_poor_fit(fit: CalibrationFit, domain: dict[str, Any]) -> None:
    """A fit that does not describe its profile, or rests on too few batch sizes to say how
    costs grow with the batch, is written with a warning (it was written without a word)."""
    if fit.median_abs_error > MAX_MEDIAN_FIT_ERROR:
        warnings.warn(
            f"median |error| {100 * fit.median_abs_error:.0f}% over the fitted points (more than "
            f"{100 * MAX_MEDIAN_FIT_ERROR:.0f}%): the calibrated curves do not describe this "
            "profile, and replays with the preset will say so",
            InputWarning,
            stacklevel=2,
        )
    if len(domain["batches"]) < 3:
        warnings.warn(
            f"fitted on {len(domain['batches'])} batch size(s) ({domain['batches']}): how costs "
            "grow with the batch is extrapolated (profile more --batches)",
            InputWarning,
            stacklevel=2,
        )


def unfitted_error_rows(profile: Profile, cost: CalibratedCost) -> list[dict[str, Any]]:
    """Error rows of the profile's ops the fit does not take (prefill, sd_switch, train, ...)
    as the calibrated preset prices them: replays charge them so (the SD switch of the shipped
    H200 profile was priced 9x its measured time, and calibrate showed only the fitted ops)."""
    frame = compare_to_roofline(profile, cost)
    rows = []
    for op in dict.fromkeys(frame.op):
        if op in FIT_OPS:
            continue
        e = (frame[frame.op == op].roofline_s / frame[frame.op == op].seconds - 1).abs()
        rows.append({"op": f"{op} (not fitted)", "num_points": len(e),
                     "median_abs_error": f"{100 * e.median():.2f}%",
                     "max_abs_error": f"{100 * e.max():.2f}%"})  # fmt: skip
    return rows


def cmd_calibrate(args: argparse.Namespace) -> int:
    # the profile-info resolution
    from tltsim.cli.profile_info import hardware_of_profile, model_of_profile, profile_tp

    out = args.out or args.profile.with_name(f"{args.profile.stem}-hardware.json")
    if out.suffix != ".json":  # replay --hardware-file reads .json preset files only
        raise UsageError(f"--out {out}: a hardware preset is a .json file")
    _check_not_a_sidecar(out, args.profile)  # (first: it says more than "another format")
    check_out_file(out, file_format=PRESET_FORMAT)
    profile = load_profile(args.profile)
    model, hardware = (
        model_of_profile(args.model, profile),
        hardware_of_profile(args.hardware, profile),
    )
    if model is None or hardware is None:  # (it asked for both where one was missing)
        missing = [flag for flag, v in (("--model", model), ("--hardware", hardware)) if v is None]
        what = " or ".join("the model" if f == "--model" else "the hardware" for f in missing)
        raise UsageError(
            f"{args.profile}: need {' and '.join(missing)} (the sidecar names no preset for {what})"
        )
    check_sidecar_agrees(args, profile, model, hardware)
    tp = profile_tp(args.tp, profile, is_strict=True)
    fields = tuple(f.strip() for f in args.fit.split(","))
    if "" in fields:  # (fit_a,,fit_b was read as fit_a,fit_b)
        raise UsageError(f"--fit {args.fit}: an empty item")
    if len(set(fields)) != len(fields):
        raise UsageError(f"--fit {args.fit}: a parameter is named twice")
    # what the fit does not touch keeps the GPU's calibration: a preset file's own (a refit of
    # some fields reset its fitted overheads to the roofline's), else the shipped one
    if args.hardware is not None and _is_calibrated_preset(args.hardware):
        base = load_hardware_preset(args.hardware)[1]
    else:
        base = CALIBRATIONS.get(hardware.name) or CalibrationParams.roofline_limit(hardware)
    measured = {r.op for r in profile.rows}
    if "verify" not in measured:  # (decode alone fitted 3% and mis-priced verify by up to
        # 387% at batch 64: TLT 0.98x where the whole profile gives 1.59x)
        raise UsageError(
            f"{args.profile}: no verify rows: SD's costs would be guessed from decode alone; "
            "profile with a drafter (tltrun profile --drafter D)"
        )
    try:
        fit = fit_calibration(
            profile.rows, model, hardware, tp, base, fields, source=str(args.profile)
        )
    except ValueError as err:  # a model/TP mismatch (RooflineCost's checks)
        raise UsageError(f"{args.profile}: {err}") from None
    print(
        f"{args.profile}: fitted {len(fit.fitted)} parameters to {len(fit.rows)} points "
        f"({model.name} on {hardware.name}, tp={tp})"
    )
    for key in INCOMPLETE_MARKS:  # tltrun profile's marks of a run that did not end
        if key in profile.meta:
            print(f"note: an incomplete profile ({key}: {profile.meta[key]})")
    _warn_at_bounds(fit)
    if profile.meta.get("clock", "wall") != "wall":  # (it was fitted as GPU seconds, unsaid)
        warnings.warn(
            f"{args.profile}: timed on the {profile.meta['clock']!r} clock (its sidecar): a "
            "GPU's costs are wall seconds, which replays simulate",
            InputWarning,
            stacklevel=2,
        )
    if "drafter" not in measured:  # (after the fit: a refused fit says only why)
        warnings.warn(
            f"{args.profile}: no drafter rows: the drafter's forwards are priced by the curves "
            "fitted to the target's (profile with --drafter to measure them)",
            InputWarning,
            stacklevel=2,
        )
    domain = fit_domain(fit)
    print(
        f"fitted on batches {domain['batches'][0]}-{domain['batches'][-1]} "
        f"({len(domain['batches'])} sizes), context {domain['min_context_tokens']:,.0f}-"
        f"{domain['max_context_tokens']:,.0f} tokens per sequence"
    )
    _warn_poor_fit(fit, domain)
    params = dataclasses.asdict(fit.params)
    print(
        format_table(
            [
                {
                    "name": k,
                    "value": v,
                    "status": "fitted" if k in fit.fitted else "held",
                }
                for k, v in params.items()
                if k != "source"
            ],
            PARAM_COLUMNS,
            {"value": ".6g"},
            left=("name", "status"),
        )
    )
    errors = fit.rel_errors
    ops = [r.op for r in fit.rows]
    rows = []
    for op in dict.fromkeys(ops):
        e = np.abs(errors[[i for i, o in enumerate(ops) if o == op]])
        rows.append(
            {
                "op": op,
                "num_points": len(e),
                "median_abs_error": f"{100 * np.median(e):.2f}%",
                "max_abs_error": f"{100 * np.max(e):.2f}%",
            }
        )
    rows += unfitted_error_rows(profile, CalibratedCost(model, hardware, params=fit.params, tp=tp))
    print("fit error (predicted / measured - 1; ops marked 'not fitted' are priced by the fit):")
    print(format_table(rows, ERROR_COLUMNS, left=("op",)))
    save_hardware_preset(
        out,
        hardware,
        fit.params,
        {
            "fitted_to": {
                "profile": str(args.profile),
                "model": model.name,
                "tp": tp,
                "profile_meta": {k: v for k, v in profile.meta.items() if k != "model"},
            },
            "fitted_fields": list(fit.fitted),
            "fit_domain": domain,
            "fit_error": {
                "median_abs": fit.median_abs_error,
                "max_abs": fit.max_abs_error,
                "num_points": len(fit.rows),
            },
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    )
    print(f"wrote {out} (use it with tltsim replay --hardware-file)")
    return 0
