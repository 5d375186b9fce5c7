"""``tltsim`` command line: replay / sweep / report / advise / compare / fit / calibrate /
profile-info / gen / validate / import / import-verl.

    tltsim replay traces/synth_reasoning_rl.json --preset h100x8-qwen7b   # simulate, compare policies
    tltsim sweep sweep.toml                                              # grid / random search
    tltsim report results/replay-synth_reasoning_rl                      # PNG figures
    tltsim gen --out my.json ; tltsim validate my.json                   # traces
    tltsim calibrate profile.csv --hardware H100-SXM --model Qwen2.5-7B --out h100.json
    tltsim advise traces/synth_reasoning_rl.json --preset h100x8-qwen7b  # recommend settings
    tltsim compare RUN/trace_nospec.json RUN/trace_tlt.json --profile p.csv  # measured vs sim

Each subcommand family has a module in ``tltsim.cli`` (replay, sweep, compare, fidelity = fit,
trace = gen / validate / import / import-verl, calibrate, profile_info, advise)
whose ``register(subparsers)`` adds its parsers and sets ``func``; the libraries they call hold
no argument parsing and print nothing. Run ``tltsim --help``. Bad input (any
``tltsim.errors.TLTError``, a bad flag) ends with one ``error: ...`` line and exit code 2
(``tltsim.cli.args.run_command``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tltsim.cli.args import OneLineParser, run_command
from tltsim.errors import UsageError


def _cmd_report(args: argparse.Namespace) -> int:
    from analysis import ReportError
    from analysis.report import report  # matplotlib is only needed here

    try:
        paths = report(args.dir)
    except ReportError as err:
        raise UsageError(str(err)) from None
    for path in paths:
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tltsim.cli import advise, calibrate, compare, fidelity, replay, sweep, trace

    parser = OneLineParser(
        prog="tltsim", description="Simulate long-tail RL rollouts and TLT policies."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    replay.register(sub)
    fidelity.register(sub)  # fit, profile-info
    compare.register(sub)  # compare: measured vs simulated
    sweep.register(sub)
    calibrate.register(sub)  # calibrate: fit the GPU cost model to a profile
    advise.register(sub)  # advise: sweep, recommend, config blocks
    p = sub.add_parser("report", help="draw PNG figures from a replay or sweep output directory")
    p.add_argument("dir", type=Path, help="output directory of tltsim replay or tltsim sweep")
    p.set_defaults(func=_cmd_report)
    trace.register(sub)  # gen, validate, import
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # tltsim's commands hold no process of their own to stop on SIGTERM but a sweep's pool
    return run_command(args.func, args, "tltsim", is_sigterm_handled=True)


if __name__ == "__main__":
    raise SystemExit(main())
