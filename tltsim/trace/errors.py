"""``TraceError`` and the helpers of its one-line messages, shared by the trace validators
(``tltsim.trace.schema`` for steps, prompts and responses, ``tltsim.trace.measured`` for a
step's ``measured`` block, ``tltsim.trace.table`` for the tabular twin). It imports neither of
them, so they can import it and each other without a cycle.

A message names the file, the step and prompt where known, the field, what was expected and
what was found: ``runs/x.json: step 3: field 'measured.clock': expected 'wall' or 'cpu', got 'gpu'``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tltsim.errors import TLTError


class TraceError(TLTError, ValueError):
    """Bad trace input. ``str(err)`` is one line naming file, step, prompt, field, expectation.
    (A ValueError too: callers that caught ValueError from a trace parser still do.)"""


def show(value: Any) -> str:
    """A short one-line rendering of a bad value for error messages."""
    if isinstance(value, (dict, list)) and value:
        return f"{'an object' if isinstance(value, dict) else 'a list'} of {len(value)} items"
    text = json.dumps(value) if isinstance(value, (dict, list)) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_int(value: Any) -> bool:
    return type(value) is int  # bool is a subclass of int: reject it on purpose


def is_number(value: Any) -> bool:
    """An int or a finite float (not a bool: ``True`` is no number of seconds)."""
    return type(value) is int or (type(value) is float and math.isfinite(value))
