"""The per-step logs of ``tltrun train``: ``log.jsonl`` and ``trace_steps.jsonl`` (one JSON line
per RL step, appended and fsynced by rank 0: tltrun.train.step_log), the measured tlt-trace
``trace.json`` kept equal to the latter (each step appended, ``append_trace``), and their
repair on resume.

Resume (``prepare_logs``, called by tltrun.train.launch with the checkpoint's next step): rows
of steps at or after the resumed step were written after that checkpoint, or by steps the run
redoes, so they are dropped and no step is lost or repeated; a torn last line (a kill
mid-append) is dropped with a ``RunDirWarning``; a log that stops before the checkpoint's step,
or whose steps are out of order, is a ``CheckpointError`` naming the file. Every rewrite is
atomic (temporary file, ``os.replace``). Checkpoints themselves: tltrun.train.state.

Run the tests: ``python -m pytest tests/test_run_integrity.py -q``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

from tltrun.train.state import (
    CKPT_RE,
    LOGS,
    RunDirWarning,
    checkpoint_error,
    looks_intact,
    read_jsonl,
    write_atomic,
)
from tltsim.trace.files import append_steps, save_trace
from tltsim.trace.schema import trace_from_dict

# a reward_errors.log line (tltrun.train.step_log)
_ERROR_LINE = re.compile(r"step (\d+): ")


def _log_rows(path: Path) -> list[str]:
    """The complete JSON lines of ``path``, each an object with an int ``step``; a torn last
    line (no newline: a kill mid-append) is dropped with a RunDirWarning; any other bad line is
    a CheckpointError."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    rows = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError) as err:
            raise checkpoint_error(f"{path}: line {number} is not valid JSON ({err})") from None
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            raise checkpoint_error(f"{path}: line {number} has no integer 'step'")
        rows.append(raw.decode())
    if tail.strip():
        try:
            row = json.loads(tail.decode())
            is_whole = isinstance(row, dict) and type(row.get("step")) is int
        except (UnicodeDecodeError, ValueError):
            is_whole = False
        if is_whole:  # the row is whole, only its newline was lost
            rows.append(tail.decode())
        else:
            warnings.warn(
                f"{path}: dropped a torn last line ({len(tail)} bytes without a newline: "
                "the run was killed while appending it)",
                RunDirWarning,
                stacklevel=3,
            )
    return rows


def prepare_logs(out: Path, start_step: int) -> None:
    """Validate ``log.jsonl`` and ``trace_steps.jsonl`` of a run resumed at ``start_step`` and
    keep exactly their rows of steps ``0 .. start_step - 1``: later rows belong to steps the
    resumed run redoes. A log without one of those steps (a ``next_step`` beyond the log) or
    with steps out of order is a CheckpointError."""
    for name in LOGS:
        path = out / name
        rows = _log_rows(path) if path.is_file() else []
        steps = [json.loads(row)["step"] for row in rows]
        kept = rows[:start_step]
        if steps[:start_step] != list(range(min(start_step, len(steps)))):
            raise checkpoint_error(f"{path}: steps {_span(steps)}, expected 0, 1, 2, ... in order")
        if len(kept) < start_step:
            raise checkpoint_error(
                f"{path}: has steps {_span(steps)} but the checkpoint's next_step is "
                f"{start_step} (next_step beyond the log); restore the file, or start a new "
                "run in another --out"
            )
        if kept != rows or (path.is_file() and not path.read_bytes().endswith(b"\n")):
            write_atomic(path, "".join(row + "\n" for row in kept))
    # the rollout dumps of steps the resumed run redoes (rewritten as it redoes them)
    for dump in sorted((out / "rollouts").glob("step_*.jsonl")):
        if int(dump.stem.removeprefix("step_")) >= start_step:
            dump.unlink()
    _cut_reward_errors(out / "reward_errors.log", start_step)
    _cut_trace(out)


def _cut_reward_errors(path: Path, start_step: int) -> None:
    """Keep the ``step N: ...`` lines of steps before ``start_step`` (the redone steps log
    their errors again); a torn last line goes too."""
    if not path.is_file():
        return
    text = path.read_text(errors="replace")
    kept, step = [], -1
    for line in text.splitlines(keepends=True):
        match = _ERROR_LINE.match(line)
        step = int(match[1]) if match else step  # a message's continuation: its step's
        if step < start_step and line.endswith("\n"):
            kept.append(line)
    if len(kept) != len(text.splitlines()):
        write_atomic(path, "".join(kept))


def _cut_trace(out: Path) -> None:
    """trace.json rebuilt from the cut trace_steps.jsonl (with its own meta), or removed when
    no step is left: it must never hold the steps a resumed run redoes."""
    path = out / "trace.json"
    if not path.is_file():
        return
    try:
        meta = json.loads(path.read_bytes())["meta"]
    except (ValueError, KeyError, TypeError):  # damaged: rebuilt after the next step
        meta = None
    steps = out / "trace_steps.jsonl"
    if meta is None or not steps.is_file() or not steps.read_bytes().strip():
        path.unlink()
        return
    write_trace(out, meta)


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}"
    return ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")


def append_trace(out: Path, meta: dict[str, Any], step: dict[str, Any]) -> None:
    """trace.json after ``step`` was appended to trace_steps.jsonl: the step appended to it
    (``tltsim.trace.files.append_steps``: the file's bytes copied, its steps not parsed) where
    it holds the steps before under ``meta``, else rebuilt whole (``write_trace``: the first
    step of a launch, and every step of a run resumed with another policy or worker count,
    whose meta names each launch's steps). A whole rebuild each step made a long run's
    record time quadratic: 4 s a step at step 60 of 256 x 8 responses, ~1 min at 1,000."""
    new = trace_from_dict(
        {"format": "tlt-trace", "version": 1, "meta": meta, "steps": [step]},
        str(out / "trace_steps.jsonl"),
    )
    if not append_steps(new, out / "trace.json"):
        write_trace(out, meta)


def write_trace(out: Path, meta: dict[str, Any]) -> None:
    """trace.json from trace_steps.jsonl (each row one tlt-trace step dict)."""
    steps = read_jsonl(out / "trace_steps.jsonl")
    segments = _launch_segments(steps)
    if len(segments) > 1:  # (the meta named the last launch's settings for every step)
        meta = {**meta, "source": "tltrun train, resumed with other settings: " + "; ".join(
            f"steps {first}..{last} policy {policy} on {workers} workers"
            for first, last, policy, workers in segments
        )}  # fmt: skip
    trace = trace_from_dict(
        {"format": "tlt-trace", "version": 1, "meta": meta, "steps": steps},
        str(out / "trace_steps.jsonl"),
    )
    save_trace(trace, out / "trace.tmp.json")
    os.replace(out / "trace.tmp.json", out / "trace.json")


def _launch_segments(steps: list[dict[str, Any]]) -> list[tuple[int, int, str, int]]:
    """(first step, last step, policy, workers) of each run of consecutive measured steps with
    the same policy and worker count."""
    segments: list[tuple[int, int, str, int]] = []
    for row in steps:
        measured = row.get("measured") or {}
        key = (
            str((measured.get("policy") or {}).get("name")),
            len(measured.get("worker_rollout_s") or []),
        )
        if segments and segments[-1][2:] == key:
            segments[-1] = (segments[-1][0], row["step"], *key)
        else:
            segments.append((row["step"], row["step"], *key))
    return segments


def tensorboard_writer(out: Path, start_step: int, is_on: bool):
    """Rank 0's ``SummaryWriter`` of ``out/tensorboard`` (``--tensorboard``), or None. Its
    ``purge_step`` drops the events of the steps a resumed run redoes (all of them when it
    restarts from step 0: a run killed before its first checkpoint); a resume without
    ``--tensorboard`` purges them too (the redone steps' old points stayed beside the new run)."""
    tb_dir = out / "tensorboard"
    if not is_on and not tb_dir.is_dir():
        return None
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tb_dir), purge_step=start_step)
    if is_on:
        return writer
    writer.close()
    return None


def resume_hint(out: Path, command: str) -> str:
    """How a stopped run goes on (``command`` ends in ``--out OUT``): from its newest
    checkpoint that looks intact (``looks_intact``), or, stopped before its first
    (``--checkpoint-every``), from step 0 (the stop promised 'the last checkpoint' where there
    was none)."""
    found = sorted(p for p in (out / "ckpt").glob("step_*") if CKPT_RE.match(p.name))
    done = [p.name for p in found if looks_intact(p)]
    if done:
        return f"continue from its last checkpoint ({done[-1]}) with {command} --resume"
    if found:  # (it promised the newest, which --resume then refused as damaged)
        return (
            f"none of its checkpoints is intact ({found[-1].name} the newest; {command} --resume "
            "names the damage): start the run again in another --out"
        )
    return (
        f"it wrote no checkpoint yet (--checkpoint-every): {command} --resume starts it again "
        "from step 0"
    )
