"""Speedup intervals of ``tltsim replay`` (seeds, acceptance band, cost error), their outputs and
plot, and a sweep's best-vs-runner-up distinguishability.

.venv/bin/python -m pytest tests/test_replay_intervals.py -q
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
from simtools import make_trace

from tltsim.cli.main import main
from tltsim.errors import UsageError
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import SimConfig
from tltsim.sim.intervals import (
    IntervalSpec,
    accept_band,
    mean_step_s_scaled,
    parse_seeds,
    scaled_dynamics,
    speedup_intervals,
)
from tltsim.sim.replay import RunSettings, replay_intervals, simulate_policies
from tltsim.sim.sweep import SweepSpec, sweep_summary
from tltsim.trace.files import save_trace

NAMES = ("nospec", "static", "tlt")
DRAFTER = DrafterDynamics()


def long_tail_trace():
    # 2 steps x 8 prompts x 4 responses: mostly short, one long tail per step
    step = [[300, 500, 800, 400]] * 7 + [[300, 600, 900, 6000]]
    return make_trace([step, step])


@pytest.fixture(scope="module")
def point():
    base = RunSettings(sim=SimConfig(num_gpus=4, seed=0), policy="nospec")
    trace = long_tail_trace()
    return trace, base, simulate_policies(trace, NAMES, base)


def intervals(point, **spec):
    trace, base, results = point
    return replay_intervals(trace, NAMES, base, IntervalSpec(**spec), results)


def test_intervals_contain_the_point_estimate(point) -> None:
    band = accept_band(DRAFTER, "0.9,1.1")
    got = intervals(point, seeds=(0, 1, 2), accept=band, cost_error=0.1)
    results = point[2]
    nospec = results["nospec"].summary()["mean_step_s"]
    assert got["nospec"].low == got["nospec"].high == got["nospec"].speedup == 1.0
    for name in ("static", "tlt"):
        iv = got[name]
        assert iv.speedup == nospec / results[name].summary()["mean_step_s"]
        assert iv.low < iv.speedup < iv.high
        assert set(iv.by_source) == {"seeds", "accept_rate", "cost_error"}
        for low, high in iv.by_source.values():
            assert iv.low <= low <= iv.speedup <= high <= iv.high


def test_intervals_widen_with_the_error_band(point) -> None:
    narrow = intervals(point, seeds=(0,), cost_error=0.05)["static"]
    wide = intervals(point, seeds=(0,), cost_error=0.2)["static"]
    assert wide.low < narrow.low < narrow.speedup < narrow.high < wide.high
    assert narrow.speedup == wide.speedup
    none = intervals(point, seeds=(0,), cost_error=0.0)["static"]
    assert none.low == none.speedup == none.high and none.by_source == {}
    close = intervals(point, seeds=(0,), accept=accept_band(DRAFTER, "0.97,1.03"))["static"]
    far = intervals(point, seeds=(0,), accept=accept_band(DRAFTER, "0.7,1.2"))["static"]
    assert far.low < close.low <= close.high < far.high


def test_the_accept_band_moves_the_history_drafter(point) -> None:
    """tltbase drafts from the history alone: its accept-rate interval comes from the band's
    HistoryModel ends (issue #20), not from EAGLE's dynamics."""
    trace, base, _ = point
    names = ("nospec", "tltbase")
    results = simulate_policies(trace, names, base)
    history = base.history
    held = accept_band(DRAFTER, "0.7,1.2")  # EAGLE's rates only
    moved = accept_band(DRAFTER, "0.7,1.2", history=history)
    assert moved.history_low.rate_factor == 0.7 and moved.history_high.rate_factor == 1.2
    assert moved.history_low.accept_rate(0.5, False) == pytest.approx(
        0.7 * history.accept_rate(0.5, False)
    )
    iv_held = replay_intervals(trace, names, base, IntervalSpec(seeds=(0,), accept=held), results)
    iv = replay_intervals(trace, names, base, IntervalSpec(seeds=(0,), accept=moved), results)
    assert iv_held["tltbase"].low == iv_held["tltbase"].high  # nothing of tltbase moved
    assert iv["tltbase"].low < iv["tltbase"].speedup < iv["tltbase"].high


def test_a_fit_band_moves_the_history_logits_by_their_standard_errors(tmp_path: Path) -> None:
    history = RunSettings(sim=SimConfig(), policy="tltbase").history
    fit = tmp_path / "fit.json"
    stderr = {"base_logit": 0.1, "finished_logit": 0.2, "history_logit": None}
    fit.write_text(
        json.dumps({"fit": {"stderr": {"max_accept_rate": 0.01}}, "history": {"stderr": stderr}})
    )
    band = accept_band(DRAFTER, "fit", fit, history)
    assert band.history_low.base_logit == pytest.approx(history.base_logit - 1.96 * 0.1, abs=1e-3)
    assert band.history_high.finished_logit == pytest.approx(
        history.finished_logit + 1.96 * 0.2, abs=1e-3
    )
    assert band.history_low.history_logit == history.history_logit  # no finite se: held
    fit.write_text(json.dumps({"fit": {"stderr": {"max_accept_rate": 0.01}}}))
    band = accept_band(DRAFTER, "fit", fit, history)
    assert band.history_low is None and "history drafter held" in band.description
    # the rates without a finite standard error stay at their fitted values, said
    assert "(initial_accept_rate, stale_accept_rate held: no finite standard error)" in (
        band.description
    )
    assert band.low.stale_accept_rate == band.high.stale_accept_rate == DRAFTER.stale_accept_rate


def test_seeds_change_results(point) -> None:
    got = intervals(point, seeds=(0, 1, 2))
    for name in ("static", "tlt"):
        low, high = got[name].by_source["seeds"]
        assert low < high, f"{name}: every seed gave the same speedup"


def test_cost_scaling_moves_only_sd_seconds(point) -> None:
    results = point[2]
    nospec, static = results["nospec"], results["static"]
    assert mean_step_s_scaled(nospec, 1.3) == pytest.approx(nospec.summary()["mean_step_s"])
    assert mean_step_s_scaled(static, 1.0) == static.summary()["mean_step_s"]
    slower = mean_step_s_scaled(static, 1.3) - static.summary()["mean_step_s"]
    # at most every SD second of the slowest instance 30% longer, at least something
    assert 0 < slower <= 0.3 * max(s.sd_instance_s for s in static.steps)


def test_accept_band_and_seed_parsing(tmp_path: Path) -> None:
    band = accept_band(DRAFTER, "0.9,1.1")
    assert band.low == scaled_dynamics(DRAFTER, 0.9)
    assert band.high.max_accept_rate == min(1.0, DRAFTER.max_accept_rate * 1.1)
    assert accept_band(DRAFTER, None) is None
    for bad in ("1.1,0.9", "1,inf", "nan,1"):  # inf reached HistoryModel as rate_factor
        with pytest.raises(ValueError, match="LOW <= 1 <= HIGH"):
            accept_band(DRAFTER, bad)
    with pytest.raises(UsageError, match="needs --drafter-dynamics"):
        accept_band(DRAFTER, "fit")
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"fit": {"stderr": {"max_accept_rate": 0.01, "drift_per_step": 1}}}))
    fitted = dataclasses.replace(DRAFTER, max_accept_rate=0.7, initial_accept_rate=0.7)
    band = accept_band(fitted, "fit", fit)
    assert band.low.max_accept_rate == pytest.approx(0.7 - 1.96 * 0.01, abs=1e-4)
    assert band.high.max_accept_rate == pytest.approx(0.7 + 1.96 * 0.01, abs=1e-4)
    assert band.low.initial_accept_rate <= band.low.max_accept_rate  # kept valid
    fit.write_text(json.dumps({"fit": {"stderr": {"max_accept_rate": None}}}))
    with pytest.raises(UsageError, match="no finite standard error"):
        accept_band(fitted, "fit", fit)
    assert parse_seeds(None, 3, 5) == (5, 6, 7)
    assert parse_seeds("4,1", 1, 0) == (4, 1)
    with pytest.raises(ValueError, match="distinct"):
        parse_seeds("1,1", 1, 0)


def test_replay_writes_and_prints_intervals(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.json"
    main(["gen", "--num-steps", "2", "--prompts-per-step", "8", "--seed", "1", "--out", str(trace)])
    out = tmp_path / "r"
    argv = ["replay", str(trace), "--num-gpus", "2", "--policy", "nospec,static", "--out", str(out)]
    assert main([*argv, "--seeds", "3,4", "--accept-rate-range", "0.9,1.1"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["speedup_interval"]["sources"] == ["seeds", "accept_rate", "cost_error"]
    assert summary["speedup_interval"]["seeds"] == [3, 4]
    assert json.loads((out / "config.json").read_text())["sim"]["seed"] == 3
    static = summary["policies"][1]
    assert static["speedup_vs_nospec_low"] <= static["speedup_vs_nospec"]
    assert static["speedup_vs_nospec"] <= static["speedup_vs_nospec_high"]
    # per step the larger of the two terms: on average at least either, at most both
    work, path = summary["mean_ideal_work_s"], summary["mean_ideal_critical_path_s"]
    assert max(work, path) <= summary["mean_ideal_rollout_s"] <= work + path
    text = f"{static['speedup_vs_nospec']:.2f}x [{static['speedup_vs_nospec_low']:.2f}-"
    assert text in printed and "speedup interval: min-max over seeds 3,4" in printed
    table = pd.read_csv(out / "summary.csv")
    assert list(table.policy) == ["nospec", "static"]
    assert {"speedup_vs_nospec_low", "mean_ideal_critical_path_s"} <= set(table.columns)
    from analysis.replay_plots import draw_all

    assert (out / "plots" / "step_time_per_policy.png") in draw_all(out)


def test_sweep_says_whether_the_best_is_distinguishable() -> None:
    def table(best: list[float], runner: list[float]) -> pd.DataFrame:
        rows = [
            {
                "policy": "tlt",
                "tlt.threshold": t,
                "seed": s,
                "key": f"{t}-{s}",
                "speedup_vs_nospec": v,
            }  # fmt: skip
            for t, values in ((16, best), (32, runner))
            for s, v in enumerate(values)
        ]
        return pd.DataFrame(rows)

    spec = SweepSpec(trace="t.json", seeds=(0, 1, 2))
    apart = sweep_summary(table([1.9, 2.0, 2.1], [1.5, 1.6, 1.7]), spec)
    assert apart["best"]["tlt.threshold"] == 16 and apart["runner_up"]["tlt.threshold"] == 32
    assert apart["speedup_interval_over_seeds"] == {"best": [1.9, 2.1], "runner_up": [1.5, 1.7]}
    assert apart["is_best_distinguishable"] is True
    overlap = sweep_summary(table([1.6, 2.0, 2.1], [1.5, 1.6, 1.8]), spec)
    assert overlap["best"]["tlt.threshold"] == 16 and overlap["is_best_distinguishable"] is False
    one_seed = sweep_summary(table([2.0], [1.5]), SweepSpec(trace="t.json"))
    assert one_seed["is_best_distinguishable"] is None


def test_the_ideal_bound_holds_on_a_measured_profile_with_noise(tmp_path, capsys):
    """The shipped H200 profile's batch-1 decode is cheaper at 2,048 than at 512 context
    (noise): without the monotone envelope the 'lower bound' of a one-response step exceeded
    its simulated rollout. Every simulation of a replay shares one ProfileCost, so its
    extrapolation and envelope lines are printed."""
    trace, out = tmp_path / "one.json", tmp_path / "r"
    profile = Path(__file__).resolve().parents[1] / "profiles" / "h200_qwen2.5-1.5b_random.csv"
    main(["gen", "--num-steps", "4", "--prompts-per-step", "1", "--group-size", "1",
          "--median-prompt-tokens", "500", "--prompt-tokens-sigma", "0.01",
          "--median-response-tokens", "1200", "--difficulty-sigma", "0.1", "--seed", "2",
          "--out", str(trace)])  # fmt: skip
    argv = ["replay", str(trace), "--model", "Qwen2.5-1.5B", "--hardware", "H200",
            "--num-gpus", "1", "--profile", str(profile), "--policy", "nospec,static",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert captured.err.count("warning: profile ") >= 4  # once per op and axis left
    steps = pd.read_csv(out / "steps.csv")
    assert (steps.rollout_s >= steps.ideal_rollout_s * (1 - 1e-9)).all(), steps
    summary = json.loads((out / "summary.json").read_text())
    assert all(row["rollout_over_ideal"] >= 1 - 1e-9 for row in summary["policies"])
    # summary.csv: a row's ratio is its rollout over its bound columns, one bound for all
    table = pd.read_csv(out / "summary.csv")
    assert table.mean_ideal_rollout_s.nunique() == 1
    ratio = table.mean_rollout_s / table.mean_ideal_rollout_s
    assert ratio.to_numpy() == pytest.approx(table.rollout_over_ideal.to_numpy())
    assert "profile: op decode/verify: 4 of 24 measured points raised" in printed
    assert "profile: decode: context tokens per sequence requested in" in printed


def test_without_nospec_there_is_no_interval_and_a_warning_says_so(tmp_path, capsys):
    """config.json described an interval that was never computed, and nothing was said."""
    save_trace(long_tail_trace(), tmp_path / "t.json")
    argv = ["replay", str(tmp_path / "t.json"), "--num-gpus", "2", "--policy", "tlt"]
    assert main([*argv, "--num-seeds", "2", "--out", str(tmp_path / "r")]) == 0
    assert "no interval is computed" in capsys.readouterr().err
    assert json.loads((tmp_path / "r" / "config.json").read_text())["speedup_interval"] is None
    assert main([*argv, "--out", str(tmp_path / "q")]) == 0  # nothing asked: nothing said
    assert "interval" not in capsys.readouterr().err


def test_tltbase_takes_tlt_arms_as_train_does_unless_tlt_runs_beside_it(tmp_path):
    """replay --policy tltbase --tlt-strategies 4_1_4 drafted 6_1_6 (tltrun train's tltbase
    drafts 4_1_4)."""
    save_trace(long_tail_trace(), tmp_path / "t.json")
    argv = ["replay", str(tmp_path / "t.json"), "--num-gpus", "2", "--cost-error", "0"]
    argv += ["--tlt-strategies", "4_1_4", "--tlt-bucket-starts", "1", "--tlt-threshold", "8"]

    def used(policies: str) -> dict:
        out = tmp_path / policies.replace(",", "-")
        assert main([*argv, "--policy", policies, "--out", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        return {p["policy"]: p["strategies_used"] for p in summary["policies"]}

    assert used("tltbase") == {"tltbase": ["history:4_1_4"]}
    assert used("tlt,tltbase") == {"tlt": ["4_1_4"], "tltbase": ["history:6_1_6"]}
    # arms the policy cannot take are one line before anything is written (an internal error)
    bad = ["replay", str(tmp_path / "t.json"), "--policy", "nospec,tltbase", "--out"]
    assert main([*bad, str(tmp_path / "bad"), "--tlt-bucket-starts", "1,4,8,16"]) == 2
    assert not (tmp_path / "bad").exists()


def test_the_progress_bar_weighs_exact_mode(monkeypatch):
    """An --exact replay of 10k responses ran 51 s with no bar (the threshold counted
    responses as the fast mode's)."""
    import sys

    from tltsim.sim import replay as replay_module

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    trace = long_tail_trace()  # 64 responses
    sims = 50_000 // trace.num_responses // 60 + 1  # under the threshold fast, over it exact
    assert replay_module.is_progress_quiet(trace, sims, SimConfig())
    assert not replay_module.is_progress_quiet(trace, sims, SimConfig(exact=True))
    # a cluster-wide history index runs the history drafter's iterations one event each too
    # (hunt: a 37 s replay showed no bar)
    from tltsim.sim.history_acceptance import HistoryModel

    assert replay_module.is_progress_quiet(trace, sims, SimConfig(), HistoryModel())
    assert not replay_module.is_progress_quiet(
        trace, sims, SimConfig(), HistoryModel(scope="cluster")
    )


def test_each_interval_simulation_runs_once(point):
    """NoSpec's other seeds were simulated twice (once for the baseline, once as a policy):
    the extra runs are exactly what IntervalSpec counts, which the progress bar's total uses."""
    trace, base, results = point
    calls = []

    def simulate(name, seed, drafter, history):
        calls.append((name, seed))
        return results[name]

    spec = IntervalSpec(seeds=(0, 1, 2))
    speedup_intervals(("nospec", "tlt"), spec, DRAFTER, results, simulate)
    assert sorted(calls) == [("nospec", 1), ("nospec", 2), ("tlt", 1), ("tlt", 2)]
    assert len(calls) == (len(spec.seeds) - 1) + spec.num_extra_runs_per_policy
