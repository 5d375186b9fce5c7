"""``tltrun profile``: time one engine iteration over a grid; write a ``tlt-profile`` CSV.

    tltrun profile --model runs/m/target --drafter runs/m/drafter --out profiles/cpu_torch.csv
    tltsim profile-info profiles/cpu_torch.csv

What is timed and how: ``tltrun.profile.measure``'s docstring. Flags map 1:1 onto
``ProfileRunConfig``.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import threading
import time
from pathlib import Path

from tltrun.cli.args import check_triton_impls
from tltrun.profile import measure
from tltsim.cli.args import add_dataclass_args, check_out_file, dataclass_from_args


def cmd_profile(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(measure.ProfileRunConfig, args)
    check_out_file(cfg.out)
    if cfg.backend == "torch":
        check_triton_impls(cfg.device, attn_impl=cfg.attn_impl)
    start = time.perf_counter()
    # SIGTERM (what `timeout` and job schedulers send) ends the profile as Ctrl-C does: the
    # completed rounds are written (measure.run_profile) instead of lost
    is_main = threading.current_thread() is threading.main_thread()  # where handlers may go
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if is_main else None
    try:
        rows = measure.run_profile(cfg, datetime.datetime.now(datetime.UTC))
    finally:
        if is_main:
            signal.signal(signal.SIGTERM, previous)
    ops = sorted({r.op for r in rows})
    print(
        f"{len(rows)} points ({', '.join(ops)}) measured in {time.perf_counter() - start:.0f} s; "
        f"wrote {cfg.out} and {Path(cfg.out).with_suffix('.json')}"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tltrun profile``."""
    p = subparsers.add_parser(
        "profile",
        help="measure the engine's per-iteration costs over a grid; write a tlt-profile CSV",
        description=measure.__doc__.split("\n\n")[0],
    )
    add_dataclass_args(p, measure.ProfileRunConfig)
    p.set_defaults(func=cmd_profile)
