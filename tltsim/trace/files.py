"""Load and save ``tlt-trace`` files; the format follows the file suffix.

    from tltsim.trace.files import load_trace, save_trace
    trace = load_trace("traces/synth_reasoning_rl.json")   # .json, .json.gz, .csv, .parquet
    save_trace(trace, "out/trace.csv")                       # the pandas-friendly twin

JSON (optionally gzipped) is ``tltsim.trace.schema``'s format; CSV and Parquet are the tabular
twin in ``tltsim.trace.table``. This module sits above both, so neither imports the other's
caller. Bad input raises a one-line ``TraceError``.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

from tltsim.jsonio import json_error, loads_strict
from tltsim.trace.schema import (
    SUFFIXES,
    TRACE_END,
    VERSIONS,
    Trace,
    TraceError,
    dumps_trace,
    header_lines,
    step_lines,
    trace_from_dict,
    version_of,
)

TABULAR_SUFFIXES = (".csv", ".parquet")


def trace_suffix(path: Path) -> str:
    """The suffix of ``path`` that names its format (``.json.gz`` before ``.json``)."""
    name = path.name.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    if (Path(path) / "trace.json").is_file():  # a tltrun run's directory (hunt: "unknown type")
        raise TraceError(f"{path}: a directory; its run's trace is {Path(path) / 'trace.json'}")
    raise TraceError(
        f"{path}: unknown trace file type: expected a name ending in {', '.join(SUFFIXES)}"
    )


def trace_stem(path: Path) -> str:
    """``path``'s name without its format suffix: ``qwen2.5-7b.json.gz`` -> ``qwen2.5-7b`` (the
    default output directories' names; the first dot cut it to ``qwen2``). A ``trace.json``,
    the name every tltrun train and generate run gives its trace, is named by its directory:
    ``runs/static/trace.json`` -> ``static`` (each run's compare wrote results/compare-trace,
    the next replacing the last)."""
    name = path.name
    lower = name.lower()
    stem = path.stem
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix) and len(name) > len(suffix):
            stem = name[: -len(suffix)]
            break
    if stem == "trace":
        return Path(os.path.abspath(path)).parent.name or stem
    return stem


def _read_json(path: Path) -> Any:
    try:
        data = path.read_bytes()
        if path.name.lower().endswith(".gz"):
            data = gzip.decompress(data)
        return loads_strict(data)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, expected a trace file") from None
    except json.JSONDecodeError as err:
        raise TraceError(
            f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); truncated file?"
        ) from None
    except RecursionError:
        raise TraceError(f"{path}: JSON nested too deeply to be a trace") from None
    except (OSError, EOFError, UnicodeDecodeError) as err:  # gzip.BadGzipFile is an OSError
        raise TraceError(
            f"{path}: cannot read: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
    except ValueError as err:  # a key given twice, a number too long to convert
        raise TraceError(json_error(err, str(path))) from None


def load_trace(path: str | Path) -> Trace:
    """Load and validate a trace; the format follows the suffix (.json, .json.gz, .csv, .parquet)."""
    path = Path(path)
    suffix = trace_suffix(path)
    if suffix in TABULAR_SUFFIXES:
        from tltsim.trace import table  # pandas is only needed for the tabular twin

        return table.read_table(path, suffix)
    return trace_from_dict(_read_json(path), str(path))


def save_trace(trace: Trace, path: str | Path, allow_lossy: bool = False) -> None:
    """Write ``trace``; the format follows the suffix. The tabular twins (CSV, Parquet) cannot hold
    ``accept_hist`` or ``measured``: they refuse such a trace unless ``allow_lossy`` is set.

    The file is written under a temporary name beside ``path`` and renamed over it, so a process
    killed mid-write leaves the previous file or the new one, never a torn one (``tltrun bench
    --resume`` takes a row's trace file as the mark of a finished row)."""
    path = Path(path)
    suffix = trace_suffix(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        if suffix in TABULAR_SUFFIXES:
            from tltsim.trace import table

            table.write_table(trace, path, suffix, allow_lossy, write_to=tmp)
        else:
            data = dumps_trace(trace).encode()
            if suffix == ".json.gz":
                data = gzip.compress(data, mtime=0)  # mtime=0: same trace, same bytes
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as err:
        if tmp.is_file():
            tmp.unlink()
        if err.errno is None or err.filename != str(tmp) or isinstance(err, IsADirectoryError):
            raise  # pyarrow's names both paths; a directory in the way is the temporary one
        raise OSError(err.errno, err.strerror, str(path)) from None  # the path asked for


COPY_CHUNK_BYTES = 8 << 20
_STEP_HEAD = b'\n  {"step": '  # how dumps_trace starts a step's line (prompts: 3 spaces)


def append_steps(trace: Trace, path: str | Path) -> bool:
    """Append ``trace``'s steps to the JSON trace ``save_trace`` wrote at ``path`` with the same
    meta, without parsing the steps it holds: a run that rebuilt its whole trace after every
    step parsed and validated all of it each time (0.14 s per MB: about a minute per step at
    step 1,000 of 256 x 8 responses). The file's bytes are still copied, to a temporary file
    with the new steps after them, renamed over it (a kill leaves the old file or the new
    one): a copy per step that grows with the file, at disk speed. Returns False and writes
    nothing where the file is missing, has another meta, is not in ``dumps_trace``'s layout or
    ends at a step not below the first new one (the caller then saves the whole trace)."""
    path = Path(path)
    if trace_suffix(path) != ".json" or not trace.steps or not path.is_file():
        return False
    end = ("\n" + TRACE_END + "\n").encode()
    with path.open("rb") as old:
        head = [old.readline() for _ in range(3)]
        size = old.seek(0, os.SEEK_END)
        if size < sum(map(len, head)) + len(end) + 4:
            return False
        old.seek(size - len(end) - 4)
        if old.read() != b"  ]}" + end:  # not a trace of >= 1 step in this layout
            return False
        versions = [
            v
            for v in VERSIONS
            if head == [(line + "\n").encode() for line in header_lines(trace.meta, v)]
        ]
        last = _last_step(old, size)
        if not versions or last is None or last >= trace.steps[0].step:
            return False
        header = header_lines(trace.meta, max(versions[0], version_of(trace)))
        steps = [step_lines(step, trace.max_response_tokens) for step in trace.steps]
        tmp = path.with_name(path.name + ".tmp")
        try:
            with tmp.open("wb") as new:
                new.write(("\n".join(header) + "\n").encode())
                old.seek(sum(map(len, head)))
                new.flush()
                _copy(old, new, size - len(end) - old.tell())
                new.write((",\n" + ",\n".join("\n".join(x) for x in steps)).encode() + end)
            os.replace(tmp, path)
        except BaseException:  # (a full disk, or Ctrl-C mid-copy: no stray copy of the trace)
            tmp.unlink(missing_ok=True)
            raise
    return True


def _last_step(f: Any, size: int) -> int | None:
    """The number of the last step of a ``dumps_trace`` file (its head line found from the end,
    a block at a time), or None."""
    end = size
    while end > 0:
        start = max(0, end - COPY_CHUNK_BYTES)
        f.seek(start)
        block = f.read(end - start + len(_STEP_HEAD) + 24)  # a head cut at the block's end
        at = block.rfind(_STEP_HEAD)
        if at >= 0:
            number = block[at + len(_STEP_HEAD) :].split(b",", 1)[0]
            return int(number) if number.isdigit() else None
        end = start
    return None


def _copy(src: Any, dst: Any, count: int) -> None:
    """``count`` bytes from ``src``'s position to ``dst``'s: in the kernel where it can
    (``copy_file_range``: no pass through Python's memory), else a chunk at a time."""
    try:
        while count > 0 and (n := os.copy_file_range(src.fileno(), dst.fileno(), count)):
            count -= n
        dst.seek(0, os.SEEK_END)
        return
    except (AttributeError, OSError):  # no such call, or not between these files
        pass
    while count > 0 and (chunk := src.read(min(COPY_CHUNK_BYTES, count))):
        dst.write(chunk)
        count -= len(chunk)
