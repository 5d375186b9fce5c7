"""``tltsim sweep SPEC.toml``: grid and random search over policy and cluster settings.

    tltsim sweep sweep.toml --workers 8
    tltsim report results/sweep-sweep

The spec format and what a sweep writes: ``tltsim.sim.sweep``'s docstring (also ``--help``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tltsim.cli.args import check_out_dir
from tltsim.errors import UsageError
from tltsim.sim import sweep


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``tltsim sweep``."""
    p = sub.add_parser(
        "sweep",
        help="grid / random search over policy and cluster settings",
        description=sweep.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("spec", type=Path, help="sweep spec (TOML)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="output directory (default: the spec's out, else results/sweep-<spec stem>)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes (default: all cores)",
    )
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.out is not None:
        check_out_dir(args.out)
    outcome = sweep.run_sweep(args.spec, args.out, args.workers)
    print(
        f"{len(outcome.table)} rows (points x seeds): {outcome.num_computed} simulations run, {outcome.num_reused} reused from {outcome.out / 'points.jsonl'}"
    )
    summary = json.loads((outcome.out / "summary.json").read_text())
    if summary["best"]:
        print(
            "best setting (mean speedup vs NoSpec over seeds): "
            + ", ".join(f"{k}={v}" for k, v in summary["best"].items())
        )
    print(f"wrote {outcome.out}/: sweep.parquet sweep.csv summary.json config.json points.jsonl")
    return 0
