"""JSON output of results and resolved configs (standard library only).

``write_json(path, obj)`` accepts the dataclasses, paths and numpy scalars that result
dictionaries hold, so every output directory's ``config.json`` / ``summary.json`` is written
the same way by tltsim, tltrun and the benchmarks. ``read_text`` / ``parse_json`` /
``read_json`` are the input side every loader of a user's file uses, so binary garbage
(UnicodeDecodeError), pathological nesting (RecursionError) and a directory in place of a file
all become one ``TLTError`` line naming the file instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tltsim.errors import TLTError, UsageError


def _default(o: Any) -> Any:
    """What ``json`` cannot encode by itself: dataclasses, paths, numpy scalars (``.item()``)."""
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` (dataclasses allowed) as indented JSON."""
    path.write_text(json.dumps(obj, indent=2, default=_default) + "\n")


def read_text(path: str | Path, what: str = "file", error: type[TLTError] = UsageError) -> str:
    """The UTF-8 text of ``path``; a missing, unreadable or binary file raises ``error`` naming
    ``what`` and the file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such file (expected a {what})") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected a {what}") from None
    except UnicodeDecodeError as err:
        raise error(
            f"{path}: not a text {what} (byte {err.start} is not UTF-8; binary or corrupted?)"
        ) from None
    except OSError as err:
        raise error(f"{path}: cannot read the {what} ({err.strerror or err})") from None


def parse_json(text: str | bytes, where: str, error: type[TLTError] = UsageError) -> Any:
    """``json.loads`` whose failures (bad syntax, nesting deeper than the interpreter's
    recursion limit, bytes that are not UTF-8) raise one ``error`` line starting with ``where``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(
            f"{where}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to parse") from None
    except UnicodeDecodeError as err:
        raise error(f"{where}: not UTF-8 text (byte {err.start}; binary or corrupted?)") from None


def read_json(path: str | Path, what: str = "JSON file", error: type[TLTError] = UsageError) -> Any:
    """``parse_json(read_text(path))``: one ``error`` line for every way the file can be bad."""
    return parse_json(read_text(path, what, error), str(path), error)
