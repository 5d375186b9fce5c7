"""Published SD-vs-batch series (tltsim.cost.published_sd) and benchmarks/sd_batch_validation.py's
like-for-like comparison: the series load and parse, accept rates round-trip, rows compute."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from tltsim.cost.calibrated import CALIBRATIONS
from tltsim.cost.published_sd import SD_BATCH_SERIES, SDBatchSeries
from tltsim.cost.roofline import crossover_batch
from tltsim.cost.specs import get_hardware, get_model
from tltsim.policy import SpecDecision
from tltsim.sim.acceptance import expected_accept_len

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "sd_batch_validation.py"
_SPEC = importlib.util.spec_from_file_location("sd_batch_validation", _PATH)
sdv = importlib.util.module_from_spec(_SPEC)
sys.modules["sd_batch_validation"] = sdv
_SPEC.loader.exec_module(sdv)

PARAMS = CALIBRATIONS["H100-SXM"]


def test_every_series_loads_with_a_source_known_presets_and_a_parsable_strategy():
    assert len(SD_BATCH_SERIES) >= 10
    assert len({s.name for s in SD_BATCH_SERIES}) == len(SD_BATCH_SERIES)
    for s in SD_BATCH_SERIES:
        assert len(s.source) > 20 and "arXiv" in s.source, s.name
        get_hardware(s.hardware)
        get_model(s.model)
        decision = SpecDecision.parse(s.strategy)
        assert decision.enabled and decision.draft_steps == 3, s.name  # all published: depth 3
        if "chain" in s.published_strategy:
            assert decision.is_chain and decision.verify_tokens == decision.draft_steps
        assert len(s.batches) == len(s.speedups) and all(v > 0 for v in s.speedups)
    # The two printed accept lengths (SpecDecode-Bench Fig. 2 text) sit on their series.
    printed = {s.strategy: s.accept_len for s in SD_BATCH_SERIES if s.accept_len is not None}
    assert set(printed) == {"3_1_3", "3_4_21"}


def test_a_series_rejects_a_bad_strategy_or_mismatched_lengths():
    base = SD_BATCH_SERIES[0]
    with pytest.raises(ValueError, match="strategy"):
        dataclasses.replace(base, strategy="chain3")
    with pytest.raises(ValueError, match="one speedup per batch"):
        dataclasses.replace(base, speedups=base.speedups[:-1])
    with pytest.raises(ValueError, match="increase"):
        dataclasses.replace(base, batches=tuple(reversed(base.batches)))


@pytest.mark.parametrize("strategy", ["3_1_3", "3_2_6", "3_4_21", "8_4_32"])
@pytest.mark.parametrize("rate", [0.1, 0.45, 0.8, 0.97])
def test_accept_rate_for_len_round_trips(strategy, rate):
    decision = SpecDecision.parse(strategy)
    length = expected_accept_len(decision, rate)
    solved = sdv.accept_rate_for_len(decision, length)
    assert expected_accept_len(decision, solved) == pytest.approx(length, abs=1e-9)
    if decision.is_chain:  # monotone: the rate itself comes back
        assert solved == pytest.approx(rate, abs=1e-9)


def test_accept_rate_for_len_rejects_unreachable_lengths():
    chain = SpecDecision.parse("3_1_3")
    with pytest.raises(ValueError):
        sdv.accept_rate_for_len(chain, 4.5)  # at most 3 drafts + the bonus token
    with pytest.raises(ValueError):
        sdv.accept_rate_for_len(SpecDecision.parse("3_4_21"), 1.5)  # siblings alone give ~2


def test_measured_stop_and_bucket_rule():
    series = next(s for s in SD_BATCH_SERIES if s.name == "T3 EAGLE MT-Bench")
    first_losing = next(b for b, v in zip(series.batches, series.speedups, strict=True) if v < 1)
    last_paying = series.batches[series.batches.index(first_losing) - 1]
    assert sdv.measured_stop(series) == (last_paying, first_losing)
    paying = dataclasses.replace(series, speedups=tuple(v + 1 for v in series.speedups))
    assert sdv.measured_stop(paying) == (series.batches[-1], None)
    # (16, 64] spans buckets 16-31 .. 64-127; one more on each side: 8 .. 255
    assert [sdv.is_within_one_bucket(b, 16, 64) for b in (7, 8, 255, 256)] == [0, 1, 1, 0]
    assert not sdv.is_within_one_bucket(None, 16, 64)
    # "> 64": anything from the 32-63 bucket on, or never stopping
    assert [sdv.is_within_one_bucket(b, 64, None) for b in (31, 32, None)] == [0, 1, 1]


@pytest.mark.parametrize("name", ["F1 chain GSM8K", "F2 tree21 GSM8K"])
def test_like_for_like_rows_recompute_from_the_cost_models(name):
    series = next(s for s in SD_BATCH_SERIES if s.name == name)
    context = 1500.0
    rows, stop, errors = sdv.compare_series(series, PARAMS, context)
    assert [r["cost"] for r in rows] == ["published", "roofline", "calibrated"]
    decision = SpecDecision.parse(series.strategy)
    costs = sdv.series_costs(series, PARAMS)
    assert costs["calibrated"].drafter_spec.vocab_size == series.draft_vocab_size
    for row in rows[1:]:
        cost = costs[row["cost"]]
        assert expected_accept_len(decision, row["rate"]) == pytest.approx(row["accept"])
        for batch in series.batches:  # L x t_plain / t_sd, recomputed here
            c = batch * context
            expected = (
                row["accept"] * cost.decode_iter_s(batch, c) / cost.sd_iter_s(batch, c, decision)
            )
            assert row[f"b{batch}"] == pytest.approx(expected, rel=1e-12)
        if series.accept_len is None:  # fitted on the smallest batch: that cell matches
            assert row["from"] == f"fit b{series.batches[0]}"
            assert row[f"b{series.batches[0]}"] == pytest.approx(series.speedups[0], rel=1e-6)
        else:
            assert row["accept"] == series.accept_len
        simulated = crossover_batch(cost, decision, row["accept"], context, sdv.MAX_STOP_BATCH)
        assert stop[f"{row['cost']}_stop"] == ("none" if simulated is None else simulated)
        last_paying, first_losing = sdv.measured_stop(series)
        assert stop[f"{row['cost']}_within"] == sdv.is_within_one_bucket(
            simulated, last_paying, first_losing
        )
    num_predicted = len(series.batches) - (series.accept_len is None)
    assert len(errors) == 2 * num_predicted


def test_like_for_like_summary_counts_what_the_stops_say():
    series = tuple(s for s in SD_BATCH_SERIES if s.name.startswith("F2 tree21"))
    rows, stops, summary = sdv.like_for_like(PARAMS, 2048.0, series)
    assert len(rows) == 3 * len(series) and len(stops) == len(series)
    intervals = [sdv.measured_stop(s) for s in series]
    assert all(hi is not None for _, hi in intervals)  # every k=21 tree stops inside 1..128
    for cost in ("roofline", "calibrated"):
        s = summary[cost]
        assert s["num_series_within_one_bucket"] == sum(x[f"{cost}_within"] for x in stops)
        assert s["num_series_with_measured_stop"] == len(series)
        inside = sum(
            x[f"{cost}_stop"] != "none" and lo < x[f"{cost}_stop"] <= hi
            for x, (lo, hi) in zip(stops, intervals, strict=True)
        )
        assert s["num_of_those_inside_interval"] == inside
        # every batch but the fitted smallest one is a prediction, and that one too where the
        # fit was clipped (it does not match by construction then)
        clipped = {r["series"] for r in rows if r["cost"] == cost and "(clipped)" in r["from"]}
        assert clipped or cost == "calibrated"  # the roofline clips one of these fits
        assert s["num_predicted_points"] == sum(
            len(x.batches) - (x.accept_len is None and x.name not in clipped) for x in series
        )


def test_drafter_pairs_divide_the_weaker_drafters_speedups_by_the_strongers():
    """Only series differing in the drafter alone pair up (EAGLE-3 Table 3's two rows); each
    ratio is the two rows' speedups divided; both fitted at batch 2, the models agree there."""
    rows, _, _ = sdv.like_for_like(PARAMS, 2048.0)
    pairs = sdv.drafter_pairs(rows)
    assert [(p["pair"], p["cost"]) for p in pairs] == [
        ("EAGLE / EAGLE-3", c) for c in ("published", "roofline", "calibrated")
    ]
    weak, strong = (next(s for s in SD_BATCH_SERIES if s.name == f"T3 {d} MT-Bench")
                    for d in ("EAGLE", "EAGLE-3"))  # fmt: skip
    for b, w, st in zip(strong.batches, weak.speedups, strong.speedups, strict=True):
        assert pairs[0][f"b{b}"] == pytest.approx(w / st, rel=1e-12)
    for p in pairs[1:]:
        assert p["b2"] == pytest.approx(pairs[0]["b2"], rel=1e-5)
        row_w, row_s = (next(r for r in rows if r["series"] == s.name and r["cost"] == p["cost"])
                        for s in (weak, strong))  # fmt: skip
        assert p["b64"] == pytest.approx(row_w["b64"] / row_s["b64"], rel=1e-12)


def test_sd_batch_series_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        SDBatchSeries("x")  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SD_BATCH_SERIES[0].speedups = (1.0,)  # type: ignore[misc]
