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


class TLTError(Exception):
    """Input a user can fix; ``str(err)`` is one line. The CLIs print it and exit 2."""


class UsageError(TLTError):
    """Bad user input: a flag, a value, a missing or malformed file."""


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
