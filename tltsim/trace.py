"""The ``tlt-trace`` v1 format: load, validate, save; CSV twin; importers of public length data.

A trace is a list of RL steps; each step holds prompts; each prompt holds the lengths of its
group's responses (see ../shared/DESIGN.md, "Trace format"). Both tltsim (replay) and tltrun
(measured runs) read and write this one format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FORMAT = "tlt-trace"
VERSION = 1
FINISH_REASONS = ("stop", "length")


class TraceError(ValueError):
    """Bad trace input. ``str(err)`` is one line naming file, step, prompt, field, expectation."""


@dataclass(frozen=True)
class Response:
    tokens: int  # generated tokens, >= 1
    finish: str = "stop"  # "stop" (EOS) or "length" (hit max_response_tokens)
    accept_hist: tuple[int, ...] | None = None  # measured: count of verifies that accepted i tokens


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt_tokens: int
    responses: tuple[Response, ...]


@dataclass(frozen=True)
class Step:
    step: int
    prompts: tuple[Prompt, ...]
    measured: dict[str, Any] | None = None  # written by tltrun: rollout_s, train_s, ...

    @property
    def num_responses(self) -> int:
        return sum(len(p.responses) for p in self.prompts)


@dataclass(frozen=True)
class Trace:
    meta: dict[str, Any] = field(default_factory=dict)
    steps: tuple[Step, ...] = ()
