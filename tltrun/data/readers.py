"""Reading a data source's records before they are checked (``dataset.py`` checks them): JSONL,
a JSON list (or JSON Lines named ``.json``), Parquet, CSV, a ``datasets.save_to_disk``
directory, or a directory of data files.

A directory that ``save_to_disk`` did not write (no ``state.json`` / ``dataset_dict.json``) is
read as the shards of one dataset, the layout of a Hugging Face hub dataset's files
(``train-00000-of-00002.parquet``, ``train-00001-of-00002.parquet``) or of a Spark/pandas export
(``part-0.parquet``, ...): its files with one data suffix, in name order (numbers as numbers:
``part-2`` before ``part-10``), rows numbered across them. Where file names say a split (a word
of the name is one of datasets' split keywords, ``SPLIT_KEYWORDS``: ``gsm8k_train.jsonl``,
``test-00000-of-00001.parquet``), the ``train`` files are read, or the only split's; several
splits without train, or files of a split beside files of none, are refused naming them.
Subdirectories are not read (a hub dataset's configs, ``main/`` and ``socratic/``, are
directories: pass the one to use).
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tltrun.data.rows import GYM_PREFIX
from tltsim.errors import UsageError
from tltsim.jsonio import DuplicateKeyError, loads_strict

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# How rows are read, recorded with a run's data fingerprint (tltrun train's config.json): 2 since
# session 38 (whole float answers as integers, NaN as None in other columns, pandas' index
# dropped, a key given twice refused); 3 since session 39 (a chat message's other keys kept,
# reasoning_content, tool_calls, name). A resume cannot compare fingerprints across versions.
READER_VERSION = 3
READER_CHANGES = {2: "whole float answers, NaN, pandas' index", 3: "chat messages' other keys"}
# What save_to_disk writes beside the data: a Dataset's state.json, a DatasetDict's dataset_dict.json.
SAVE_TO_DISK_FILES = ("state.json", "dataset_dict.json")
# The split keywords of datasets' data-files resolution (datasets.data_files: each split's
# spellings, matched as a word of the file name between the delimiters [-._ 0-9]).
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SPLIT_OF_WORD = {word: split for split, words in SPLIT_KEYWORDS.items() for word in words}


class DataError(UsageError):
    """A dataset that cannot be used; one line naming the file, the line or row, and the key."""


@dataclass(frozen=True, kw_only=True)
class RawRow:
    """A record as read, before checking: its 0-based index, its place for messages, and either
    the record or why it could not be read."""

    index: int
    place: str
    record: dict[str, Any] | None
    problem: str = ""


def read_records(path: Path, num_rows: int | None) -> Iterator[RawRow]:
    """The records of ``path`` (a file or a directory, see the module docstring), their indices
    0-based over the whole source; only the first ``num_rows`` when it is given."""
    if not path.is_dir():
        records = _read_file(path, index_from=0)
    elif any((path / name).is_file() for name in SAVE_TO_DISK_FILES):
        records = _read_saved_dataset(path)
    else:
        records = _read_shards(path, shard_files(path))
    for raw in records:
        if num_rows is not None and raw.index >= num_rows:
            return
        yield raw


def split_read(path: Path) -> str | None:
    """The split of ``path`` that ``read_records`` reads, where the source names splits: a
    DatasetDict's ``train`` or only split, a shard directory's split by file names; None for a
    file, a Dataset and unnamed shards. (For the caller to say which split trains: a directory
    holding only a ``test`` split is read, as datasets reads it.)"""
    if not path.is_dir():
        return None
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            return None  # read_records says what is wrong with it
        return _dict_split([str(x) for x in splits]) if isinstance(splits, list) else None
    if any((path / name).is_file() for name in SAVE_TO_DISK_FILES):
        return None
    try:
        return split_of(shard_files(path)[0].name)
    except (DataError, OSError):
        return None


def _dict_split(splits: list[str]) -> str | None:
    """The split of a DatasetDict that is read: ``train``, else the only one (None: several
    without train, which the reader refuses)."""
    if "train" in splits:
        return "train"
    return splits[0] if len(splits) == 1 else None


def _read_file(path: Path, *, index_from: int) -> Iterator[RawRow]:
    readers = {
        ".jsonl": _read_jsonl,
        ".json": _read_json_list,
        ".parquet": _read_parquet,
        ".csv": _read_csv,
    }
    if path.suffix not in readers:
        raise DataError(
            f"{path}: unknown data format {path.suffix!r}; expected one of "
            f"{', '.join(FILE_SUFFIXES)}, a datasets directory or {GYM_PREFIX}<task>"
        )
    for raw in readers[path.suffix](path):
        yield replace(raw, index=raw.index + index_from) if index_from else raw


def shard_files(path: Path) -> tuple[Path, ...]:
    """The files of the directory ``path`` read as one dataset's shards, in name order (see the
    module docstring); a ``DataError`` naming what is there when none, or no one choice, fits."""
    files = sorted(
        (f for f in path.iterdir() if f.is_file() and f.suffix in FILE_SUFFIXES),
        key=lambda f: _natural_key(f.name),  # part-2 before part-10 (Dask writes part.N)
    )
    if not files:
        subdirs = sorted(f.name for f in path.iterdir() if f.is_dir())
        inside = f"; its subdirectories: {', '.join(subdirs[:8])} (pass one)" if subdirs else ""
        raise DataError(
            f"{path}: a directory with no data files ({', '.join(FILE_SUFFIXES)}) that datasets' "
            f"save_to_disk did not write{inside}"
        )
    suffixes = sorted({f.suffix for f in files})
    if len(suffixes) > 1:
        raise DataError(
            f"{path}: data files of several formats ({', '.join(suffixes)}); a directory is read "
            "as the shards of one dataset: keep one format in it, or pass one file"
        )
    splits: dict[str | None, list[Path]] = {}
    for f in files:
        splits.setdefault(split_of(f.name), []).append(f)
    if set(splits) == {None}:
        return tuple(files)
    if None in splits:  # read with the others, a test file named otherwise would be trained on
        others = ", ".join(f.name for f in splits[None][:3])
        raise DataError(
            f"{path}: some file names say a split and some do not ({others}); keep one "
            "dataset's files in the directory, or pass one file"
        )
    if "train" in splits:
        return tuple(splits["train"])
    if len(splits) == 1:
        return tuple(next(iter(splits.values())))
    raise DataError(
        f"{path}: files of several splits ({', '.join(sorted(splits))}) and none of train; "
        "pass the file to use, or a directory holding one split's files"
    )


def split_of(name: str) -> str | None:
    """The split a data file's name says (``SPLIT_KEYWORDS``: ``gsm8k_train.jsonl`` and
    ``train-00000-of-00002.parquet`` are train, ``evaluation.jsonl`` test), None if none or
    several."""
    words = re.split(r"[-._ 0-9]+", name.rsplit(".", 1)[0].lower())
    found = {_SPLIT_OF_WORD[w] for w in words if w in _SPLIT_OF_WORD}
    return found.pop() if len(found) == 1 else None


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _read_shards(path: Path, files: tuple[Path, ...]) -> Iterator[RawRow]:
    index_from = 0
    for f in files:
        for raw in _read_file(f, index_from=index_from):
            yield raw
            index_from = raw.index + 1


def _read_jsonl(path: Path) -> Iterator[RawRow]:
    index = 0
    try:
        with path.open(encoding="utf-8-sig") as f:  # -sig: a leading BOM is not data
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                place = f"{path}:{line_no}"
                try:
                    record = loads_strict(line)  # a key given twice: which value is meant?
                except (ValueError, RecursionError) as err:  # too deep; an int of > 4300 digits
                    problem = f"bad JSON ({_json_problem(err)})"
                    yield RawRow(index=index, place=place, record=None, problem=problem)
                else:
                    if isinstance(record, dict):
                        yield RawRow(index=index, place=place, record=record)
                    else:
                        yield RawRow(
                            index=index,
                            place=place,
                            record=None,
                            problem=f"expected a JSON object, got {type_name(record)}",
                        )
                index += 1
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def _is_json_lines(path: Path) -> bool:
    """Whether a ``.json`` file is JSON Lines: its first non-blank line is a JSON object on its
    own (a list, or an object spanning lines, is read whole and refused if not a list)."""
    try:
        with path.open(encoding="utf-8-sig") as f:
            for line in f:
                if line.strip():
                    return line.lstrip()[0] == "{" and isinstance(_loads_or_none(line), dict)
    except UnicodeDecodeError:
        pass  # the whole-file reader says it is not UTF-8
    return False


def _loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_problem(err: BaseException) -> str:
    if isinstance(err, json.JSONDecodeError):
        return err.msg
    if isinstance(err, DuplicateKeyError):
        return f"key {str(err)!r} given twice in one object"
    return one_line(err)


def _read_json_list(path: Path) -> Iterator[RawRow]:
    """A ``.json`` file: a list of objects, or JSON Lines (what ``datasets``' ``to_json`` and
    pandas' ``to_json(lines=True)`` write under that name; ``load_dataset("json")`` reads both)."""
    if _is_json_lines(path):  # streamed (a single-line object is one row, as in datasets)
        yield from _read_jsonl(path)
        return
    try:
        data = loads_strict(path.read_text(encoding="utf-8-sig"))
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError, an int of > 4300 digits
        problem = _json_problem(err) if isinstance(err, ValueError) else one_line(err)
        raise DataError(f"{path}: not a JSON file ({problem})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type_name(data)}")
    for index, record in enumerate(data):
        place = f"{path}:row {index + 1}"
        if isinstance(record, dict):
            yield RawRow(index=index, place=place, record=record)
        else:
            problem = f"expected a JSON object, got {type_name(record)}"
            yield RawRow(index=index, place=place, record=None, problem=problem)


def _read_parquet(path: Path) -> Iterator[RawRow]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file ({one_line(err)})") from None
    yield from _table_rows(table.to_batches(), path)


# pandas writes a DataFrame's index beside its columns under these names (a filtered frame's
# to_parquet, datasets' from_pandas): not data, and a reward would receive it as a keyword
_PANDAS_INDEX = re.compile(r"__index_level_\d+__")


def _table_rows(batches: Iterable[Any], path: Path) -> Iterator[RawRow]:
    """The rows of Arrow record batches (or tables) as records, the pandas index dropped. A
    value Python cannot hold (a date past year 9999) makes its row bad, not the file."""
    index = 0
    for batch in batches:
        names = [n for n in batch.schema.names if not _PANDAS_INDEX.fullmatch(n)]
        if len(names) < len(batch.schema.names):
            batch = batch.select(names)
        try:
            rows = [(record, "") for record in batch.to_pylist()]
        except (OverflowError, ValueError):  # per row, to name the bad ones
            rows = [_one_row(batch, i) for i in range(batch.num_rows)]
        for record, problem in rows:
            yield RawRow(
                index=index, place=f"{path}:row {index + 1}", record=record, problem=problem
            )
            index += 1


def _one_row(batch: Any, i: int) -> tuple[dict[str, Any] | None, str]:
    """Row ``i`` of ``batch`` as (record, ""), or (None, why Python cannot hold it)."""
    try:
        return batch.slice(i, 1).to_pylist()[0], ""
    except (OverflowError, ValueError) as err:
        return None, f"a value Python cannot hold ({type(err).__name__}: {one_line(err)})"


def _read_csv(path: Path) -> Iterator[RawRow]:
    try:
        # utf-8-sig: Excel's "CSV UTF-8" starts with a BOM, which would stick to the first column
        # a field's cap (131,072 characters by default) refused a whole file that pandas and
        # datasets read; prompts are capped by tokens later, naming the row
        csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
        with path.open(encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                raise DataError(f"{path}: empty CSV file (expected a header line)")
            # a named column given twice kept its last value; unnamed ones (the trailing
            # commas of a spreadsheet's export) are not data: dropped, as before
            twice = sorted({name for name in header if name and header.count(name) > 1})
            if twice:
                raise DataError(f"{path}: column {twice[0]!r} given twice in the header")
            line_no = reader.line_num + 1
            index = 0
            for values in reader:
                place = f"{path}:{line_no}"
                line_no = reader.line_num + 1
                if not values:  # a blank line, skipped as in JSONL
                    continue
                if len(values) != len(header):
                    problem = f"expected {len(header)} fields as in the header, got {len(values)}"
                    yield RawRow(index=index, place=place, record=None, problem=problem)
                else:
                    record = {k: v for k, v in zip(header, values, strict=True) if k}
                    yield RawRow(index=index, place=place, record=record)
                index += 1
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except csv.Error as err:
        raise DataError(f"{path}: not a CSV file ({one_line(err)})") from None


def _read_saved_dataset(path: Path) -> Iterator[RawRow]:
    # Set before datasets is imported (it reads the variable once): load_from_disk needs no
    # network, and this keeps any lookup it might do off it.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    # KeyError, TypeError: a damaged state.json or dataset_info.json
    except (ValueError, OSError, KeyError, TypeError) as err:
        raise DataError(
            f"{path}: not a directory written by datasets' save_to_disk ({one_line(err)})"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if not splits:
            raise DataError(f"{path}: a DatasetDict without splits (no rows)")
        chosen = _dict_split(splits)
        if chosen is not None:
            loaded = loaded[chosen]
        else:
            raise DataError(
                f"{path}: a DatasetDict without a 'train' split and with several splits "
                f"({', '.join(splits)}); save the one to use with save_to_disk"
            )
    yield from _table_rows(loaded.with_format("arrow").iter(batch_size=1024), path)


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        dict: "object",
        list: "list",
        str: "string",
        bool: "bool",
        int: "int",
        float: "float",
    }.get(type(value), type(value).__name__)


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:200] or type(err).__name__
