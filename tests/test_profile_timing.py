"""How ``tltrun profile`` times a point (``tltrun.profile.timing``): warm-up and reset around
timed calls, interleaved rounds, hooks between series and rounds, time budgets and Ctrl-C, and
each row's statistic within its percentiles.

Run: .venv/bin/python -m pytest tests/test_profile_timing.py -q
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tltrun.profile.timing import Interruption, Measure, Series


@given(
    st.lists(st.floats(1e-6, 10.0), min_size=1, max_size=30),
    st.sampled_from(["median", "mean"]),
)
@settings(max_examples=200, deadline=None)
def test_row_statistic_within_percentiles(samples, statistic):
    row = Measure(0, len(samples), statistic).row("decode", 1, 8, 1, samples)
    assert 0 < row.seconds_p10 <= row.seconds <= row.seconds_p90
    if statistic == "median":
        assert row.seconds == pytest.approx(float(np.median(samples)))


@pytest.mark.parametrize("statistic", ["median", "mean"])
def test_draft_steps_times_drafter_plus_verify_is_the_iterations_statistic(statistic):
    """The verify row took the median draft step from each sample whatever --statistic was:
    with mean (README's advice for a shared machine) and right-skewed samples the profile's
    SD iteration came out 10% above the measured one."""
    from tltrun.profile.torch_engine import point_rows
    from tltsim.policy import SpecDecision

    d = SpecDecision.parse("6_1_6")
    draft = np.array([6.0, 6.1, 6.2, 6.0, 12.0]) * 1e-3  # one slow spell (another job)
    it = np.array([10.0, 10.1, 10.2, 10.0, 16.0]) * 1e-3
    timed = {("decode", 1, 128): it / 2, ("draft", 1, 128, d): draft,
             ("iteration", 1, 128, d): it, ("switch", 1, 128): it}  # fmt: skip
    measure = Measure(0, 5, statistic)
    rows = {r.op: r for r in point_rows(1, 128, [d], timed, measure.row)}
    modelled = d.draft_steps * rows["drafter"].seconds + rows["verify"].seconds
    assert modelled == pytest.approx(measure.row("x", 1, 128, 1, it).seconds, rel=1e-12)


def test_measure_times_after_warmup_and_resets():
    calls, resets = [], []
    samples = Measure(2, 3, "median").samples(lambda: calls.append(1), lambda: resets.append(1))
    assert len(samples) == 3 and len(calls) == 5 and len(resets) == 5
    assert (samples >= 0).all()


def test_back_to_back_samples_are_the_mean_of_consecutive_calls(monkeypatch):
    """num_calls > 1: each round times that many calls in a row (reset after each, untimed)
    after the warm-up, and the sample is their mean."""
    import tltrun.profile.timing as profile

    now, events = [0.0], []

    def fn():  # the k-th call of the whole run takes k seconds on the fake clock
        events.append("call")
        now[0] += events.count("call")

    def reset():
        events.append("reset")
        now[0] += 1000.0  # untimed: must not reach a sample

    monkeypatch.setitem(profile.CLOCKS, "wall", lambda: now[0])
    series = profile.Series(("x",), fn, reset, num_calls=3)
    samples = Measure(1, 2, "mean").interleaved([series])[("x",)]
    # round 1: warm-up call 1, timed calls 2, 3, 4; round 2: warm-up 5, timed 6, 7, 8
    assert samples.tolist() == [3.0, 7.0]
    assert events == ["call", "reset"] * 8


def test_ops_warmed_once_get_one_warm_up_where_another_op_ran_before():
    """Series not warmed each round (the training ops) get one untimed call in later rounds
    where they open the round or follow another op; others of the same op none; a lone series
    (Measure.samples) runs back to back."""
    calls = dict.fromkeys(["a1", "a2", "b1", "b2"], 0)

    def count(name):
        def fn():
            calls[name] += 1

        return fn

    series = [Series((n[0], n), count(n), is_warmed_each_round=False) for n in calls]
    Measure(2, 3, "median").interleaved(series)
    # round 1: 2 warm-ups + 1 timed each; rounds 2, 3: the first of each op 1 + 1, the rest 1
    assert calls == {"a1": 7, "a2": 5, "b1": 7, "b2": 5}
    alone = [0]
    Measure(2, 3, "median").samples(lambda: alone.__setitem__(0, alone[0] + 1))
    assert alone == [5]


def test_hooks_run_between_series_and_rounds_untimed(monkeypatch):
    """A benchmark's measured run goes between the profile's series (fine) or rounds (coarse);
    neither reaches a sample."""
    import tltrun.profile.timing as profile

    now, events = [0.0], []

    def tick():
        now[0] += 1.0

    monkeypatch.setitem(profile.CLOCKS, "wall", lambda: now[0])
    series = [profile.Series((k,), tick, num_calls=1) for k in "ab"]

    def after_series(r, i, n):
        events.append(("series", r, i, n))
        now[0] += 100.0

    def after_round(r):
        events.append(("round", r))
        now[0] += 1000.0

    timed = Measure(0, 2, "mean").interleaved(
        series, between_rounds=after_round, between_series=after_series
    )
    assert timed[("a",)].tolist() == timed[("b",)].tolist() == [1.0, 1.0]
    assert events == [
        ("series", 0, 0, 2),
        ("series", 0, 1, 2),
        ("round", 0),
        ("series", 1, 0, 2),
        ("series", 1, 1, 2),
        ("round", 1),
    ]


def test_a_deadline_ends_the_rounds_but_keeps_the_completed_ones():
    """A profile under a time limit: no round starts after the deadline, and every series keeps
    the rounds it completed (at least the first), so the profile is written with fewer samples
    rather than killed with none."""
    calls = []
    series = [Series((k,), lambda k=k: calls.append(k), num_calls=1) for k in "ab"]
    passed = Measure(0, 5, "mean", deadline=time.perf_counter() - 1.0)  # already past
    timed = passed.interleaved(series)
    assert [len(v) for v in timed.values()] == [1, 1] and calls == ["a", "b"]
    far = Measure(0, 5, "mean", deadline=time.perf_counter() + 3600.0)
    assert [len(v) for v in far.interleaved(series).values()] == [5, 5]


def test_ctrl_c_after_a_complete_round_keeps_the_completed_rounds():
    """Ctrl-C ends the rounds; with an ``Interruption`` to report to, the completed rounds'
    samples come back (the interrupted round's dropped); without one, or before the first round
    ended, it propagates."""

    def ctrl_c_in_round(n: int):
        count = [0]

        def fn():
            count[0] += 1
            if count[0] == n:
                raise KeyboardInterrupt

        return fn

    series = [Series(("a",), lambda: None), Series(("b",), ctrl_c_in_round(3))]
    interruption = Interruption()
    timed = Measure(0, 5, "mean", interruption=interruption).interleaved(series)
    assert interruption.is_set and [len(v) for v in timed.values()] == [2, 2]
    with pytest.raises(KeyboardInterrupt):  # nobody to report to
        Measure(0, 5, "mean").interleaved([Series(("b",), ctrl_c_in_round(3))])
    with pytest.raises(KeyboardInterrupt):  # no round complete
        Measure(0, 5, "mean", interruption=Interruption()).interleaved(
            [Series(("b",), ctrl_c_in_round(1))]
        )
