"""reasoning-gym as a prompt source: procedurally generated, verifiable reasoning problems
(``reasoning_gym.create_dataset(task, seed=..., size=..., **config)``; over a hundred tasks, from
``basic_arithmetic`` to ``sudoku``), a second built-in source of long-tail reasoning data that
needs no download. ``--data reasoning-gym:chain_sum?min_terms=3`` reads as task ``chain_sum``
with config ``{"min_terms": 3}``; ``tltrun train`` scores such rows with ``--reward
reasoning-gym:chain_sum`` (``rewards.py``), which calls the task's own ``score_answer``.

A row's ``meta`` holds the entry's question and metadata (JSON-safe) and, under
``"reasoning_gym"``, the coordinates that regenerate the exact entry (task, seed, size, config,
index): a reasoning-gym dataset's item ``i`` depends only on its config, seed and ``i``, so the
scorer in a reward process rebuilds the entry with its original Python types rather than trusting
a JSON round trip of the metadata.

    rows = gym_rows("basic_arithmetic", seed=0, num_rows=100, config={})
"""

from __future__ import annotations

import difflib
import json
import urllib.parse
from typing import Any

from tltrun.data.rows import GYM_PREFIX, PromptRow, json_safe
from tltsim.errors import UsageError

# The query key of a --data reasoning-gym path that is ours, not the task's config: it names a
# system prompt of reasoning_gym.utils.SYSTEM_PROMPTS (e.g. "default", which asks for the answer
# inside <answer></answer>, the tag the library's scorer helper extracts).
SYSTEM_PROMPT_KEY = "system_prompt"


def task_names() -> list[str]:
    """Every task reasoning-gym registers, sorted."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task(task: str, *, what: str = "reasoning-gym task") -> None:
    """UsageError (one line, with the closest valid names) unless ``task`` is registered."""
    names = task_names()
    if task in names:
        return
    close = difflib.get_close_matches(task, names, n=5, cutoff=0.5) or names[:5]
    raise UsageError(f"{what} {task!r}: unknown; {len(names)} tasks exist, e.g. {', '.join(close)}")


def parse_gym_path(path: str) -> tuple[str, dict[str, Any], str | None]:
    """``reasoning-gym:<task>[?key=value&...]`` -> (task, config, system prompt name or None)."""
    body = path.removeprefix(GYM_PREFIX)
    task, _, query = body.partition("?")
    if not task:
        raise UsageError(f"--data {path!r}: expected {GYM_PREFIX}<task>[?key=value&...]")
    config: dict[str, Any] = {}
    # split by hand: parse_qsl reads '+' as a space (form encoding), and a JSON value such as
    # operators=["+","*"] is typed on a command line, not form-encoded; %XX escapes still work
    # (%26 for a literal '&')
    for part in filter(None, query.split("&")):
        key, is_pair, value = part.partition("=")
        if not is_pair or not key:
            raise UsageError(f"--data {path!r}: {part!r} is not key=value")
        key, value = urllib.parse.unquote(key), urllib.parse.unquote(value)
        if key in config:  # (the last one was kept, unsaid; a column or JSON key twice is refused)
            raise UsageError(f"--data {path!r}: {key!r} given twice")
        try:
            config[key] = json.loads(value)
        except json.JSONDecodeError:
            config[key] = value
    system_prompt = config.pop(SYSTEM_PROMPT_KEY, None)
    if system_prompt is not None:
        system_prompt = str(system_prompt)
    return task, config, system_prompt


def create(task: str, *, seed: int, num_rows: int, config: dict[str, Any]):
    """The reasoning-gym dataset object; a bad config key or value is a one-line UsageError."""
    import reasoning_gym

    check_task(task)
    for reserved in ("seed", "size"):
        if reserved in config:
            raise UsageError(
                f"reasoning-gym task {task!r}: config key {reserved!r} is set by "
                f"{'--seed' if reserved == 'seed' else '--data-num-rows'}, not in the data path"
            )
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=num_rows, **config)
    except CONFIG_ERRORS as err:
        raise UsageError(
            f"reasoning-gym task {task!r}: bad config {config}: {_brief(err)}"
        ) from None


# What reasoning-gym raises for a config value of the wrong kind (3.5 disks, 1e400 digits),
# at construction or only when an entry is generated
CONFIG_ERRORS = (TypeError, ValueError, AssertionError, OverflowError)


def _brief(err: Exception) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__


def generate_entry(dataset, task: str, config: dict[str, Any], index: int) -> dict[str, Any]:
    """Entry ``index`` of ``dataset``; a config that fails to generate it is a UsageError."""
    try:
        return dataset[index]
    except CONFIG_ERRORS as err:
        raise UsageError(
            f"reasoning-gym task {task!r}: config {config} fails generating entry {index}: "
            f"{_brief(err)}"
        ) from None


def _system_prompt_text(name: str) -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if name not in SYSTEM_PROMPTS:
        raise UsageError(
            f"reasoning-gym {SYSTEM_PROMPT_KEY}={name!r}: unknown; expected one of "
            f"{', '.join(sorted(SYSTEM_PROMPTS))}"
        )
    return SYSTEM_PROMPTS[name]


def gym_rows(
    task: str,
    *,
    seed: int,
    num_rows: int,
    config: dict[str, Any],
    system_prompt: str | None = None,
) -> tuple[PromptRow, ...]:
    """``num_rows`` problems of ``task`` generated from ``seed``. The prompt is the question
    (plain text), or chat messages [system, user] when ``system_prompt`` names one of
    reasoning-gym's system prompts; the answer is the entry's answer."""
    dataset = create(task, seed=seed, num_rows=num_rows, config=config)
    system_text = _system_prompt_text(system_prompt) if system_prompt is not None else None
    coords = {"task": task, "seed": seed, "size": num_rows, "config": json_safe(config)}
    rows = []
    for index in range(num_rows):
        item = generate_entry(dataset, task, config, index)
        question = str(item["question"])
        prompt: str | tuple[dict[str, str], ...] = question
        if system_text is not None:
            prompt = (
                {"role": "system", "content": system_text},
                {"role": "user", "content": question},
            )
        rows.append(
            PromptRow(
                prompt_id=f"gym:{task}:{seed}:{index}",
                prompt=prompt,
                answer=None if item.get("answer") is None else str(item["answer"]),
                meta={
                    "question": question,
                    "metadata": json_safe(item.get("metadata", {})),
                    "reasoning_gym": {**coords, "index": index},
                },
                source=f"{GYM_PREFIX}{task}:{index}",
            )
        )
    return tuple(rows)


def gym_sft_examples(
    task: str, *, seed: int, num_rows: int, config: dict[str, Any]
) -> tuple[tuple[str, str], ...]:
    """(prompt, reference response) pairs for ``tltrun sft``: each entry's question and its
    answer text. A task without a single reference answer (answer None) is a UsageError."""
    dataset = create(task, seed=seed, num_rows=num_rows, config=config)
    pairs = []
    for index in range(num_rows):
        item = generate_entry(dataset, task, config, index)
        if item.get("answer") is None:
            raise UsageError(
                f"reasoning-gym task {task!r}: entry {index} has no reference answer to "
                f"train on (its scorer accepts several); pick another task for SFT"
            )
        pairs.append((str(item["question"]), str(item["answer"])))
    return tuple(pairs)
