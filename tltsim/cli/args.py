"""Helpers that map frozen config dataclasses 1:1 onto argparse flags, and the CLI error type.

Every subcommand builds its flags from a config dataclass (STYLE.md: "CLI flags are generated
from, or mapped 1:1 onto, those fields"), so a flag and its field can never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any


class UsageError(Exception):
    """Bad user input. ``tltsim.cli.main.main`` prints ``str(err)`` on one line and exits 2."""


def _base_type(tp: Any) -> Any:
    """``int | None`` -> int; ``tuple[int, ...]`` -> tuple; plain types unchanged."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    return origin or tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """Add ``--{prefix}{field-name}`` for every field of dataclass ``cls`` (default: unset)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or not f.init:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        helptext = f.metadata.get("help", "") + (
            f" (default: {default})" if default is not None else ""
        )
        if tp is bool:
            group.add_argument(
                flag,
                dest=prefix + f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=helptext,
            )
        elif tp in (tuple, list):
            group.add_argument(
                flag, dest=prefix + f.name, default=None, help=helptext + " (comma-separated)"
            )
        else:
            group.add_argument(
                flag,
                dest=prefix + f.name,
                type=tp if tp in (int, float, str) else str,
                default=None,
                help=helptext,
            )


def dataclass_from_args(
    cls: type, ns: argparse.Namespace, prefix: str = "", base: Any = None
) -> Any:
    """Build ``cls`` from parsed flags; fields whose flag was not given keep ``base``'s value
    (or the dataclass default). Validation errors from ``__post_init__`` become UsageError."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        raw = getattr(ns, prefix + f.name, None)
        if raw is None:
            if base is not None:
                values[f.name] = getattr(base, f.name)
            continue
        tp = _base_type(hints[f.name])
        if tp in (tuple, list) and isinstance(raw, str):
            inner = typing.get_args(hints[f.name])
            elem = inner[0] if inner and inner[0] is not Ellipsis else str
            try:
                raw = tuple(elem(x) for x in raw.split(",") if x != "")
            except ValueError:
                raise UsageError(
                    f"--{prefix}{f.name.replace('_', '-')}: expected comma-separated {elem.__name__} values, got {raw!r}"
                ) from None
        values[f.name] = raw
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{cls.__name__}: {err}") from None


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` (dataclasses allowed) as indented JSON."""

    def default(o: Any) -> Any:
        if dataclasses.is_dataclass(o):
            return dataclasses.asdict(o)
        if isinstance(o, Path):
            return str(o)
        if hasattr(o, "item"):
            return o.item()
        raise TypeError(f"not JSON serialisable: {type(o).__name__}")

    path.write_text(json.dumps(obj, indent=2, default=default) + "\n")


def fail(message: str) -> typing.NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
