"""``tltrun sft``, ``tltrun sft-eval`` and ``tltrun task``: the built-in task's starting policy.

    tltrun sft --out runs/sft                   # train, save the checkpoint, evaluate
    tltrun sft --out runs/sft --resume          # continue a killed run with its settings
    tltrun sft-eval runs/sft                    # re-run only the held-out evaluation
    tltrun task --num-prompts 4 --seed 0        # sample problems and the length statistics

What SFT trains and writes: ``tltrun.train.sft``'s docstring; the task: ``tltrun.train.tasks``.
Flags of ``sft`` map 1:1 onto ``SFTConfig`` and, as ``--task-*``, ``TaskConfig``.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import fields
from typing import Any

from tltrun.cli.args import offline_configs_from_args, stop_says_how_to_resume
from tltrun.data.rows import GYM_PREFIX
from tltrun.train import sft
from tltrun.train.sft_config import SFTConfig
from tltrun.train.state import RunLock
from tltrun.train.tasks import TaskConfig, length_stats, make_examples
from tltsim.cli.args import add_dataclass_args, check_out_dir
from tltsim.cli.table import format_table
from tltsim.errors import UsageError

LENGTH_COLUMNS = {
    "name": "response tokens",
    "num": "num",
    "median": "median",
    "p99": "p99",
    "max": "max",
    "max_over_median": "max/med",
    "truncated": "truncated",
}
LENGTH_FORMATS = {"median": ".0f", "max_over_median": ".1f"}


def eval_table(result: dict[str, Any]) -> str:
    """The evaluation as printed by ``tltrun sft``: accuracy per bucket, length statistics."""
    greedy = result["greedy"]
    if "by_difficulty" not in greedy:  # --data: accuracy by the task's reward, lengths
        if greedy["accuracy"] is None:
            return "no evaluation prompts"
        rows = [{"name": k, **v, "truncated": greedy["num_truncated"] if k == "greedy" else 0}
                for k, v in result["response_tokens"].items()]  # fmt: skip
        # a file is the user's training set, and a small reasoning-gym task may have no
        # problem training did not see: its accuracy is then on training prompts (said so)
        kind = (
            "held-out prompts"
            if greedy["is_held_out"]
            else "TRAINING prompts (the data holds no prompt training did not see)"
        )
        return "\n".join(
            [
                f"greedy accuracy {greedy['accuracy']:.3f} over {greedy['num_prompts']} "
                f"{kind} (reward errors: {greedy['num_reward_errors']})",
                format_table(rows, LENGTH_COLUMNS, LENGTH_FORMATS, left=("name",)),
            ]
        )
    lines = [
        "greedy: no held-out prompts evaluated"
        if greedy["accuracy"] is None
        else f"greedy accuracy {greedy['accuracy']:.3f} over {greedy['num_prompts']} held-out "
        "prompts\n"
        + format_table(
            greedy["by_difficulty"],
            {"ops": "ops", "num_prompts": "prompts", "accuracy": "accuracy"},
            {"accuracy": ".3f"},
        ),
        "sampled (temperature 1): no prompts"
        if result["sampled"]["accuracy"] is None
        else f"sampled (temperature 1) accuracy {result['sampled']['accuracy']:.3f}",
    ]
    rows = []
    for name in ("reference", "greedy", "reference_grouped", "sampled"):
        s = result["response_tokens"][name]
        if s is not None:
            truncated = result[name]["num_truncated"] if name in ("greedy", "sampled") else 0
            rows.append({"name": name, **s, "truncated": truncated})
    lines.append(format_table(rows, LENGTH_COLUMNS, LENGTH_FORMATS, left=("name",)))
    sampled = result["sampled"]
    if sampled["group_max_over_min_median"] is not None:
        lines.append(
            f"per-prompt longest/shortest of {sampled['group_size']} samples: median "
            f"{sampled['group_max_over_min_median']:.2f} (reference "
            f"{sampled['reference_group_max_over_min_median']:.2f}), max "
            f"{sampled['group_max_over_min_max']:.2f} (reference "
            f"{sampled['reference_group_max_over_min_max']:.2f})"
        )
    return "\n".join(lines)


def summary_table(metrics: dict[str, Any]) -> str:
    loss = (
        "no steps trained"
        if metrics["first_loss"] is None
        else f"loss {metrics['first_loss']:.3f} -> {metrics['final_loss']:.3f}"
    )
    head = (
        f"params {metrics['num_params']:,}  train {metrics['train_s']:.0f} s  eval "
        f"{metrics['eval_s']:.0f} s  {loss}"
    )
    return "\n".join([head, eval_table(metrics)])


def _cmd_sft(args: argparse.Namespace) -> int:
    configs = offline_configs_from_args(
        args,
        {"sft": (SFTConfig, ""), "task": (TaskConfig, "task-")},
        command="tltrun sft",
        config_file="sft_config.json",
        finished_file="metrics.json",
    )
    if configs is None:
        print(f"{args.out}: the run already finished (metrics.json is written); nothing to resume")
        return 0
    cfg, task = configs["sft"], configs["task"]
    if not args.resume:
        _check_unused_settings(cfg, task)
    out = check_out_dir(cfg.out)
    with RunLock(out, "tltrun sft"), stop_says_how_to_resume(out, "tltrun sft"):
        metrics = sft.run_sft(cfg, task, is_resume=args.resume)
    print(summary_table(metrics))
    print(f"checkpoint and metrics.json written to {cfg.out}")
    return 0


def _check_unused_settings(cfg: SFTConfig, task: TaskConfig) -> None:
    """Refuse settings nothing reads: the built-in task's beside --data (they were recorded in
    sft_config.json and ignored: no sampled evaluation ran), and --data's without it."""
    if cfg.data is None:  # and the reverse: settings of --data without it (recorded, unused)
        data_only = ("prompt_key", "response_key", "data_num_rows", "skip_bad_rows")
        given = [
            f"--{f.name.replace('_', '-')}"
            for f in fields(SFTConfig)
            if f.name in data_only and getattr(cfg, f.name) != f.default
        ]
        if given:
            raise UsageError(f"{', '.join(given)}: settings of --data, which is not given")
        return
    # --data's settings its kind does not read (recorded in sft_config.json and ignored): a
    # reasoning-gym task gives question and answer, a file holds what it holds
    unread = (
        ("prompt_key", "response_key") if cfg.data.startswith(GYM_PREFIX) else ("data_num_rows",)
    )
    given = [
        f"--{f.name.replace('_', '-')}"
        for f in fields(SFTConfig)
        if f.name in unread and getattr(cfg, f.name) != f.default
    ]
    if given:
        kind = "a reasoning-gym task (its question and answer)" if unread[0] == "prompt_key" else (
            "a file (it is read whole; reasoning-gym tasks are generated that many rows)"
        )  # fmt: skip
        raise UsageError(f"{', '.join(given)}: not read for {kind}: drop them")
    given = [
        f"--{f.name.replace('_', '-')}"
        for f in fields(SFTConfig)
        if f.name in ("num_sample_prompts", "group_size") and getattr(cfg, f.name) != f.default
    ] + [
        f"--task-{f.name.replace('_', '-')}"
        for f in fields(TaskConfig)
        if getattr(task, f.name) != f.default
    ]
    if given:
        raise UsageError(
            f"{', '.join(given)}: settings of the built-in task, which --data {cfg.data} "
            "replaces (it trains and evaluates on its own rows); drop them"
        )


def _cmd_sft_eval(args: argparse.Namespace) -> int:
    print(eval_table(sft.evaluate_checkpoint(args.checkpoint)))
    return 0


MAX_TASK_SAMPLES = 100_000


def _cmd_task(args: argparse.Namespace) -> int:
    # Sample problems for reading and 32 x group-size solutions for statistics: 10^5 of either
    # is already minutes of output; 10^12 never finished.
    if not (1 <= args.num_prompts <= MAX_TASK_SAMPLES and 1 <= args.group_size <= MAX_TASK_SAMPLES):
        raise UsageError(f"--num-prompts and --group-size must be in [1, {MAX_TASK_SAMPLES}]")
    cfg = TaskConfig()
    rng = random.Random(args.seed)
    for ex in make_examples(cfg, rng, args.num_prompts, num_solutions=1):
        print(ex.prompt + ex.solutions[0])
    batch = make_examples(cfg, rng, 32, num_solutions=args.group_size)
    lengths = [len(s) for ex in batch for s in ex.solutions]
    spreads = sorted(max(map(len, ex.solutions)) / min(map(len, ex.solutions)) for ex in batch)
    print("response chars over 32 prompts x", args.group_size, "samples:", length_stats(lengths))
    print(f"per-prompt max/min: median {statistics.median(spreads):.2f}, max {spreads[-1]:.2f}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sft`` (flags = SFTConfig fields, ``--task-*`` = TaskConfig), ``sft-eval``, ``task``."""
    parser = subparsers.add_parser(
        "sft",
        help="train a small model on the built-in task's worked solutions or --data's rows",
        description=sft.__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the killed run in --out from its last state, with its sft_config.json",
    )
    add_dataclass_args(parser, SFTConfig)
    add_dataclass_args(parser, TaskConfig, prefix="task-")
    parser.set_defaults(func=_cmd_sft)

    again = subparsers.add_parser(
        "sft-eval",
        help="re-run the held-out evaluation of a tltrun sft checkpoint",
        description="Greedy accuracy per difficulty bucket and response-length statistics of a "
        "checkpoint, with the task, eval settings and seed of its sft_config.json.",
    )
    again.add_argument("checkpoint", metavar="DIR", help="output directory of tltrun sft")
    again.set_defaults(func=_cmd_sft_eval)

    task = subparsers.add_parser(
        "task",
        help="print sample problems of the built-in task and its length statistics",
        description="Print sample problems with worked solutions, then the response-length "
        "statistics of 32 prompts x GROUP_SIZE reference solutions (default TaskConfig).",
    )
    task.add_argument(
        "--num-prompts",
        type=int,
        default=4,
        metavar="N",
        help="sample problems to print (default: 4)",
    )
    task.add_argument(
        "--group-size",
        type=int,
        default=8,
        metavar="N",
        help="solutions per prompt in the statistics (default: 8)",
    )
    task.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")
    task.set_defaults(func=_cmd_task)
