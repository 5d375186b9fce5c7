"""Prompt datasets (tltrun.data.dataset, tltrun.data.gym): every format read from files written
here, chat-message prompts, each kind of bad row as one line with file, line and key,
--skip-bad-rows counts, the eval split, and the per-epoch prompt stream (pure in (seed, step),
epoch-straddling, each row once per epoch). CPU only, no network."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tltrun.data.dataset import (
    DataError,
    DataSpec,
    PromptRow,
    PromptStream,
    load_rows,
    split_eval,
)
from tltrun.data.gym import gym_rows, gym_sft_examples, parse_gym_path
from tltrun.train.responses import group_names
from tltsim.errors import UsageError

RECORDS = [
    {"prompt": "What is 1 + 2?", "answer": "3", "level": 1},
    {
        "prompt": [{"role": "user", "content": "What is 3/4 as a decimal?"}],
        "answer": 0.75,
        "level": 2,
    },
    {"prompt": "Name the capital of France.", "answer": "Paris", "level": 3},
]
PLAIN = [r for r in RECORDS if isinstance(r["prompt"], str)]


def write_jsonl(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def _check_plain(rows):
    assert [r.prompt for r in rows] == [r["prompt"] for r in PLAIN]
    assert [r.answer for r in rows] == ["3", "Paris"]


def test_jsonl_with_chat_messages(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", RECORDS, extra_lines=[""])
    loaded = load_rows(DataSpec(path=str(path)))
    assert loaded.num_skipped == 0 and len(loaded.rows) == 3
    first, chat, _ = loaded.rows
    assert first == PromptRow(
        prompt_id="train.jsonl:0",
        prompt="What is 1 + 2?",
        answer="3",
        meta={"level": 1},
        source=f"{path}:1",
    )
    assert chat.prompt == ({"role": "user", "content": "What is 3/4 as a decimal?"},)
    assert chat.answer == "0.75" and chat.prompt_text == "user: What is 3/4 as a decimal?"


def test_json_list_parquet_csv_and_datasets_directory(tmp_path):
    import datasets
    import pandas as pd

    (tmp_path / "train.json").write_text(json.dumps(RECORDS))
    loaded = load_rows(DataSpec(path=str(tmp_path / "train.json")))
    assert len(loaded.rows) == 3 and loaded.rows[2].source.endswith("train.json:row 3")

    # Parquet keeps chat messages as a list of structs.
    pd.DataFrame(RECORDS[1:2] * 2).to_parquet(tmp_path / "chat.parquet")
    rows = load_rows(DataSpec(path=str(tmp_path / "chat.parquet"))).rows
    assert [r.prompt for r in rows] == [tuple(RECORDS[1]["prompt"])] * 2
    assert rows[1].prompt_id == "chat.parquet:1" and rows[0].meta == {"level": 2}

    pd.DataFrame(PLAIN).to_parquet(tmp_path / "plain.parquet")
    _check_plain(load_rows(DataSpec(path=str(tmp_path / "plain.parquet"))).rows)

    # CSV: every value a string; a quoted field with a newline moves the next record's line.
    csv_path = tmp_path / "train.csv"
    csv_path.write_text('prompt,answer,level\n"two\nlines",3,1\nNext one?,Paris,3\n')
    rows = load_rows(DataSpec(path=str(csv_path))).rows
    assert [r.prompt for r in rows] == ["two\nlines", "Next one?"]
    assert [r.source for r in rows] == [f"{csv_path}:2", f"{csv_path}:4"]
    assert rows[0].meta == {"level": "1"}

    datasets.Dataset.from_list(PLAIN).save_to_disk(str(tmp_path / "ds"))
    _check_plain(load_rows(DataSpec(path=str(tmp_path / "ds"))).rows)
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(PLAIN), "test": datasets.Dataset.from_list(PLAIN[:1])}
    )
    splits.save_to_disk(str(tmp_path / "dd"))
    _check_plain(load_rows(DataSpec(path=str(tmp_path / "dd"))).rows)


def test_keys_answerless_rows_and_num_rows(tmp_path):
    path = write_jsonl(
        tmp_path / "q.jsonl", [{"question": "a?", "sol": 1}, {"question": "b?", "sol": 2}]
    )
    rows = load_rows(DataSpec(path=str(path), prompt_key="question", answer_key=None)).rows
    assert [(r.prompt, r.answer, r.meta) for r in rows] == [
        ("a?", None, {"sol": 1}),
        ("b?", None, {"sol": 2}),
    ]
    rows = load_rows(
        DataSpec(path=str(path), prompt_key="question", answer_key="sol", num_rows=1)
    ).rows
    assert [(r.prompt, r.answer) for r in rows] == [("a?", "1")]


def test_a_json_file_of_json_lines_is_read_as_datasets_reads_it(tmp_path):
    """Hunt: ``Dataset.to_json("x.json")`` writes JSON Lines (``load_dataset("json")`` reads a list
    or lines); it was refused as "not a JSON file". A bad line is named as in a .jsonl."""
    import datasets

    datasets.Dataset.from_list(PLAIN).to_json(str(tmp_path / "train.json"))
    _check_plain(load_rows(DataSpec(path=str(tmp_path / "train.json"))).rows)
    (tmp_path / "bad.json").write_text('{"prompt": "a?", "answer": "1"}\n[1]\n')
    with pytest.raises(DataError, match=r"bad.json:2: expected a JSON object, got list"):
        load_rows(DataSpec(path=str(tmp_path / "bad.json")))


def test_what_pandas_and_arrow_write_beside_the_data(tmp_path):
    """Hunt: a filtered DataFrame's index reached the reward as '__index_level_0__'; a date past
    year 9999 was an internal error (now a bad row, named); a CSV field over 131,072 characters
    refused the file; a CSV header or a JSONL object naming a column twice kept the last."""
    import datetime

    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    frame = pd.DataFrame(PLAIN * 2, columns=["prompt", "answer"]).iloc[[0, 1, 3]]  # not a range
    frame.to_parquet(tmp_path / "filtered.parquet")
    assert "__index_level_0__" in pq.read_table(tmp_path / "filtered.parquet").schema.names
    rows = load_rows(DataSpec(path=str(tmp_path / "filtered.parquet"))).rows
    assert [(r.answer, r.meta) for r in rows] == [("3", {}), ("Paris", {}), ("Paris", {})]

    far = pa.array([0, 2_933_000], pa.date32())  # day 2,933,000: year ~10000
    pq.write_table(
        pa.table({"prompt": ["a?", "b?"], "answer": ["1", "2"], "d": far}), tmp_path / "d.parquet"
    )
    spec = DataSpec(path=str(tmp_path / "d.parquet"))
    with pytest.raises(
        DataError, match=r"d.parquet:row 2: a value Python cannot hold \(OverflowError: date"
    ):
        load_rows(spec)
    loaded = load_rows(DataSpec(path=spec.path, is_skip_bad_rows=True))
    assert [r.meta for r in loaded.rows] == [{"d": datetime.date(1970, 1, 1).isoformat()}]

    long = "x" * 200_000
    (tmp_path / "long.csv").write_text(f"prompt,answer\n{long},1\nshort?,2\n")
    assert [r.prompt for r in load_rows(DataSpec(path=str(tmp_path / "long.csv"))).rows] == [
        long,
        "short?",
    ]
    # a spreadsheet's export ends rows with empty columns: not data (review: refused as named
    # twice, the name '')
    (tmp_path / "trail.csv").write_text("prompt,answer,,\nq?,1,,\n")
    (row,) = load_rows(DataSpec(path=str(tmp_path / "trail.csv"))).rows
    assert (row.answer, row.meta) == ("1", {})
    (tmp_path / "dup.csv").write_text("prompt,answer,answer\nq?,1,2\n")
    with pytest.raises(DataError, match=r"dup.csv: column 'answer' given twice in the header"):
        load_rows(DataSpec(path=str(tmp_path / "dup.csv")))
    (tmp_path / "dup.jsonl").write_text('{"prompt": "q?", "answer": "1", "answer": "2"}\n')
    with pytest.raises(
        DataError, match=r"dup.jsonl:1: bad JSON \(key 'answer' given twice in one object\)"
    ):
        load_rows(DataSpec(path=str(tmp_path / "dup.jsonl")))


def test_a_datasets_sequence_of_messages_is_a_message_list(tmp_path):
    """Hunt: datasets stores ``Sequence({"role", "content"})`` (older hub chat datasets) as a dict
    of lists; such a prompt was refused as 'got object'."""
    import datasets

    features = datasets.Features(
        {
            "messages": datasets.Sequence(
                {"role": datasets.Value("string"), "content": datasets.Value("string")}
            ),
            "answer": datasets.Value("int64"),
        }
    )
    turns = {"role": ["system", "user"], "content": ["Be brief.", "hi?"]}
    ds = datasets.Dataset.from_dict({"messages": [turns], "answer": [7]}, features=features)
    ds.save_to_disk(str(tmp_path / "seq"))
    (row,) = load_rows(DataSpec(path=str(tmp_path / "seq"), prompt_key="messages")).rows
    assert row.prompt == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi?"},
    )
    assert row.answer == "7"


def test_a_missing_value_reaches_the_reward_as_none(tmp_path):
    """NaN is pandas' missing value: a JSON file written from a DataFrame carries it in the other
    columns, which a reward receives; it arrived as the string 'nan'. Infinities stay strings."""
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"prompt": "a?", "answer": "1", "hint": NaN, "w": [1.5, NaN], "cap": Infinity}\n'
    )
    (row,) = load_rows(DataSpec(path=str(path))).rows
    assert row.meta == {"hint": None, "w": [1.5, None], "cap": "inf"}
    json.dumps(row.meta, allow_nan=False)


BAD_ROWS = [
    ({"answer": "1"}, "key 'prompt': missing (columns: answer; --prompt-key names another)"),
    ({"prompt": "x"}, "key 'answer': missing (columns: prompt; --answer-key names another)"),
    (
        {"prompt": 7, "answer": "1"},
        "key 'prompt': expected a string or a list of chat messages, got int",
    ),
    ({"prompt": "   ", "answer": "1"}, "key 'prompt': empty prompt"),
    # an empty answer under 'exact' rewarded empty responses and scored the real answer 0
    ({"prompt": "x", "answer": " "}, "key 'answer': empty answer"),
    ({"prompt": [], "answer": "1"}, "key 'prompt': empty prompt (no chat messages)"),
    (
        {"prompt": [{"role": "user"}], "answer": "1"},
        "key 'prompt': message 0: 'content': expected a string, got nothing",
    ),
    (
        {"prompt": ["hi"], "answer": "1"},
        "key 'prompt': message 0: expected an object with 'role' and 'content', got string",
    ),
    ({"prompt": "x", "answer": None}, "key 'answer': expected a string or a number, got null"),
    ({"prompt": "x", "answer": [1]}, "key 'answer': expected a string or a number, got list"),
]


@pytest.mark.parametrize(("record", "reason"), BAD_ROWS)
def test_each_bad_row_is_one_line_with_file_line_and_key(tmp_path, record, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [PLAIN[0], record])
    with pytest.raises(DataError) as err:
        load_rows(DataSpec(path=str(path)))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:2: {reason}"), message
    loaded = load_rows(DataSpec(path=str(path), is_skip_bad_rows=True))
    assert [r.prompt_id for r in loaded.rows] == ["bad.jsonl:0"]
    assert loaded.num_skipped == 1 and loaded.skipped == (f"{path}:2: {reason}",)


def test_skip_counts_bad_json_and_long_prompts(tmp_path):
    path = write_jsonl(
        tmp_path / "mix.jsonl",
        [PLAIN[0], {"prompt": "a much longer prompt than the cap", "answer": "1"}, PLAIN[1]],
        extra_lines=["{not json", "[1, 2]"],
    )
    spec = DataSpec(path=str(path), is_skip_bad_rows=True)

    def num_words(row: PromptRow) -> int:
        return len(row.prompt_text.split())

    loaded = load_rows(spec, prompt_tokens=num_words, max_prompt_tokens=5)
    assert [r.prompt_id for r in loaded.rows] == ["mix.jsonl:0", "mix.jsonl:2"]
    assert loaded.num_skipped == 3
    assert loaded.skipped[0] == (
        f"{path}:2: key 'prompt': prompt of 7 tokens is longer than the max prompt length (5 tokens)"
    )
    assert loaded.skipped[1].startswith(f"{path}:4: bad JSON")
    assert loaded.skipped[2] == f"{path}:5: expected a JSON object, got list"
    with pytest.raises(DataError, match=r"mix.jsonl:2: key 'prompt': prompt of 7 tokens"):
        load_rows(DataSpec(path=str(path)), prompt_tokens=num_words, max_prompt_tokens=5)


def test_bad_sources_are_one_line_errors(tmp_path):
    cases = {
        "missing.jsonl": (None, "no such file or directory"),
        "data.txt": ("hello", "unknown data format '.txt'"),
        # an object spanning lines (a nested dataset) is no list; on one line it is one row
        "obj.json": (
            '{\n"data": [{"prompt": "x"}]\n}',
            "expected a JSON list of objects, got object",
        ),
        "one.json": ('{"prompt": "x"}', "one.json:1: key 'answer': missing (columns: prompt;"),
        "twice.json": (
            '[{"prompt": "x", "prompt": "y"}]',
            "key 'prompt' given twice in one object",
        ),
        "broken.json": ("[{", "not a JSON file"),
        "broken.parquet": ("not parquet", "not a readable Parquet file"),
        "empty.csv": ("", "empty CSV file"),
    }
    for name, (text, expected) in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(DataError) as err:
            load_rows(DataSpec(path=str(tmp_path / name)))
        assert expected in str(err.value) and "\n" not in str(err.value), (name, str(err.value))
    (tmp_path / "notds").mkdir()
    with pytest.raises(DataError, match="no data files .* save_to_disk did not write"):
        load_rows(DataSpec(path=str(tmp_path / "notds")))
    (tmp_path / "big.json").write_text('[{"prompt": "x", "answer": ' + "9" * 5000 + "}]")
    with pytest.raises(DataError, match="big.json: not a JSON file .*4300 digits"):
        load_rows(DataSpec(path=str(tmp_path / "big.json")))
    # Nothing usable left after skipping is an error too, naming the first reason.
    path = write_jsonl(tmp_path / "allbad.jsonl", [{"prompt": ""}])
    with pytest.raises(
        DataError, match=r"no usable rows; 1 bad rows skipped, first: .*allbad.jsonl:1"
    ):
        load_rows(DataSpec(path=str(path), is_skip_bad_rows=True))
    with pytest.raises(DataError, match="--prompt-key"):
        DataSpec(path="x.jsonl", prompt_key="")


def _rows(n: int) -> list[PromptRow]:
    return [PromptRow(prompt_id=f"r:{i}", prompt=f"p{i}", answer=str(i)) for i in range(n)]


def test_prompt_stream_is_pure_straddles_epochs_and_covers_each_epoch():
    rows = _rows(10)
    stream = PromptStream(rows, seed=3)
    batches = [stream.batch(step, 4) for step in range(10)]  # 40 positions = 4 epochs exactly
    flat = [r.prompt_id for b in batches for r in b]
    for epoch in range(4):
        chunk = flat[epoch * 10 : (epoch + 1) * 10]
        assert sorted(chunk) == sorted(r.prompt_id for r in rows), epoch
    # Epochs are fresh permutations, not one order repeated.
    assert flat[:10] != flat[10:20]
    # Step 2 covers positions 8..11: the end of epoch 0 and the start of epoch 1.
    assert [r.prompt_id for r in batches[2]] == flat[8:12]
    assert stream.position(2, 4) == {"epoch": 0, "index": 8}
    assert stream.position(3, 4) == {"epoch": 1, "index": 2}
    # Pure: a fresh stream asked out of order (a resumed run) gives the same batches.
    fresh = PromptStream(rows, seed=3)
    for step in (7, 2, 9, 0):
        assert fresh.batch(step, 4) == batches[step]
    assert PromptStream(rows, seed=4).batch(0, 10) != batches[0] + batches[1][:6]
    # A batch larger than the dataset spans epochs and still holds every row per epoch.
    big = PromptStream(rows, seed=0).batch(0, 25)
    assert Counter(r.prompt_id for r in big[:20]) == Counter({r.prompt_id: 2 for r in rows})
    # GRPO groups are named by prompt id (the trace's ids name prompts across steps, #20);
    # a prompt drawn twice in one step keeps two groups apart
    names = group_names(big)
    assert names[:10] == [r.prompt_id for r in big[:10]]
    assert len(set(names)) == 25 and names[big.index(big[12], 10)] == big[12].prompt_id + "#1"


def test_split_eval_is_deterministic_and_disjoint():
    rows = _rows(40)
    train, held_out = split_eval(rows, 0.1, seed=1)
    assert len(held_out) == 4 and len(train) == 36
    assert {r.prompt_id for r in train} | {r.prompt_id for r in held_out} == {
        r.prompt_id for r in rows
    }
    assert not {r.prompt_id for r in train} & {r.prompt_id for r in held_out}
    assert split_eval(rows, 0.1, seed=1) == (train, held_out)
    assert split_eval(rows, 0.1, seed=2)[1] != held_out
    assert list(train) == sorted(train, key=lambda r: int(r.prompt_id.split(":")[1]))
    assert len(split_eval(_rows(3), 0.01, seed=0)[1]) == 1
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(DataError, match="--eval-split"):
            split_eval(rows, bad, seed=0)


def test_reasoning_gym_rows_are_reproducible_and_carry_their_coordinates():
    spec = DataSpec(
        path="reasoning-gym:basic_arithmetic?min_terms=2&max_terms=3", num_rows=5, seed=7
    )
    rows = load_rows(spec).rows
    assert [r.prompt_id for r in rows] == [f"gym:basic_arithmetic:7:{i}" for i in range(5)]
    assert load_rows(spec).rows == rows
    assert load_rows(DataSpec(path=spec.path, num_rows=5, seed=8)).rows != rows
    import reasoning_gym

    direct = reasoning_gym.create_dataset(
        "basic_arithmetic", seed=7, size=5, min_terms=2, max_terms=3
    )
    for i, row in enumerate(rows):
        assert row.prompt == direct[i]["question"] and row.answer == direct[i]["answer"]
        assert row.meta["reasoning_gym"] == {
            "task": "basic_arithmetic",
            "seed": 7,
            "size": 5,
            "config": {"min_terms": 2, "max_terms": 3},
            "index": i,
        }
        json.dumps(row.meta)  # JSON-serialisable
    chat = gym_rows("basic_arithmetic", seed=7, num_rows=1, config={}, system_prompt="default")
    assert [m["role"] for m in chat[0].prompt] == ["system", "user"]
    assert "<answer>" in chat[0].prompt[0]["content"]
    pairs = gym_sft_examples(
        "basic_arithmetic", seed=7, num_rows=2, config={"min_terms": 2, "max_terms": 3}
    )
    assert pairs == tuple((r.prompt, r.answer) for r in rows[:2])


# reasoning-gym's randrange on a float bound warns (Python 3.11) before it raises
@pytest.mark.filterwarnings("ignore:randrange.. will raise TypeError:DeprecationWarning")
def test_reasoning_gym_bad_input_is_one_line():
    assert parse_gym_path("reasoning-gym:chain_sum?min_terms=3&x=abc&system_prompt=default") == (
        "chain_sum",
        {"min_terms": 3, "x": "abc"},
        "default",
    )
    # a JSON value keeps its '+' (parse_qsl read it as a space); %26 is a literal '&'
    assert parse_gym_path('reasoning-gym:basic_arithmetic?operators=["+","*"]&x=a%26b')[1] == {
        "operators": ["+", "*"],
        "x": "a&b",
    }
    cases = {
        "reasoning-gym:chain_sum?min_terms": "'min_terms' is not key=value",
        "reasoning-gym:basic_arithmetc": "unknown; ",
        "reasoning-gym:basic_arithmetic?no_such_key=1": "bad config",
        "reasoning-gym:basic_arithmetic?seed=1": "config key 'seed' is set by --seed,",
        "reasoning-gym:basic_arithmetic?size=3": "'size' is set by --data-num-rows,",
        "reasoning-gym:basic_arithmetic?system_prompt=nope": "system_prompt='nope': unknown",
        "reasoning-gym:": "expected reasoning-gym:<task>",
        # values of the wrong kind that reasoning-gym takes, then fails on generating an entry
        "reasoning-gym:tower_of_hanoi?max_disks=3.5": "fails generating entry 0",
        "reasoning-gym:chain_sum?max_digits=1e400": "reasoning-gym task 'chain_sum'",
        # (the last one was kept, unsaid)
        "reasoning-gym:chain_sum?min_terms=2&min_terms=5": "'min_terms' given twice",
    }
    for path, expected in cases.items():
        with pytest.raises(UsageError) as err:
            load_rows(DataSpec(path=path, num_rows=2))
        assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(UsageError, match="basic_arithmetic"):
        load_rows(DataSpec(path="reasoning-gym:basic_arithmetc", num_rows=2))


def test_damaged_datasets_directory_is_one_line(tmp_path):
    import datasets

    path = tmp_path / "ds"
    datasets.Dataset.from_list(PLAIN).save_to_disk(str(path))
    for damage in ("{}", "[]"):  # state.json of another shape: KeyError / TypeError inside
        (path / "state.json").write_text(damage)
        with pytest.raises(DataError, match="not a directory written by datasets' save_to_disk"):
            load_rows(DataSpec(path=str(path)))


def test_byte_order_marks_blank_csv_lines_and_float_answers(tmp_path):
    """Excel's "CSV UTF-8" and some editors' JSONL start with a BOM; a CSV may hold blank
    lines; a float answer is written without an exponent (math-verify reads '1e-05' as 1)."""
    bom = "\ufeff"
    (tmp_path / "q.csv").write_text(
        bom + "prompt,answer\r\nWhat is 1 + 2?,3\r\n\r\nName it.,Paris\r\n"
    )
    rows = load_rows(DataSpec(path=str(tmp_path / "q.csv"))).rows
    assert [(r.prompt_id, r.prompt, r.answer) for r in rows] == [
        ("q.csv:0", "What is 1 + 2?", "3"),
        ("q.csv:1", "Name it.", "Paris"),
    ]
    (tmp_path / "q.jsonl").write_text(bom + json.dumps(PLAIN[0]) + "\n")
    assert load_rows(DataSpec(path=str(tmp_path / "q.jsonl"))).rows[0].answer == "3"
    floats = [{"prompt": f"p{i}", "answer": a} for i, a in enumerate([1e-05, 1e16, 0.75, 2.5e-300])]
    rows = load_rows(DataSpec(path=str(write_jsonl(tmp_path / "f.jsonl", floats)))).rows
    assert [r.answer for r in rows] == [
        "0.00001",
        "10000000000000000",
        "0.75",
        "2.5\\times 10^{-300}",
    ]


def test_whole_floats_and_decimals_are_answers_as_written(tmp_path):
    """Hunt: pandas stores an integer column with a missing value as float64, so 7 arrived as
    '7.0', which 'exact' never matched with \\boxed{7}; a Parquet decimal was refused."""
    from decimal import Decimal

    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    frame = pd.DataFrame({"prompt": ["a?", "b?", "c?"], "answer": [7, None, -3]})
    assert str(frame["answer"].dtype) == "float64"
    frame.to_parquet(tmp_path / "ints.parquet")
    loaded = load_rows(DataSpec(path=str(tmp_path / "ints.parquet"), is_skip_bad_rows=True))
    assert [r.answer for r in loaded.rows] == ["7", "-3"] and loaded.num_skipped == 1
    values = [Decimal("7.50"), Decimal("-2"), Decimal("0.0000001")]
    table = pa.table(
        {"prompt": ["a?", "b?", "c?"], "answer": pa.array(values, pa.decimal128(38, 8))}
    )
    pq.write_table(table, tmp_path / "dec.parquet")
    rows = load_rows(DataSpec(path=str(tmp_path / "dec.parquet"))).rows
    # (review: str() gave '7.50000000', '-2.00000000' and '1.0E-7', which math-verify reads as 1)
    assert [r.answer for r in rows] == ["7.5", "-2", "0.0000001"]


def test_jsonl_lines_json_cannot_hold_are_bad_rows(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    path = write_jsonl(
        tmp_path / "odd.jsonl",
        [PLAIN[0]],
        extra_lines=[deep, '{"prompt": "x", "answer": ' + "9" * 5000 + "}"],
    )
    loaded = load_rows(DataSpec(path=str(path), is_skip_bad_rows=True))
    assert [r.prompt for r in loaded.rows] == [PLAIN[0]["prompt"]] and loaded.num_skipped == 2
    assert loaded.skipped[0].startswith(f"{path}:2: bad JSON (maximum recursion depth")
    assert loaded.skipped[1].startswith(f"{path}:3: bad JSON (Exceeds the limit")
