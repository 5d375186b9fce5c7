"""Like-for-like check of simulated SD speedup vs batch size against published series (issue #21).

Used by ``benchmarks/bench_costmodel.py``. For every published series
(``tltsim.cost.published_sd.SD_BATCH_SERIES``: source, engine, GPU, target, drafter, strategy,
dataset, batch -> speedup) the simulator is set up as the series was run (the series' model
preset, its strategy in tltsim naming, its drafter's LM-head size) and its speedup

    accept_len x decode_iter_s(b, b x ctx) / sd_iter_s(b, b x ctx, strategy)

is computed at each published batch b under the roofline and the calibrated cost model. The only
free quantity is acceptance, one parameter per series and cost model:

* where the source prints an accept length, the per-token accept rate a solves
  ``expected_accept_len(strategy, a) = published`` (``tltsim.sim.acceptance``; trees at the
  default sibling rate);
* otherwise a is fitted so that the simulated speedup at the series' smallest batch equals the
  published one; that cell matches by construction and every other batch is a prediction. A fit
  that needs a rate outside [0, 1] is clipped and flagged.

Nothing else is tuned to the published speedups. Per series, the measured interval where SD
stops paying (last batch above 1x, first below) is compared with ``crossover_batch`` (the first
batch where SD's tokens/s falls below plain decoding's) in power-of-two buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tltsim.cost.calibrated import CalibratedCost, CalibrationParams
from tltsim.cost.published_sd import SD_BATCH_SERIES, SDBatchSeries
from tltsim.cost.roofline import CostModel, RooflineCost
from tltsim.cost.specs import DrafterSpec, get_hardware, get_model
from tltsim.policy import SpecDecision
from tltsim.sim.acceptance import DEFAULT_SIBLING_RATE, expected_accept_len

MAX_STOP_BATCH = 4096  # crossover_batch's search limit; None beyond it
# The rate grid the accept-rate solver brackets on before bisecting: a tree's expected accept
# length is not monotone in a near a = 0 (lower-ranked siblings lose mass as a grows), so the
# solver returns the smallest rate that reaches the length.
NUM_RATE_GRID = 1000


def accept_rate_for_len(
    decision: SpecDecision, accept_len: float, sibling_rate: float = DEFAULT_SIBLING_RATE
) -> float:
    """The smallest per-token accept rate a in [0, 1] with
    ``expected_accept_len(decision, a) == accept_len``; ValueError if no rate reaches it."""
    grid = np.linspace(0.0, 1.0, NUM_RATE_GRID + 1)
    lengths = [expected_accept_len(decision, float(a), sibling_rate) for a in grid]
    if accept_len <= lengths[0]:
        if math.isclose(accept_len, lengths[0]):
            return 0.0
        raise ValueError(
            f"{decision.strategy}: accept length {accept_len} < {lengths[0]:.3f} at a=0"
        )
    above = next((i for i, length in enumerate(lengths) if length >= accept_len), None)
    if above is None:
        raise ValueError(f"{decision.strategy}: accept length {accept_len} > {lengths[-1]:.3f}")
    lo, hi = float(grid[above - 1]), float(grid[above])
    for _ in range(60):  # bisection to double precision within the bracketing grid cell
        mid = (lo + hi) / 2
        if expected_accept_len(decision, mid, sibling_rate) < accept_len:
            lo = mid
        else:
            hi = mid
    return hi


def series_costs(series: SDBatchSeries, params: CalibrationParams) -> dict[str, CostModel]:
    """Roofline and calibrated cost of the series' model and GPU, with its drafter's LM head."""
    model, hardware = get_model(series.model), get_hardware(series.hardware)
    drafter = DrafterSpec(model, draft_vocab_size=series.draft_vocab_size)
    return {
        "roofline": RooflineCost(model, hardware, drafter=drafter),
        "calibrated": CalibratedCost(model, hardware, drafter=drafter, params=params),
    }


def simulated_speedup(
    cost: CostModel, decision: SpecDecision, accept_len: float, batch: int, context_per_seq: float
) -> float:
    """SD tokens/s over plain decoding's at ``batch`` sequences of ``context_per_seq`` tokens."""
    context = batch * context_per_seq
    return (
        accept_len
        * cost.decode_iter_s(batch, context, 1)
        / cost.sd_iter_s(batch, context, decision)
    )


@dataclass(frozen=True, kw_only=True)
class AcceptSetting:
    """How a series' acceptance was set for one cost model."""

    accept_rate: float
    accept_len: float
    origin: str  # "published" or "fit bN" (fitted on batch N's speedup)
    is_clipped: bool  # the fit needed a rate outside [0, 1]


def accept_setting(series: SDBatchSeries, cost: CostModel, context_per_seq: float) -> AcceptSetting:
    """From the published accept length if there is one, else fitted on the smallest batch."""
    decision = SpecDecision.parse(series.strategy)
    if series.accept_len is not None:
        rate = accept_rate_for_len(decision, series.accept_len)
        return AcceptSetting(
            accept_rate=rate, accept_len=series.accept_len, origin="published", is_clipped=False
        )
    batch = series.batches[0]
    # speedup = L x t_plain / t_sd, so the length that reproduces the published speedup is:
    needed = series.speedups[0] / simulated_speedup(cost, decision, 1.0, batch, context_per_seq)
    low, high = expected_accept_len(decision, 0.0), expected_accept_len(decision, 1.0)
    rate = accept_rate_for_len(decision, min(max(needed, low), high))
    return AcceptSetting(
        accept_rate=rate,
        accept_len=expected_accept_len(decision, rate),
        origin=f"fit b{batch}",
        is_clipped=not low <= needed <= high,
    )


def bucket(batch: int) -> int:
    """Power-of-two bucket: 1 -> 0, 2-3 -> 1, 4-7 -> 2, ..., 64-127 -> 6."""
    return batch.bit_length() - 1


def measured_stop(series: SDBatchSeries) -> tuple[int, int | None]:
    """(last batch still > 1x before the first below 1x, first batch below 1x or None)."""
    for i, (batch, speedup) in enumerate(zip(series.batches, series.speedups, strict=True)):
        if speedup < 1.0:
            return (series.batches[i - 1] if i else 0), batch
    return series.batches[-1], None


def describe_interval(last_paying: int, first_losing: int | None) -> str:
    return f"> {last_paying}" if first_losing is None else f"({last_paying}, {first_losing}]"


def is_within_one_bucket(stop: int | None, last_paying: int, first_losing: int | None) -> bool:
    """Whether a simulated stop batch (None: pays to MAX_STOP_BATCH) lies in the measured
    interval (last_paying, first_losing] widened by one power-of-two bucket on each side."""
    low = bucket(last_paying + 1) - 1
    if stop is None:
        return first_losing is None or bucket(MAX_STOP_BATCH) <= bucket(first_losing) + 1
    if first_losing is None:
        return bucket(stop) >= low
    return low <= bucket(stop) <= bucket(first_losing) + 1


def compare_series(
    series: SDBatchSeries, params: CalibrationParams, context_per_seq: float
) -> tuple[list[dict], dict, list[float]]:
    """Speedup rows (published, roofline, calibrated), the stop-batch comparison, and the
    relative errors of the predicted (not fitted) points."""
    decision = SpecDecision.parse(series.strategy)
    published = {f"b{b}": s for b, s in zip(series.batches, series.speedups, strict=True)}
    rows = [{"series": series.name, "cost": "published", "accept": series.accept_len, **published}]
    last_paying, first_losing = measured_stop(series)
    stop = {
        "series": series.name,
        "strategy": series.strategy,
        "measured_stop": describe_interval(last_paying, first_losing),
    }
    errors = []
    for name, cost in series_costs(series, params).items():
        setting = accept_setting(series, cost, context_per_seq)
        row = {
            "series": series.name,
            "cost": name,
            "from": setting.origin + (" (clipped)" if setting.is_clipped else ""),
            "rate": setting.accept_rate,
            "accept": setting.accept_len,
        }
        for i, batch in enumerate(series.batches):
            value = simulated_speedup(cost, decision, setting.accept_len, batch, context_per_seq)
            row[f"b{batch}"] = value
            # a fitted series' first point is matched by its fit, unless the fit was clipped
            # (then the point is a prediction like any other, and it missed: counted)
            if setting.origin == "published" or i > 0 or setting.is_clipped:
                errors.append((name, value / series.speedups[i] - 1.0))
        rows.append(row)
        sim_stop = cost.crossover_batch(
            decision, setting.accept_len, context_per_seq, max_batch=MAX_STOP_BATCH
        )
        stop[f"{name}_stop"] = "none" if sim_stop is None else sim_stop
        stop[f"{name}_within"] = is_within_one_bucket(sim_stop, last_paying, first_losing)
    return rows, stop, errors


def like_for_like(
    params: CalibrationParams,
    context_per_seq: float,
    series: tuple[SDBatchSeries, ...] = SD_BATCH_SERIES,
) -> tuple[list[dict], list[dict], dict]:
    """All series: speedup rows, stop comparisons, and a summary per cost model (series within
    one bucket, of all and of those whose measured stop lies inside the published batches, and
    how many of those the simulated stop hits without widening; median and max |error| of the
    predicted points)."""
    rows, stops, errors = [], [], []
    for s in series:
        r, stop, e = compare_series(s, params, context_per_seq)
        rows.extend(r)
        stops.append(stop)
        errors.extend(e)
    # The informative series are those whose measured stop lies inside the published batches
    # ("> max batch" is met by any simulated stop from the bucket below max on).
    bounded = [(i, measured_stop(s)) for i, s in enumerate(series) if measured_stop(s)[1]]
    summary = {}
    for name in ("roofline", "calibrated"):
        e = np.abs([err for cost, err in errors if cost == name])
        stops_in = [stops[i][f"{name}_stop"] for i, _ in bounded]
        summary[name] = {
            "num_series": len(stops),
            "num_series_within_one_bucket": sum(bool(s[f"{name}_within"]) for s in stops),
            "num_series_with_measured_stop": len(bounded),
            "num_of_those_within_one_bucket": sum(
                bool(stops[i][f"{name}_within"]) for i, _ in bounded
            ),
            "num_of_those_inside_interval": sum(
                stop != "none" and lo < stop <= hi
                for stop, (_, (lo, hi)) in zip(stops_in, bounded, strict=True)
            ),
            "num_predicted_points": len(e),
            "median_abs_error": float(np.median(e)),
            "max_abs_error": float(np.max(e)),
        }
    return rows, stops, summary


def drafter_pairs(
    rows: list[dict], series: tuple[SDBatchSeries, ...] = SD_BATCH_SERIES
) -> list[dict]:
    """Series that differ only in the drafter (same source, engine, target, strategy, dataset and
    batches): per cost row, the weaker drafter's speedup over the stronger one's at each batch.
    Each series' acceptance is one batch-independent number, so a simulated ratio moves with
    batch only through the drafters' cost difference (fc width, LM-head rows); a published ratio
    that moves further says how the engine's speedup depends on the drafter beyond step time."""

    def same_setup(s: SDBatchSeries) -> tuple:
        return (s.source, s.engine, s.target, s.strategy, s.dataset, s.batches)

    out = []
    by_setup: dict[tuple, list[SDBatchSeries]] = {}
    for s in series:
        by_setup.setdefault(same_setup(s), []).append(s)
    for group in by_setup.values():
        if len(group) != 2:
            continue
        strong, weak = sorted(group, key=lambda s: -s.speedups[0])
        for cost in ("published", "roofline", "calibrated"):
            a, b = (next(r for r in rows if r["series"] == s.name and r["cost"] == cost)
                    for s in (weak, strong))  # fmt: skip
            ratios = {f"b{n}": a[f"b{n}"] / b[f"b{n}"] for n in strong.batches}
            out.append({"pair": f"{weak.drafter} / {strong.drafter}", "cost": cost, **ratios})
    return out


def context_sensitivity(
    params: CalibrationParams, series_name: str, contexts: tuple[float, ...]
) -> list[dict]:
    """One series compared at several contexts per sequence (its acceptance set anew at each)."""
    series = next(s for s in SD_BATCH_SERIES if s.name == series_name)
    out = []
    for context in contexts:
        rows, stop, _ = compare_series(series, params, context)
        for row in rows[1:]:
            cost = row["cost"]
            out.append(
                {
                    "context_per_seq": context,
                    **row,
                    "stop": stop[f"{cost}_stop"],
                    "within": stop[f"{cost}_within"],
                }
            )
    return out


__all__ = [
    "AcceptSetting",
    "MAX_STOP_BATCH",
    "accept_rate_for_len",
    "accept_setting",
    "bucket",
    "compare_series",
    "context_sensitivity",
    "describe_interval",
    "drafter_pairs",
    "is_within_one_bucket",
    "like_for_like",
    "measured_stop",
    "series_costs",
    "simulated_speedup",
]
