"""``tltsim compare``: measured runs replayed with a measured profile, simulated vs measured.

    tltsim compare runs/fid/trace_nospec.json runs/fid/trace_tlt.json --profile profiles/cpu.csv

What is replayed and how, and what ``--out`` gets: ``tltsim.fidelity.compare``'s docstring.
Prints the per-step table, the per-step speedups over ``--baseline`` and the error summary.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import pandas as pd

from tltsim.cli.args import add_dataclass_args, check_out_dir, dataclass_from_args, given_fields
from tltsim.cli.table import format_cell, format_table
from tltsim.errors import InputWarning
from tltsim.fidelity import compare
from tltsim.fidelity.fit import load_dynamics, load_history
from tltsim.policy import TLTConfig
from tltsim.policy.tlt import TLTBASE_FIELDS
from tltsim.trace.files import trace_stem

STEP_COLUMNS = {
    "policy": "policy",
    "step": "step",
    "measured_rollout_s": "rollout meas",
    "sim_rollout_s": "sim",
    "rollout_err_pct": "err%",
    "measured_train_s": "train meas",
    "sim_train_s": "sim",
    "train_err_pct": "err%",
    "measured_accept_len": "accept meas",
    "sim_accept_len": "sim",
}
STEP_FORMATS = {
    "measured_rollout_s": ".3f",
    "sim_rollout_s": ".3f",
    "rollout_err_pct": ".1f",
    "measured_train_s": ".3f",
    "sim_train_s": ".3f",
    "train_err_pct": ".1f",
    "measured_accept_len": ".2f",
    "sim_accept_len": ".2f",
}
SPEEDUP_COLUMNS = {
    "policy": "policy",
    "step": "step",
    "measured_speedup": "speedup meas",
    "sim_speedup": "sim",
    "speedup_err_pct": "err%",
}
SPEEDUP_FORMATS = {"measured_speedup": ".3f", "sim_speedup": ".3f", "speedup_err_pct": ".1f"}


def format_report(steps: pd.DataFrame, ups: pd.DataFrame, summary: dict[str, Any]) -> str:
    """The per-step errors, the per-step speedups (if a baseline ran) and the summary lines."""
    lines = [
        "per step (seconds):",
        format_table(steps.to_dict("records"), STEP_COLUMNS, STEP_FORMATS, left=("policy",)),
    ]
    if not ups.empty:
        records = ups.to_dict("records")
        lines += ["", format_table(records, SPEEDUP_COLUMNS, SPEEDUP_FORMATS, left=("policy",))]
    lines.append("")
    for policy, s in summary["policies"].items():
        ro, tr = s["rollout_err_pct"], s["train_err_pct"]
        lines.append(
            f"{policy}: rollout error median {format_cell(ro['median'], '.1f')}% p90 {format_cell(ro['p90'], '.1f')}% over {ro['num_steps']} steps; "
            f"train error median {format_cell(tr['median'], '.1f')}% p90 {format_cell(tr['p90'], '.1f')}%"
        )
    for policy, s in summary["speedups"].items():
        lines.append(
            f"{policy} vs {s['baseline']}: rollout speedup measured {s['measured_speedup']:.3f}x, simulated {s['sim_speedup']:.3f}x "
            f"(error {s['speedup_err_pct']:.1f}%; per step median {format_cell(s['per_step_err_pct']['median'], '.1f')}%)"
        )
    lines += ["profile: " + line for line in summary["profile_extrapolation"]]
    return "\n".join(lines)


def _warn_unused_tlt_flags(tlt: dict, policies: set[str]) -> None:
    """``--tlt-*`` flags reach tlt traces whole and tltbase traces in ``TLTBASE_FIELDS``
    (measured_run): one warning line naming those no trace took (they were dropped unsaid)."""
    if "tlt" in policies:
        taken = set(tlt)
    else:
        taken = set(tlt) & set(TLTBASE_FIELDS) if "tltbase" in policies else set()
    unused = sorted(set(tlt) - taken)
    if unused:
        flags = ", ".join("--tlt-" + name.replace("_", "-") for name in unused)
        warnings.warn(
            f"{flags}: no trace ran a policy that takes it (tlt takes every --tlt-* flag, "
            f"tltbase its switch and bandit settings; the traces ran {', '.join(sorted(policies))})",
            InputWarning,
            stacklevel=2,
        )


def cmd_compare(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(compare.CompareConfig, args)
    # the --tlt-* flags given replace those fields of each run's recorded config (a whole
    # TLTConfig of defaults replaced it when one was)
    tlt = given_fields(TLTConfig, args, prefix="tlt-")
    drafter = load_dynamics(args.drafter_dynamics) if args.drafter_dynamics else None
    history = load_history(args.drafter_dynamics) if args.drafter_dynamics else None
    steps, ups, summary, config = compare.compare(args.traces, cfg, tlt, drafter, history)
    _warn_unused_tlt_flags(tlt, {run["policy"] for run in config["runs"]})
    out = Path(cfg.out) if cfg.out else Path("results") / f"compare-{trace_stem(args.traces[0])}"
    plots = compare.write_outputs(check_out_dir(out, kind="compare"), steps, ups, summary, config)
    print(format_report(steps, ups, summary))
    names = ["config.json", "steps.csv", "speedups.csv", "summary.json"] + [p.name for p in plots]
    print(f"wrote {out}/: {' '.join(names)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tltsim compare``."""
    p = subparsers.add_parser(
        "compare",
        help="replay measured runs with a measured profile; simulated vs measured, with errors",
        description=compare.__doc__.split("\n\n")[0],
    )
    p.add_argument("traces", type=Path, nargs="+", help="measured tlt-traces, one per policy run")
    p.add_argument(
        "--drafter-dynamics",
        type=Path,
        default=None,
        metavar="PATH",
        help="simulate acceptance with these fitted dynamics (tltsim fit --out) instead of replaying the measured per-step acceptance",
    )
    add_dataclass_args(p, compare.CompareConfig)
    add_dataclass_args(p, TLTConfig, prefix="tlt-", default_text="each trace's recorded setting")
    p.set_defaults(func=cmd_compare)
