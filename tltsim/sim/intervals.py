"""Speedup intervals of a replay: how far each policy's speedup vs NoSpec moves under other
seeds, another acceptance model and the cost model's calibration error.

    spec = IntervalSpec(seeds=(0, 1, 2), accept=accept_band(drafter, "0.9,1.1"), cost_error=0.1)
    intervals = speedup_intervals(trace, names, base_settings, spec, results)  # results: seed 0's
    intervals["tlt"].low, intervals["tlt"].high, intervals["tlt"].by_source["seeds"]

Three sources, each included only when asked for (``IntervalSpec.sources``):

* ``seeds``: the trace replayed under each seed (accept-length draws, random placement, TLT's
  bandit); each policy's speedup is taken against NoSpec at the same seed.
* ``accept_rate``: the whole replay again with the drafter's accept rates at the low and at the
  high end of a band (``accept_band``: factors on the rates, or a ``tltsim fit`` file's rates
  -/+ 1.96 standard errors). The history drafter's ``HistoryModel`` moves with EAGLE's rates:
  the same factors on its per-token match rate, or its fitted logits -/+ 1.96 standard errors
  when the fit file holds them (else it is held at its nominal value, and the band says so).
* ``cost_error``: SD iteration seconds x (1 -/+ e) against plain decoding, applied to every run
  above with its schedule held fixed: a step's rollout becomes max over instances of (finish
  + (f - 1) x SD seconds), with no extra simulation. Holding the schedule fixed is exact for
  StaticSpec within a step; an adaptive policy would shift work away from SD when it costs more,
  so for TLT the low end is conservative.

The interval is the minimum and maximum (not a percentile band: a handful of seeds has no
meaningful tails) of the speedup over every seed x acceptance end x cost end; it always contains
the point estimate, which is the first seed's nominal run (the replay's own results).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tltsim.errors import UsageError
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import MAX_SEED, MAX_SIMULATIONS
from tltsim.sim.history_acceptance import HistoryModel
from tltsim.sim.metrics import SimResult

# 0.1: the measured fidelity runs (README "Fidelity") put a profiled cost model's per-step time
# error at p90 2.2-9.7% (torch and vLLM, NoSpec and TLT) and its SD speedup error at 1.4-3.9%;
# 10% covers the worst p90. A roofline preset never checked against its GPU is further off:
# give it a larger band.
DEFAULT_COST_ERROR = 0.1
# Two-sided 95% normal quantile: a fitted rate -/+ Z_95 standard errors.
Z_95 = 1.959963984540054
ACCEPT_RATE_FIELDS = ("max_accept_rate", "initial_accept_rate", "stale_accept_rate")
HISTORY_LOGIT_FIELDS = ("base_logit", "finished_logit", "history_logit")
SOURCES = ("seeds", "accept_rate", "cost_error")


@dataclass(frozen=True, kw_only=True)
class AcceptBand:
    """The drafter dynamics at the low and the high end of the acceptance model's uncertainty."""

    low: DrafterDynamics
    high: DrafterDynamics
    description: str  # what the band is, for the summary ("x0.9-x1.1", "fit +/- 1.96 se")
    # the history drafter's model at the two ends; None: held at the replay's own
    history_low: HistoryModel | None = None
    history_high: HistoryModel | None = None


@dataclass(frozen=True, kw_only=True)
class IntervalSpec:
    """What a replay's speedup interval includes (``ReplayConfig``'s interval flags)."""

    seeds: tuple[int, ...]  # the first is the point estimate's seed
    accept: AcceptBand | None = None
    cost_error: float = 0.0  # relative error of SD iteration seconds; 0: not included

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds}")
        if not 0.0 <= self.cost_error < 1.0:
            raise ValueError(f"cost_error must be in [0, 1), got {self.cost_error}")

    @property
    def sources(self) -> tuple[str, ...]:
        used = (len(self.seeds) > 1, self.accept is not None, self.cost_error > 0)
        return tuple(s for s, is_used in zip(SOURCES, used, strict=True) if is_used)

    @property
    def num_extra_runs_per_policy(self) -> int:
        """Simulations beyond the point estimate's, per speculating policy."""
        return len(self.seeds) * (3 if self.accept else 1) - 1


@dataclass(frozen=True, kw_only=True)
class SpeedupInterval:
    """One policy's speedup vs NoSpec: the point estimate, the interval, and the interval each
    source alone gives (the others at their nominal values)."""

    speedup: float
    low: float
    high: float
    by_source: dict[str, tuple[float, float]] = field(default_factory=dict)


def scaled_dynamics(dynamics: DrafterDynamics, factor: float) -> DrafterDynamics:
    """``dynamics`` with every accept rate x ``factor``, capped at 1 (scaling keeps the rates'
    order, so the result is valid whenever ``dynamics`` is)."""
    return dataclasses.replace(
        dynamics,
        **{name: min(1.0, getattr(dynamics, name) * factor) for name in ACCEPT_RATE_FIELDS},
    )


def _fit_band(dynamics: DrafterDynamics, path: Path, history: HistoryModel | None) -> AcceptBand:
    """Rates of a ``tltsim fit --out`` file -/+ Z_95 standard errors, clipped to [0, 1] and to
    stale <= max, initial <= max; ``history``'s logits -/+ Z_95 of the file's history standard
    errors, if it has them."""
    try:
        obj = json.loads(path.read_text())
        stderr = obj["fit"]["stderr"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{path}: no fitted standard errors to read ({err})") from None
    ses = {
        n: float(stderr[n])
        for n in ACCEPT_RATE_FIELDS
        if isinstance(stderr.get(n), (int, float)) and math.isfinite(stderr[n])
    }
    if not ses:
        raise UsageError(
            f"{path}: fit.stderr has no finite standard error of {', '.join(ACCEPT_RATE_FIELDS)}"
        )

    def end(sign: float) -> DrafterDynamics:
        rates = {
            n: min(1.0, max(0.0, getattr(dynamics, n) + sign * Z_95 * ses.get(n, 0.0)))
            for n in ACCEPT_RATE_FIELDS
        }
        top = rates["max_accept_rate"]
        rates["stale_accept_rate"] = min(rates["stale_accept_rate"], top)
        rates["initial_accept_rate"] = min(rates["initial_accept_rate"], top)
        return dataclasses.replace(dynamics, **rates)

    history_ses = _history_stderr(obj) if history is not None else {}
    description = f"fit +/- {Z_95:.2f} se"
    held = [n for n in ACCEPT_RATE_FIELDS if n not in ses]
    if held:  # an undetermined rate (infinite standard error) stays at its fitted value
        description += f" ({', '.join(held)} held: no finite standard error)"
    if history is None or not history_ses:
        if history is not None:
            description += " (history drafter held: the fit has no history standard errors)"
        return AcceptBand(low=end(-1.0), high=end(1.0), description=description)

    def history_end(sign: float) -> HistoryModel:
        shifted = {n: getattr(history, n) + sign * Z_95 * se for n, se in history_ses.items()}
        return dataclasses.replace(history, **shifted)

    return AcceptBand(
        low=end(-1.0),
        high=end(1.0),
        description=description,
        history_low=history_end(-1.0),
        history_high=history_end(1.0),
    )


def _history_stderr(obj: dict) -> dict[str, float]:
    """The finite standard errors of the history model's logits in a ``tltsim fit --out``
    document ({} if it has none)."""
    entry = obj.get("history") if type(obj) is dict else None
    stderr = entry.get("stderr") if type(entry) is dict else None
    if type(stderr) is not dict:
        return {}
    return {
        n: float(stderr[n])
        for n in HISTORY_LOGIT_FIELDS
        if isinstance(stderr.get(n), (int, float)) and math.isfinite(stderr[n])
    }


def accept_band(
    dynamics: DrafterDynamics,
    spec: str | None,
    fit_path: Path | None = None,
    history: HistoryModel | None = None,
) -> AcceptBand | None:
    """The band of ``--accept-rate-range``: None (not included), ``LOW,HIGH`` (factors on every
    accept rate, e.g. ``0.9,1.1``) or ``fit`` (the ``--drafter-dynamics`` file's standard
    errors around ``dynamics``). ``history``: the replay's history-drafter model, moved with
    the band (module docstring); None: not moved."""
    if spec is None:
        return None
    if spec.strip() == "fit":
        if fit_path is None:
            raise UsageError("--accept-rate-range fit needs --drafter-dynamics FILE (tltsim fit)")
        return _fit_band(dynamics, fit_path, history)
    low, high = parse_range(spec)
    return AcceptBand(
        low=scaled_dynamics(dynamics, low),
        high=scaled_dynamics(dynamics, high),
        description=f"x{low:g}-x{high:g}",
        history_low=_scaled_history(history, low),
        history_high=_scaled_history(history, high),
    )


def _scaled_history(history: HistoryModel | None, factor: float) -> HistoryModel | None:
    if history is None:
        return None
    return dataclasses.replace(history, rate_factor=history.rate_factor * factor)


def parse_range(spec: str) -> tuple[float, float]:
    """``LOW,HIGH`` positive factors with LOW <= 1 <= HIGH (ValueError otherwise)."""
    parts = spec.split(",")
    try:
        low, high = (float(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"accept_rate_range: expected LOW,HIGH (e.g. 0.9,1.1) or 'fit', got {spec!r}"
        ) from None
    if not 0 < low <= 1 <= high < math.inf:
        raise ValueError(f"accept_rate_range: need 0 < LOW <= 1 <= HIGH, finite, got {spec!r}")
    return low, high


def parse_seeds(spec: str | None, num_seeds: int, first: int) -> tuple[int, ...]:
    """``--seeds 0,1,2`` as given, else ``--num-seeds N`` seeds from ``first`` (``--seed``);
    each in [0, MAX_SEED], at most MAX_SIMULATIONS of them."""
    if spec is None:
        if not 1 <= num_seeds <= MAX_SIMULATIONS:
            raise ValueError(f"num_seeds: expected 1 to {MAX_SIMULATIONS}, got {num_seeds}")
        if first + num_seeds - 1 > MAX_SEED:
            raise ValueError(
                f"seed {first} + num_seeds {num_seeds}: seeds go past the largest, {MAX_SEED}"
            )
        return tuple(range(first, first + num_seeds))
    try:
        seeds = tuple(int(s) for s in spec.split(","))  # (an empty item is refused: 0,,1)
    except ValueError:
        raise ValueError(f"seeds: expected comma-separated integers, got {spec!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or len(seeds) > MAX_SIMULATIONS:
        raise ValueError(f"seeds: expected 1 to {MAX_SIMULATIONS} distinct integers, got {spec!r}")
    bad = [s for s in seeds if not 0 <= s <= MAX_SEED]
    if bad:
        raise ValueError(f"seeds: {bad[0]} is not in [0, {MAX_SEED}]")
    return seeds


def mean_step_s_scaled(result: SimResult, sd_factor: float) -> float:
    """Mean step seconds of ``result`` with SD iteration seconds x ``sd_factor``, the schedule
    held fixed: each step's rollout is max over instances of finish + (f - 1) x SD seconds."""
    if not result.steps:
        return 0.0
    if sd_factor == 1.0:  # exactly the summary's figure (the point estimate)
        return sum(rec.step_s for rec in result.steps) / len(result.steps)
    frame = result.instances_frame()
    rollout = {rec.step: rec.rollout_s for rec in result.steps}
    finish = frame.step.map(rollout) - frame.idle_s - frame.spot_train_s
    scaled = (finish + (sd_factor - 1.0) * frame.sd_s).groupby(frame.step).max()
    total = sum(
        float(scaled.get(rec.step, rec.rollout_s)) + rec.checkpoint_s + rec.train_s
        for rec in result.steps
    )
    return total / len(result.steps)


# One simulation: (settings name, seed, drafter dynamics, history model or None for the
# replay's own) -> its result.
Simulate = Callable[[str, int, DrafterDynamics, HistoryModel | None], SimResult]


def speedup_intervals(
    names: Sequence[str],
    spec: IntervalSpec,
    drafter: DrafterDynamics,
    point: dict[str, SimResult],
    simulate: Simulate,
) -> dict[str, SpeedupInterval]:
    """Each policy's ``SpeedupInterval`` vs NoSpec ({} when NoSpec is not among ``names``).

    ``point`` holds the replay's own results (seed ``spec.seeds[0]``, ``drafter``); every other
    (policy, seed, acceptance end) is run through ``simulate``. NoSpec never speculates, so it
    runs once per seed and its own interval is 1x."""
    if "nospec" not in names:
        return {}
    ends: dict[str, tuple[DrafterDynamics, HistoryModel | None]] = {"nominal": (drafter, None)}
    if spec.accept is not None:
        ends |= {
            "low": (spec.accept.low, spec.accept.history_low),
            "high": (spec.accept.high, spec.accept.history_high),
        }
    factors = {"nominal": 1.0}
    if spec.cost_error > 0:
        factors |= {"low": 1.0 + spec.cost_error, "high": 1.0 - spec.cost_error}
    first = spec.seeds[0]

    def run(name: str, seed: int, end: str) -> SimResult:
        if seed == first and end == "nominal":
            return point[name]
        return simulate(name, seed, *ends[end])

    nospec = {seed: run("nospec", seed, "nominal") for seed in spec.seeds}  # each run once
    base = {seed: result.summary()["mean_step_s"] for seed, result in nospec.items()}
    out = {}
    for name in names:
        # speedup[(seed, acceptance end, cost end)]
        speedup: dict[tuple[int, str, str], float] = {}
        for seed in spec.seeds:
            for end in ends if name != "nospec" else ("nominal",):
                result = nospec[seed] if name == "nospec" else run(name, seed, end)
                for cost_end, f in factors.items():
                    step = mean_step_s_scaled(result, f if name != "nospec" else 1.0)
                    speedup[(seed, end, cost_end)] = base[seed] / step if step > 0 else 0.0
        values = np.array(list(speedup.values()))
        nominal = speedup[(first, "nominal", "nominal")]
        by_source = {
            "seeds": _band(speedup, lambda s, e, c: e == "nominal" and c == "nominal"),
            "accept_rate": _band(speedup, lambda s, e, c: s == first and c == "nominal"),
            "cost_error": _band(speedup, lambda s, e, c: s == first and e == "nominal"),
        }
        out[name] = SpeedupInterval(
            speedup=nominal,
            low=float(values.min()),
            high=float(values.max()),
            by_source={k: v for k, v in by_source.items() if k in spec.sources},
        )
    return out


def _band(
    speedup: dict[tuple[int, str, str], float], keep: Callable[[int, str, str], bool]
) -> tuple[float, float]:
    """Min and max of the speedups whose (seed, acceptance end, cost end) ``keep`` accepts."""
    picked = [v for k, v in speedup.items() if keep(*k)]
    return (min(picked), max(picked))


def describe(spec: IntervalSpec) -> dict[str, Any]:
    """The summary's record of what an interval includes."""
    return {
        "kind": "min-max",
        "sources": list(spec.sources),
        "seeds": list(spec.seeds),
        "accept_rate_range": spec.accept.description if spec.accept else None,
        "cost_error": spec.cost_error,
    }


def described_sources(described: dict[str, Any] | None) -> list[str]:
    """``describe``'s record in words ("seeds 0,1,2", "SD iteration cost +/-10%"), as the
    replay's text and its figure say it."""
    sources = described["sources"] if described else []
    parts = []
    if "seeds" in sources:
        parts.append(f"seeds {','.join(map(str, described['seeds']))}")
    if "accept_rate" in sources:
        parts.append(f"accept rates {described['accept_rate_range']}")
    if "cost_error" in sources:
        parts.append(f"SD iteration cost +/-{100 * described['cost_error']:g}%")
    return parts
