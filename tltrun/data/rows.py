"""The row type that every prompt source produces (files in ``dataset.py``, reasoning-gym tasks
in ``gym.py``), and the JSON-safe conversion of the columns a row carries to its reward."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

GYM_PREFIX = "reasoning-gym:"


@dataclass(frozen=True, kw_only=True)
class PromptRow:
    """One prompt of a dataset, ready for the tokenizer and the reward."""

    prompt_id: str
    prompt: str | tuple[dict[str, Any], ...]
    answer: str | None
    meta: dict = field(default_factory=dict)
    source: str = ""

    @property
    def prompt_text(self) -> str:
        """The prompt as one string (chat messages joined as ``role: content`` lines): what a
        reward's ``prompt`` argument and the rollout dump show."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(f"{m['role']}: {m['content'] or ''}" for m in self.prompt)


def json_safe(value: Any) -> Any:
    """``value`` with tuples as lists, non-string keys as strings, NaN as None and anything else
    JSON cannot hold (infinities, bytes, dates, numpy scalars of odd kinds) as its ``str``.

    NaN is how pandas (and a JSON file written from it) marks a missing value: a reward reading a
    row's other columns gets None there, as from a null in Parquet, not the string "nan"."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((json_safe(v) for v in value), key=repr)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return json_safe(item())
        except (TypeError, ValueError):
            pass
    return str(value)
