"""Tests of ``tlt-trace`` validation: bad input, JSON or CSV, a missing file, a directory or a
broken gzip, exits 2 with one line naming the file, step, prompt and field. The format's round
trips and accessors: tests/test_trace.py, whose ``GOOD`` document these cases break.

Run: ``.venv/bin/python -m pytest tests/test_trace_validation.py -q``
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from test_trace import GOOD

from tltsim.cli.main import main

# --- bad input: exit code 2, one line naming file / step / prompt / field ----------------------


def _bad(edit) -> dict:
    doc = json.loads(json.dumps(GOOD))
    edit(doc)
    return doc


def _prompt(doc: dict) -> dict:
    return doc["steps"][0]["prompts"][0]


JSON_CASES = {
    "missing responses": (
        lambda d: _prompt(d).pop("responses"),
        ["step 0 prompt 'p0'", "'responses'"],
    ),
    "missing steps": (lambda d: d.pop("steps"), ["'steps'"]),
    "missing tokens": (
        lambda d: _prompt(d).update(responses=[5, {"finish": "stop"}]),
        ["prompt 'p0' response 1", "'tokens'"],
    ),
    "string tokens": (
        lambda d: _prompt(d).update(responses=[5, "812"]),
        ["prompt 'p0' response 1", "'tokens'", "positive integer", "'812'"],
    ),
    "bool tokens": (
        lambda d: _prompt(d).update(responses=[True, 5]),
        ["response 0", "'tokens'", "True"],
    ),
    "float tokens": (
        lambda d: _prompt(d).update(responses=[5, 7.5]),
        ["response 1", "'tokens'", "7.5"],
    ),
    "negative tokens": (
        lambda d: _prompt(d).update(responses=[5, -3]),
        ["step 0 prompt 'p0' response 1", "'tokens'", "-3"],
    ),
    "zero tokens": (
        lambda d: _prompt(d).update(responses=[0, 5]),
        ["response 0", "'tokens'", "got 0"],
    ),
    "tokens over cap": (
        lambda d: _prompt(d).update(responses=[5, 1001]),
        ["'tokens'", "max_response_tokens (1000)"],
    ),
    "zero prompt tokens": (
        lambda d: _prompt(d).update(prompt_tokens=0),
        ["prompt 'p0'", "'prompt_tokens'", "got 0"],
    ),
    "string prompt tokens": (
        lambda d: _prompt(d).update(prompt_tokens="10"),
        ["'prompt_tokens'", "'10'"],
    ),
    "int id": (lambda d: _prompt(d).update(id=3), ["step 0 prompts[0]", "'id'", "string"]),
    "wrong format": (lambda d: d.update(format="tlt-trac"), ["'format'", "'tlt-trace'"]),
    "wrong version": (lambda d: d.update(version=3), ["'version'", "got 3"]),
    "string version": (lambda d: d.update(version="1"), ["'version'", "got '1'"]),
    "empty steps": (lambda d: d.update(steps=[]), ["'steps'", "non-empty"]),
    "empty prompts": (
        lambda d: d["steps"][0].update(prompts=[]),
        ["step 0", "'prompts'", "non-empty"],
    ),
    "empty responses": (
        lambda d: _prompt(d).update(responses=[]),
        ["prompt 'p0'", "'responses'", "non-empty"],
    ),
    "bad finish": (
        lambda d: _prompt(d).update(responses=[5, {"tokens": 7, "finish": "eos"}]),
        ["response 1", "'finish'", "'stop' or 'length'", "'eos'"],
    ),
    "bad accept_hist": (
        lambda d: _prompt(d).update(responses=[5, {"tokens": 7, "accept_hist": [1, -1]}]),
        ["response 1", "'accept_hist'"],
    ),
    "negative step": (lambda d: d["steps"][0].update(step=-1), ["steps[0]", "'step'", "-1"]),
    "steps not ascending": (
        lambda d: d["steps"].append(d["steps"][0]),
        ["steps[1]", "'step'", "ascend"],
    ),
    "duplicate prompt": (
        lambda d: d["steps"][0]["prompts"].append(_prompt(d)),
        ["prompts[1]", "'id'", "unique"],
    ),
    "group size mismatch": (
        lambda d: _prompt(d).update(responses=[5]),
        ["prompt 'p0'", "'responses'", "2 responses"],
    ),
    "unknown field": (
        lambda d: _prompt(d).update(prompt_token=3),
        ["prompt 'p0'", "'prompt_token'"],
    ),
    "bad meta cap": (
        lambda d: d["meta"].update(max_response_tokens="big"),
        ["meta", "'max_response_tokens'"],
    ),
    "meta not object": (lambda d: d.update(meta=[]), ["'meta'", "object"]),
    # Python's json reads NaN / Infinity; the trace was then saved back as bare NaN (not JSON)
    "meta nan": (
        lambda d: d["meta"].update(notes={"loss": [1.0, float("nan")]}),
        ["meta", "'notes.loss.1'", "a finite number", "got nan"],
    ),
    "measured not object": (
        lambda d: d["steps"][0].update(measured=[1.5]),
        ["step 0", "'measured'", "an object"],
    ),
    "measured string seconds": (
        lambda d: d["steps"][0].update(measured={"rollout_s": "1.5"}),
        ["step 0", "'measured.rollout_s'", "seconds >= 0", "'1.5'"],
    ),
    "measured bool seconds": (
        lambda d: d["steps"][0].update(measured={"train_s": True}),
        ["step 0", "'measured.train_s'", "True"],
    ),
    "measured unknown field": (
        lambda d: d["steps"][0].update(measured={"rolout_s": 1.0}),
        ["step 0", "unknown field 'measured.rolout_s'"],
    ),
    "measured bad policy seed": (
        lambda d: d["steps"][0].update(measured={"policy": {"name": "tlt", "seed": -1}}),
        ["step 0", "'measured.policy.seed'", "-1"],
    ),
    "measured policy seed beyond int64": (  # (2^53 < a seed < 2^63 loads: an identifier)
        lambda d: d["steps"][0].update(measured={"policy": {"name": "tlt", "seed": 2**63}}),
        ["step 0", "'measured.policy.seed'", "[0, 2^63)"],
    ),
    "measured unknown policy field": (
        lambda d: d["steps"][0].update(measured={"policy": {"nam": "tlt"}}),
        ["step 0", "unknown field 'measured.policy.nam'"],
    ),
    "measured bad hist": (
        lambda d: d["steps"][0].update(measured={"accept_hist_by_strategy": {"2_1_2": [1, -1]}}),
        ["step 0", "'measured.accept_hist_by_strategy'"],
    ),
    "measured bad response hist": (
        lambda d: d["steps"][0].update(
            measured={"response_accept_hist_by_strategy": {"p0": [{"4_1_4": [-1]}, {}]}}
        ),
        ["step 0", "'measured.response_accept_hist_by_strategy'"],
    ),
    "measured unknown drafter arm": (
        lambda d: d["steps"][0].update(measured={"accept_hist_by_strategy": {"medusa:2_1_2": [1]}}),
        ["step 0", "'measured.accept_hist_by_strategy'", "DRAFTER:strategy", "history"],
    ),
    "measured eagle arm": (  # EAGLE's keys stay plain strategies: one key form per drafter
        lambda d: d["steps"][0].update(
            measured={"policy": {"iterations_per_strategy": {"eagle:2_1_2": 1}}}
        ),
        ["step 0", "'measured.policy.iterations_per_strategy'"],
    ),
    "measured bad clock": (
        lambda d: d["steps"][0].update(measured={"clock": "gpu"}),
        ["step 0", "'measured.clock'", "'wall' or 'cpu'", "'gpu'"],
    ),
    "measured zero cap": (
        lambda d: d["steps"][0].update(measured={"max_running_requests": 0}),
        ["step 0", "'measured.max_running_requests'", "integer >= 1 or null"],
    ),
    "measured null seconds": (
        lambda d: d["steps"][0].update(measured={"rollout_s": None}),
        ["step 0", "'measured.rollout_s'", "None"],
    ),
    # validate accepted these; compare overflowed or refused them, fit dropped histograms
    "measured huge count": (
        lambda d: d["steps"][0].update(measured={"prefix_block_tokens": 10**30}),
        ["step 0", "'measured.prefix_block_tokens'", "an integer in [1, "],
    ),
    "measured histograms of a prompt not in the step": (
        lambda d: d["steps"][0].update(
            measured={"response_accept_hist_by_strategy": {"zz": [{}, {}]}}
        ),
        ["step 0", "prompt 'zz' is not in the step"],
    ),
    "measured histograms of too few responses": (
        lambda d: d["steps"][0].update(measured={"response_accept_hist_by_strategy": {"p0": [{}]}}),
        ["step 0", "prompt 'p0': expected one entry per response (2), got 1"],
    ),
    "measured placement missing a prompt": (
        lambda d: d["steps"][0].update(measured={"instance_prompts": [["p0"], []]}),
        ["step 0", "'measured.instance_prompts'", "exactly once"],
    ),
}


def _run_validate(path: Path, capsys: pytest.CaptureFixture) -> str:
    code = main(["validate", str(path)])
    captured = capsys.readouterr()
    assert code == 2
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"error: {path}"), err
    return err


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_bad_json_gives_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, case: str
) -> None:
    edit, fragments = JSON_CASES[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_bad(edit)))
    err = _run_validate(path, capsys)
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_good_document_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "good.json"
    path.write_text(json.dumps(GOOD))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{path}: 1 steps, 1 prompts, 2 responses") and "\n" not in out


def test_a_policy_seed_beyond_2_to_53_loads(tmp_path: Path, capsys) -> None:
    """A seed is an identifier: tltrun generate --seed 2^53 + 1 wrote a trace that tltsim
    refused ("expected an integer in [0, 2^53]")."""
    doc = _bad(
        lambda d: d["steps"][0].update(measured={"policy": {"name": "tlt", "seed": 2**53 + 1}})
    )
    path = tmp_path / "seed.json"
    path.write_text(json.dumps(doc))
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err


FILE_CASES = {
    "truncated json": ("t.json", lambda: json.dumps(GOOD)[:70], ["not valid JSON", "truncated"]),
    "top-level list": ("t.json", lambda: "[1, 2]", ["top level"]),
    "csv missing column": (
        "t.csv",
        lambda: "step,prompt_id,response_tokens\n0,a,5\n",
        ["missing column 'prompt_tokens'"],
    ),
    "csv string tokens": (
        "t.csv",
        lambda: "step,prompt_id,prompt_tokens,response_tokens\n0,a,3,5\n0,a,3,abc\n",
        ["line 3", "'response_tokens'", "'abc'"],
    ),
    "csv negative": (
        "t.csv",
        lambda: "step,prompt_id,prompt_tokens,response_tokens\n0,a,3,-5\n",
        ["line 2", "'response_tokens'", "'-5'"],
    ),
    "csv zero": (
        "t.csv",
        lambda: "step,prompt_id,prompt_tokens,response_tokens\n0,a,0,5\n",
        ["line 2", "'prompt_tokens'", "got 0"],
    ),
    "csv float": (
        "t.csv",
        lambda: "step,prompt_id,prompt_tokens,response_tokens\n0,a,3,5.0\n",
        ["line 2", "'5.0'"],
    ),
    "csv bad finish": (
        "t.csv",
        lambda: "step,prompt_id,prompt_tokens,response_tokens,finish\n0,a,3,5,eos\n",
        ["line 2", "'finish'", "'eos'"],
    ),
    "csv prompt tokens disagree": (
        "t.csv",
        lambda: "step,prompt_id,prompt_tokens,response_tokens\n0,a,3,5\n0,a,4,6\n",
        ["line 3", "step 0, prompt 'a'", "'prompt_tokens'", "as on line 2"],
    ),
    "csv no rows": ("t.csv", lambda: "step,prompt_id,prompt_tokens,response_tokens\n", ["no rows"]),
    "csv empty": ("t.csv", lambda: "", ["empty CSV"]),
    "csv version in other digits": (  # int('١') is 1: it was read as version 1
        "t.csv",
        lambda: (
            "# tlt-trace v\u0661 meta: {}\nstep,prompt_id,prompt_tokens,response_tokens\n0,a,3,5\n"
        ),
        ["'version'", "got '\u0661'"],
    ),
    "csv wrong version": (
        "t.csv",
        lambda: "# tlt-trace v3 meta: {}\nstep,prompt_id,prompt_tokens,response_tokens\n0,a,3,5\n",
        ["'version'", "got 3"],
    ),
    "csv over cap": (
        "t.csv",
        lambda: (
            '# tlt-trace v1 meta: {"max_response_tokens": 4}\nstep,prompt_id,prompt_tokens,response_tokens\n0,a,3,5\n'
        ),
        ["line 3", "max_response_tokens (4)"],
    ),
    "unknown suffix": ("t.txt", lambda: "{}", ["unknown trace file type"]),
    # the file's own line after blank lines and a quoted field over two lines (it said 3)
    "csv line after blank lines": (
        "t.csv",
        lambda: "step,prompt_id,prompt_tokens,response_tokens\n0,a,10,5\n\n\n0,a,10,x\n",
        ["line 5 (step 0, prompt 'a')"],
    ),
    "csv line after a quoted newline": (
        "t.csv",
        lambda: 'step,prompt_id,prompt_tokens,response_tokens\n0,"multi\nline",10,5\n0,b,10,x\n',
        ["line 4 (step 0, prompt 'b')"],
    ),
    # json.loads kept the last of a repeated key; a 5,000-digit number raised ValueError
    "json key twice": (
        "t.json",
        lambda: json.dumps(GOOD).replace(
            '"responses": [5, 7]', '"responses": [5, 7], "responses": [7]'
        ),
        ["key 'responses' given twice"],
    ),
    "json number too long": (
        "t.json",
        lambda: json.dumps(GOOD).replace('"prompt_tokens": 10', '"prompt_tokens": ' + "9" * 5000),
        ["more than 4,300 digits"],
    ),
    "csv meta number too long": (
        "t.csv",
        lambda: (
            '# tlt-trace v1 meta: {"x": '
            + "9" * 5000
            + "}\nstep,prompt_id,prompt_tokens,response_tokens\n0,a,3,5\n"
        ),
        ["line 1", "more than 4,300 digits"],
    ),
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_bad_files_give_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, case: str
) -> None:
    name, text, fragments = FILE_CASES[case]
    path = tmp_path / name
    path.write_text(text())
    err = _run_validate(path, capsys)
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_missing_file_directory_and_broken_gzip(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert "no such file" in _run_validate(tmp_path / "nope.json", capsys)
    assert "no such file" in _run_validate(tmp_path / "nope.csv", capsys)
    (tmp_path / "dir.json").mkdir()
    assert "directory" in _run_validate(tmp_path / "dir.json", capsys)
    # a tltrun run's directory names its trace (hunt: "unknown trace file type")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trace.json").write_text(json.dumps(GOOD))
    said = _run_validate(tmp_path / "run", capsys)
    assert f"a directory; its run's trace is {tmp_path / 'run' / 'trace.json'}" in said
    good = gzip.compress(json.dumps(GOOD).encode())
    (tmp_path / "cut.json.gz").write_bytes(good[: len(good) // 2])
    assert "cannot read" in _run_validate(tmp_path / "cut.json.gz", capsys)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    assert "Parquet" in _run_validate(tmp_path / "junk.parquet", capsys)


def test_a_csv_cut_at_a_prompt_boundary_is_refused(tmp_path: Path, capsys) -> None:
    """Hunt (twice): a CSV twin cut between two prompts validated as a shorter trace; its meta
    line now counts the rows written. A CSV without the count (older) is read as it is."""
    from tltsim.trace.files import load_trace, save_trace
    from tltsim.trace.schema import trace_from_dict

    prompts = [{"id": f"p{i}", "prompt_tokens": 10, "responses": [5, 7]} for i in range(3)]
    doc = {"format": "tlt-trace", "version": 1, "meta": {"group_size": 2},
           "steps": [{"step": 0, "prompts": prompts}]}  # fmt: skip
    save_trace(trace_from_dict(doc, "doc"), tmp_path / "t.csv")
    lines = (tmp_path / "t.csv").read_text().splitlines(keepends=True)  # meta, header, 6 rows
    (tmp_path / "cut.csv").write_text("".join(lines[:-2]))  # the last prompt's two rows
    err = _run_validate(tmp_path / "cut.csv", capsys)
    assert "4 rows, but its meta line says 6 were written: the file was cut or edited" in err
    header = json.loads(lines[0].split("meta: ", 1)[1])
    del header["_tlt_num_rows"]
    old = lines[0].split("meta: ", 1)[0] + "meta: " + json.dumps(header) + "\n"
    (tmp_path / "old.csv").write_text(old + "".join(lines[1:-2]))
    assert load_trace(tmp_path / "old.csv").num_responses == 4


@pytest.mark.parametrize("has_meta", [True, False])
def test_csv_with_a_leading_byte_order_mark_reads_like_without(tmp_path: Path, has_meta) -> None:
    """A spreadsheet's BOM hid the '#' of the meta line: 'missing column step' for a good file."""
    from tltsim.trace.files import load_trace, save_trace
    from tltsim.trace.schema import trace_from_dict

    path = tmp_path / "t.csv"
    save_trace(trace_from_dict(GOOD, "GOOD"), path)
    if not has_meta:
        path.write_text("".join(path.read_text().splitlines(keepends=True)[1:]))
    plain = load_trace(path)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_trace(path) == plain and plain.steps[0].prompts


def test_parquet_columns_and_metadata_of_other_types_are_one_line(tmp_path, capsys) -> None:
    """A decimal (or date, bytes) column ended in the .str accessor's AttributeError, schema
    metadata that is not UTF-8 in a UnicodeDecodeError: internal errors with exit 1."""
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"step": [0], "prompt_id": ["a"], "prompt_tokens": [3]}
    odd = pa.table({**columns, "response_tokens": pa.array([decimal.Decimal(5)])})
    pq.write_table(odd, tmp_path / "decimal.parquet")
    assert "column 'response_tokens': expected integers, got a column of decimal" in (
        _run_validate(tmp_path / "decimal.parquet", capsys)
    )
    plain = pa.table({**columns, "response_tokens": [5]})
    pq.write_table(
        plain.replace_schema_metadata({b"tlt-trace": b"\x80\x81"}), tmp_path / "u.parquet"
    )
    assert "schema metadata 'tlt-trace' is not valid JSON" in _run_validate(
        tmp_path / "u.parquet", capsys
    )
    # a misspelt header field: ignored with its contents before (a JSON trace refused it)
    header = {"format": "tlt-trace", "version": 1, "meta": {}, "mta": {"group_size": 2}}
    pq.write_table(
        plain.replace_schema_metadata({b"tlt-trace": json.dumps(header).encode()}),
        tmp_path / "h.parquet",
    )
    assert "unknown field 'mta' (expected only format, meta, version)" in _run_validate(
        tmp_path / "h.parquet", capsys
    )


def test_validate_counts_the_responses_at_the_cap_apart(tmp_path, capsys) -> None:
    """A response ended by its own length limit below the cap (tltrun's replays) was counted
    as one that "finished at the cap"."""
    doc = json.loads(json.dumps(GOOD))
    doc["meta"]["max_response_tokens"] = 7
    doc["steps"][0]["prompts"][0]["responses"] = [{"tokens": 5, "finish": "length"}, 7]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert main(["validate", str(path)]) == 0
    assert "2 ended by length (1 at the cap of 7)" in capsys.readouterr().out
    # without a cap in meta (tltrun generate's traces) the count was left out altogether
    del doc["meta"]["max_response_tokens"]
    path.write_text(json.dumps(doc))
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.endswith("), 1 ended by length\n")
