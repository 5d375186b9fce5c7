"""JSON output of results and resolved configs (standard library only).

``write_json(path, obj)`` accepts the dataclasses, paths and numpy scalars that result
dictionaries hold, so every output directory's ``config.json`` / ``summary.json`` is written
the same way by tltsim, tltrun and the benchmarks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


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
