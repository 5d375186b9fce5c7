"""``tltrun train`` and ``tltrun report``: GRPO with spot drafter training, and its figures.

    tltrun train --config train.toml            # or train.json; flags override the file
    tltrun train --model-dir runs/sft --out runs/rl --num-workers 2 --num-steps 20 --policy tlt
    tltrun train --out runs/rl --resume         # continue after a crash or kill -9
    torchrun --nproc-per-node 8 -m tltrun.cli.main train --config train.toml   # one rank per GPU
    tltrun report runs/rl                       # reward curve, accept length, step-time breakdown

What one RL step does and what ``--out`` gets: ``tltrun.train.launch``'s docstring. Flags map
1:1 onto ``TrainConfig`` (``tltrun.train.config``) and, as ``--task-*``, ``TaskConfig``; a
``--config`` file holds ``TrainConfig`` fields and a ``[task]`` section.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
import warnings
from dataclasses import asdict, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tltrun.rollout.interface import GREEDY_BELOW_TEMPERATURE
from tltrun.train import launch
from tltrun.train import state as train_state
from tltrun.train.config import TrainConfig
from tltrun.train.config_checks import absolute_path, absolute_paths
from tltrun.train.resumable import check_resume_dir
from tltrun.train.tasks import TaskConfig
from tltsim.cli.args import add_dataclass_args, check_out_dir, dataclass_from_args, given_fields
from tltsim.errors import UsageError
from tltsim.jsonio import closest, parse_json, read_text, typed_fields
from tltsim.policy import is_eagle_drafting


def load_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    text = read_text(file, "config file")
    if file.suffix.lower() == ".toml":  # (T1.TOML was read as JSON)
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise UsageError(f"--config {path}: not valid TOML ({err})") from None
    else:
        raw = parse_json(text, f"--config {path}")
    if not isinstance(raw, dict):
        raise UsageError(
            f"--config {path}: expected a table of TrainConfig fields, got {type(raw).__name__}"
        )
    if not isinstance(raw.get("task", {}), dict):
        raise UsageError(f"--config {path}: [task] must be a table of TaskConfig fields")
    task_names = {f.name for f in fields(TaskConfig)}
    unknown_task = sorted(set(raw.get("task", {})) - task_names)
    if unknown_task:  # (Python's "unexpected keyword argument" came through)
        said = _unknown(unknown_task, task_names)
        raise UsageError(f"--config {path} [task]: unknown field(s) {said}")
    known = {f.name for f in fields(TrainConfig)}
    # a boolean by its flag's name (spot_training for is_spot_training), as sweep specs take it
    for key in [k for k in raw if k not in known and f"is_{k}" in known]:
        if f"is_{key}" in raw:
            raise UsageError(f"--config {path}: {key} and is_{key} are one setting; keep one")
        raw[f"is_{key}"] = raw.pop(key)
    unknown = sorted(set(raw) - known - {"task"})
    if unknown:
        raise UsageError(f"--config {path}: unknown field(s) {_unknown(unknown, known)}")
    # each value of the field's type (TOML / JSON arrays -> the frozen dataclass's tuples)
    task = raw.pop("task", None)
    raw = typed_fields(TrainConfig, raw, f"--config {path}")
    if task is not None:
        raw["task"] = typed_fields(TaskConfig, task, f"--config {path} [task]")
    return raw


def _unknown(names: list[str], known: set[str]) -> str:
    """The unknown keys, each with the closest known one (flags got one, keys did not)."""
    hints = [(n, closest(n, known)) for n in names]
    return ", ".join(f"{n} ({hint}?)" if hint else n for n, hint in hints)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train`` (flags = TrainConfig fields, ``--task-*`` = TaskConfig) and ``report``."""
    parser = subparsers.add_parser(
        "train",
        help="GRPO with spot drafter training on idle rollout workers",
        description=launch.__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="TOML or JSON file of TrainConfig fields (+ [task]); its relative paths are read "
        "from the current directory, as a flag's are",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest intact checkpoint, with the run's settings (config.json)",
    )
    parser.add_argument(
        "--override-config",
        action="store_true",
        help="with --resume: accept flags that change the run (recorded in config_history.jsonl)",
    )
    add_dataclass_args(parser, TrainConfig)
    add_dataclass_args(parser, TaskConfig, prefix="task-")
    parser.set_defaults(func=_cmd_train)
    report = subparsers.add_parser("report", help="plots of one or more tltrun train runs")
    report.add_argument("runs", nargs="+", help="output directories of tltrun train")
    report.add_argument(
        "--out", default=None, metavar="DIR", help="figure directory (default: first run)"
    )
    report.set_defaults(func=_cmd_report)


def _is_said_by_another_rank() -> bool:
    """Under torchrun every rank checks the same settings: one rank per node says what is
    wrong (it was printed once per rank; a file only one node lacks is said by that node)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("LOCAL_RANK", "0") != "0"


def _cmd_train(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("always", train_state.RunDirWarning)
        warnings.simplefilter("always", launch.LaunchWarning)
        try:
            cfg, task = _train_configs(args)
        except UsageError:
            if _is_said_by_another_rank():
                return 2
            raise
        try:
            out = launch.run_train(
                cfg, task, is_resume=args.resume, is_override_config=args.override_config
            )
        except UsageError:  # (the ranks' exchange of settings found a difference: every rank)
            if _is_said_by_another_rank():
                return 2
            raise
        except launch.RunFinished as done:
            print(done)
            return 0
        except launch.RankZeroStopped as err:
            # one output for all under torchrun's agent: rank 0 says why (and exit 0: the
            # run had finished, rank 0 said so)
            if "TORCHELASTIC_RUN_ID" in os.environ or err.exit_code == 0:
                return err.exit_code
            raise  # (a rank started on its own, by SLURM say: its own log says it)
        except KeyboardInterrupt:
            if "TORCHELASTIC_RUN_ID" not in os.environ:
                raise
            # Ctrl-C to torchrun's agent reaches every rank: rank 0 says how to go on (each
            # rank printed "interrupted", nothing said --resume)
            if os.environ.get("RANK", "0") == "0":
                from tltrun.train.elastic import train_resume_hint

                print(f"interrupted; {train_resume_hint(Path(cfg.out))}", file=sys.stderr)
            return 130
    if os.environ.get("RANK", "0") == "0":  # under torchrun: rank 0 speaks for the job
        print(f"log.jsonl, trace.json, checkpoints and final/ written to {out}")
    return 0


def _recorded_for_other_size(said: str, stored: dict | None, given: set[str]) -> str:
    """A resume on another number of workers refused the run's recorded ``fsdp_size`` or
    ``prompt_split`` by its field name, without saying it was recorded or how to change it."""
    if stored is None:
        return said
    for name in ("fsdp_size", "prompt_split"):
        flag = "--" + name.replace("_", "-")
        if name not in given and f"{name} " in said:
            said = said.removeprefix("TrainConfig: ").replace(
                f"{name} ", f"the run's recorded {flag} ", 1
            )
            return f"{said}; resume with {flag} for this world size and --override-config"
    return said


def _train_configs(args: argparse.Namespace) -> tuple[TrainConfig, TaskConfig]:
    """The run's settings: --config's, the flags over them, a resume's recorded ones below
    both; checked (one UsageError naming where a bad value was set)."""
    raw = load_config_file(args.config) if args.config else {}
    task_raw = raw.pop("task", {})
    # the file's values over the defaults, then the flags over both, validated once together
    # (the file was validated alone: `prompt_split = [2, 1]` beside --prompts-per-step 3, or
    # `reward` beside --data, were refused)
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.init}
    base = SimpleNamespace(**{**defaults, "model_dir": "?", "out": "?", **raw})
    if args.override_config and not args.resume:
        raise UsageError("--override-config applies to --resume only")
    # A resume starts from the run's own settings; flags and --config change them (and
    # tltrun.train.launch refuses changes that alter the run unless --override-config).
    stored = None
    if args.resume and (args.out or raw.get("out")):
        resumed = Path(args.out or raw["out"])
        check_resume_dir(resumed, is_resume=True)  # before "--model-dir is required"
        stored = launch.resumed_config(resumed)
    if stored is not None:
        run_dir = Path(args.out or raw["out"])
        # the settings now are config.json's with the history's overrides applied
        where = str(run_dir / "config.json") + (
            f" + {train_state.CONFIG_HISTORY}"
            if (run_dir / train_state.CONFIG_HISTORY).is_file()
            else ""
        )
        try:
            recorded = TrainConfig(**_tuples(stored["train"], TrainConfig, where))
        except (KeyError, TypeError, ValueError) as err:
            raise UsageError(f"{where}: {err}") from None
        base = SimpleNamespace(**{**asdict(recorded), **raw})
    from tltrun.train import elastic

    env = elastic.rank_env()
    if env is not None:  # under torchrun the world size is the number of workers, before any
        # check that reads it (fsdp_size, prompt_split were checked against the default 2)
        # (a RANK left set without torchrun gets launch.run_ranked's warning instead: one,
        # not two that contradicted each other)
        is_agent = elastic.is_torchrun_agent()
        if args.num_workers not in (None, env.world_size) and env.rank == 0 and is_agent:
            warnings.warn(
                f"--num-workers {args.num_workers}: not used under torchrun, whose world size "
                f"({env.world_size}) is the number of workers",
                launch.LaunchWarning,
                stacklevel=2,
            )
        base.num_workers, args.num_workers = env.world_size, None
    # input paths recorded absolute: a run resumes from any directory (see absolute_paths)
    try:
        cfg = absolute_paths(dataclass_from_args(TrainConfig, args, base=base))
    except UsageError as err:
        said = str(err)
        sized = (
            "num_workers",
            "prompt_split",
            "fsdp_size",
            "num-workers",
            "prompt-split",
            "fsdp-size",
        )
        if env is not None and any(n in said for n in sized):
            # the world size decided num_workers: a recorded prompt_split or fsdp_size for
            # another size fails here
            said = f"torchrun world size {env.world_size}: {said}"
        said = _recorded_for_other_size(said, stored, {*given_fields(TrainConfig, args), *raw})
        if raw:
            said += f" (--config {args.config} with the flags over it)"
        raise UsageError(said) from None
    if "?" in (cfg.model_dir, cfg.out):
        raise UsageError("--model-dir and --out are required")
    try:
        stored_task = (
            _tuples(stored["task"], TaskConfig, f"{where} [task]")
            if stored
            else asdict(launch.task_for(cfg.model_dir))
        )
        task_base = TaskConfig(**{**stored_task, **task_raw})
    except (KeyError, TypeError, ValueError) as err:
        where_task = f"--config {args.config} [task]" if task_raw else "[task] section"
        raise UsageError(f"{where_task}: {err}") from None
    task = dataclass_from_args(TaskConfig, args, prefix="task-", base=task_base)
    # what the run had before these flags and --config: the stored settings, else defaults
    before = (
        dict(_tuples(stored["train"], TrainConfig, where))
        if stored
        else {f.name: f.default for f in fields(TrainConfig)}
    )
    by_name = {f.name: f for f in fields(TrainConfig)}
    changed = {  # (a path recorded relative by an older run compared as it resolves from here)
        n
        for n in {*given_fields(TrainConfig, args), *raw}
        if getattr(cfg, n) != absolute_path(by_name[n], before.get(n))
    }
    changed_task = {
        n
        for n in {*given_fields(TaskConfig, args, prefix="task-"), *task_raw}
        if getattr(task, n) != stored_task.get(n)
    }
    _check_used(
        cfg,
        changed,
        changed_task,
        {*raw, *task_raw}
        - {*given_fields(TrainConfig, args), *given_fields(TaskConfig, args, prefix="task-")},
        args.config,
    )
    _check_inputs(cfg)
    # spot training as asked, or by default on a resume where the policy drafts with EAGLE
    # (hunt: a default run resumed 2 -> 1 dropped the drafter's AdamW state unsaid; a fresh
    # one-worker run by default has nothing to lose)
    wants_spot = cfg.is_spot_training
    if wants_spot is None and args.resume:
        wants_spot = is_eagle_drafting(cfg.policy, cfg.tlt_drafters, cfg.static_strategy)
    if wants_spot and cfg.num_workers < 2 and os.environ.get("RANK", "0") == "0":
        said = (
            "--spot-training" if cfg.is_spot_training else f"--policy {cfg.policy}'s spot training"
        )
        warnings.warn(  # (it was dropped unsaid: a 2 -> 1 resume lost the drafter's AdamW state)
            f"{said}: idle workers train the drafter, and {cfg.num_workers} worker is never "
            "idle: no drafter training in this run (a resumed run's drafter optimizer state "
            "is not carried on)",
            launch.LaunchWarning,
            stacklevel=2,
        )
    if cfg.temperature < GREEDY_BELOW_TEMPERATURE and os.environ.get("RANK", "0") == "0":
        warnings.warn(  # (hunt: every step's loss was 0.0, unsaid)
            f"--temperature {cfg.temperature}: greedy decoding gives a group's responses the "
            "same tokens, so GRPO's advantages are 0 and the actor does not learn (a "
            "temperature > 0 samples; greedy suits checks of the rollout)",
            launch.LaunchWarning,
            stacklevel=2,
        )
    return cfg, task


def _check_used(
    cfg: TrainConfig,
    given: set[str],
    given_task: set[str],
    from_file: set[str] = frozenset(),
    config: str | None = None,
) -> None:
    """Refuse settings given (flags or --config) that this run would not read, where they
    change a value (a config file of every setting, defaults included, stays accepted): the
    built-in task's beside --data, TLT's and the static strategy beside a policy that takes
    neither (they were recorded in config.json and ignored, and a later --resume changing one
    was refused as a change of the run), --data's settings without --data, and the torch
    engine's beside --backend vllm."""

    def flags(names, prefix: str = "") -> str:  # a setting of the --config file by its key
        return ", ".join(  # a boolean's flag drops its is_ (tltsim.cli.args.flag_name)
            f"{n} (--config {config})"
            if n in from_file
            else f"--{prefix}{n.removeprefix('is_').replace('_', '-')}"
            for n in sorted(names)
        )

    if cfg.data is not None and given_task:
        raise UsageError(
            f"{flags(given_task, 'task-')}: settings of the built-in task, which --data "
            f"{cfg.data} replaces; drop them"
        )
    data_settings = given & {
        "prompt_key", "answer_key", "data_num_rows", "skip_bad_rows", "max_prompt_tokens"
    }  # fmt: skip
    if cfg.data is None and data_settings:  # sft refuses them so too
        raise UsageError(
            f"{flags(data_settings)}: settings of --data, which is not given (the built-in task "
            "reads none of them); drop them"
        )
    torch_only = given & {
        "compile_layers", "fuse_projections", "is_history_cross_prompt", "is_eager", "attn_impl"
    }  # fmt: skip
    if cfg.backend == "vllm" and torch_only:
        raise UsageError(
            f"{flags(torch_only)}: settings of the torch "
            "engine, which --backend vllm does not run; drop them"
        )
    unused = (
        {n for n in given if n.startswith("tlt_")} if cfg.policy in ("nospec", "static") else set()
    )
    if cfg.policy == "tltbase":  # it drafts from the history alone (policy_settings)
        unused |= given & {"tlt_drafters", "tlt_drafter_explore"}
    if "static_strategy" in given and cfg.policy != "static":
        unused.add("static_strategy")
    if unused:
        raise UsageError(f"{flags(unused)}: not read by --policy {cfg.policy}; drop them")
    # (hunt: each was recorded, read by nothing, and refused as a change on a later --resume)
    spot = given & {"drafter_lr", "drafter_batch_size", "spot_max_epochs"}
    # (one worker: kept for a resume on more, as a shared config's smoke run gives them)
    if spot and not cfg.is_spot_harvesting and cfg.num_workers >= 2:
        why = (
            "--no-spot-training"
            if cfg.is_spot_training is False
            else f"--policy {cfg.policy} drafts with no EAGLE drafter, --spot-training turns it on"
        )
        raise UsageError(
            f"{flags(spot)}: settings of spot drafter training, which this run does not do "
            f"({why}); drop them"
        )
    if "overlong_penalty" in given and not cfg.overlong_buffer_tokens:
        raise UsageError(
            f"{flags({'overlong_penalty'})}: applies over --overlong-buffer-tokens, which is 0 "
            "(no overlong shaping); give both, or drop it"
        )


def _check_inputs(cfg: TrainConfig) -> None:
    """Validate the model and drafter checkpoints' files (and a Triton --attn-impl's platform)
    before any worker starts: a truncated or garbage safetensors file is one error line here
    instead of a traceback per worker."""
    from tltrun.cli.args import check_triton_impls
    from tltrun.model.hf_checkpoint import check_checkpoint, safetensors_shapes

    if cfg.backend == "torch":  # Triton attention where Triton cannot run: one line here
        check_triton_impls(cfg.device, cfg.dtype_name, attn_impl=cfg.attn_impl)
    check_checkpoint(cfg.model_dir)
    if cfg.drafter_dir is not None:
        safetensors_shapes(Path(cfg.drafter_dir) / "model.safetensors")


def _tuples(section: Any, cls: type, where: str) -> dict[str, Any]:
    """config.json's fields that ``cls`` still has (one a code change removed since the run
    started is not the user's setting: ``tltrun.train.state.config_diff``), type-checked
    (a damaged file is one line naming the field), lists back into the frozen dataclasses'
    tuples."""
    if not isinstance(section, dict):
        raise UsageError(f"{where}: expected an object of settings, got {type(section).__name__}")
    names = {f.name for f in fields(cls)}
    return typed_fields(cls, {k: v for k, v in section.items() if k in names}, where)


def _cmd_report(args: argparse.Namespace) -> int:
    from analysis import ReportError
    from analysis.train_plots import report

    try:
        paths = report(args.runs, args.out, prepare_out=check_out_dir if args.out else None)
    except ReportError as err:
        raise UsageError(str(err)) from None
    for path in paths:
        print(path)
    return 0
