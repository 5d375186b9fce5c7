"""``tltsim`` command line: replay / sweep / gen / validate / import / report.

Each subcommand lives in the module that owns its subject and registers itself here through a
``register(subparsers)`` function that sets ``func`` on its parser. Run ``tltsim --help``.
"""

from __future__ import annotations

import argparse
import sys

from tltsim.cliutil import UsageError
from tltsim.trace import TraceError


def build_parser() -> argparse.ArgumentParser:
    from tltsim import cli_trace

    parser = argparse.ArgumentParser(prog="tltsim", description="Simulate long-tail RL rollouts and TLT policies.")
    sub = parser.add_subparsers(dest="command", required=True)
    cli_trace.register(sub)  # gen, validate, import
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UsageError, TraceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
