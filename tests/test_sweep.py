"""``tltsim sweep``: spec parsing, grid + random points, the tidy table, resume, report.

.venv/bin/python -m pytest tests/test_sweep.py -q
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pandas as pd
import pytest

from tltsim.cli.main import main
from tltsim.errors import UsageError
from tltsim.sim.sweep import load_spec, run_sweep, spec_points

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "azure_conv_rl.json"

SPEC = f"""
trace = "{TRACE}"
seeds = [0, 1]
max_steps = 2
[fixed]
num_gpus = 4
[grid]
policy = ["static", "tlt"]
"tlt.threshold" = [8, 32]
"""


def write_spec(tmp_path: Path, text: str = SPEC) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


def test_points_cover_the_grid_plus_baselines(tmp_path: Path) -> None:
    points = spec_points(load_spec(write_spec(tmp_path)))
    # static x 2 thresholds (tlt.* settings still make distinct points), tlt x 2, one NoSpec baseline
    assert sorted(p["policy"] for p in points) == ["nospec", "static", "static", "tlt", "tlt"]
    assert {"num_gpus": 4, "policy": "nospec"} in points


def test_random_points_are_seeded(tmp_path: Path) -> None:
    text = f"""
trace = "{TRACE}"
[random]
num_points = 5
seed = 7
"tlt.epsilon" = {{low = 0.0, high = 0.3}}
num_gpus = {{choices = [2, 4]}}
"""
    a = spec_points(load_spec(write_spec(tmp_path, text)))
    b = spec_points(load_spec(write_spec(tmp_path, text)))
    assert a == b and len([p for p in a if p.get("policy") != "nospec"]) == 5
    assert all(0.0 <= p["tlt.epsilon"] <= 0.3 for p in a if "tlt.epsilon" in p)


def test_sweep_table_resume_and_report(tmp_path: Path) -> None:
    spec = write_spec(tmp_path)
    out = tmp_path / "out"
    first = run_sweep(spec, out, workers=1)
    # 5 points x 2 seeds; the two static points differ only in tlt.threshold, which StaticSpec
    # ignores, so they share one simulation: 4 simulations per seed.
    assert first.num_computed == 8 and first.num_reused == 0
    table = pd.read_parquet(out / "sweep.parquet")
    assert (
        len(table) == 10
        and table.groupby(["policy", "tlt.threshold", "seed"], dropna=False).size().max() == 1
    )
    static = table[table.policy == "static"].sort_values(["seed", "tlt.threshold"])
    assert static.mean_step_s.iloc[0] == static.mean_step_s.iloc[1]
    assert (table[table.policy == "nospec"].speedup_vs_nospec == 1.0).all()
    assert (table[table.policy != "nospec"].speedup_vs_nospec > 1.0).all()
    assert pd.read_csv(out / "sweep.csv").shape == table.shape
    lines = (out / "points.jsonl").read_text().splitlines()

    again = run_sweep(spec, out, workers=1)  # resume: nothing to recompute
    assert again.num_computed == 0 and again.num_reused == 8
    assert (out / "points.jsonl").read_text().splitlines() == lines
    pd.testing.assert_frame_equal(again.table, first.table)

    (out / "points.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])  # torn write
    partial = run_sweep(spec, out, workers=1)
    assert partial.num_computed == 3 and partial.num_reused == 5
    # the torn line is left where it was: the rows appended after it stay readable
    assert run_sweep(spec, out, workers=1).num_computed == 0

    def tidy(t: pd.DataFrame) -> pd.DataFrame:
        return t.drop(columns=["wall_s"]).sort_values("key").reset_index(drop=True)

    pd.testing.assert_frame_equal(tidy(partial.table), tidy(first.table))

    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "sweep" and summary["varying"] == ["tlt.threshold"]
    assert summary["best"]["policy"] in ("static", "tlt")
    assert main(["report", str(out)]) == 0
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert pngs == ["speedup_per_policy.png", "speedup_vs_tlt.threshold.png"]


def test_parallel_workers_give_the_same_table(tmp_path: Path) -> None:
    spec = write_spec(tmp_path)
    serial = run_sweep(spec, tmp_path / "serial", workers=1).table
    parallel = run_sweep(spec, tmp_path / "parallel", workers=2).table
    key = ["key"]
    pd.testing.assert_frame_equal(
        serial.drop(columns=["wall_s"]).sort_values(key).reset_index(drop=True),
        parallel.drop(columns=["wall_s"]).sort_values(key).reset_index(drop=True),
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ('trace = "x.json"\n[grid]\nnum_gpu = [1]', "unknown setting 'num_gpu'"),
        ('trace = "x.json"\n[grid]\n"tlt.thresh" = [1]', "unknown setting 'tlt.thresh'"),
        ('trace = "x.json"\nseeds = []', "seeds"),
        ('trace = "x.json"\n[grid]\npolicy = "tlt"', "non-empty list"),
        ('traces = "x.json"', "unknown top-level key"),
        ('trace = "x.json"\n[random]\n"tlt.epsilon" = 0.1\nnum_points = 2', "low = .., high = .."),
        ("trace = [", "cannot read"),
        # a value of the wrong type, named when the spec is read (not a '<' between str and int)
        (
            'trace = "x.json"\n[grid]\n"tlt.threshold" = ["abc", 8]',
            'tlt.threshold: expected an integer, got "abc"',
        ),
        ('trace = "x.json"\n[grid]\nnum_gpus = [8, 1.5]', "num_gpus: expected an integer, got 1.5"),
        (
            'trace = "x.json"\n[fixed]\n"tlt.epsilon" = true',
            "tlt.epsilon: expected a number, got true",
        ),
        (
            'trace = "x.json"\n[fixed]\nspot_training = 1',
            "spot_training: expected true or false, got 1",
        ),
        ('trace = "x.json"\n[fixed]\npolicy = 3', "policy: expected a string, got 3"),
        (
            'trace = "x.json"\n[grid]\n"tlt.strategies" = [["4_1_4", 2]]',
            r"tlt.strategies\[1\]: expected a string",
        ),
        (
            'trace = "x.json"\nseeds = [0]\n[random]\nnum_points = 2\n"tlt.threshold" = {low = 1, high = 4.5}',
            "tlt.threshold: expected an integer, got 4.5",
        ),
        (
            'trace = "x.json"\nseeds = [0]\n[random]\nnum_points = 2\n"spot.max_trainers" = {choices = [2, "all"]}',
            'spot.max_trainers: expected an integer, got "all"',
        ),
        ('trace = "x.json"\nseeds = [0, 1, 0]', "'seeds' repeats a seed"),
        # beyond int64: the Parquet table failed after every simulation had run
        (
            'trace = "x.json"\n[grid]\n"tlt.threshold" = [18446744073709551616]',
            "tlt.threshold: 18446744073709551616 is beyond what the sweep table holds",
        ),
        (
            'trace = "x.json"\nseeds = [0]\n[random]\nnum_points = 2\n'
            '"tlt.threshold" = {low = 1, high = 99999999999999999999999}',
            "99999999999999999999999 is beyond what the sweep table holds",
        ),
    ],
)
def test_bad_specs_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_spec(write_spec(tmp_path, text))


def test_bad_values_fail_before_any_point_runs(tmp_path: Path, capsys) -> None:
    spec = write_spec(tmp_path, f'trace = "{TRACE}"\n[grid]\nnum_gpus = [4, 6]\ntp = [4]')
    assert main(["sweep", str(spec), "--out", str(tmp_path / "o")]) == 2
    assert "not a multiple of tp" in capsys.readouterr().err
    assert not (tmp_path / "o" / "points.jsonl").exists()
    # a name only the cost model checks (a worker found it, after points had run)
    spec = write_spec(tmp_path, f'trace = "{TRACE}"\n[grid]\nhardware = ["H200", "H300"]')
    assert main(["sweep", str(spec), "--out", str(tmp_path / "o")]) == 2
    assert "unknown hardware preset 'H300'" in capsys.readouterr().err
    assert not (tmp_path / "o" / "points.jsonl").exists()


def test_nospec_in_a_grid_of_settings_it_ignores(tmp_path: Path) -> None:
    """NoSpec points that differ only in tlt.* settings are one simulation (one key): the table
    still has its speedups (it stopped at reindexing the duplicate keys, after every run)."""
    text = SPEC.replace('policy = ["static", "tlt"]', 'policy = ["nospec", "tlt"]')
    outcome = run_sweep(write_spec(tmp_path, text), tmp_path / "out", workers=1)
    table = outcome.table
    assert (table[table.policy == "nospec"].speedup_vs_nospec == 1.0).all()
    assert (table[table.policy == "tlt"].speedup_vs_nospec > 1.0).all()
    assert (tmp_path / "out" / "summary.json").is_file()


def test_a_resumed_sweep_of_another_trace_or_max_steps_reuses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = run_sweep(write_spec(tmp_path), out, workers=1)
    other = SPEC.replace("max_steps = 2", "max_steps = 1")
    again = run_sweep(write_spec(tmp_path, other), out, workers=1)
    assert again.num_reused == 0 and again.num_computed == first.num_computed
    assert (again.table.mean_step_s != first.table.mean_step_s).any()
    trace = ROOT / "traces" / "synth_reasoning_rl.json"
    third = run_sweep(write_spec(tmp_path, other.replace(str(TRACE), str(trace))), out, workers=1)
    assert third.num_reused == 0
    assert run_sweep(write_spec(tmp_path, other), out, workers=1).num_computed == 0  # resumed


def test_settings_a_policy_ignores_make_neither_two_results_nor_a_runner_up(tmp_path: Path):
    """TLTBase takes TLT's switch settings (tltbase_settings): its points of two thresholds
    were keyed as one simulation, so a sweep over them reported one result for both. StaticSpec
    ignores them: its two "settings" were the best and the runner-up, one simulation twice,
    "not distinguishable", while the real runner-up (tlt) went unnamed."""
    from tltsim.sim.sweep import effective, point_key

    low, high = ({"policy": "tltbase", "tlt.threshold": t} for t in (1, 64))
    assert point_key(low, 0) != point_key(high, 0)
    assert "tlt.strategies" not in effective({"policy": "tltbase", "tlt.strategies": ["2_1_2"]})
    # no EAGLE drafter, no trainer: drafter dynamics and spot training cannot change TLTBase
    assert effective({"policy": "tltbase", "drafter.drift_per_step": 0.5}) == {"policy": "tltbase"}
    assert effective({"policy": "tltbase", "is_spot_training": False}) == {"policy": "tltbase"}
    trace = ROOT / "traces" / "synth_reasoning_rl.json"
    text = SPEC.replace(str(TRACE), str(trace)).replace("[8, 32]", "[1, 64]")
    text = text.replace('["static", "tlt"]', '["static", "tlt", "tltbase"]')
    text = text.replace("max_steps = 2", "max_steps = 1").replace("num_gpus = 4", "num_gpus = 8")
    outcome = run_sweep(write_spec(tmp_path, text), tmp_path / "out", workers=1)
    table = outcome.table
    tltbase = table[(table.policy == "tltbase") & (table.seed == 0)]
    assert tltbase["speedup_vs_nospec"].nunique() == 2, tltbase  # two thresholds, two results
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    ranked = [summary["best"], summary["runner_up"]]
    assert [s["policy"] for s in ranked].count("static") <= 1, summary  # one static setting
    assert all("tlt.threshold" not in s for s in ranked if s["policy"] == "static"), summary


def test_report_of_a_sweep_over_a_string_setting(tmp_path: Path) -> None:
    """The best-setting label formatted the value with 'g': a static_strategy sweep's report
    ended with 'Unknown format code g for object of type str'."""
    spec = write_spec(
        tmp_path,
        f'trace = "{TRACE}"\nseeds = [0]\nmax_steps = 1\n[fixed]\nnum_gpus = 4\n'
        '[grid]\npolicy = ["static"]\nstatic_strategy = ["4_1_4", "8_4_32"]\n',
    )
    out = tmp_path / "out"
    run_sweep(spec, out, workers=1)
    assert main(["report", str(out)]) == 0
    assert (out / "plots" / "speedup_vs_static_strategy.png").stat().st_size > 0


def test_report_of_a_grid_plus_random_sweep(tmp_path: Path) -> None:
    """Grid points lack the random settings and random points the grid's: the heat map's grid
    was empty and the report failed ('zero-size array to reduction operation'), a policy with
    no point setting a line's setting failed argmax. Now: a panel per policy with points that
    set both, a line per policy with points that set it."""
    spec = write_spec(
        tmp_path,
        f'trace = "{TRACE}"\nseeds = [0]\nmax_steps = 1\n[fixed]\nnum_gpus = 4\n'
        '[grid]\npolicy = ["static", "tlt"]\n"tlt.threshold" = [8, 32]\n'
        '[random]\nnum_points = 2\nseed = 0\n"tlt.epsilon" = {low = 0.0, high = 0.3}\n',
    )
    out = tmp_path / "out"
    run_sweep(spec, out, workers=1)
    assert main(["report", str(out)]) == 0
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert pngs == [
        "speedup_per_policy.png",
        "speedup_vs_tlt.epsilon.png",
        "speedup_vs_tlt.threshold.png",
    ]


def test_a_random_sweep_is_drawn_as_points_not_as_a_grid_of_categories(tmp_path, monkeypatch):
    """Hunt: 150 random draws of two settings became a heat map of ~100 x 150 mostly empty
    cells with a tick label each, and lines zigzagging between single draws. Settings with
    more than MAX_CATEGORIES values are drawn as scatters; a small grid keeps its heat map."""
    import matplotlib.pyplot as plt

    from analysis import sweep_plots

    spec = write_spec(
        tmp_path,
        f'trace = "{TRACE}"\nseeds = [0]\nmax_steps = 1\n[fixed]\nnum_gpus = 4\n'
        '[grid]\npolicy = ["tlt"]\n[random]\nnum_points = 14\nseed = 0\n'
        '"tlt.threshold" = {low = 4, high = 128}\n"tlt.epsilon" = {low = 0.0, high = 0.3}\n',
    )
    out = tmp_path / "out"
    run_sweep(spec, out, workers=1)
    kinds = {}

    def keep(fig, path):
        kinds[Path(path).name] = [
            (len(ax.images), len(ax.collections), [line.get_linestyle() for line in ax.get_lines()])
            for ax in fig.axes
        ]
        plt.close(fig)
        return Path(path)

    monkeypatch.setattr(sweep_plots, "_save", keep)
    sweep_plots.draw_all(out)
    images, collections, _ = kinds["speedup_tlt.threshold_x_tlt.epsilon.png"][0]
    assert images == 0 and collections == 1  # a scatter, no heat map
    _, _, styles = kinds["speedup_vs_tlt.threshold.png"][0]
    assert styles[0] == "None"  # the points, unjoined (then the best star)


def test_a_preset_file_is_read_beside_the_spec_and_a_recalibrated_one_recomputes(
    tmp_path: Path, monkeypatch
) -> None:
    """``hardware = "gpu.json"`` (and ``out``) resolve beside the spec, as ``trace`` does; the
    resume key covers the preset file's contents (a recalibrated file reused the old rows)."""
    import dataclasses

    from tltsim.cost.calibrated import CALIBRATIONS, save_hardware_preset
    from tltsim.cost.specs import HARDWARE_PRESETS

    here = tmp_path / "study"
    params = CALIBRATIONS["H100-SXM"]

    def calibrate(bandwidth_fraction: float) -> None:
        slower = dataclasses.replace(params, bandwidth_fraction=bandwidth_fraction)
        save_hardware_preset(here / "gpu.json", HARDWARE_PRESETS["H100-SXM"], slower, {})

    calibrate(params.bandwidth_fraction)
    spec = f"""
trace = "{TRACE}"
max_steps = 1
out = "o"
[fixed]
num_gpus = 4
hardware = "gpu.json"
[grid]
policy = ["static"]
"""
    (here / "spec.toml").write_text(spec)
    monkeypatch.chdir(tmp_path)  # not the spec's directory
    first = run_sweep(here / "spec.toml", workers=1)
    assert first.out == here / "o" and first.num_computed == 2
    calibrate(0.1)
    again = run_sweep(here / "spec.toml", workers=1)
    assert again.num_reused == 0 and again.num_computed == 2
    assert (again.table.mean_step_s > first.table.mean_step_s).all()
    assert run_sweep(here / "spec.toml", workers=1).num_computed == 0  # resumed


def _drawn_texts(out, monkeypatch) -> dict[str, list[str]]:
    """The report figures of sweep directory ``out``: file name -> axes titles and legend labels."""
    from pathlib import Path as P

    import matplotlib.pyplot as plt

    from analysis import sweep_plots

    drawn = {}

    def keep(fig, path):
        drawn[P(path).name] = [ax.get_title() for ax in fig.axes] + [
            label for ax in fig.axes for label in ax.get_legend_handles_labels()[1]
        ]
        plt.close(fig)
        return P(path)

    monkeypatch.setattr(sweep_plots, "_save", keep)
    sweep_plots.draw_all(out)
    return drawn


def test_a_policy_that_ignores_the_swept_setting_is_no_best_value_of_it(tmp_path, monkeypatch):
    """SPEC sweeps tlt.threshold over static and tlt: static's flat line got the star
    ('best: static, tlt.threshold=8'), though the summary names no threshold for static."""
    out = tmp_path / "out"
    run_sweep(write_spec(tmp_path), out, workers=1)
    labels = _drawn_texts(out, monkeypatch)["speedup_vs_tlt.threshold.png"]
    assert "static (does not read tlt.threshold)" in labels and "tlt" in labels
    (best,) = [label for label in labels if label.startswith("highest mean:")]
    assert best.startswith("highest mean: tlt, tlt.threshold=")


def test_an_integer_setting_stays_one_and_an_on_off_one_is_drawn_as_on_off(tmp_path, monkeypatch):
    """Hunt: the NoSpec baseline sets no tlt.threshold, so the column became float and
    sweep.csv read 8.0; is_spot_training was drawn on a 0..1 axis ticked at 0.2, 0.4, ..."""
    import pandas as pd

    from analysis import sweep_plots

    out = tmp_path / "out"
    run_sweep(write_spec(tmp_path), out, workers=1)
    column = pd.read_csv(out / "sweep.csv", dtype=str)["tlt.threshold"].dropna()
    assert len(column) and all(value.isdigit() for value in column), list(column)
    ticks = {}

    def keep(fig, path):
        ticks[path] = [t.get_text() for t in fig.axes[0].get_xticklabels()]
        return path

    monkeypatch.setattr(sweep_plots, "_save", keep)
    # as a sweep's table holds it: the NoSpec baseline's None makes the column 'object'
    table = pd.DataFrame({"policy": ["nospec", "tlt", "tlt"],
                          "is_spot_training": [None, False, True],
                          "speedup_vs_nospec": [1.0, 1.2, 1.3]})  # fmt: skip
    sweep_plots.speedup_lines(table, "is_spot_training", tmp_path / "s.png")
    assert ticks[tmp_path / "s.png"] == ["off", "on"]


def test_a_heat_map_says_which_settings_its_cells_average(tmp_path, monkeypatch):
    """Three varied settings: the heat map over the first two averages the third; its titles
    and its star say so (a cell read as one setting's result named a setting never run)."""
    import json

    import pandas as pd

    rows = [
        {"policy": policy, "seed": 0, "a": a, "b": b, "c": c, "speedup_vs_nospec": 1.0 + a + b * c}
        for policy in ("nospec", "tlt")
        for a in (1, 2)
        for b in (1, 2)
        for c in (0, 1)
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "sweep.parquet")
    (tmp_path / "summary.json").write_text(json.dumps({"varying": ["a", "b", "c"]}))
    texts = _drawn_texts(tmp_path, monkeypatch)["speedup_a_x_b.png"]
    assert "tlt: speedup vs NoSpec\n(mean over seeds, c)" in texts
    assert "highest mean over c" in texts


def test_a_new_sweep_killed_before_its_table_leaves_no_stale_one(tmp_path: Path, monkeypatch):
    """A sweep of another spec into the same out, killed while simulating, left the old
    sweep's table and summary beside its own config.json (report drew them): they are removed
    first; points.jsonl stays (its rows are keyed by what they simulated)."""
    import tltsim.sim.sweep as sweep_module

    out = tmp_path / "out"
    run_sweep(write_spec(tmp_path), out, workers=1)
    other = write_spec(tmp_path, SPEC.replace("[8, 32]", "[16]"))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_module, "_run_task", killed)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(other, out, workers=1)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "points.jsonl"]
    assert json.loads((out / "config.json").read_text())["spec"]["grid"]["tlt.threshold"] == [16]


def test_an_out_that_is_a_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    spec = write_spec(tmp_path)
    with pytest.raises(UsageError, match="out .*afile: exists and is not a directory"):
        run_sweep(spec, tmp_path / "afile", workers=1)


LONG_SPEC = f"""
trace = "{ROOT / "traces" / "synth_reasoning_rl.json"}"
seeds = [0, 1, 2, 3]
[fixed]
preset = "h100x64-qwen7b"
exact = true
[grid]
policy = ["tlt"]
"tlt.threshold" = [8, 16, 32, 64]
"""


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_a_stopped_parallel_sweep_says_one_line_and_leaves_no_process(tmp_path, how):
    """Found by a hygiene hunt: SIGTERM left the pool's workers running until their point was
    done, then printed BrokenPipeError tracebacks and the resource tracker's 'leaked semaphore'
    warning; Ctrl-C (SIGINT to the whole process group) printed each worker's traceback."""
    import signal
    import subprocess
    import sys

    spec = write_spec(tmp_path, LONG_SPEC)
    cmd = [sys.executable, "-m", "tltsim.cli.main", "sweep", str(spec), "--out",
           str(tmp_path / "out"), "--workers", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(4)  # the pool is up and simulating
    children = _children(proc.pid)
    assert children, "no pool workers seen"
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends
    _, err = proc.communicate(timeout=60)
    expected = {"SIGTERM": (143, "stopped by SIGTERM\n"), "Ctrl-C": (130, "interrupted\n")}[how]
    assert (proc.returncode, err) == expected
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in children)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(p) for p in fh.read().split()]
