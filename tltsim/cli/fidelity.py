"""``tltsim fit``, and the ``--profile`` / ``--drafter-dynamics`` helpers other subcommands
(replay, compare) use (issue #7); ``register`` adds ``profile-info`` from ``profile_info.py``.

    tltsim fit runs/measured.json --out fitted_drafter.json [--strategy 4_1_4] [--fixed learn_tokens]

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
import math
from pathlib import Path
from typing import Any

from tltsim.cli.args import add_dataclass_args, check_out_file, dataclass_from_args
from tltsim.cli.profile_info import register_profile_info
from tltsim.cli.table import format_table
from tltsim.cost.measured import (
    with_profile,
)
from tltsim.cost.roofline import CostModel, RooflineCost
from tltsim.cost.specs import HardwareSpec, ModelSpec
from tltsim.errors import UsageError
from tltsim.fidelity.fit import FORMAT as DYNAMICS_FORMAT
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
            "status": (
                ("fitted" if math.isfinite(fit.stderr[name]) else "fitted (at a bound, or flat)")
                if name in fit.stderr
                else "held: " + fit.held.get(name, "")
            ),
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
            "status": (
                "fitted" + (f" ({fit.caveats[name]})" if name in fit.caveats else "")
                if name in stderr
                else "held: " + fit.held[name]
            ),
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
        check_out_file(args.out, file_format=DYNAMICS_FORMAT)
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
    register_profile_info(subparsers)


__all__ = [
    "add_profile_args",
    "cost_model_from_args",
    "dynamics_from_args",
    "extrapolation_lines",
    "register",
]
