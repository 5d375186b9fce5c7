"""Measured profile files: the schema (write and load, the CSV's and the sidecar's one-line
errors, exit 2), the sidecar's attention_context, profiles a ProfileCost refuses (a one-point
curve; missing ops without a fallback), and the CLI (``profile-info``, ``--profile``). The
costs a profile gives: tests/test_profile.py, whose profiles and roofline these tests reuse.

Run: .venv/bin/python -m pytest tests/test_profile_schema.py -q
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from test_profile import META, SMALL, bilinear, bilinear_profile, roofline

from tltsim.cli.fidelity import cost_model_from_args
from tltsim.cli.main import main
from tltsim.cost.measured import ProfileCost, profile_from_cost
from tltsim.cost.profile import (
    COLUMNS,
    Profile,
    ProfileError,
    ProfileRow,
    grid_points,
    load_profile,
    write_profile,
)
from tltsim.cost.roofline import CostModel, RooflineCost
from tltsim.cost.specs import get_hardware, get_model
from tltsim.errors import UsageError

# --- schema: write, load, errors ---------------------------------------------------------------


def test_write_load_round_trip(tmp_path: Path) -> None:
    profile = bilinear_profile()
    path = tmp_path / "p.csv"
    write_profile(profile.rows, path, META)
    loaded = load_profile(path)
    assert loaded.rows == profile.rows  # repr() of floats round-trips exactly
    assert loaded.meta["hardware"] == "H100-SXM" and loaded.meta["format"] == "tlt-profile"
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)


def _write_raw(tmp_path: Path, text: str, meta: dict | None = None) -> Path:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    path.with_suffix(".json").write_text(
        json.dumps({"format": "tlt-profile", "version": 1, **(meta or META)})
    )
    return path


GOOD_ROW = "decode,1,128,1,0.01,0.009,0.011,5"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", "empty file"),
        (
            "op,batch,context_tokens,tokens_per_seq,seconds,seconds_p10,seconds_p90\n"
            + GOOD_ROW[:-2],
            "missing column 'num_repeats'",
        ),
        (",".join(COLUMNS) + "\n", "no measured rows"),
        (
            ",".join(COLUMNS) + "\n" + "decode,1,128,1,-0.01,0.009,0.011,5",
            "row 2: column 'seconds': expected a number > 0",
        ),
        (
            ",".join(COLUMNS) + "\n" + "encode,1,128,1,0.01,0.009,0.011,5",
            "row 2: column 'op': expected one of decode",
        ),
        (
            ",".join(COLUMNS) + "\n" + GOOD_ROW + "\n" + "decode,two,128,1,0.01,0.009,0.011,5",
            "row 3: column 'batch': expected an integer",
        ),
        (
            ",".join(COLUMNS) + "\n" + "decode,1,128,1,0.01,0.02,0.011,5",
            "row 2: column 'seconds_p10'",
        ),
        (
            ",".join(COLUMNS) + "\n" + "decode,1,128,2,0.01,0.009,0.011,5",
            "row 2: column 'tokens_per_seq': expected 1 for op decode",
        ),
        (",".join(COLUMNS) + "\n" + GOOD_ROW + "\n" + GOOD_ROW, "row 3: duplicate point"),
        # blank lines count: the duplicate is the file's line 5 (it said row 3)
        (
            ",".join(COLUMNS) + "\n" + GOOD_ROW + "\n\n\n" + GOOD_ROW,
            "row 5: duplicate point op=decode batch=1 context_tokens=128 tokens_per_seq=1 (first at row 2)",
        ),
        # int() and float() take these: "1_0" read as batch 10, a typo as another point
        (
            ",".join(COLUMNS) + "\n" + "decode,1_0,128,1,0.01,0.009,0.011,5",
            "'batch': expected an integer",
        ),
        (
            ",".join(COLUMNS) + "\n" + "decode,\u0661,128,1,0.01,0.009,0.011,5",
            "'batch': expected an integer",
        ),
        (
            ",".join(COLUMNS) + "\n" + "decode,1,128,1,0.0_1,0.009,0.011,5",
            "'seconds': expected a number",
        ),
        (",".join(COLUMNS) + ",extra\n" + GOOD_ROW + ",1", "unknown column 'extra'"),
        (",".join(COLUMNS) + ",seconds\n" + GOOD_ROW + ",999", "column 'seconds' appears twice"),
        # sd_switch's tokens_per_seq restates context / batch; its table has no place for two
        (
            ",".join(COLUMNS) + "\n" + "sd_switch,3,72,7,0.01,0.009,0.011,5",
            "row 2: column 'tokens_per_seq': expected context_tokens / batch = 24, rounded",
        ),
        (
            ",".join(COLUMNS) + "\n" + "sd_switch,3,73,24,0.01,0.009,0.011,5\n"
            "sd_switch,3,73,25,0.02,0.019,0.021,5",
            "row 3: duplicate point op=sd_switch batch=3 context_tokens=73",
        ),
    ],
)
def test_bad_profile_is_one_line_exit_2(tmp_path: Path, capsys, text: str, expected: str) -> None:
    path = _write_raw(tmp_path, text)
    assert main(["profile-info", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(path) in err
    assert expected in err, err


def test_a_leading_byte_order_mark_is_not_part_of_the_header(tmp_path: Path) -> None:
    """Spreadsheets save CSV with a BOM; it was read into the first column's name ('op')."""
    path = _write_raw(tmp_path, ",".join(COLUMNS) + "\n" + GOOD_ROW + "\n")
    rows = load_profile(path).rows
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_profile(path).rows == rows and rows[0].batch == 1


def test_missing_sidecar_and_bad_sidecar(tmp_path: Path, capsys) -> None:
    path = tmp_path / "p.csv"
    path.write_text(",".join(COLUMNS) + "\n" + GOOD_ROW + "\n")
    assert main(["profile-info", str(path)]) == 2
    assert "missing sidecar" in capsys.readouterr().err
    path.with_suffix(".json").write_text(
        json.dumps({"format": "tlt-profile", "version": 1, **{**META, "tp": 0}})
    )
    with pytest.raises(ProfileError, match="field 'tp'"):
        load_profile(path)
    side = {"format": "tlt-profile", "version": 1, **META, "attention_context": "ragged"}
    path.with_suffix(".json").write_text(json.dumps(side))
    with pytest.raises(ProfileError, match="'attention_context': expected one of summed, padded"):
        load_profile(path)


@pytest.mark.parametrize("value", [None, "summed", "padded"])
def test_attention_context_of_the_sidecar_reaches_the_cost_model(tmp_path, value) -> None:
    path = tmp_path / "p.csv"
    extra = {} if value is None else {"attention_context": value}
    write_profile(bilinear_profile().rows, path, {**META, **extra})
    cost = ProfileCost(load_profile(path))
    assert cost.is_context_padded is (value == "padded")


def test_single_point_curve_is_rejected() -> None:
    rows = (ProfileRow("prefill", 1, 0, 64, 0.01, 0.01, 0.01, 1),)
    with pytest.raises(ProfileError, match="only one prompt tokens per sequence value"):
        ProfileCost(Profile(rows, META, "one.csv"), fallback=roofline())


def test_missing_ops_need_a_fallback() -> None:
    decode_only = Profile(
        tuple(r for r in bilinear_profile().rows if r.op == "decode"), META, "d.csv"
    )
    with pytest.raises(
        ProfileError, match="no rows for op verify, drafter, prefill, train, drafter_train"
    ):
        ProfileCost(decode_only)
    fallback = roofline()
    cost = ProfileCost(decode_only, fallback=fallback)
    assert cost.train_s(10_000, 500) == fallback.train_s(10_000, 500)
    assert cost.decode_iter_s(4, 4 * 300, 1) == pytest.approx(
        bilinear("decode", 4, 1200, 1), rel=1e-12
    )
    assert any("from RooflineCost" in line for line in cost.extrapolation_report())


# --- the CLI: profile-info, --profile ---------------------------------------------------------


def test_profile_info_prints_grid_and_comparison(tmp_path: Path, capsys) -> None:
    path = tmp_path / "roofline.csv"
    write_profile(profile_from_cost(grid_points(SMALL), roofline()), path, META)
    assert main(["profile-info", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "decode" in out
        and "median_ratio" in out
        and "measured / roofline (Qwen2.5-7B on H100-SXM, tp=1)" in out
    )


def test_cost_model_from_args(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    write_profile(bilinear_profile().rows, path, META)
    model, hw = get_model("Qwen2.5-7B"), get_hardware("H100-SXM")
    assert isinstance(
        cost_model_from_args(argparse.Namespace(profile=None), model, hw, 1), RooflineCost
    )
    cost = cost_model_from_args(argparse.Namespace(profile=path), model, hw, 1)
    assert isinstance(cost, ProfileCost) and isinstance(cost, CostModel)
    with pytest.raises(UsageError, match="measured with tp=1, but the simulation runs tp=2"):
        cost_model_from_args(argparse.Namespace(profile=path), model, hw, 2)


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """``tltsim profile-info ... | head -1`` (unbuffered output) ended as 'error: internal
    error: BrokenPipeError', exit 1."""
    import os
    import subprocess
    import sys

    profile = sorted((Path(__file__).resolve().parents[1] / "profiles").glob("*.csv"))[0]
    cmd = [sys.executable, "-m", "tltsim", "profile-info", str(profile)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.readline()
    proc.stdout.close()  # as head does after its line
    err = proc.stderr.read().decode()
    # 141 (128 + SIGPIPE) when a later line met the closed pipe; 0 if all fit the pipe first
    assert proc.wait(timeout=60) in (141, 0) and err == "", err


def test_profile_info_prints_the_provenance_one_field_per_line(tmp_path: Path, capsys) -> None:
    """The sidecar's fields were one ';'-joined line (a 900-character line for a GPU profile)."""
    path = tmp_path / "p.csv"
    config = {f"setting_{i}": list(range(i)) for i in range(12)}
    write_profile(bilinear_profile().rows, path, {**META, "config": config})
    assert main(["profile-info", str(path)]) == 0
    head = capsys.readouterr().out.split("\nop ")[0].splitlines()
    assert head[0] == f"{path}: {len(bilinear_profile().rows)} measured points"
    assert "  software: python=3.12, torch=2.13.0" in head and max(map(len, head)) <= 100
    config_lines = head[head.index(next(h for h in head if h.startswith("  config: "))) :][:6]
    words = " ".join(" ".join(config_lines).split())  # a value may wrap inside its list
    assert "setting_10=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], setting_11=[0, 1, 2, 3," in words


def test_a_profile_of_another_model_is_said_once() -> None:
    """replay --profile of the 1.5B profile under a 7B preset priced every op with the 1.5B's
    times and recorded the 7B, without a word; now one warning names the shapes."""
    import warnings

    from tltsim.cost.measured import ProfileModelWarning, with_profile

    shipped = Path(__file__).resolve().parents[1] / "profiles" / "h200_qwen2.5-1.5b_random.csv"
    hw = get_hardware("H200")
    with pytest.warns(ProfileModelWarning, match="hidden_size 1536 vs 3584"):
        with_profile(shipped, RooflineCost(get_model("Qwen2.5-7B"), hw))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileModelWarning)
        assert isinstance(
            with_profile(shipped, RooflineCost(get_model("Qwen2.5-1.5B"), hw)), ProfileCost
        )
