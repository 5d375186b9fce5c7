"""What a sweep spec may say (a read-only hunt's findings): each setting in one table only,
`seed` only through the `seeds` list, `max_steps` an integer (true was read as 1), and a grid's
values as their setting's type (a float setting's [0, 0.0] was two points, simulated twice).

Run: ``python -m pytest tests/test_sweep_spec.py -q``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from tltsim.errors import UsageError
from tltsim.sim.sweep_spec import load_spec, spec_points

TRACE = Path(__file__).resolve().parents[1] / "traces" / "synth_reasoning_rl.json"


def spec(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(f'trace = "{TRACE}"\nseeds = [0]\n{body}')
    return path


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("max_steps = true\n[grid]\n\"tlt.threshold\" = [16]\n", "max_steps must be an integer"),
        ("[fixed]\nnum_gpus = 8\n[grid]\nnum_gpus = [16]\n",
         "num_gpus set in both [fixed] and [grid]"),
        ("[fixed]\nspot_training = true\n[grid]\nis_spot_training = [false]\n",
         "is_spot_training set in both [fixed] and [grid]"),
        ("[grid]\nseed = [1, 2]\n", "seed is set by the spec's 'seeds' list"),
    ],
)  # fmt: skip
def test_a_spec_that_says_one_thing_twice_or_wrongly_is_one_line(tmp_path, body, says):
    with pytest.raises(UsageError, match=says.replace("[", r"\[").replace("]", r"\]")):
        load_spec(spec(tmp_path, body))


def test_grid_values_equal_as_their_type_are_one_point(tmp_path):
    loaded = load_spec(spec(tmp_path, '[grid]\n"tlt.epsilon" = [0, 0.0, 0.1]\n'))
    assert loaded.grid["tlt.epsilon"] == [0.0, 0.1]
    values = [p["tlt.epsilon"] for p in spec_points(loaded) if "tlt.epsilon" in p]
    assert values == [0.0, 0.1] and all(type(v) is float for v in values)


def test_a_sweep_point_records_no_timeline_unless_asked():
    """Sweeps keep summaries only; the timelines they recorded and dropped cost a quarter of
    their time and memory."""
    from tltsim.sim.sweep import settings_of

    assert not settings_of({"policy": "tlt"}, seed=0).sim.is_timeline_recorded
    assert not settings_of({"preset": "h100x8-qwen7b"}, seed=0).sim.is_timeline_recorded
    asked = settings_of({"is_timeline_recorded": True}, seed=0)
    assert asked.sim.is_timeline_recorded


def test_a_float_settings_random_range_draws_floats_from_integer_ends(tmp_path):
    """Hunt: {low = 0, high = 1} for tlt.epsilon drew only 0 and 1 (integers where both ends
    are), while [grid] read the same 0 as 0.0."""
    body = '[random]\nnum_points = 6\n"tlt.epsilon" = {low = 0, high = 1}\n"tlt.threshold" = {low = 4, high = 64}\n'
    points = [p for p in spec_points(load_spec(spec(tmp_path, body))) if "tlt.epsilon" in p]
    assert len(points) == 6
    assert all(type(p["tlt.epsilon"]) is float for p in points)
    assert len({p["tlt.epsilon"] for p in points}) == 6  # not just 0.0 and 1.0
    assert all(type(p["tlt.threshold"]) is int for p in points)  # an integer setting: integers


def test_a_bad_point_names_the_spec_file(tmp_path):
    """Hunt: an unknown policy in a grid was refused naming the point, not the file."""
    from tltsim.sim.sweep import run_sweep

    path = spec(tmp_path, '[grid]\npolicy = ["TLT"]\n')
    with pytest.raises(UsageError, match=f"^{path}: .*unknown policy 'TLT'"):
        run_sweep(path, tmp_path / "out")


def test_a_setting_a_point_left_to_its_default_is_named_in_the_best(tmp_path, capsys):
    """Hunt: a grid of tlt.threshold beside a random tlt.epsilon: the random points ran the
    default threshold, and the best setting (one of them) left the threshold out; the grid's
    points ran the default epsilon, which made them other settings than one naming it."""
    import json

    from tltsim.cli.main import main

    body = ('max_steps = 1\n[fixed]\npreset = "h100x8-qwen7b"\n[grid]\n"tlt.threshold" = [16, 32]'
            '\n[random]\nnum_points = 2\nseed = 5\n"tlt.epsilon" = {low = 0, high = 0.3}\n')  # fmt: skip
    assert main(["sweep", str(spec(tmp_path, body)), "--out", str(tmp_path / "s")]) == 0
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    for picked in (summary["best"], summary["runner_up"]):
        assert set(picked) == {"policy", "tlt.threshold", "tlt.epsilon", "speedup_vs_nospec"}
    printed = capsys.readouterr().out
    assert "tlt.threshold=" in printed.split("best setting")[1].split("\n")[0]
    assert not re.search(r"=0\.\d{5}", printed)  # floats to 4 digits, the runner-up's too
    points = pd.read_csv(tmp_path / "s" / "sweep.csv")
    # the table keeps what each point said (the random points' and NoSpec's blank)
    assert points["tlt.threshold"].isna().sum() == 3


def test_a_list_setting_beside_a_random_section_fills_its_default_as_the_table_writes_lists(
    tmp_path,
):
    """Review: the defaults were rebuilt from table cells, where lists are comma strings
    ('8_4_32,8_4_16' read as strategy '8'), and a list default was unhashable in the
    grouping: the summary failed after every point had run."""
    import json

    from tltsim.cli.main import main

    body = ('max_steps = 1\n[fixed]\npreset = "h100x8-qwen7b"\n[grid]\n"tlt.strategies" = '
            '[["8_4_32", "8_4_16"]]\n"tlt.bucket_starts" = [[1, 16]]\n[random]\nnum_points = 1\n'
            'seed = 5\n"tlt.epsilon" = {low = 0, high = 0.3}\n')  # fmt: skip
    assert main(["sweep", str(spec(tmp_path, body)), "--out", str(tmp_path / "s")]) == 0
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    settings = {summary["best"]["tlt.strategies"], summary["runner_up"]["tlt.strategies"]}
    assert settings == {"8_4_32,8_4_16", "8_4_48,8_4_32,8_4_16,8_4_8"}  # (the default's)
