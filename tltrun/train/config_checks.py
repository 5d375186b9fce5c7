"""Validation of ``TrainConfig`` (called by its ``__post_init__``): every field a user can
set, checked before any worker starts, each failure one ``ValueError`` line naming the field.
Kept apart from the fields so that each file reads on its own. Also what a ``--resume`` may
change against the run's recorded config and inputs (``refuse_fixed_changes``,
``check_same_inputs``, ``warn_restarted_state``)."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from pathlib import Path
from typing import Any

from tltrun.model.config import check_device
from tltrun.rollout.engine_config import DTYPES
from tltrun.rollout.vllm_config import VLLM_DTYPES
from tltsim.errors import MAX_LR, UsageError
from tltsim.policy import POLICY_NAMES, make_policy

BACKENDS = ("torch", "vllm")


def check_train_config(cfg: Any) -> None:
    """Raise ValueError for the first field of ``cfg`` (a ``tltrun.train.config.TrainConfig``,
    which calls this from ``__post_init__``: this module does not import it back) that no run
    can use."""
    if not cfg.model_dir or not cfg.out:
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
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, got {cfg.num_steps}")
    from tltrun.model.attention import ATTN_IMPLS

    if cfg.attn_impl is not None and cfg.attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl {cfg.attn_impl!r}: expected one of {', '.join(ATTN_IMPLS)}")
    if cfg.keep_checkpoints < 0:
        raise ValueError(f"keep_checkpoints must be >= 0, got {cfg.keep_checkpoints}")
    # GRPO normalises rewards within a group: with one response per prompt every advantage
    # is 0, the loss is 0 and the run learns nothing (it used to exit 0 silently).
    if cfg.group_size < 2:
        raise ValueError(
            f"group_size must be >= 2 for GRPO (one response per prompt has zero advantage), got {cfg.group_size}"
        )
    # int32 bounds on counts (a larger value overflowed in torch, or ran for ever) and the
    # int64 seed range of torch.manual_seed
    for name in (
        "num_workers",
        "num_steps",
        "prompts_per_step",
        "group_size",
        "max_new_tokens",
    ):
        if getattr(cfg, name) >= 2**31:
            raise ValueError(f"{name} must be < 2^31, got {getattr(cfg, name)}")
    if not 0 <= cfg.seed < 2**63:
        raise ValueError(f"seed must be in [0, 2^63), got {cfg.seed}")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ValueError(f"dtype {cfg.dtype!r}: expected one of {', '.join(DTYPES)}")
    check_device(cfg.device)  # before the workers start (cuda without CUDA)
    # torch.set_num_threads(10^8) crashed the workers (SIGSEGV); more threads than cores
    # only oversubscribes them
    if cfg.num_threads > (os.cpu_count() or 1):
        raise ValueError(
            f"num_threads {cfg.num_threads}: more than this machine's {os.cpu_count()} cores"
        )
    if cfg.policy not in POLICY_NAMES:
        raise ValueError(f"policy must be one of {POLICY_NAMES}, got {cfg.policy!r}")
    if cfg.policy in ("tlt", "tltbase", "static"):  # the policy validates its settings
        make_policy(cfg.policy, seed=0, **cfg.policy_settings())
    if cfg.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {cfg.backend!r}")
    # vLLM schedules and samples in its own engine: nothing makes its rollouts repeatable
    if cfg.backend == "vllm" and cfg.is_history_drafting:
        # a vLLM engine runs one speculative method (EAGLE for the spot-trained drafter)
        raise ValueError(
            "backend vllm: the history drafter (policy tltbase or tlt_drafters with history) "
            "runs on the torch backend only in tltrun train"
        )
    if cfg.backend == "vllm" and cfg.dtype is not None and cfg.dtype not in VLLM_DTYPES:
        raise ValueError(f"dtype {cfg.dtype!r}: backend vllm takes {', '.join(VLLM_DTYPES)}")
    if cfg.is_deterministic and cfg.backend != "torch":
        raise ValueError("deterministic: only the torch backend's rollouts are repeatable")
    if cfg.prompts_per_step < cfg.num_workers and not cfg.prompt_split:
        raise ValueError("prompts_per_step must be >= num_workers (every worker rolls out)")
    if cfg.prompt_split and (
        len(cfg.prompt_split) != cfg.num_workers
        or sum(cfg.prompt_split) != cfg.prompts_per_step
        or min(cfg.prompt_split) < 1
    ):
        raise ValueError(
            f"prompt_split {cfg.prompt_split}: need {cfg.num_workers} counts >= 1 "
            f"summing to prompts_per_step={cfg.prompts_per_step}"
        )
    for name in ("data_num_rows", "reward_processes", "eval_max_prompts", "eval_num_samples",
                 "max_prompt_tokens", "max_tokens_per_microbatch"):  # fmt: skip
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    # each is a process per worker: 10^5 would start that many (more than cores only contend)
    if cfg.reward_processes > (os.cpu_count() or 1):
        raise ValueError(
            f"reward_processes {cfg.reward_processes}: at most this machine's "
            f"{os.cpu_count()} cores"
        )
    # HSDP (shard within groups of fsdp_size, replicate across them) is not implemented
    if cfg.fsdp_size not in (1, cfg.num_workers):
        raise ValueError(
            f"fsdp_size {cfg.fsdp_size}: 1 (replicated) or num_workers ({cfg.num_workers}) "
            "(sharding over a subset of the ranks is not implemented)"
        )
    if cfg.eval_every < 0 or cfg.overlong_buffer_tokens < 0:
        raise ValueError("eval_every and overlong_buffer_tokens must be >= 0")
    if cfg.overlong_buffer_tokens >= cfg.max_new_tokens:
        raise ValueError(
            f"overlong_buffer_tokens {cfg.overlong_buffer_tokens} must be < max_new_tokens "
            f"{cfg.max_new_tokens}"
        )
    if not 0 <= cfg.format_penalty < math.inf:
        raise ValueError(f"format_penalty must be finite and >= 0, got {cfg.format_penalty}")
    if not (0 < cfg.reward_timeout_s < math.inf and 0 <= cfg.overlong_penalty < math.inf):
        raise ValueError(
            "finite reward_timeout_s > 0 and overlong_penalty >= 0 required, got "
            f"{cfg.reward_timeout_s}, {cfg.overlong_penalty}"
        )
    if cfg.reward_errors not in ("zero", "raise"):
        raise ValueError(f"reward_errors must be zero or raise, got {cfg.reward_errors!r}")
    if not 0 <= cfg.eval_split < 1:
        raise ValueError(f"eval_split must be in [0, 1), got {cfg.eval_split}")
    if cfg.eval_split and cfg.eval_data:
        raise ValueError("eval_split and eval_data exclude each other")
    if cfg.eval_split and not cfg.data:
        raise ValueError("eval_split splits --data; the built-in task evaluates on fresh problems")
    if cfg.eval_data and not cfg.data:
        raise ValueError(
            "eval_data without --data: the built-in task evaluates on fresh problems of its "
            "own (it would be ignored)"
        )
    files = [p for p in (cfg.data, cfg.eval_data) if p and not p.startswith("reasoning-gym:")]
    if not files and (cfg.prompt_key, cfg.answer_key) != ("prompt", "answer"):
        raise ValueError(
            "prompt_key and answer_key name columns of a --data / --eval-data file; the "
            "built-in task's and reasoning-gym's rows have none"
        )
    if cfg.data is None and cfg.reward not in ("", "builtin"):
        raise ValueError(f"reward {cfg.reward!r}: the built-in task has its own reward (builtin)")
    if cfg.data and not cfg.data.startswith("reasoning-gym:") and cfg.reward in ("", "builtin"):
        raise ValueError(
            f"data {cfg.data}: name its reward with --reward (math, exact, regex:PATTERN, "
            "reasoning-gym:<task> or file.py:function)"
        )
    if cfg.format_penalty > 0 and cfg.is_user_reward:  # (recorded, never applied)
        raise ValueError(
            f"format_penalty {cfg.format_penalty}: a file.py:function reward has no answer "
            "form to miss (its function decides the whole reward); drop it, or penalise "
            "inside the function"
        )
    if not cfg.answer_key and not (cfg.data and cfg.is_user_reward):
        raise ValueError(
            f"answer_key '': reward {cfg.reward_name!r} compares responses with an answer "
            "column; data without one needs a file.py:function reward (it receives "
            "answer=None)"
        )
    if cfg.max_running_requests is not None and cfg.max_running_requests < 1:
        raise ValueError("max_running_requests must be >= 1 or None")
    # not (...) forms: NaN fails every comparison, so it is refused (a NaN temperature
    # sampled token 0 every time); inf is refused as well
    if not (0 <= cfg.temperature < math.inf and 0 < cfg.top_p <= 1 and 0 < cfg.poll_s < 60):
        raise ValueError(
            "finite temperature >= 0, top_p in (0, 1] and poll_s in (0, 60) required, got "
            f"{cfg.temperature}, {cfg.top_p}, {cfg.poll_s}"
        )
    if not (0 < cfg.lr <= MAX_LR and 0 < cfg.drafter_lr <= MAX_LR and 0 <= cfg.kl_coef < math.inf):
        raise ValueError(
            f"lr and drafter_lr in (0, {MAX_LR}] and finite kl_coef >= 0 required, got {cfg.lr}, "
            f"{cfg.drafter_lr}, {cfg.kl_coef}"
        )


def check_same_inputs(out: Path, old: dict, data: dict, cfg: Any) -> None:
    """A resume (``tltrun.train.launch.prepare_run_dir``) refuses training data, evaluation data or a --model-dir (the KL reference,
    reloaded from it) that changed since the run started. Evaluation rows are compared only at
    the --eval-max-prompts they were recorded with (a resume may change it, and a
    reasoning-gym evaluation set is generated that long)."""
    recorded = old.get("data", {})
    if not data or not recorded:
        return
    data_changed = "with different data than the run trained on (rows of {} changed); restore "
    refusals = {  # key -> what the refusal says changed
        "fingerprint": data_changed.format("--data / --eval-data"),
        "train_fingerprint": data_changed.format("--data"),
        "eval_fingerprint": data_changed.format("--eval-data / --eval-split"),
        "model_sha256": f"with other weights in --model-dir {cfg.model_dir} than the run "
        "started from (its KL reference is reloaded from there); restore ",
        "tokenizer_sha256": f"with another tokenizer, chat template or generation_config.json "
        f"in --model-dir {cfg.model_dir} than the run started with (the prompts' tokens, stop "
        "ids and scored text would change mid-run); restore ",
    }
    if "train_fingerprint" in recorded:  # else a run started before the split fingerprints
        del refusals["fingerprint"]
        # only a generated evaluation set's rows depend on --eval-max-prompts (a file's or a
        # split's fingerprint is taken before the cut, so it is compared whatever the value)
        is_generated = (cfg.eval_data or "").startswith("reasoning-gym:")
        if is_generated and recorded.get("eval_max_prompts") != cfg.eval_max_prompts:
            del refusals["eval_fingerprint"]
    # a run started before the readers' version was recorded read some values otherwise (a
    # whole float answer as '7.0', a NaN as 'nan', pandas' index as a column): its
    # fingerprints cannot tell the same file from another one (review: a resume on unchanged
    # data was refused, "restore them")
    from tltrun.train.state import RunDirWarning

    changed = [key for key in refusals if key in recorded and recorded[key] != data.get(key)]
    is_other_reading = recorded.get("reader_version") != data.get("reader_version")
    model_keys = {"model_sha256", "tokenizer_sha256"} & set(changed)  # (not the readers' doing)
    if changed and (not is_other_reading or model_keys):
        key = min(model_keys) if model_keys else changed[0]
        raise UsageError(
            f"{out}: --resume {refusals[key]}them, or start a new run in another --out"
        )
    if changed:
        from tltrun.data.readers import READER_CHANGES

        then, now = recorded.get("reader_version", 1), data.get("reader_version")
        what = "; ".join(c for v, c in READER_CHANGES.items() if then < v <= (now or 0))
        warnings.warn(
            f"{out}: the run's data fingerprint was taken by a tltrun that read data files "
            f"otherwise (reader version {then}, now {now}: {what}), so whether its rows "
            "changed cannot be told: continuing with this reading",
            RunDirWarning,
            stacklevel=2,
        )


def warn_neutral_changes(out: Path, neutral: dict[str, list], cfg: Any) -> None:
    """A resume-neutral change that still changes a ``--deterministic`` run's numbers: the
    thread count (a hunt saw the drafter's digest change at the first step resumed)."""
    from tltrun.train.state import RunDirWarning

    if cfg.is_deterministic and "train.num_threads" in neutral:
        before, now = neutral["train.num_threads"]
        warnings.warn(
            f"{out}: --num-threads {before} -> {now}: a --deterministic run repeats itself at "
            "one thread count; the steps from here on will differ from an uninterrupted run's",
            RunDirWarning,
            stacklevel=2,
        )


# Settings a resume cannot change, even with --override-config: why, for the refusal.
FIXED_ON_RESUME = {
    # the run's trace records one group size (its validation refused the earlier steps)
    "train.group_size": "the run's trace records one group size per prompt",
    # the data position of a step is step x prompts per step (rows were skipped or repeated)
    "train.prompts_per_step": "a step's place in the data is its number x --prompts-per-step",
    # the worker loads the checkpoint's drafter (spot training continues it): it was ignored
    "train.drafter_dir": "the run's drafter continues from its checkpoint's drafter/",
    # the data position is a place in the epoch's seeded shuffle (and the evaluation split is
    # drawn from the seed): a new seed repeated 6 and skipped 6 of 40 rows in the epoch, and the
    # checkpoint's sampling and spot-trainer RNG streams kept the old seed's state anyway
    "train.seed": "each epoch's prompt order and the evaluation split are drawn from the seed",
}
# Settings of the SD policy: a resume that changes one starts the policy afresh
# (--deterministic: its rewards are modelled costs, not seconds; tltrun.train.spot)
POLICY_FIELDS = ("train.policy", "train.static_strategy", "train.is_deterministic")
# Settings of the history drafter's index (EngineConfig.history_config): a resume that changes
# one starts the index empty (RolloutHistory.load_state_dict)
HISTORY_FIELDS = ("train.is_history_cross_prompt",)


def refuse_fixed_changes(out: Path, diff: dict[str, list]) -> None:
    """Refuse what a resume cannot change (``FIXED_ON_RESUME``, a lower --max-new-tokens:
    the trace's earlier responses would exceed it), before any other check of the resume: a
    new --seed redraws the evaluation split and was reported as changed data, and the refusal
    that asked for --override-config came before the one saying it cannot help."""
    for key, (before, after) in diff.items():
        why = FIXED_ON_RESUME.get(key)
        if key == "train.max_new_tokens" and after < before:
            why = f"the run's trace holds responses of up to {before} tokens"
        if why is not None:
            raise UsageError(
                f"{out}: --resume cannot change {flag_of(key)} ({before!r} -> {after!r}), even with "
                f"--override-config: {why}; start a new run in another --out"
            )


def warn_restarted_state(out: Path, diff: dict[str, list]) -> None:
    """Say that a changed SD policy starts afresh (what it learned, bandit estimates and SD
    switches, was learned under the old settings), and a changed history index empty."""
    from tltrun.train.state import RunDirWarning

    policy = [k for k in diff if k in POLICY_FIELDS or k.startswith("train.tlt_")]
    history = [k for k in diff if k in HISTORY_FIELDS]  # (it was emptied without a word)
    for keys, what in (
        (policy, "the SD policy starts afresh (its bandit estimates and SD switches were learned"),
        (history, "the history drafter's index starts empty (the earlier rollouts it held were "
                  "indexed"),
    ):  # fmt: skip
        if keys:
            names = ", ".join(map(flag_of, keys))
            warnings.warn(
                f"{out}: {names} changed: {what} under the old settings)",
                RunDirWarning,
                stacklevel=3,
            )


def flag_of(key: str) -> str:
    """A config.json key as the flag a user types (``train.is_deterministic`` ->
    ``--deterministic``, ``task.median_ops`` -> ``--task-median-ops``)."""
    section, _, name = key.partition(".")
    prefix = "--task-" if section == "task" else "--"
    return prefix + name.removeprefix("is_").replace("_", "-")


def check_eval_flags(cfg) -> None:
    """Evaluation settings of ``cfg`` (a TrainConfig) that would run without effect: one line,
    not a silent run (an --eval-split without --eval-every held 20% of the data out of training
    for nothing)."""
    from tltrun.rollout.interface import GREEDY_BELOW_TEMPERATURE

    if not cfg.eval_every:
        given = [flag for flag, is_given in (
            ("--eval-data", cfg.eval_data is not None), ("--eval-split", cfg.eval_split > 0),
            ("--eval-num-samples", cfg.eval_num_samples > 1)) if is_given]  # fmt: skip
        if given:
            raise UsageError(
                f"{', '.join(given)} without --eval-every: nothing is evaluated"
                + (" (and --eval-split's rows are not trained on)" if cfg.eval_split > 0 else "")
            )
    if cfg.eval_num_samples > 1 and cfg.temperature < GREEDY_BELOW_TEMPERATURE:
        raise UsageError(
            f"--eval-num-samples {cfg.eval_num_samples} at --temperature {cfg.temperature}: "
            "greedy responses are all the same; use 1, or a temperature to sample at"
        )


def absolute_paths(cfg: Any) -> Any:
    """``cfg`` with its input paths (fields shown as PATH or DIR, ``out`` aside) absolute where
    they name something on this machine (a reasoning-gym spec stays as it is): a run recorded
    `--data d.jsonl` and could be resumed or evaluated only from the directory it started in,
    and a respelled path (`../d.jsonl`) was refused as other data."""
    resolved = {f.name: absolute_path(f, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    changes = {name: value for name, value in resolved.items() if value != getattr(cfg, name)}
    return dataclasses.replace(cfg, **changes) if changes else cfg


def absolute_path(f: dataclasses.Field, value: Any) -> Any:
    """``value`` of field ``f`` as ``absolute_paths`` records it (``--reward file.py:function``
    too: its file was looked up from wherever a resume ran)."""
    if f.name == "reward" and isinstance(value, str):
        path, sep, function = value.strip().rpartition(":")
        if sep and path.endswith(".py") and Path(path).is_file():
            return f"{Path(path).resolve()}:{function}"
        return value
    if f.name == "out" or f.metadata.get("metavar") not in ("PATH", "DIR"):
        return value
    if isinstance(value, str) and value and Path(value).exists():
        return str(Path(value).resolve())
    return value


def is_same_path(cls: type, name: str, before: object, after: object) -> bool:
    """Whether field ``name`` of dataclass ``cls`` went from a relative path (older runs
    recorded paths as typed) to the same path spelt absolute (``absolute_paths``)."""
    field = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    return field is not None and before != after and absolute_path(field, before) == after
