"""``ProfileCost``: a ``CostModel`` that interpolates a measured profile (``tltsim.cost.profile``),
and the comparison of a profile with the roofline (issue #7).

    from tltsim.cost.profile import load_profile
    from tltsim.cost.measured import ProfileCost, compare_to_roofline, summarize_comparison
    cost = ProfileCost(load_profile("profiles/cpu_torch.csv"))
    cost.decode_iter_s(batch=8, context_tokens=8 * 700)
    cost.extrapolation_report()     # lines: which (op, axis) left the grid, how far, how often

Interpolation scheme (why it matches the physics)
-------------------------------------------------
Iteration ops (decode/verify, drafter) are interpolated over (tokens_per_seq, batch B, context
per sequence L = context_tokens / B): piecewise linear in L at each measured batch, then in B
between measured batches, then in tokens_per_seq. Within one roofline regime a forward pass
costs ``a + b*B + c*L + d*B*L`` (weights streamed once, per-token matmuls, KV reads of B*L
tokens), which this scheme reproduces exactly. Where the cost turns from memory- to
compute-bound inside a grid segment, the kink is rebuilt from the neighbouring segments
(``tltsim.cost.interp``: exact for a maximum of two affine pieces when the kink has a full segment on
either side; the chord, an over-charge, in an axis' first or last segment). Against a profile
generated from ``RooflineCost`` (benchmarks/bench_profilecost.py, default ``ProfileGrid``),
points away from the edge segments agree to within 0.5% (median 0.00%); anywhere in the grid
to within ~11%, where a kink falls in an edge segment.

Prefill and SD-switch re-prefill use (B, tokens per sequence T) the same way, but with chords
along T: attention grows as T^2 there, smoothly, and the kink rebuild would under-charge it.
On a doubling T grid that costs up to a few per cent, and up to ~16% at the memory/compute
transition of short prompts on some presets (median < 0.3%).

Rollout ops never get cheaper with a larger batch or a longer context: measured points that
noise made cheaper are raised to the most of the points with less work at the same width
(``monotone_envelope``), and each slice along context is made nondecreasing between its knots
too. ``extrapolation_report`` says how many points moved and by how much.

Training ops time one update of ``batch`` sequences: linear in sequences per update at each
measured sequence length, then linear in sequence length. A step's training of more sequences
than the largest measured update costs that many updates of the largest measured size
(training runs as fixed-size mini-batch updates, each paying its optimizer step): this is the
expected use, not an extrapolation, and raises no warning.

Outside the grid every axis extrapolates linearly from its last two points (not flat: flat
would under-charge long contexts and large batches); an upper extrapolation never decreases
and nothing goes below zero. Each (op, axis) that leaves the grid raises one
``ProfileExtrapolationWarning`` per ``ProfileCost`` and is counted in ``extrapolations``
(``extrapolation_report()`` gives the lines ``tltsim replay`` prints); an axis measured at one
value only is held constant, with the same warning.

``decode_span_s`` / ``sd_span_s`` (the simulator's hot path) sum the interpolant over many
iterations in closed form: at fixed batch the interpolant is an exact piecewise-linear function
of L (cached per batch and tokens_per_seq), and L grows linearly, so each linear piece
contributes an arithmetic series.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from tltsim.cost.interp import ZERO, Curve, maximum, nondecreasing
from tltsim.cost.profile import (
    OPS,
    REQUIRED_OPS,
    Profile,
    ProfileError,
    ProfileRow,
    load_profile,
)
from tltsim.cost.profile_tables import AXES, ENVELOPE_FIXED, profile_tables
from tltsim.cost.roofline import CostModel, crossover_batch, default_sd_iter_s
from tltsim.cost.specs import MODEL_PRESETS, ModelSpec
from tltsim.errors import UsageError
from tltsim.policy import SpecDecision


class ProfileExtrapolationWarning(UserWarning):
    """A cost was asked for outside the measured grid of a profile."""


_MAX_SLICES = 65536  # cached 1-D slices per ProfileCost (a few KB each)


# --- the cost model --------------------------------------------------------------------------


@dataclass
class Extrapolation:
    """How often one (op, axis) was asked for outside the grid, and how far."""

    op: str
    axis: str
    grid_lo: float
    grid_hi: float
    num_calls: int = 0
    min_requested: float = math.inf
    max_requested: float = -math.inf

    def line(self) -> str:
        how = (
            "held constant: one value measured"
            if self.grid_lo == self.grid_hi
            else "linear extrapolation"
        )
        return (
            f"{self.op}: {self.axis} requested in [{self.min_requested:g}, {self.max_requested:g}] "
            f"outside the measured [{self.grid_lo:g}, {self.grid_hi:g}] in {self.num_calls} calls ({how})"
        )


class ProfileCost:
    """``CostModel`` interpolating a measured ``Profile`` (scheme: module docstring). Ops the
    profile lacks come from ``fallback`` (e.g. a ``RooflineCost``); without one they are an
    error. ``is_warned=False`` still counts extrapolations but raises no warnings."""

    def __init__(self, profile: Profile, fallback: CostModel | None = None, is_warned: bool = True):
        self.profile = profile
        self.fallback = fallback
        self.is_warned = is_warned
        self._tables, self.monotone_lifts, self.batch_raises = profile_tables(profile)
        self.fallback_ops = tuple(op for op in REQUIRED_OPS if op not in profile.ops)
        if self.fallback_ops and fallback is None:
            raise ProfileError(
                f"{profile.source}: no rows for op {', '.join(self.fallback_ops)} (required: {', '.join(REQUIRED_OPS)}; or give a fallback cost model)"
            )
        self.extrapolations: dict[tuple[str, str], Extrapolation] = {}
        self._slices: dict[tuple, Curve] = {}
        # the profiled engine pads attention to the batch's longest context (tltsim.cost.profile):
        # older engines, and tltrun's torch engine with dense attention (sdpa, its CPU default);
        # with flex attention (its CUDA default, issue #18) its profiles say "summed"
        self.is_context_padded = profile.meta.get("attention_context") == "padded"

    # -- lookups with range bookkeeping --

    def _note(
        self, table: str, op: str, coords: tuple[float, ...], v_lo: float, v_hi: float
    ) -> None:
        axes = AXES[table]
        for level, value, lo, hi in self._tables[table].out_of_range(coords, v_lo, v_hi):
            axis = axes[level][0]
            rec = self.extrapolations.get((op, axis))
            if rec is None:
                rec = self.extrapolations[(op, axis)] = Extrapolation(op, axis, lo, hi)
                if self.is_warned:
                    how = (
                        "holding it constant (one value measured)"
                        if lo == hi
                        else "extrapolating linearly from the last two points"
                    )
                    warnings.warn(
                        f"profile {self.profile.source}: {op}: {axis} {value:g} is outside the measured range [{lo:g}, {hi:g}]; {how} (warned once per op and axis)",
                        ProfileExtrapolationWarning,
                        stacklevel=4,
                    )
            rec.num_calls += 1
            rec.min_requested = min(rec.min_requested, value)
            rec.max_requested = max(rec.max_requested, value)
            rec.grid_lo, rec.grid_hi = min(rec.grid_lo, lo), max(rec.grid_hi, hi)

    def _slice(self, table: str, coords: tuple[float, ...]) -> Curve:
        """The exact 1-D interpolant in the innermost coordinate, cached: the simulator asks
        again and again for the same (tokens_per_seq, batch)."""
        key = (table, *coords)
        curve = self._slices.get(key)
        if curve is None:
            if len(self._slices) >= _MAX_SLICES:
                self._slices.clear()
            curve = maximum(self._tables[table].slice(coords), ZERO)
            if table in ENVELOPE_FIXED:  # more context never takes less time, between knots too
                curve = nondecreasing(curve)
            self._slices[key] = curve
        return curve

    def _value(self, table: str, op: str, *coords: float) -> float:
        outer, v = tuple(coords[:-1]), coords[-1]
        self._note(table, op, outer, v, v)
        return self._slice(table, outer).value(v)

    def _span(
        self, table: str, op: str, coords: tuple[float, ...], v0: float, dv: float, n: int
    ) -> float:
        if n <= 0:
            return 0.0
        self._note(table, op, coords, v0, v0 + (n - 1) * dv)
        return self._slice(table, coords).span(v0, dv, n)

    def _has(self, op: str) -> bool:
        return op not in self.fallback_ops

    def extrapolation_report(self) -> list[str]:
        """One line per (op, axis) that left the grid, per table whose noise was lifted
        (``monotone_envelope``), and the ops taken from the fallback."""
        lines = [rec.line() for rec in self.extrapolations.values()]
        lines += [lift.line() for lift in (*self.monotone_lifts, *self.batch_raises)]
        if self.fallback_ops:
            lines.append(
                f"ops not in the profile, from {type(self.fallback).__name__}: {', '.join(self.fallback_ops)}"
            )
        return lines

    # -- CostModel --

    def decode_iter_s(self, batch: int, context_tokens: float, tokens_per_seq: int = 1) -> float:
        _check_batch(batch, tokens_per_seq)
        op = "decode" if tokens_per_seq == 1 else "verify"
        if not self._has(op):
            return self.fallback.decode_iter_s(batch, context_tokens, tokens_per_seq)
        return self._value("target", op, tokens_per_seq, batch, context_tokens / batch)

    def decode_span_s(self, batch: int, context_tokens: float, num_iters: int) -> float:
        if not self._has("decode"):
            return self.fallback.decode_span_s(batch, context_tokens, num_iters)
        _check_batch(batch, 1)
        # Plain decoding: each sequence's context grows by one token per iteration.
        return self._span("target", "decode", (1, batch), context_tokens / batch, 1.0, num_iters)

    def sd_span_s(
        self,
        batch: int,
        context_tokens: float,
        decision: SpecDecision,
        num_iters: int,
        tokens_per_iter: float,
    ) -> float:
        """Sum of ``sd_iter_s`` over ``num_iters`` iterations whose batch context grows by
        ``tokens_per_iter`` per iteration (closed form, like ``RooflineCost.sd_span_s``)."""
        _check_batch(batch, 1)
        if not decision.enabled:
            if not self._has("decode"):
                return sum(
                    self.decode_iter_s(batch, context_tokens + i * tokens_per_iter)
                    for i in range(num_iters)
                )
            return self._span(
                "target",
                "decode",
                (1, batch),
                context_tokens / batch,
                tokens_per_iter / batch,
                num_iters,
            )
        if not (self._has("drafter") and self._has("verify")):
            return sum(
                self.sd_iter_s(batch, context_tokens + i * tokens_per_iter, decision)
                for i in range(num_iters)
            )
        per_seq, growth = context_tokens / batch, tokens_per_iter / batch
        draft = self._span("drafter", "drafter", (decision.topk, batch), per_seq, growth, num_iters)
        verify = self._span(
            "target", "verify", (decision.verify_tokens + 1, batch), per_seq, growth, num_iters
        )
        return decision.draft_steps * draft + verify

    def prefill_s(self, num_tokens: int, context_tokens: float = 0.0, num_seqs: float = 1) -> float:
        if num_tokens <= 0:
            return 0.0
        if not self._has("prefill"):
            return self.fallback.prefill_s(num_tokens, context_tokens, num_seqs)
        seqs = max(1, num_seqs)
        per_seq, cached = num_tokens / seqs, context_tokens / seqs
        fresh = self._value("prefill", "prefill", seqs, per_seq)
        if cached <= 0:
            return fresh
        # On top of a cache: the last ``per_seq`` tokens of a longer prefill; never less than a
        # prefill of the new tokens alone (more context only adds attention work).
        longer = self._value("prefill", "prefill", seqs, per_seq + cached) - self._value(
            "prefill", "prefill", seqs, cached
        )
        return max(fresh, longer)

    def drafter_iter_s(self, batch: int, context_tokens: float, tokens_per_seq: int = 1) -> float:
        _check_batch(batch, tokens_per_seq)
        if not self._has("drafter"):
            return self.fallback.drafter_iter_s(batch, context_tokens, tokens_per_seq)
        return self._value("drafter", "drafter", tokens_per_seq, batch, context_tokens / batch)

    def sd_iter_s(self, batch: int, context_tokens: float, decision: SpecDecision) -> float:
        return default_sd_iter_s(self, batch, context_tokens, decision)

    def sd_switch_s(self, batch: float, context_tokens: float) -> float:
        if batch < 1 or context_tokens <= 0:
            return 0.0
        if "sd_switch" in self._tables:
            return self._value("sd_switch", "sd_switch", batch, context_tokens / batch)
        return self.prefill_s(int(round(context_tokens)), 0.0, batch)

    def train_s(self, num_tokens: int, mean_seq_tokens: float = 0.0) -> float:
        return self._train("train", num_tokens, mean_seq_tokens)

    def drafter_train_s(self, num_tokens: int, mean_seq_tokens: float = 0.0) -> float:
        return self._train("drafter_train", num_tokens, mean_seq_tokens)

    def _train(self, op: str, num_tokens: int, mean_seq_tokens: float) -> float:
        if num_tokens <= 0:
            return 0.0
        if not self._has(op):
            method = self.fallback.train_s if op == "train" else self.fallback.drafter_train_s
            return method(num_tokens, mean_seq_tokens)
        table = self._tables[op]
        # 0 means "unknown length": the shortest measured sequences (least attention), as the
        # roofline leaves attention out for 0.
        seq = mean_seq_tokens if mean_seq_tokens > 0 else table.lo
        num_seqs = num_tokens / seq
        curve = self._slice(op, (seq,))
        self._note(op, op, (seq,), num_seqs, min(num_seqs, curve.hi))
        if num_seqs <= curve.hi:
            return curve.value(num_seqs)
        # More sequences than the largest measured update: the work is that many updates of the
        # largest measured size (veRL trains a step as fixed-size mini-batch updates), so the
        # per-update overhead (optimizer step) is paid once per update, not once per step.
        return num_seqs / curve.hi * curve.value(curve.hi)

    def crossover_batch(
        self,
        decision: SpecDecision,
        accept_len: float,
        context_per_seq: float,
        max_batch: int = 4096,
    ) -> int | None:
        return crossover_batch(self, decision, accept_len, context_per_seq, max_batch)


def with_profile(path: Path | None, roofline: CostModel) -> CostModel:
    """``roofline`` when ``path`` is None, else a ``ProfileCost`` of the profile at ``path``
    that falls back to ``roofline`` for the ops it lacks (replay's ``--profile``)."""
    if path is None:
        return roofline
    profile = load_profile(path)
    tp = getattr(roofline, "tp", None)
    if tp is not None and profile.meta.get("tp") != tp:
        raise UsageError(
            f"{path}: measured with tp={profile.meta.get('tp')}, but the simulation runs tp={tp} (one profile describes one engine instance)"
        )
    _warn_if_other_model(profile, getattr(roofline, "model", None))
    cost = ProfileCost(profile, fallback=roofline)
    _warn_if_incomplete(profile, roofline)
    return cost


class ProfileModelWarning(UserWarning):
    """A profile measured a model of other shapes than the one simulated."""


class ProfileGapWarning(UserWarning):
    """A profile of a run that did not end, or without some op: the gaps are priced by the
    fallback cost model, another machine's and model's physics."""


# tltrun profile's sidecar marks of a run that did not end as asked (tltrun.profile.measure)
INCOMPLETE_MARKS = ("partial", "interrupted", "failed_ops")


def profile_gaps(profile: Profile) -> dict[str, Any]:
    """What a profile lacks, for config.json and warnings: the sidecar's marks of a run that did
    not end (``INCOMPLETE_MARKS``) and the required ops it has no rows for."""
    return {
        "incomplete": {k: profile.meta[k] for k in INCOMPLETE_MARKS if k in profile.meta},
        "ops_not_measured": [op for op in REQUIRED_OPS if op not in profile.ops],
    }


def _warn_if_incomplete(profile: Profile, fallback: CostModel) -> None:
    gaps = profile_gaps(profile)
    model, hardware = getattr(fallback, "model", None), getattr(fallback, "hardware", None)
    machine = f" ({hardware.name}, {model.name})" if model and hardware else ""
    said = []
    if gaps["incomplete"]:
        key, value = next(iter(gaps["incomplete"].items()))
        said.append(f"is of a run that did not end ({key}: {str(value)[:160]})")
    if gaps["ops_not_measured"]:
        said.append(
            f"has no rows for {', '.join(gaps['ops_not_measured'])}: "
            f"{type(fallback).__name__}{machine} prices them, so a policy using them mixes two "
            "machines' times"
        )
    if said:
        warnings.warn(
            f"profile {profile.source} {'; and it '.join(said)}", ProfileGapWarning, stacklevel=3
        )


def _warn_if_other_model(profile: Profile, simulated: ModelSpec | None) -> None:
    """A profile of another model prices every measured op with that model's times while the
    results name the simulated one: said once (a deliberate what-if is allowed)."""
    recorded = profile.meta.get("model")
    try:
        if isinstance(recorded, dict):
            measured = ModelSpec.from_hf_config(recorded, name=simulated.name if simulated else "")
        elif isinstance(recorded, str) and recorded in MODEL_PRESETS:
            measured = MODEL_PRESETS[recorded]
        else:
            return
    except ValueError:
        return  # profile-info and calibrate name a bad sidecar model; the times still stand
    shapes = measured.shape_differences(simulated) if simulated is not None else []
    if not shapes:
        return
    warnings.warn(
        f"profile {profile.source} measured another model than the simulated {simulated.name} "
        f"({'; '.join(shapes[:3])}): its measured times are used as they are",
        ProfileModelWarning,
        stacklevel=3,
    )


def _check_batch(batch: int, tokens_per_seq: int) -> None:
    if batch < 1 or tokens_per_seq < 1:
        raise ValueError(f"need batch >= 1 and tokens_per_seq >= 1, got {batch}, {tokens_per_seq}")


# --- measured vs roofline --------------------------------------------------------------------


def cost_seconds(
    op: str, batch: int, context_tokens: int, tokens_per_seq: int, cost: CostModel
) -> float:
    """What ``cost`` charges for the work of one profile point."""
    b, c, t = batch, float(context_tokens), tokens_per_seq
    if op in ("decode", "verify"):
        return cost.decode_iter_s(b, c, t)
    if op == "drafter":
        return cost.drafter_iter_s(b, c, t)
    if op == "prefill":
        return cost.prefill_s(b * t, 0.0, b)
    if op == "sd_switch":
        return cost.sd_switch_s(b, c)
    if op == "train":
        return cost.train_s(b * t, t)
    if op == "drafter_train":
        return cost.drafter_train_s(b * t, t)
    raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")


def profile_from_cost(
    points: Iterable[tuple[str, int, int, int]], cost: CostModel
) -> list[ProfileRow]:
    """Rows charging ``cost``'s seconds at ``points`` (e.g. ``grid_points``), spread 0: a
    noiseless profile of a model, to check the interpolation against the model itself."""
    rows = []
    for op, b, c, t in points:
        s = cost_seconds(op, b, c, t, cost)
        rows.append(ProfileRow(op, b, c, t, s, s, s, 1))
    return rows


def compare_to_roofline(profile: Profile, roofline: CostModel) -> pd.DataFrame:
    """Per measured point: measured and roofline seconds and their ratio (a pandas DataFrame,
    one row per profile row); ``summarize_comparison`` condenses it per op."""
    records = []
    for r in profile.rows:
        predicted = cost_seconds(r.op, r.batch, r.context_tokens, r.tokens_per_seq, roofline)
        records.append(
            {
                **asdict(r),
                "roofline_s": predicted,
                "ratio": r.seconds / predicted if predicted > 0 else math.inf,
            }
        )
    return pd.DataFrame.from_records(records)


def summarize_comparison(frame: pd.DataFrame) -> pd.DataFrame:
    """Per op: points, median / min / max of measured / roofline."""
    grouped = frame.groupby("op", sort=False)["ratio"]
    out = grouped.agg(
        num_points="size", median_ratio="median", min_ratio="min", max_ratio="max"
    ).reset_index()
    order = {op: i for i, op in enumerate(OPS)}
    return out.sort_values("op", key=lambda s: s.map(order)).reset_index(drop=True)


__all__ = [
    "Extrapolation",
    "ProfileCost",
    "ProfileExtrapolationWarning",
    "compare_to_roofline",
    "cost_seconds",
    "profile_from_cost",
    "summarize_comparison",
]
