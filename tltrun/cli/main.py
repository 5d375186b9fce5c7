"""``tltrun``: the runtime's command line.

    tltrun generate --model DIR --prompts FILE.jsonl --out DIR [--drafter DIR] [--policy tlt]
    tltrun train-drafter --model DIR --data DIR/generations.jsonl --out DIR [--train-num-steps N]
    tltrun bench --trace T --policy nospec,static,tlt --model DIR --drafter DIR --out DIR
    tltrun sft --out DIR [--data FILE]         (a starting policy; sft-eval scores one; task)
    tltrun train --model-dir DIR --out DIR     (GRPO with spot drafter training; report: figures)
    tltrun profile --model DIR --out FILE.csv  (measured costs for tltsim --profile)

Each subcommand family has a module in ``tltrun.cli`` (generate, train_drafter, bench, sft =
sft / sft-eval / task, train = train / report, profile)
whose ``register(subparsers)`` adds its parsers; flags map 1:1 onto config dataclasses, and every
output directory gets the resolved ``config.json``. The libraries they call hold no argument
parsing and print nothing.

Bad input (missing file, bad model directory, missing field, bad flag: any
``tltsim.errors.TLTError``) prints one ``error:`` line and exits 2
(``tltsim.cli.args.run_command``).
"""

from __future__ import annotations

import argparse
import os
import sys

from tltsim.cli.args import OneLineParser, run_command

# What the command pins PYTHONHASHSEED to when the user has not: some reasoning-gym tasks
# (word_ladder, knight_swap, isomorphic_strings, ransom_note, list_functions,
# polynomial_multiplication) iterate sets of strings, so the problems a seed generates depend on
# the interpreter's hash seed. The launcher, the workers and the reward processes (which
# regenerate an entry to score it) must see the same problems, and a resume the same data.
PINNED_HASH_SEED = "0"


def build_parser() -> argparse.ArgumentParser:
    from tltrun.cli import bench, generate, profile, sft, train, train_drafter

    parser = OneLineParser(prog="tltrun", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    generate.register(sub)
    train_drafter.register(sub)
    bench.register(sub)
    sft.register(sub)  # sft, sft-eval, task
    train.register(sub)  # train, report (GRPO with spot drafter training)
    profile.register(sub)  # profile: measured cost table for tltsim --profile
    return parser


def pin_hash_seed() -> None:
    """Re-execute this command with PYTHONHASHSEED pinned unless the user set one (the processes
    it starts inherit it; torchrun's ranks each re-execute the same way)."""
    if os.environ.get("PYTHONHASHSEED", "random") != "random":
        return
    os.environ["PYTHONHASHSEED"] = PINNED_HASH_SEED
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command itself, not a call from Python (tests)
        pin_hash_seed()
    args = build_parser().parse_args(argv)
    # SIGTERM (a scheduler's, `timeout`'s) ends these with one line and exit 143, their run
    # directory unlocked (they died silently with -15), the offline trainers' line saying how to
    # resume; train's launcher and profile handle SIGTERM themselves
    is_sigterm_handled = args.command in ("generate", "bench", "sft", "train-drafter", "sft-eval")
    return run_command(args.func, args, "tltrun", is_sigterm_handled=is_sigterm_handled)


if __name__ == "__main__":
    raise SystemExit(main())
