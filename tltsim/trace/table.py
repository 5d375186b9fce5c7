"""The tabular twin of ``tlt-trace`` v1: CSV and Parquet, one row per response.

Columns ``step,prompt_id,prompt_tokens,response_tokens`` plus an optional ``finish``
(``stop``/``length``; when absent a response equal to the cap is ``length``, see
``tltsim.trace.schema.inferred_finish``). The trace's ``meta`` travels in a first comment line
of the CSV, ``# tlt-trace v1 meta: {...}``, with the file's row count (``CSV_ROWS_KEY``, checked
on reading); read the CSV with ``pd.read_csv(path, skiprows=1)`` (``comment="#"`` would cut a
prompt id holding a ``#``). In Parquet the header is the schema metadata's ``tlt-trace`` key.
A CSV without that line is accepted (its meta is then ``{"source": <file name>}``).
Per-response ``accept_hist`` and per-step ``measured`` are JSON-only. Use through ``tltsim.trace.files.load_trace`` / ``save_trace``.

Rows may come in any order: steps are sorted by number, prompts keep their first appearance
within the step, responses keep row order. Bad rows raise one-line ``TraceError`` naming the
line (CSV) or row (Parquet), the step and prompt where known, and the column.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tltsim.jsonio import json_error, loads_strict
from tltsim.trace.schema import (
    FINISH_REASONS,
    FORMAT,
    MAX_COUNT,
    VERSION,
    Prompt,
    Response,
    Step,
    Trace,
    TraceError,
    check_header,
)

COLUMNS = ("step", "prompt_id", "prompt_tokens", "response_tokens")
META_PREFIX = f"# {FORMAT} v{VERSION} meta: "
PARQUET_META_KEY = b"tlt-trace"
# The CSV's meta line also counts its rows under this key (taken out of the trace's meta on
# reading): a file cut at a prompt boundary read as a valid, shorter trace. JSON, gzip and
# Parquet catch a cut file themselves; a CSV without the key (older, or written by hand) is
# read as it is.
CSV_ROWS_KEY = "_tlt_num_rows"
_HEADER_RE = re.compile(r"# (\S+) v(\S+) meta: (.*)")
_MAX_DIGITS = 15  # int64-safe; no real token count comes near 10**15


def _header_meta(line: str, source: str) -> dict[str, Any]:
    match = _HEADER_RE.fullmatch(line.rstrip("\r\n"))
    if match is None:
        raise TraceError(
            f"{source}: line 1: expected '{META_PREFIX}{{...}}' or the column header, got {line[:40]!r}"
        )
    fmt, version, meta_text = match.groups()
    try:
        meta = loads_strict(meta_text)
    except json.JSONDecodeError as err:
        raise TraceError(
            f"{source}: line 1: meta is not valid JSON ({err.msg} at column {err.colno})"
        ) from None
    except (ValueError, RecursionError) as err:  # a key twice, a number too long to convert
        raise TraceError(
            json_error(err, f"{source}: line 1: meta")
            if isinstance(err, ValueError)
            else f"{source}: line 1: meta nested too deeply"
        ) from None
    version_value = int(version) if version.isascii() and version.isdigit() else version
    return check_header({"format": fmt, "version": version_value, "meta": meta}, source)


def _read_csv(path: Path) -> tuple[dict[str, pd.Series], dict[str, Any], Callable[[int], str]]:
    source = str(path)
    try:
        # -sig: a leading BOM (spreadsheets write one) would hide the '#' of the meta line
        with path.open(encoding="utf-8-sig", newline="") as fh:
            first = fh.readline()
            has_meta = first.startswith("#")
            meta = _header_meta(first, source) if has_meta else {"source": path.name}
            if not has_meta:
                fh.seek(0)
            # Read on from the open file, past the meta line, rather than with skiprows: pandas'
            # tokenizer honours quotes while it skips, so meta JSON with a field starting '"'
            # after a comma (e.g. {"model": ","}) would swallow the whole file.
            frame = pd.read_csv(fh, dtype=str, keep_default_na=False, na_filter=False)
    except FileNotFoundError:
        raise TraceError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{source}: is a directory, expected a trace file") from None
    except pd.errors.EmptyDataError:
        raise TraceError(
            f"{source}: empty CSV: expected the header {','.join(COLUMNS)} and one row per response"
        ) from None
    except (pd.errors.ParserError, UnicodeDecodeError, OSError) as err:
        raise TraceError(
            f"{source}: not a readable CSV: {str(err).strip().splitlines()[0]}"
        ) from None
    num_rows = meta.pop(CSV_ROWS_KEY, None) if has_meta else None
    if num_rows is not None and num_rows != len(frame):
        raise TraceError(
            f"{source}: {len(frame)} rows, but its meta line says {num_rows} were written: the "
            f"file was cut or edited since (to read it as it is, remove {CSV_ROWS_KEY!r} from "
            "the meta line)"
        )
    lines: list[int] = []  # each data row's first file line, found when an error names one

    def row(i: int) -> str:
        if not lines:
            lines.extend(csv_row_lines(path, has_meta))
        return f"line {lines[i]}" if i < len(lines) else f"row {i + 1}"

    return {name: frame[name] for name in frame.columns}, meta, row


def csv_row_lines(path: Path, has_meta: bool) -> list[int]:
    """The file line (1-based) each data row starts on: pandas skips blank lines and reads a
    quoted field over several lines, so the row index plus the header lines named a wrong
    line after either (tltsim's own writer quotes an id holding a newline)."""
    starts = []
    # a gzipped source (ServeGen's .csv.gz): its lines, not its compressed bytes as text
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8-sig", newline="") as fh:
        offset = 1 if has_meta else 0
        if has_meta:
            fh.readline()
        reader = csv.reader(fh)
        end, is_header = offset, True
        for record in reader:
            start, end = end + 1, offset + reader.line_num
            if not record:  # a blank line: no row
                continue
            if is_header:
                is_header = False
                continue
            starts.append(start)
    return starts


def _read_parquet(path: Path) -> tuple[dict[str, pd.Series], dict[str, Any], Callable[[int], str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = str(path)
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise TraceError(f"{source}: no such file") from None
    except (pa.ArrowException, OSError) as err:
        raise TraceError(
            f"{source}: not a readable Parquet file: {str(err).strip().splitlines()[0]}"
        ) from None
    raw = (table.schema.metadata or {}).get(PARQUET_META_KEY)
    if raw is None:
        meta = {"source": path.name}
    else:
        try:
            header = loads_strict(raw)
        except (ValueError, RecursionError) as err:  # bad JSON or UTF-8, a key twice, ...
            reason = err.msg if isinstance(err, json.JSONDecodeError) else type(err).__name__
            raise TraceError(
                f"{source}: schema metadata '{PARQUET_META_KEY.decode()}' is not valid JSON ({reason})"
            ) from None
        meta = check_header(header, source, is_table_header=True)
    columns = {name: table.column(name).to_pandas() for name in table.column_names}
    return columns, meta, lambda i: f"row {i + 1}"


def _int_column(
    values: pd.Series, name: str, minimum: int, source: str, row: Callable[[int], str]
) -> np.ndarray:
    """Validated int64 array from a column of digit strings or integers (no floats, no bools)."""
    expected = "an integer >= 0" if minimum == 0 else "a positive integer"
    if values.dtype.kind in "iu":
        ints = values.to_numpy(dtype=np.int64)
    elif values.dtype.kind in "OUST" and pd.api.types.infer_dtype(values) not in (
        "string",
        "empty",
    ):  # decimals, dates, bytes ... in an object column (the .str accessor failed on them)
        raise TraceError(
            f"{source}: column '{name}': expected integers, got a column of "
            f"{pd.api.types.infer_dtype(values)}"
        )
    elif values.dtype.kind in "OUST":
        # Strict digits only: int() would also take " 5", "1_000" and (via float) "5.0".
        is_digits = (
            values.str.fullmatch(f"[0-9]{{1,{_MAX_DIGITS}}}").fillna(False).to_numpy(dtype=bool)
        )
        bad = np.flatnonzero(~is_digits)
        if bad.size:
            i = int(bad[0])
            raise TraceError(
                f"{source}: {row(i)}: column '{name}': expected {expected}, got {values.iloc[i]!r}"
            )
        ints = values.astype(np.int64).to_numpy()
    else:
        raise TraceError(
            f"{source}: column '{name}': expected integers, got a column of {values.dtype}"
        )
    bad = np.flatnonzero((ints < minimum) | (ints > MAX_COUNT))  # the JSON format's bound
    if bad.size:
        i = int(bad[0])
        raise TraceError(
            f"{source}: {row(i)}: column '{name}': expected {expected} <= {MAX_COUNT}, got {int(ints[i])}"
        )
    return ints


def _with_step_and_prompt(
    row: Callable[[int], str], steps: np.ndarray, ids: np.ndarray
) -> Callable[[int], str]:
    """Row labels that also name the row's step and prompt, as found in the file."""

    def label(i: int) -> str:
        # a step cell read as text is shown quoted (one holding a newline split the line)
        step = steps[i]
        step = repr(step) if isinstance(step, str) and not step.isdecimal() else step
        return f"{row(i)} (step {step}, prompt {ids[i]!r})"

    return label


def _trace_from_columns(
    columns: dict[str, pd.Series], meta: dict[str, Any], source: str, row: Callable[[int], str]
) -> Trace:
    missing = [c for c in COLUMNS if c not in columns]
    if missing:
        raise TraceError(
            f"{source}: missing column '{missing[0]}' (expected columns {','.join(COLUMNS)}[,finish])"
        )
    extra = sorted(set(columns) - set(COLUMNS) - {"finish"})
    if extra:
        raise TraceError(
            f"{source}: unknown column '{extra[0]}' (expected columns {','.join(COLUMNS)}[,finish])"
        )
    if len(columns["step"]) == 0:
        raise TraceError(
            f"{source}: no rows: expected one row per response (a trace needs at least one step)"
        )
    ids = columns["prompt_id"].to_numpy(dtype=object)
    where = _with_step_and_prompt(row, columns["step"].to_numpy(dtype=object), ids)
    steps = _int_column(columns["step"], "step", 0, source, where)
    prompt_tokens = _int_column(columns["prompt_tokens"], "prompt_tokens", 1, source, where)
    tokens = _int_column(columns["response_tokens"], "response_tokens", 1, source, where)
    cap = meta.get("max_response_tokens")
    if cap is not None and (over := np.flatnonzero(tokens > cap)).size:
        i = int(over[0])
        raise TraceError(
            f"{source}: {where(i)}: column 'response_tokens': expected a positive integer <= max_response_tokens ({cap}), got {int(tokens[i])}"
        )
    is_id = np.fromiter((isinstance(v, str) and v != "" for v in ids), dtype=bool, count=len(ids))
    if not is_id.all():
        i = int(np.flatnonzero(~is_id)[0])
        raise TraceError(
            f"{source}: {where(i)}: column 'prompt_id': expected a non-empty string, got {ids[i]!r}"
        )
    if "finish" in columns:
        finishes = columns["finish"].to_numpy(dtype=object)
        bad = np.flatnonzero(~np.isin(finishes, FINISH_REASONS))
        if bad.size:
            i = int(bad[0])
            raise TraceError(
                f"{source}: {where(i)}: column 'finish': expected 'stop' or 'length', got {finishes[i]!r}"
            )
        is_length = finishes == "length"
    else:  # no column: a response at the cap hit it (inferred_finish)
        is_length = tokens == cap if cap is not None else np.zeros(len(tokens), dtype=bool)
    return _build(steps, ids, prompt_tokens, tokens, is_length, meta, source, row, where)


def _build(steps, ids, prompt_tokens, tokens, is_length, meta, source, row, where) -> Trace:
    """Group rows into steps and prompts (vectorised); prompt_tokens must agree within a prompt."""
    codes = pd.DataFrame({"s": steps, "p": ids}).groupby(["s", "p"], sort=False).ngroup().to_numpy()
    first = np.unique(codes, return_index=True)[
        1
    ]  # first row of each prompt (codes: first-appearance order)
    mismatch = np.flatnonzero(prompt_tokens != prompt_tokens[first[codes]])
    if mismatch.size:
        i = int(mismatch[0])
        j = int(first[codes[i]])
        raise TraceError(
            f"{source}: {where(i)}: column 'prompt_tokens': expected {prompt_tokens[j]} as on {row(j)}, got {prompt_tokens[i]}"
        )
    group_size = meta.get("group_size")
    counts = np.bincount(codes)
    if group_size is not None and (bad := np.flatnonzero(counts != group_size)).size:
        j = int(first[bad[0]])
        raise TraceError(
            f"{source}: step {steps[j]} prompt {ids[j]!r}: field 'responses': expected {group_size} rows (meta.group_size), got {counts[bad[0]]}"
        )
    # Equal responses share one immutable Response object (as in trace_from_dict).
    keys, inverse = np.unique(tokens * 2 + is_length, return_inverse=True)
    shared = np.empty(len(keys), dtype=object)
    shared[:] = [Response(tokens=int(k) // 2, finish="length" if k % 2 else "stop") for k in keys]
    order = np.lexsort((np.arange(len(codes)), codes, steps))  # step, then prompt, then row
    responses = shared[inverse.reshape(-1)[order]]
    starts = np.flatnonzero(np.r_[True, codes[order][1:] != codes[order][:-1]])
    ends = np.r_[starts[1:], len(order)].tolist()
    by_step: dict[int, list[Prompt]] = {}  # insertion order = ascending steps (rows sorted)
    for a, b in zip(starts.tolist(), ends, strict=True):
        i = int(order[a])
        prompt = Prompt(
            id=ids[i], prompt_tokens=int(prompt_tokens[i]), responses=tuple(responses[a:b])
        )
        by_step.setdefault(int(steps[i]), []).append(prompt)
    built = [Step(step=s, prompts=tuple(prompts)) for s, prompts in by_step.items()]
    return Trace(meta=meta, steps=tuple(built))


def read_table(path: Path, suffix: str) -> Trace:
    columns, meta, row = _read_csv(path) if suffix == ".csv" else _read_parquet(path)
    return _trace_from_columns(columns, meta, str(path), row)


def trace_to_frame(trace: Trace) -> pd.DataFrame:
    """One row per response: step, prompt_id, prompt_tokens, response_tokens, finish."""
    rows = [
        (s.step, p.id, p.prompt_tokens, r.tokens, r.finish)
        for s in trace.steps
        for p in s.prompts
        for r in p.responses
    ]
    frame = pd.DataFrame(rows, columns=[*COLUMNS, "finish"])
    return frame.astype({"step": np.int64, "prompt_tokens": np.int64, "response_tokens": np.int64})


def write_table(
    trace: Trace, path: Path, suffix: str, allow_lossy: bool, write_to: Path | None = None
) -> None:
    """``trace`` as ``suffix``'s table at ``write_to`` (default ``path``; errors name ``path``)."""
    write_to = path if write_to is None else write_to
    has_measured = any(s.measured is not None for s in trace.steps)
    has_hist = any(
        r.accept_hist is not None for s in trace.steps for p in s.prompts for r in p.responses
    )
    if (has_measured or has_hist) and not allow_lossy:
        lost = "per-step 'measured'" if has_measured else "per-response 'accept_hist'"
        raise TraceError(
            f"{path}: {suffix[1:]} cannot hold {lost}: save as .json, or pass allow_lossy to drop it"
        )
    frame = trace_to_frame(trace)
    if suffix == ".csv":
        with write_to.open("w", encoding="utf-8", newline="") as fh:
            # pandas' skiprows tokenizes the line it skips: a field opening with '"' after a
            # comma (a meta string ending in ',': `"model": ","`) swallowed the whole file. With
            # json.dumps' ", " separators ',"' only occurs there, and \u002c is the same comma.
            meta_text = json.dumps({**trace.meta, CSV_ROWS_KEY: len(frame)})
            meta_text = meta_text.replace(',"', '\\u002c"')
            fh.write(META_PREFIX + meta_text + "\n")
            # csv quotes a field holding the line terminator ("\n") but not a bare "\r", which
            # readers take for a line end: an id holding one is written with every field quoted
            is_cr = frame["prompt_id"].astype(str).str.contains("\r", regex=False).any()
            quoting = csv.QUOTE_ALL if is_cr else csv.QUOTE_MINIMAL
            frame.to_csv(fh, index=False, lineterminator="\n", quoting=quoting)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(frame, preserve_index=False)
    header = json.dumps({"format": FORMAT, "version": VERSION, "meta": trace.meta})
    table = table.replace_schema_metadata({PARQUET_META_KEY: header.encode()})
    pq.write_table(table, write_to)
