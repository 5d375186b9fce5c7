"""``tltsim replay`` and ``tltsim report`` end to end: files written, figures drawn, bad input.

.venv/bin/python -m pytest tests/test_cli.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pandas as pd
import pytest

from tltsim.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "traces" / "synth_reasoning_rl.json"


def assert_real_png(path: Path) -> None:
    """Exists, is not tiny, and is not a blank canvas."""
    assert path.exists() and path.stat().st_size > 15_000, path
    pixels = mpimg.imread(path)[..., :3]
    assert pixels.std() > 0.05, f"{path.name} looks blank"
    assert (pixels.reshape(-1, 3) < 0.9).any(axis=1).mean() > 0.02, f"{path.name} has almost no ink"


@pytest.fixture(scope="module")
def replay_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replay")
    assert (
        main(
            [
                "replay",
                str(SAMPLE),
                "--max-steps",
                "3",
                "--preset",
                "h100x8-qwen7b",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return out


def test_replay_writes_every_result_file(replay_dir: Path) -> None:
    config = json.loads((replay_dir / "config.json").read_text())
    assert config["sim"]["num_gpus"] == 8 and config["sim"]["model"] == "Qwen2.5-7B"
    assert config["replay"]["policy"] == "all" and config["trace"].endswith(
        "synth_reasoning_rl.json"
    )
    summary = json.loads((replay_dir / "summary.json").read_text())
    assert summary["kind"] == "replay"
    rows = {r["policy"]: r for r in summary["policies"]}
    assert set(rows) == {"nospec", "static", "tlt", "tltbase"}  # every policy, the history one too
    assert rows["nospec"]["speedup_vs_nospec"] == pytest.approx(1.0)
    assert rows["tlt"]["speedup_vs_nospec"] > 1.0
    for row in rows.values():
        assert row["mean_rollout_s"] >= summary["mean_ideal_rollout_s"]
    steps = pd.read_csv(replay_dir / "steps.csv")
    assert len(steps) == 3 * len(rows) and set(steps.policy) == set(rows)
    instances = pd.read_csv(replay_dir / "instances.csv")
    assert len(instances) == 3 * len(rows) * 8
    timeline = pd.read_parquet(replay_dir / "timeline.parquet")
    assert {"sd", "decode", "prefill", "train", "spot_train"} <= set(timeline.phase)
    responses = pd.read_parquet(replay_dir / "responses.parquet")
    assert len(responses) == 3 * 512 and responses.finish_s_tlt.notna().all()


def test_report_draws_readable_pngs(replay_dir: Path) -> None:
    assert main(["report", str(replay_dir)]) == 0
    names = {p.name for p in (replay_dir / "plots").glob("*.png")}
    assert names == {
        "length_cdf.png",
        "gantt_slowest_step.png",
        "active_requests.png",
        "step_breakdown.png",
        "step_time_per_policy.png",
        "accept_length.png",
    }
    for name in names:
        assert_real_png(replay_dir / "plots" / name)


def test_report_colours_every_policy_and_keeps_no_stale_figure(replay_dir: Path, monkeypatch):
    """tltbase was drawn in NoSpec's colour (matplotlib's first default), with the EAGLE
    drafter's acceptance it never drafts with; a report into a plots/ directory kept figures
    an earlier report had drawn there from other results."""
    import matplotlib.pyplot as plt

    from analysis import replay_plots

    drawn = {}

    def keep(fig, path):
        drawn[Path(path).name] = [
            (line.get_label(), line.get_color()) for ax in fig.axes for line in ax.get_lines()
        ]
        plt.close(fig)
        return Path(path)

    (replay_dir / "plots").mkdir(exist_ok=True)
    (replay_dir / "plots" / "speedup_vs_old.png").write_bytes(b"old")
    monkeypatch.setattr(replay_plots, "_save", keep)
    replay_plots.draw_all(replay_dir)
    assert not (replay_dir / "plots" / "speedup_vs_old.png").exists()
    labels = dict(drawn["accept_length.png"])
    assert labels["tltbase: mean accept length"] != labels["tlt: mean accept length"]
    assert "tltbase: mean accept length" in labels and not any(
        label.startswith("tltbase: EAGLE") for label in labels
    )
    assert len({color for _, color in drawn["step_time_per_policy.png"]}) >= 4


def test_a_one_step_run_is_drawn_on_a_step_axis_with_every_line_visible(tmp_path, monkeypatch):
    """Hunt: with one step the x axis ran -0.045..0.045 'RL step' with fractional ticks, and the
    ideal rollout and the drafter's acceptance (lines without markers) drew nothing."""
    import matplotlib.pyplot as plt

    from analysis import replay_plots

    out = tmp_path / "one"
    argv = ["replay", str(SAMPLE), "--max-steps", "1", "--policy", "nospec,tlt", "--out", str(out)]
    assert main(argv) == 0
    axes = {}

    def keep(fig, path):
        axes[Path(path).name] = [
            (ax.get_xlim(), ax.get_xticks(), ax.get_lines()) for ax in fig.axes
        ]
        plt.close(fig)
        return Path(path)

    monkeypatch.setattr(replay_plots, "_save", keep)
    replay_plots.draw_all(out)
    for name in ("step_time_per_policy.png", "accept_length.png"):
        xlim, ticks, lines = axes[name][0]
        assert xlim == (-1.0, 1.0) and all(t == int(t) for t in ticks), (name, xlim, ticks)
        # the step axes (accept_length's twin too); not the speedup bars' reference line
        every = [line for ax in axes[name] if ax[0] == xlim for line in ax[2]]
        assert len(every) >= 2 and all(
            line.get_marker() not in (None, "None", "") for line in every
        ), [(line.get_label(), line.get_marker()) for line in every]


def test_single_policy_prints_the_per_step_table(tmp_path: Path, capsys) -> None:
    assert (
        main(
            [
                "replay",
                str(SAMPLE),
                "--max-steps",
                "2",
                "--policy",
                "nospec",
                "--num-gpus",
                "4",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "rollout_%" in out and "bubble_%" in out and "summary" in out
    assert json.loads((tmp_path / "config.json").read_text())["sim"]["num_gpus"] == 4


def test_flags_override_the_preset(tmp_path: Path) -> None:
    main(
        [
            "replay",
            str(SAMPLE),
            "--max-steps",
            "1",
            "--policy",
            "nospec",
            "--preset",
            "h200x8-qwen32b",
            "--num-gpus",
            "16",
            "--out",
            str(tmp_path),
        ]
    )
    sim = json.loads((tmp_path / "config.json").read_text())["sim"]
    assert (sim["model"], sim["hardware"], sim["num_gpus"], sim["tp"]) == (
        "Qwen2.5-32B",
        "H200",
        16,
        2,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["replay", "no/such/trace.json"], "no/such/trace.json"),
        (["replay", str(SAMPLE), "--preset", "h100x3-gpt5"], "unknown --preset 'h100x3-gpt5'"),
        (["replay", str(SAMPLE), "--policy", "nospec,fast"], "policy"),
        (
            ["replay", str(SAMPLE), "--num-gpus", "6", "--tp", "4"],
            "--num-gpus=6 is not a multiple of --tp=4",
        ),
        (["replay", str(SAMPLE), "--model", "GPT-9"], "unknown model preset"),
        (["replay", str(SAMPLE), "--tlt-epsilon", "2"], "epsilon"),
        (["report", str(ROOT / "traces")], "no summary.json"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys
) -> None:
    if argv[0] == "replay":
        argv = [*argv, "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_the_console_entry_point_exits_2_without_a_traceback(tmp_path: Path) -> None:
    argv = ["replay", str(SAMPLE), "--model", "GPT-9", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "tltsim.cli.main", *argv], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: unknown model preset")


def test_a_refused_replay_leaves_no_output_directory(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["replay", str(SAMPLE), "--preset", "h100x8-qwen7b", "--accept-rate-range", "fit"]
    assert main(argv) == 2
    assert "needs --drafter-dynamics" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["sweep", "{tmp}/bad.toml", "--out", "{tmp}/o/sweep"],
        ["calibrate", str(ROOT / "profiles" / "h200_qwen2.5-1.5b_random.csv"),
         "--hardware", "NOPE", "--out", "{tmp}/o/deep/h.json"],
        ["import", "servegen", "{tmp}/missing.csv", "--out", "{tmp}/o/t.json"],
    ],
)  # fmt: skip
def test_a_refused_command_leaves_no_directory_it_created(tmp_path: Path, argv, capsys) -> None:
    """Commands that created --out (or an output file's folders) before a check of their input
    failed left them behind empty; an existing directory and whatever a command wrote stay."""
    (tmp_path / "bad.toml").write_text('trace = "x.json"\n[grid]\npolicy = ["warp"]\n')
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2 and capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()  # already there: kept
    assert main(argv) == 2 and (tmp_path / "o").is_dir()


def test_a_replay_killed_before_its_results_leaves_no_stale_ones(
    replay_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A second replay into the same --out killed while simulating left the first replay's
    results beside its own config.json, and report drew them as its own: they are removed
    before the new config.json is written, and summary.json (what report reads first) is
    written last."""
    import shutil

    import tltsim.cli.replay as cli_replay

    out = tmp_path / "out"
    shutil.copytree(replay_dir, out)
    assert main(["report", str(out)]) == 0

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_replay, "simulate_policies", killed)
    argv = ["replay", str(SAMPLE), "--max-steps", "1", "--policy", "nospec", "--out", str(out)]
    assert main(argv) == 130  # what a Ctrl-C gives ("interrupted")
    assert json.loads((out / "config.json").read_text())["replay"]["policy"] == "nospec"
    left = sorted(p.name for p in out.iterdir())
    assert left == ["config.json", "plots"] and not list((out / "plots").glob("*.png"))
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    assert "no summary.json: the run that wrote its config.json did not finish" in (
        capsys.readouterr().err
    )
    # a tltrun train run is not an unfinished replay: the other report draws it
    (out / "log.jsonl").write_text('{"step": 0}\n')
    assert main(["report", str(out)]) == 2
    assert f"a tltrun train run (log.jsonl); draw it with tltrun report {out}" in (
        capsys.readouterr().err
    )
    # nor is a finished tltrun generate or bench output (hunt: "run it again")
    (out / "log.jsonl").unlink()
    # an advise output points to its sweep (hunt)
    (out / "advise.json").write_text("{}")
    assert main(["report", str(out)]) == 2
    assert f"a tltsim advise output; draw its sweep: tltsim report {out / 'sweep'}" in (
        capsys.readouterr().err
    )
    (out / "advise.json").unlink()
    for command in ("generate", "bench"):
        (out / "config.json").write_text(json.dumps({command: {}, "engine": {}}))
        assert main(["report", str(out)]) == 2
        assert f"{out}: a tltrun {command} output directory; tltsim report draws" in (
            capsys.readouterr().err
        )


def test_a_directory_of_another_commands_results_is_refused(
    replay_dir: Path, tmp_path: Path, capsys
) -> None:
    """Hunt: each command removed only its own earlier files, so an advice written into a
    replay's --out left that replay's summary.json beside it, and report drew the replay as
    this run's; a replay into an advice's directory left a recommendation for another trace."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(replay_dir, out)
    before = sorted(p.name for p in out.iterdir())
    assert main(["advise", str(SAMPLE), "--max-steps", "1", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --out {out}: holds the results of a tltsim replay (config.json); give this "
        "advise a directory of its own (or remove that one)"
    )
    assert sorted(p.name for p in out.iterdir()) == before  # nothing removed or added
    spec = tmp_path / "s.toml"
    spec.write_text(f'trace = "{SAMPLE}"\nmax_steps = 1\n')
    assert main(["sweep", str(spec), "--out", str(out)]) == 2
    assert "holds the results of a tltsim replay (config.json); give this sweep" in (
        capsys.readouterr().err
    )
    # the spec's own out too (review: it wrote over the replay's config.json and summary.json)
    spec.write_text(f'out = "{out}"\n' + spec.read_text())
    assert main(["sweep", str(spec)]) == 2
    assert f"error: {spec}: out {out}: holds the results of a tltsim replay" in (
        capsys.readouterr().err
    )
    (out / "advise.json").write_text("{}")
    argv = ["replay", str(SAMPLE), "--max-steps", "1", "--policy", "nospec", "--out", str(out)]
    assert main(argv) == 2
    assert "holds the results of a tltsim advise (advise.json)" in capsys.readouterr().err
    (out / "advise.json").unlink()
    assert main(argv) == 0  # its own kind: replaced
    # a model's config.json, or a tltrun run's, was written over (hunt: the model then failed
    # to load; the run could no longer be resumed)
    for config, says in (
        ('{"model_type": "qwen2"}', "holds a model (config.json)"),
        ('{"generate": {}, "engine": {}}', "holds the results of a tltrun generate (config.json)"),
    ):
        (out / "config.json").write_text(config)
        assert main(argv) == 2
        assert says in capsys.readouterr().err
        assert (out / "config.json").read_text() == config


def test_the_summary_footnote_names_the_columns_shown(tmp_path: Path, capsys) -> None:
    """Hunt: a tlt-only replay's footnote spoke of reclaimed_gpu_s, a column its table lacks,
    and a one-step trace's of 'the 1 steps'."""
    argv = ["replay", str(SAMPLE), "--max-steps", "1", "--out", str(tmp_path / "o")]
    assert main([*argv, "--policy", "tlt"]) == 0
    assert "(step_s, rollout_s: means per step; drafter_gpu_s: total over the 1 step)\n" in (
        capsys.readouterr().out
    )
    assert main([*argv, "--policy", "nospec,tlt", "--max-steps", "2"]) == 0
    assert "reclaimed_gpu_s, drafter_gpu_s: totals over the 2 steps)" in capsys.readouterr().out


def test_report_of_a_compare_output_says_its_figures_are_there(tmp_path: Path, capsys) -> None:
    """Hunt: it said "field 'kind' must be 'replay' or 'sweep', got 'compare'"."""
    (tmp_path / "summary.json").write_text('{"kind": "compare"}')
    (tmp_path / "parity.png").write_bytes(b"")
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path}: a tltsim compare output, whose figures compare wrote already "
        "(parity.png)\n"
    )
