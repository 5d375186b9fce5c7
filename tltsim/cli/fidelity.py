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
from pathlib import Path
from typing import Any

from tltsim.sim.acceptance import DrafterDynamics
from tltsim.cli.args import UsageError, add_dataclass_args, dataclass_from_args
from tltsim.cost.roofline import CostModel, RooflineCost
from tltsim.fidelity.fit import FitConfig, fit_trace, format_fit, load_dynamics, save_fit
from tltsim.cost.profile import OPS, Profile, load_profile
from tltsim.cost.measured import ProfileCost, compare_to_roofline, summarize_comparison
from tltsim.cost.specs import HARDWARE_PRESETS, MODEL_PRESETS, HardwareSpec, ModelSpec
from tltsim.trace.schema import load_trace

# --- helpers for simulating subcommands -------------------------------------------------------


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    """``--profile FILE`` (measured cost profile) and ``--drafter-dynamics FILE`` (fit output)."""
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="measured cost profile CSV (tltrun profile); replaces the roofline, which still prices ops the profile lacks",
    )
    parser.add_argument(
        "--drafter-dynamics",
        type=Path,
        default=None,
        help="drafter dynamics fitted by tltsim fit --out; --drafter-* flags override its fields",
    )


def with_profile(path: Path | None, roofline: CostModel) -> CostModel:
    """``roofline`` when ``path`` is None, else a ``ProfileCost`` of the profile at ``path``
    that falls back to ``roofline`` for the ops it lacks."""
    if path is None:
        return roofline
    profile = load_profile(path)
    tp = getattr(roofline, "tp", None)
    if tp is not None and profile.meta.get("tp") != tp:
        raise UsageError(
            f"{path}: measured with tp={profile.meta.get('tp')}, but the simulation runs tp={tp} (one profile describes one engine instance)"
        )
    return ProfileCost(profile, fallback=roofline)


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


def extrapolation_lines(cost: Any) -> list[str]:
    """Lines saying where a ``ProfileCost`` left its measured grid (none for the roofline)."""
    report = getattr(cost, "extrapolation_report", None)
    if report is None:
        return []
    return ["profile extrapolation: " + line for line in report()]


# --- tltsim fit ------------------------------------------------------------------------------------


def _cmd_fit(args: argparse.Namespace) -> int:
    config = dataclass_from_args(FitConfig, args)
    trace = load_trace(args.trace)
    base = load_dynamics(args.base) if args.base is not None else None
    result = fit_trace(trace, config, str(args.trace), base)
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


def _hardware_spec(arg: str | None, profile: Profile) -> HardwareSpec | None:
    source = arg if arg is not None else profile.meta.get("hardware")
    if source in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[source]
    if arg is None:
        return None
    path = Path(arg)
    try:
        fields = json.loads(path.read_text())
        return HardwareSpec(**fields)
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as err:
        raise UsageError(
            f"--hardware {arg}: not a preset ({', '.join(HARDWARE_PRESETS)}) nor a JSON file of HardwareSpec fields ({err})"
        ) from None


def _values(values: list[float]) -> str:
    found = sorted(set(values))
    shown = ", ".join(f"{v:g}" for v in found[:8])
    return shown + (f", ... ({len(found)} values)" if len(found) > 8 else "")


def grid_lines(profile: Profile) -> list[str]:
    """Per op: how many points, and the values measured on each axis."""
    lines = []
    for op in OPS:
        rows = profile.rows_of(op)
        if not rows:
            lines.append(f"  {op:<14} (not measured)")
            continue

        batch = _values([r.batch for r in rows])
        per_seq = _values([r.tokens_per_seq for r in rows])
        context = _values([r.context_tokens / r.batch for r in rows])
        lines.append(
            f"  {op:<14} {len(rows):>4} points; batch {batch}; tokens_per_seq {per_seq}; context/seq {context}"
        )
    return lines


def _cmd_profile_info(args: argparse.Namespace) -> int:
    profile = load_profile(args.file)
    meta = {k: v for k, v in profile.meta.items() if k not in ("format", "version", "model")}
    print(
        f"{profile.source}: {len(profile.rows)} measured points; "
        + "; ".join(f"{k}: {v}" for k, v in sorted(meta.items()))
    )
    print("\n".join(grid_lines(profile)))
    model, hardware = _model_spec(args.model, profile), _hardware_spec(args.hardware, profile)
    if model is None or hardware is None:
        print("(no roofline comparison: pass --model and --hardware, presets or files)")
        return 0
    tp = args.tp or int(profile.meta.get("tp", 1))
    try:
        roofline = RooflineCost(model, hardware, tp=tp)
    except ValueError as err:
        raise UsageError(str(err)) from None
    summary = summarize_comparison(compare_to_roofline(profile, roofline))
    print(f"measured / roofline ({model.name} on {hardware.name}, tp={tp}):")
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fit`` and ``profile-info`` to the ``tltsim`` command line."""
    fit = subparsers.add_parser(
        "fit",
        help="fit drafter-dynamics parameters to a measured trace",
        description="Fit DrafterDynamics (acceptance vs drafter training tokens, drift per RL step) to a measured run's accept histograms; method and trace contract: tltsim/fidelity/fit.py docstring.",
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
        help="write the fitted parameters as JSON (for --drafter-dynamics)",
    )
    fit.add_argument(
        "--base",
        type=Path,
        default=None,
        help="drafter-dynamics JSON whose values the held parameters keep (default: DrafterDynamics defaults)",
    )
    add_dataclass_args(fit, FitConfig)
    fit.set_defaults(func=_cmd_fit)

    info = subparsers.add_parser(
        "profile-info",
        help="print a measured profile's grid and how far the roofline is from it",
        description="Load and validate a profile CSV (schema: tltsim/cost/profile.py docstring); print its grid and, per op, measured / roofline seconds.",
    )
    info.add_argument("file", type=Path, help="profile CSV (its sidecar JSON next to it)")
    info.add_argument(
        "--model", default=None, help="model preset or config.json (default: the sidecar's model)"
    )
    info.add_argument(
        "--hardware",
        default=None,
        help="GPU preset or JSON file of HardwareSpec fields (default: the sidecar's hardware, if a preset)",
    )
    info.add_argument(
        "--tp", type=int, default=None, help="TP degree of the roofline (default: the sidecar's tp)"
    )
    info.set_defaults(func=_cmd_profile_info)


__all__ = [
    "add_profile_args",
    "cost_model_from_args",
    "dynamics_from_args",
    "extrapolation_lines",
    "grid_lines",
    "register",
    "with_profile",
]
