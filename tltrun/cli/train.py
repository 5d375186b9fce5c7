"""``tltrun train`` and ``tltrun report``: GRPO with spot drafter training, and its figures.

    tltrun train --config train.toml            # or train.json; flags override the file
    tltrun train --model-dir runs/sft --out runs/rl --num-workers 2 --num-steps 20 --policy tlt
    tltrun train --out runs/rl --resume         # continue after a crash or kill -9
    tltrun report runs/rl                       # reward curve, accept length, step-time breakdown

What one RL step does and what ``--out`` gets: ``tltrun.train.launch``'s docstring. Flags map
1:1 onto ``TrainConfig`` (``tltrun.train.config``) and, as ``--task-*``, ``TaskConfig``; a
``--config`` file holds ``TrainConfig`` fields and a ``[task]`` section.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from tltrun.train import launch
from tltrun.train.config import TrainConfig
from tltrun.train.tasks import TaskConfig
from tltsim.cli.args import add_dataclass_args, dataclass_from_args
from tltsim.errors import UsageError


def load_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        raw = (
            tomllib.loads(file.read_text())
            if file.suffix == ".toml"
            else json.loads(file.read_text())
        )
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise UsageError(
            f"--config {path}: not valid {file.suffix[1:] or 'JSON'} ({err})"
        ) from None
    # TOML / JSON arrays -> tuples (the frozen dataclass's tuple fields)
    raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(raw) - known - {"task"})
    if unknown:
        raise UsageError(f"--config {path}: unknown field(s) {', '.join(unknown)}")
    return raw


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train`` (flags = TrainConfig fields, ``--task-*`` = TaskConfig) and ``report``."""
    parser = subparsers.add_parser(
        "train",
        help="GRPO with spot drafter training on idle rollout workers",
        description=launch.__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--config", metavar="PATH", help="TOML or JSON file of TrainConfig fields (+ [task])"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    add_dataclass_args(parser, TrainConfig)
    add_dataclass_args(parser, TaskConfig, prefix="task-")
    parser.set_defaults(func=_cmd_train)
    report = subparsers.add_parser("report", help="plots of one or more tltrun train runs")
    report.add_argument("runs", nargs="+", help="output directories of tltrun train")
    report.add_argument(
        "--out", default=None, metavar="DIR", help="figure directory (default: first run)"
    )
    report.set_defaults(func=_cmd_report)


def _cmd_train(args: argparse.Namespace) -> int:
    raw = load_config_file(args.config) if args.config else {}
    task_raw = raw.pop("task", {})
    try:
        base = TrainConfig(**{**{"model_dir": "?", "out": "?"}, **raw})
    except (TypeError, ValueError) as err:
        raise UsageError(f"--config {args.config}: {err}") from None
    if args.resume and not args.model_dir and not raw.get("model_dir"):
        previous = Path(args.out or raw.get("out", "")) / "config.json"
        if previous.is_file():
            base = TrainConfig(**{**json.loads(previous.read_text())["train"], **raw})
    cfg = dataclass_from_args(TrainConfig, args, base=base)
    if "?" in (cfg.model_dir, cfg.out):
        raise UsageError("--model-dir and --out are required")
    try:
        task_base = TaskConfig(**{**asdict(launch.task_for(cfg.model_dir)), **task_raw})
    except (TypeError, ValueError) as err:
        raise UsageError(f"[task] section: {err}") from None
    task = dataclass_from_args(TaskConfig, args, prefix="task-", base=task_base)
    out = launch.run_train(cfg, task, is_resume=args.resume)
    print(f"log.jsonl, trace.json, checkpoints and final/ written to {out}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from analysis.train_plots import report

    try:
        paths = report(args.runs, args.out)
    except ValueError as err:
        raise UsageError(str(err)) from None
    for path in paths:
        print(path)
    return 0
