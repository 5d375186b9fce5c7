"""A directory that datasets' save_to_disk did not write is read as one dataset's shards
(tltrun.data.readers): a hub dataset's parquet files in name order, its train split where the
names say several, row ids numbered across the shards; what cannot be read as one dataset
(several formats, several splits and no train, only subdirectories) is one DataError line.
CPU only, no network."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from tltrun.data.dataset import DataError, DataSpec, load_rows


def _rows(n, start=0):
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(start, start + n)]


def test_hub_parquet_shards_read_in_order_as_one_dataset(tmp_path):
    data = tmp_path / "main"
    data.mkdir()
    # written out of order: the name order, not the directory's, is the row order
    pd.DataFrame(_rows(2, start=3)).to_parquet(data / "train-00001-of-00002.parquet")
    pd.DataFrame(_rows(3)).to_parquet(data / "train-00000-of-00002.parquet")
    pd.DataFrame(_rows(4, start=100)).to_parquet(data / "test-00000-of-00001.parquet")
    (data / "README.md").write_text("dataset card: not data")
    rows = load_rows(DataSpec(path=str(data))).rows
    assert [r.answer for r in rows] == ["1", "2", "3", "4", "5"]
    assert [r.prompt_id for r in rows] == [f"main:{i}" for i in range(5)]
    assert rows[3].source.endswith("train-00001-of-00002.parquet:row 1")
    capped = load_rows(DataSpec(path=str(data), num_rows=4)).rows
    assert [r.answer for r in capped] == ["1", "2", "3", "4"]  # the first 4 across shards


def test_shards_without_split_names_and_a_lone_split(tmp_path):
    parts = tmp_path / "export"
    parts.mkdir()
    for i in range(12):  # part-2 comes before part-10 (numbers as numbers, as Dask writes)
        lines = [json.dumps(r) for r in _rows(2, start=2 * i)]
        (parts / f"part-{i}.jsonl").write_text("\n".join(lines) + "\n")
    rows = load_rows(DataSpec(path=str(parts))).rows
    assert [r.answer for r in rows] == [str(i + 1) for i in range(24)]
    assert rows[5].source == f"{parts / 'part-2.jsonl'}:2"

    only_test = tmp_path / "only_test"
    only_test.mkdir()
    pd.DataFrame(_rows(2)).to_parquet(only_test / "test-00000-of-00001.parquet")
    assert len(load_rows(DataSpec(path=str(only_test))).rows) == 2


def test_bad_row_in_a_later_shard_names_that_shard_and_keeps_ids(tmp_path):
    data = tmp_path / "d"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps(_rows(1)[0]) + "\n")
    (data / "b.jsonl").write_text('{"prompt": ""}\n' + json.dumps(_rows(1, start=7)[0]) + "\n")
    with pytest.raises(DataError, match=r"b\.jsonl:1: key 'prompt': empty prompt"):
        load_rows(DataSpec(path=str(data)))
    loaded = load_rows(DataSpec(path=str(data), is_skip_bad_rows=True))
    # ids count the skipped row, so they do not move when it is fixed
    assert [r.prompt_id for r in loaded.rows] == ["d:0", "d:2"] and loaded.num_skipped == 1


@pytest.mark.parametrize(
    ("files", "subdirs", "expected"),
    [
        (("a.jsonl", "b.parquet"), (), r"several formats \(\.jsonl, \.parquet\)"),
        (
            ("test-00000.parquet", "validation-00000.parquet"),
            (),
            r"several splits \(test, validation\) and none of train",
        ),
        ((), ("main", "socratic"), r"no data files .*subdirectories: main, socratic \(pass one\)"),
        # a split's files beside files of none: reading both trained on a test file named
        # otherwise; dropping the others dropped data unsaid
        (("train.jsonl", "extra.jsonl"), (), r"some file names say a split and some do not"),
        (("data.jsonl", "evaluation.jsonl"), (), r"some file names say a split .*data\.jsonl"),
    ],
)
def test_directories_that_are_not_one_dataset_are_one_line(tmp_path, files, subdirs, expected):
    data = tmp_path / "d"
    data.mkdir()
    for name in files:
        if name.endswith(".parquet"):
            pd.DataFrame(_rows(1)).to_parquet(data / name)
        else:
            (data / name).write_text(json.dumps(_rows(1)[0]) + "\n")
    for name in subdirs:
        (data / name).mkdir()
    with pytest.raises(DataError, match=expected) as err:
        load_rows(DataSpec(path=str(data)))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        # datasets' keywords anywhere between delimiters, their synonyms as one split
        (("gsm8k_test.jsonl", "gsm8k_train.jsonl"), ["1", "2"]),
        (("training-0.jsonl", "testing-0.jsonl"), ["1", "2"]),
        (("dev.jsonl", "eval.jsonl"), None),  # validation and test, no train: refused
    ],
)
def test_split_keywords_as_datasets_knows_them(tmp_path, names, expected):
    data = tmp_path / "d"
    data.mkdir()
    for name in names:
        start = 0 if "train" in name else 100
        (data / name).write_text("\n".join(json.dumps(r) for r in _rows(2, start)) + "\n")
    if expected is None:
        with pytest.raises(
            DataError, match=r"several splits \(test, validation\) and none of train"
        ):
            load_rows(DataSpec(path=str(data)))
    else:
        assert [r.answer for r in load_rows(DataSpec(path=str(data))).rows] == expected


def test_a_directory_given_as_dot_names_its_rows(tmp_path, monkeypatch):
    data = tmp_path / "mydata"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps(_rows(1)[0]) + "\n")
    monkeypatch.chdir(data)
    assert load_rows(DataSpec(path=".")).rows[0].prompt_id == "mydata:0"  # was ":0"
