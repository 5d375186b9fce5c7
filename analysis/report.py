"""Detect a replay or sweep output directory and draw its figures (``tltsim report DIR``).

    tltsim report results/replay-synth_reasoning_rl

The kind is read from ``DIR/summary.json`` (``"kind": "replay" | "sweep"``); figures go to
``DIR/plots/*.png``. A directory that is neither raises ValueError with one line saying why.
"""

from __future__ import annotations

import json
from pathlib import Path

from analysis import ReportError


def report(out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    summary_path = out_dir / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
    except FileNotFoundError:
        if (out_dir / "log.jsonl").is_file():  # a tltrun train run directory
            raise ReportError(
                f"{out_dir}: a tltrun train run (log.jsonl); draw it with tltrun report {out_dir}"
            ) from None
        if (out_dir / "advise.json").is_file():
            raise ReportError(
                f"{out_dir}: a tltsim advise output; draw its sweep: tltsim report {out_dir / 'sweep'}"
            ) from None
        command = _tltrun_command(out_dir / "config.json")
        if command is not None:  # (it was told to run a finished tltrun output again)
            raise ReportError(
                f"{out_dir}: a tltrun {command} output directory; tltsim report draws tltsim "
                f"replay and sweep outputs (replay its traces: tltsim replay {out_dir}/trace*.json)"
            ) from None
        if (out_dir / "config.json").is_file():  # written first, summary.json last
            raise ReportError(
                f"{out_dir}: no summary.json: the run that wrote its config.json did not finish "
                "(killed or interrupted?); run it again"
            ) from None
        raise ReportError(
            f"{out_dir}: no summary.json (expected the output directory of tltsim replay or tltsim sweep)"
        ) from None
    except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError
        raise ReportError(f"{summary_path}: unreadable ({err})") from None
    kind = summary.get("kind") if isinstance(summary, dict) else None
    if kind == "replay":
        from analysis.replay_plots import draw_all
    elif kind == "sweep":
        from analysis.sweep_plots import draw_all
    elif kind == "compare":  # (it was "field 'kind' must be 'replay' or 'sweep'")
        raise ReportError(
            f"{out_dir}: a tltsim compare output, whose figures compare wrote already "
            f"({', '.join(sorted(p.name for p in out_dir.glob('*.png'))) or 'none left'})"
        )
    else:
        raise ReportError(f"{summary_path}: field 'kind' must be 'replay' or 'sweep', got {kind!r}")
    import pandas as pd

    try:
        return draw_all(out_dir)
    except FileNotFoundError as err:
        raise ReportError(f"{out_dir}: missing result file {Path(err.filename).name}") from None
    except (pd.errors.EmptyDataError, pd.errors.ParserError) as err:  # a damaged results CSV
        raise ReportError(
            f"{out_dir}: a result file is not as tltsim {kind} wrote it ({err})"
        ) from None


def _tltrun_command(config_path: Path) -> str | None:
    """``generate`` or ``bench`` when ``config_path`` is such a tltrun run's config.json."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(config, dict) and "engine" in config:
        return next((c for c in ("generate", "bench") if c in config), None)
    return None
