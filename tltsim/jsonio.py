"""JSON output of results and resolved configs (standard library only).

``write_json(path, obj)`` accepts the dataclasses, paths and numpy scalars that result
dictionaries hold, so every output directory's ``config.json`` / ``summary.json`` is written
the same way by tltsim, tltrun and the benchmarks. ``read_text`` / ``parse_json`` /
``read_json`` are the input side every loader of a user's file uses, so binary garbage
(UnicodeDecodeError), pathological nesting (RecursionError) and a directory in place of a file
all become one ``TLTError`` line naming the file instead of a traceback. ``typed_fields``
checks a config file's values against the dataclass they configure, before any run starts;
``exact_fields`` also refuses names the dataclass lacks and names the fields it needs.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
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
    """Write ``obj`` (dataclasses allowed) as indented strict JSON: a NaN or infinite float is
    written as ``null`` (``finite_json``; compare's per-response rates of a response with no
    verify in a step were written as bare NaN, which strict readers refuse). Atomically: a
    temporary file beside it, renamed over it, so that a kill mid-write never leaves a torn
    ``summary.json`` that ``report`` would take for a finished run's."""
    path = Path(path)
    text = dumps_strict(obj, indent=2) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def dumps_strict(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``obj`` (dataclasses, paths, numpy scalars allowed) with every
    non-finite float as ``null``."""
    plain = json.loads(json.dumps(obj, default=_default))  # dataclasses, numpy -> plain values
    return json.dumps(finite_json(plain), allow_nan=False, **kwargs)


def remove_stale_outputs(out: Path, names: tuple[str, ...]) -> None:
    """Delete the result files ``names`` and the figures (``plots/*.png``) an earlier run left
    in ``out``, before a new run writes its ``config.json`` there: a run killed before its
    results were written left the old ones beside the new config, and ``report`` drew them as
    this run's."""
    for name in names:
        (out / name).unlink(missing_ok=True)
    for png in (out / "plots").glob("*.png"):
        png.unlink()


def finite_json(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None: strict JSON has no NaN
    (``json.dumps`` writes a bare ``NaN`` that jq, JavaScript and pandas' strict readers refuse),
    so a value that is not a number is written as ``null``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: finite_json(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_json(value) for value in obj]
    return obj


def read_text(path: str | Path, what: str = "file", error: type[TLTError] = UsageError) -> str:
    """The UTF-8 text of ``path`` (a leading byte-order mark, which Windows editors write, is
    not part of it: JSON refused it as 'Unexpected UTF-8 BOM'); a missing, unreadable or binary
    file raises ``error`` naming ``what`` and the file."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
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


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice (json.loads keeps the last silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def loads_strict(text: str | bytes) -> Any:
    """``json.loads`` that refuses an object naming a key twice (a typo that kept the last
    value: ``"responses": [5, 6], "responses": [7]`` loaded as [7]); DuplicateKeyError."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def json_error(err: ValueError, where: str) -> str:
    """The one-line message of a ``loads_strict`` failure (any ValueError it raises)."""
    if isinstance(err, json.JSONDecodeError):
        return f"{where}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
    if isinstance(err, UnicodeDecodeError):
        return f"{where}: not UTF-8 text (byte {err.start}; binary or corrupted?)"
    if isinstance(err, DuplicateKeyError):
        return f"{where}: key {str(err)!r} given twice in one JSON object (which one is meant?)"
    if "integer string conversion" in str(err):  # int() of a number over Python's limit
        return f"{where}: a number of more than 4,300 digits (corrupted file?)"
    return f"{where}: not valid JSON ({str(err).splitlines()[0]})"


def parse_json(text: str | bytes, where: str, error: type[TLTError] = UsageError) -> Any:
    """``loads_strict`` whose failures (bad syntax, a key given twice, a number too long to
    convert, nesting deeper than the interpreter's recursion limit, bytes that are not UTF-8)
    raise one ``error`` line starting with ``where``."""
    try:
        return loads_strict(text)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to parse") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, DuplicateKeyError, ...
        raise error(json_error(err, where)) from None


def read_json(path: str | Path, what: str = "JSON file", error: type[TLTError] = UsageError) -> Any:
    """``parse_json(read_text(path))``: one ``error`` line for every way the file can be bad."""
    return parse_json(read_text(path, what, error), str(path), error)


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def typed_fields(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` (a TOML/JSON table of ``cls``'s fields) checked against the fields' types:
    an ``int`` field takes an integer (not true/false, not 1.5), a ``float`` field any number
    (an integer becomes a float), a ``bool`` field true or false, a ``str`` field a string, a
    ``tuple[T, ...]`` field a list of those (returned as a tuple), ``X | None`` also null. Other
    types and unknown names pass unchanged (the caller reports unknown names). A mismatch is
    one UsageError: ``where``, the field, what was expected and what was given, where the
    dataclass would have taken a wrong type silently or failed later with a Python message."""
    hints = typing.get_type_hints(cls)
    checked = dict(values)
    for name, value in values.items():
        if name in hints:
            checked[name] = typed_value(hints[name], value, f"{where}: {name}")
    return checked


def exact_fields(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """``typed_fields``, where every name must be one of ``cls``'s fields (a misspelt one was
    refused with Python's "unexpected keyword argument" or, had it a default, silently ignored)
    and every field without a default must be there: one UsageError naming the field."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in values:
        if name not in fields:
            close = closest(name, fields)
            hint = f"did you mean {close!r}?" if close else f"expected some of {', '.join(fields)}"
            raise UsageError(f"{where}: unknown field {name!r} ({hint})")
    for name, f in fields.items():
        needed = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if needed and name not in values:
            close = closest(name, values)
            hint = f" (the file has {close!r})" if close else ""
            raise UsageError(f"{where}: missing field {name!r}{hint}")
    return typed_fields(cls, values, where)


def closest(name: str, names: Any) -> str | None:
    """The one of ``names`` most like ``name`` (a misspelling's intended word), if any is."""
    close = difflib.get_close_matches(name, [str(n) for n in names], n=1, cutoff=0.6)
    return close[0] if close else None


def typed_value(tp: Any, value: Any, where: str) -> Any:
    """One value of a field of type ``tp`` (``typed_fields``' rules)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        return typed_value(rest[0], value, where) if len(rest) == 1 else value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple):
            raise UsageError(f"{where}: expected a list, got {_shown(value)}")
        return tuple(typed_value(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if tp not in _TYPE_WORDS:
        return value
    if not (type(value) is tp or (tp is float and type(value) is int)):
        raise UsageError(f"{where}: expected {_TYPE_WORDS[tp]}, got {_shown(value)}")
    return float(value) if tp is float else value


def _shown(value: Any) -> str:
    """A value as the config file spells it (true, "one", 1.5), else as Python does."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
