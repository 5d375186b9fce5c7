"""The error types of tltsim and tltrun (standard library only, so every layer may raise them).

A library raises a ``TLTError`` subclass for input a user can fix — a bad flag value, file,
trace, profile or checkpoint — with a message of one line that names the file, field and what
was expected. The command lines (``tltsim.cli.main``, ``tltrun.cli.main``, through
``tltsim.cli.args.run_command``) catch ``TLTError``, print ``error: <message>`` and exit 2;
anything else is a bug: one ``error: internal error: ...`` line, exit 1, the traceback in a file.

Subclasses defined beside their subject: ``tltsim.trace.schema.TraceError``,
``tltsim.cost.profile.ProfileError`` (a ``UsageError``), ``tltrun.model.config.CheckpointError``.
"""

from __future__ import annotations

import math


class TLTError(Exception):
    """Input a user can fix; ``str(err)`` is one line. The CLIs print it and exit 2."""


class UsageError(TLTError):
    """Bad user input: a flag, a value, a missing or malformed file."""


class InputWarning(UserWarning):
    """Input that is used, with a part of it left out or repaired (e.g. a torn last line of a
    killed run's log); the CLIs print it as one ``warning:`` line."""


# The largest learning rate the trainers take: an AdamW step moves each weight by up to about
# lr, and initialised weights are ~1/sqrt(hidden) << 1, so beyond 1 nothing trains (a lr of
# 1e38 overflowed inside torch's AdamW: an internal error, not a message).
MAX_LR = 1.0


class DivergedError(TLTError):
    """Training met a loss or gradient norm that is not finite (too high a learning rate, an
    fp16 overflow); raised before that step's update, so the weights are the last step's."""


def check_finite(value: float, what: str) -> None:
    """Raise ``DivergedError`` unless ``value`` (``what``, e.g. "sft step 12: loss") is finite."""
    if not math.isfinite(value):
        raise DivergedError(
            f"{what} is {value}: training diverged and this step's update was not applied; "
            "lower the learning rate"
        )


class WorkerError(TLTError):
    """A worker process of a multi-process run failed; ``str(err)`` names its rank and the
    cause in one line (the full traceback goes to a file the message names). ``exit_code`` is
    2 when the worker's own error was a ``TLTError`` (input a user can fix), else 1 (a bug).
    ``is_output_cut``: the workers were killed mid-run, so a worker's progress bar may have
    left the terminal's last line unfinished (the error line then starts a new one)."""

    def __init__(self, message: str, exit_code: int = 1, *, is_output_cut: bool = False) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.is_output_cut = is_output_cut


class StoppedError(TLTError):
    """A run stopped by Ctrl-C (exit 130) or SIGTERM (143) before it finished; ``str(err)`` says
    how to continue it. Raised by the commands that can resume in place of the bare
    KeyboardInterrupt / SIGTERM, which printed "interrupted" or nothing at all."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.is_output_cut = True  # a progress bar's line may be open


def is_input_error_name(qualified_name: str) -> bool:
    """Whether ``module.Class`` (as a traceback's last line names it) is a TLTError subclass
    that is defined in a module already imported."""
    todo, seen = [TLTError], set()
    while todo:
        cls = todo.pop()
        seen.add(f"{cls.__module__}.{cls.__qualname__}")
        seen.add(cls.__qualname__)
        todo.extend(cls.__subclasses__())
    return qualified_name in seen
