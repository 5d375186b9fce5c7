"""``tltsim profile-info``: a measured profile's grid, what it lacks, and how far the roofline and
calibrated cost models are from it; and how a profile's model, hardware and TP are resolved from
flags and its sidecar (``tltsim calibrate`` resolves them the same way).

    tltsim profile-info profiles/h200_qwen2.5-1.5b_random.csv [--model NAME|config.json] [--hardware NAME|hw.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from tltsim.cli.table import format_fields, format_table
from tltsim.cost.calibrated import (
    CALIBRATIONS,
    PRESET_FORMAT,
    CalibratedCost,
    CalibrationParams,
    load_hardware_preset,
)
from tltsim.cost.hardware import preset_of_device
from tltsim.cost.measured import compare_to_roofline, profile_gaps, summarize_comparison
from tltsim.cost.profile import OPS, Profile, load_profile
from tltsim.cost.profile_tables import profile_tables
from tltsim.cost.roofline import CostModel, RooflineCost
from tltsim.cost.specs import (
    DTYPE_BYTES,
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    HardwareSpec,
    ModelSpec,
)
from tltsim.errors import UsageError
from tltsim.jsonio import exact_fields


def model_of_profile(arg: str | None, profile: Profile) -> ModelSpec | None:
    """The model the profile's times are priced with (``--model``, else the sidecar's), its
    bytes per weight and KV element in the dtype the profile was timed in (the sidecar's
    ``config.dtype``): a config.json's ``torch_dtype`` (float32 beside a bf16 run) or bf16
    beside a CPU run's float32 priced other bytes than the engine moved, and the calibrated
    bandwidth fraction came out off by that factor, unsaid."""
    spec = _model_of_profile(arg, profile)
    config = profile.meta.get("config")
    dtype = config.get("dtype") if isinstance(config, dict) else None
    if spec is None or not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        return spec
    size = DTYPE_BYTES[dtype]
    return dataclasses.replace(spec, bytes_per_param=size, kv_bytes_per_elem=size)


def _model_of_profile(arg: str | None, profile: Profile) -> ModelSpec | None:
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


def profile_tp(arg: int | None, profile: Profile, is_strict: bool = False) -> int:
    """``--tp``, else the sidecar's ``tp`` (default 1); at least 1 either way. ``is_strict``
    (calibrate): a ``--tp`` other than the sidecar's is refused, as replay refuses it (one
    profile measures one engine); profile-info's roofline may price another TP (a what-if)."""
    tp = arg if arg is not None else profile.meta.get("tp", 1)
    if type(tp) is not int or tp < 1:
        where = "--tp" if arg is not None else f"{profile.source}: sidecar field 'tp'"
        raise UsageError(f"{where}: expected an integer >= 1, got {tp!r}")
    recorded = profile.meta.get("tp")
    if is_strict and arg is not None and type(recorded) is int and recorded != arg:
        raise UsageError(
            f"--tp {arg}: {profile.source} was measured with tp={recorded} (its sidecar); "
            "leave --tp out"
        )
    return tp


def hardware_of_profile(arg: str | None, profile: Profile) -> HardwareSpec | None:
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
    if arg is None:  # tltrun profile records the device's name ("NVIDIA H200")
        preset = None if source is None else preset_of_device(source)
        return (
            (None, None) if preset is None else (HARDWARE_PRESETS[preset], CALIBRATIONS.get(preset))
        )
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
        checked = exact_fields(HardwareSpec, fields, f"{path}")
        try:
            return HardwareSpec(**checked), None
        except ValueError as err:  # a value out of range: the file is one, its value is not
            raise UsageError(f"{path}: {err}") from None
    except UsageError as err:  # (its message starts with the file)
        raise UsageError(f"--hardware {err}") from None
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
    profile_tables(profile)  # what replay refuses (a curve of one point) is refused here too
    meta = {k: v for k, v in profile.meta.items() if k not in ("format", "version", "model")}
    print(f"{profile.source}: {len(profile.rows)} measured points")
    print(format_fields(meta))
    print(grid_table(profile))
    gaps = profile_gaps(profile)
    if gaps["ops_not_measured"]:
        print(
            f"not measured (replay prices them by its cost model): {', '.join(gaps['ops_not_measured'])}"
        )
    model = model_of_profile(args.model, profile)
    hardware, calibration = _hardware_and_calibration(args.hardware, profile)
    if model is None or hardware is None:
        print("(no roofline comparison: pass --model and --hardware, presets or files)")
        return 0
    tp = profile_tp(args.tp, profile)
    measured = model_of_profile(None, profile) if args.model is not None else None
    shapes = measured.shape_differences(model) if measured is not None else []
    if shapes:  # a deliberate what-if, but said (calibrate refuses it)
        print(
            f"note: --model {args.model}: not the model the profile measured ({'; '.join(shapes)});"
            " the comparison below prices another model's bytes and FLOPs"
        )
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


def register_profile_info(subparsers: argparse._SubParsersAction) -> None:
    """Add ``profile-info`` to the ``tltsim`` command line."""
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
        help="GPU preset, JSON file of HardwareSpec fields, or tltsim calibrate preset file (default: the sidecar's hardware, if a preset or the device name of a preset's exact "
        "variant, e.g. 'NVIDIA H200')",
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
    "grid_table",
    "hardware_of_profile",
    "model_of_profile",
    "profile_tp",
    "register_profile_info",
]
