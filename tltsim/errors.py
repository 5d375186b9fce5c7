"""The error types of tltsim and tltrun (standard library only, so every layer may raise them).

A library raises a ``TLTError`` subclass for input a user can fix — a bad flag value, file,
trace, profile or checkpoint — with a message of one line that names the file, field and what
was expected. The command lines (``tltsim.cli.main``, ``tltrun.cli.main``) catch ``TLTError``,
print ``error: <message>`` and exit 2; anything else is a bug and keeps its traceback.

Subclasses defined beside their subject: ``tltsim.trace.schema.TraceError``,
``tltsim.cost.profile.ProfileError`` (a ``UsageError``), ``tltrun.model.transformer.CheckpointError``.
"""

from __future__ import annotations


class TLTError(Exception):
    """Input a user can fix; ``str(err)`` is one line. The CLIs print it and exit 2."""


class UsageError(TLTError):
    """Bad user input: a flag, a value, a missing or malformed file."""
