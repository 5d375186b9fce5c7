"""The prompts and rewards of one ``tltrun train`` run: the built-in task, or the user's data
(``--data``) and reward (``--reward``), and the held-out evaluation set (issue #16).

* Built-in task (no ``--data``): each step draws fresh problems from a stream seeded by
  (seed, step) (``builtin_rows``), scored by ``tltrun.train.tasks.reward``; the evaluation set
  is ``eval_max_prompts`` problems from a stream of its own.
* ``--data``: ``tltrun.data.dataset.load_rows`` reads the rows once (bad rows stop the run, or
  are counted with ``--skip-bad-rows``); ``PromptStream`` deals each step's prompts, a pure
  function of (seed, step) that shuffles every epoch afresh, so the checkpoint's data position
  is its step number (``RunData.position`` says which epoch and index, for the log). The
  evaluation set is ``--eval-data``, or ``--eval-split`` of ``--data`` held out from training.

``train_fingerprint`` hashes every row the run trains on (all its columns), ``eval_fingerprint``
the evaluation rows before ``--eval-max-prompts`` cuts them (so changing that, which a resume
may, keeps it):
the launcher records both in ``config.json`` and refuses to resume a run whose data changed
underneath it. ``fingerprint`` (both, evaluation rows cut) is what runs before them recorded.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tltrun.data.dataset import DataSpec, PromptRow, PromptStream, load_rows, split_eval
from tltrun.data.readers import split_read
from tltrun.data.rewards import RewardSpec, parse_reward
from tltrun.data.rows import GYM_PREFIX
from tltrun.train.config import TrainConfig
from tltrun.train.tasks import TaskConfig, sample_problem
from tltsim.errors import UsageError

# The evaluation stream of the built-in task, seeded apart from every training stream (those
# are seeded seed * 1_000_003 + step, step >= 0). It was the int -1: random.Random seeds an int
# by its absolute value, so at seed 0 it was step 1's stream, and evaluation read prompts that
# step trained on.
_EVAL_STREAM = "eval"


def builtin_rows(task: TaskConfig, seed: int, step: int | str, num_prompts: int) -> list[PromptRow]:
    """The built-in task's prompts of stream ``step`` (a training step, or ``_EVAL_STREAM``): a
    pure function of (seed, step). A problem's id is its prompt text's hash, so a prompt that
    recurs in a later step keeps its id (the history drafter's key for its earlier rollouts,
    issue #20)."""
    rng = random.Random(f"{seed}:{step}" if isinstance(step, str) else seed * 1_000_003 + step)
    rows = []
    for _ in range(num_prompts):
        problem = sample_problem(task, rng)
        digest = hashlib.sha1(problem.prompt.encode()).hexdigest()[:16]
        rows.append(
            PromptRow(
                prompt_id=f"task-{digest}",
                prompt=problem.prompt,
                answer=str(problem.answer),
                meta={},
                source=f"built-in task, stream {step}",
            )
        )
    return rows


class DataWarning(UserWarning):
    """Data that runs, but not as the flags read (``warn_data``): one ``warning:`` line."""


def _prompt_key(prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


@dataclass(frozen=True, kw_only=True)
class RunData:
    """What a worker needs to deal prompts: the training stream (None: the built-in task) and
    the evaluation rows."""

    stream: PromptStream | None
    eval_rows: tuple[PromptRow, ...]
    num_train_rows: int
    num_skipped: int
    fingerprint: str
    train_fingerprint: str
    eval_fingerprint: str
    task: TaskConfig
    seed: int
    num_eval_rows_left: int = 0  # evaluation rows past --eval-max-prompts, never evaluated

    def meta_keys(self) -> tuple[str, ...]:
        """The columns a ``file.py:function`` reward receives as keywords besides prompt,
        response and answer, over every row (``tltrun.data.scoring.Scorer``)."""
        rows = (*(self.stream.rows if self.stream is not None else ()), *self.eval_rows)
        return tuple(sorted({key for row in rows for key in row.meta}))

    def num_eval_in_training(self) -> int:
        """Evaluation prompts that are also training prompts (same text or messages): a small
        reasoning-gym task repeats its few problems in both, and a file's duplicated rows fall
        on both sides of --eval-split. The built-in task's streams are apart by seed."""
        if self.stream is None:
            return 0
        seen = {_prompt_key(row.prompt) for row in self.stream.rows}
        return sum(_prompt_key(row.prompt) in seen for row in self.eval_rows)

    def step_rows(self, step: int, num_prompts: int) -> list[PromptRow]:
        if self.stream is None:
            return builtin_rows(self.task, self.seed, step, num_prompts)
        return self.stream.batch(step, num_prompts)

    def position(self, step: int, num_prompts: int) -> dict:
        """Where step ``step`` starts in the data (for the log and checkpoints)."""
        if self.stream is None:
            return {"stream": step}
        return self.stream.position(step, num_prompts)


# --eval-data reasoning-gym:<task> generates its problems from seed + this offset, so they are
# not the training problems (the same seed would regenerate exactly those)
EVAL_GYM_SEED_OFFSET = 1_000_003


def _spec(cfg: TrainConfig, path: str, is_eval: bool = False) -> DataSpec:
    return DataSpec(
        path=path,
        prompt_key=cfg.prompt_key,
        answer_key=cfg.answer_key or None,  # '': the rows have no answer column
        is_skip_bad_rows=cfg.skip_bad_rows,
        # a file holds what it holds (all of it is read, so an evaluation file's fingerprint is
        # taken before --eval-max-prompts cuts it); a reasoning-gym task generates --data-num-rows
        # training rows, --eval-max-prompts held-out ones
        num_rows=(
            None
            if not path.startswith(GYM_PREFIX)
            else cfg.eval_max_prompts
            if is_eval
            else cfg.data_num_rows
        ),
        seed=cfg.seed + (EVAL_GYM_SEED_OFFSET if is_eval else 0),
    )


def prompt_cap(cfg: TrainConfig, max_positions: int) -> tuple[int, str]:
    """(longest prompt in tokens, what sets it): --max-prompt-tokens, or less where the model's
    max_position_embeddings minus --max-new-tokens is less (a prompt and its response must fit
    the model's positions: the torch engine decoded past them, vLLM refused to start).
    A --max-new-tokens that leaves no room is one UsageError."""
    room = max_positions - cfg.max_new_tokens
    if room < 1:
        raise UsageError(
            f"--max-new-tokens {cfg.max_new_tokens}: leaves no room for a prompt in the model's "
            f"{max_positions} positions (max_position_embeddings, config.json)"
        )
    if room < cfg.max_prompt_tokens:
        return room, (
            f"what the model's {max_positions} positions leave beside --max-new-tokens "
            f"{cfg.max_new_tokens}"
        )
    return cfg.max_prompt_tokens, "the max prompt length (--max-prompt-tokens)"


def max_request_tokens(cfg: TrainConfig, task: TaskConfig, max_positions: int) -> int:
    """The engine's max_model_len: the longest prompt (``prompt_cap``, or the built-in task's)
    plus --max-new-tokens, within the model's positions (``load_run_data`` refused more)."""
    prompt = task.max_prompt_chars + 1 if cfg.data is None else prompt_cap(cfg, max_positions)[0]
    return prompt + cfg.max_new_tokens


def load_run_data(
    cfg: TrainConfig,
    task: TaskConfig,
    prompt_tokens: Callable[[PromptRow], int],
    max_positions: int,
) -> RunData:
    """The run's data; raises DataError (one line: file, line, key) on a bad row, a prompt
    longer than ``prompt_cap`` included."""
    if cfg.data is None:
        if task.max_prompt_chars + 1 + cfg.max_new_tokens > max_positions:
            raise UsageError(
                f"the built-in task's prompts ({task.max_prompt_chars + 1} tokens) and "
                f"--max-new-tokens {cfg.max_new_tokens} exceed the model's {max_positions} "
                "positions (max_position_embeddings, config.json)"
            )
        eval_rows = (
            tuple(builtin_rows(task, cfg.seed, _EVAL_STREAM, cfg.eval_max_prompts))
            if cfg.eval_every
            else ()
        )
        return RunData(
            stream=None,
            eval_rows=eval_rows,
            num_train_rows=0,
            num_skipped=0,
            fingerprint="builtin",
            train_fingerprint="builtin",
            eval_fingerprint="builtin",
            task=task,
            seed=cfg.seed,
        )
    cap, what = prompt_cap(cfg, max_positions)
    loaded = load_rows(
        _spec(cfg, cfg.data), prompt_tokens=prompt_tokens, max_prompt_tokens=cap,
        max_prompt_what=what,
    )  # fmt: skip
    rows, num_skipped = loaded.rows, loaded.num_skipped
    eval_rows: tuple[PromptRow, ...] = ()
    if cfg.eval_split:
        rows, eval_rows = split_eval(rows, cfg.eval_split, cfg.seed)
    elif cfg.eval_data:
        held = load_rows(
            _spec(cfg, cfg.eval_data, is_eval=True),
            prompt_tokens=prompt_tokens,
            max_prompt_tokens=cap,
            max_prompt_what=what,
        )
        eval_rows, num_skipped = held.rows, num_skipped + held.num_skipped
    all_eval_rows, eval_rows = eval_rows, eval_rows[: cfg.eval_max_prompts]
    return RunData(
        stream=PromptStream(rows, cfg.seed),
        eval_rows=tuple(eval_rows),
        num_train_rows=len(rows),
        num_skipped=num_skipped,
        fingerprint=_rows_digest((*rows, *eval_rows)),
        train_fingerprint=_rows_digest(rows),
        eval_fingerprint=_rows_digest(all_eval_rows),
        task=task,
        seed=cfg.seed,
        num_eval_rows_left=len(all_eval_rows) - len(eval_rows),
    )


def _rows_digest(rows: Sequence[PromptRow]) -> str:
    digest = hashlib.sha1()
    for row in rows:
        # the other columns too: they reach the reward (**meta); a row without any hashes as
        # before they were included, so runs recorded then still resume
        fields = [row.prompt_id, row.prompt, row.answer, *([row.meta] if row.meta else [])]
        digest.update(json.dumps(fields, default=str).encode())
    return digest.hexdigest()


def reward_spec(cfg: TrainConfig, is_module_checked: bool = True) -> RewardSpec:
    """The run's reward (``TrainConfig.reward_name``), checked: the launcher imports a user
    module once (in a child process) so that a missing file or function, or a module that fails
    at import, is one error line before any worker starts; workers pass False."""
    # without --reward, a reasoning-gym --data implies its task's scorer: name --data if bad
    flag = "--reward" if cfg.reward else "--data"
    spec = parse_reward(cfg.reward_name, flag=flag, is_module_checked=is_module_checked)
    if spec.kind == "reasoning-gym":  # another task's scorer failed every row, or scored an
        # evaluation task's rows with the generic compare (hunt: both unsaid)
        from tltrun.data.gym import parse_gym_path

        for data_flag, path in (("--data", cfg.data), ("--eval-data", cfg.eval_data)):
            if path and path.startswith(GYM_PREFIX) and parse_gym_path(path)[0] != spec.arg:
                raise UsageError(
                    f"{data_flag} {path}: another reasoning-gym task than the run's reward "
                    f"scores ({spec.arg!r}, {flag} {cfg.reward_name if flag == '--reward' else cfg.data}"
                    "), whose scorer would fail or fall back on every row; give the rows' own "
                    "task (or a --reward function that scores both)"
                )
    return spec


# the start of a message list's repr or JSON: [{'role': ... / [{"content": ...
_MESSAGES_TEXT = re.compile(r"""\s*\[\s*\{\s*['"](role|content)['"]\s*:""")


def warn_data(cfg: TrainConfig, data: RunData) -> None:
    """Warnings about the run's data (found by hunts): evaluation prompts that are training
    prompts too (README's hanoi recipe evaluated on its training problems without a word),
    fewer training rows than a step's prompts (each step trains some rows more than once),
    --data-num-rows on a file, which is read whole (it was ignored without a word), evaluation
    rows past --eval-max-prompts, and text prompts that read like a message list's repr."""
    import warnings
    from dataclasses import fields

    overlap = data.num_eval_in_training()
    if overlap:
        warnings.warn(
            f"{overlap} of {len(data.eval_rows)} evaluation prompts are training prompts too: "
            "eval_reward_mean is not a held-out score",
            DataWarning,
            stacklevel=3,
        )
    if data.num_eval_rows_left:
        num_given = len(data.eval_rows) + data.num_eval_rows_left
        warnings.warn(
            f"--eval-max-prompts {cfg.eval_max_prompts}: each evaluation takes the first "
            f"{len(data.eval_rows)} of {num_given} evaluation rows",
            DataWarning,
            stacklevel=3,
        )
    if data.stream is None:
        return
    split = split_read(Path(cfg.data)) if cfg.data else None
    if split not in (None, "train"):  # (a DatasetDict or shards holding only a test split)
        warnings.warn(
            f"--data {cfg.data}: its only split is {split!r}: training on it",
            DataWarning,
            stacklevel=3,
        )
    num_like = sum(
        isinstance(row.prompt, str) and _MESSAGES_TEXT.match(row.prompt) is not None
        for row in (*data.stream.rows, *data.eval_rows)
    )
    if num_like:  # pandas' to_csv writes a messages column as its Python repr
        warnings.warn(
            f"{num_like} prompt(s) are text that reads like a list of chat messages "
            f"(a CSV of a messages column?): they are used as text, without the chat template; "
            f"keep messages in JSONL or Parquet",
            DataWarning,
            stacklevel=3,
        )
    if data.num_train_rows < cfg.prompts_per_step:
        warnings.warn(
            f"--data {cfg.data}: {data.num_train_rows} training rows for --prompts-per-step "
            f"{cfg.prompts_per_step}: every step trains some rows more than once",
            DataWarning,
            stacklevel=3,
        )
    default = next(f.default for f in fields(TrainConfig) if f.name == "data_num_rows")
    if cfg.data_num_rows != default and not cfg.data.startswith(GYM_PREFIX):
        warnings.warn(
            f"--data-num-rows {cfg.data_num_rows}: a file is read whole (the flag sets how many "
            "reasoning-gym problems are generated)",
            DataWarning,
            stacklevel=3,
        )
