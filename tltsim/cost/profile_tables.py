"""The interpolation tables of a measured profile (``ProfileCost``'s data): measured points
grouped per table (decode and verify share one), raised to their monotone envelope where
noise made more work look cheaper, and nested into ``tltsim.cost.interp`` Tables.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from tltsim.cost.interp import Curve, Table, maximum, measured_curve
from tltsim.cost.profile import Profile, ProfileError, ProfileRow

# Per table: its axes, outermost first, as (name, is_kinked), and the innermost axis' minimum.
# Kinked axes (tltsim.cost.interp) are piecewise affine by the roofline's physics; the per-sequence
# token axes of prefill and re-prefill are smooth (attention grows as T^2) and use chords.
AXES: dict[str, tuple[tuple[str, bool], ...]] = {
    "target": (("tokens_per_seq", True), ("batch", True), ("context tokens per sequence", True)),
    "drafter": (("tokens_per_seq", True), ("batch", True), ("context tokens per sequence", True)),
    "prefill": (("batch", True), ("prompt tokens per sequence", False)),
    "sd_switch": (("batch", True), ("context tokens per sequence", False)),
    "train": (("sequence tokens", False), ("sequences per update", True)),
    "drafter_train": (("sequence tokens", False), ("sequences per update", True)),
}
_X_MIN = {"prefill": 1.0, "sd_switch": 1.0}
# where "batch" is among each table's coordinates (AXES' order)
AXIS_OF_BATCH = {
    name: [axis for axis, _ in axes].index("batch")
    for name, axes in AXES.items()
    if "batch" in [axis for axis, _ in axes]
}
_MEMBERS = {
    "target": ("decode", "verify"),
    "drafter": ("drafter",),
    "prefill": ("prefill",),
    "sd_switch": ("sd_switch",),
    "train": ("train",),
    "drafter_train": ("drafter_train",),
}


def _coords(table: str, r: ProfileRow) -> tuple[float, ...]:
    per_seq = r.context_tokens / r.batch
    if table in ("target", "drafter"):
        return (r.tokens_per_seq, r.batch, per_seq)
    if table == "prefill":
        return (r.batch, r.tokens_per_seq)
    if table == "sd_switch":
        return (r.batch, per_seq)
    return (r.tokens_per_seq, r.batch)


def _build(
    points: dict[tuple[float, ...], float],
    axes: tuple[tuple[str, bool], ...],
    x_min: float,
    where: str,
    source: str,
    is_monotone_in_batch: bool = False,
    raised: list[float] | None = None,
) -> Curve | Table:
    """Nested Table over the first coordinate of ``points`` down to Curves over the last.
    ``is_monotone_in_batch``: each batch's Curve is raised to the previous batch's wherever it
    falls below it. The envelope makes measured points monotone, but each batch extrapolates
    beyond its own points with its own end slopes: the H200 profile's prefill of 16-token
    prompts (below its grid) cost 37 ms for one prompt and 3 ms for sixteen, and its drafter at
    20,000 tokens of context (above it) less at batch 64 than at batch 16. The batches raised
    so are appended to ``raised``."""
    (name, is_kinked), inner = axes[0], axes[1:]
    if not inner:
        xs = sorted(points)
        if len(xs) < 2:
            raise ProfileError(
                f"{source}: {where}: only one {name} value measured ({xs[0][0]:g}); need >= 2 to interpolate"
            )
        return measured_curve([x[0] for x in xs], [points[x] for x in xs], x_min, is_kinked)
    groups: dict[float, dict[tuple[float, ...], float]] = defaultdict(dict)
    for coords, seconds in points.items():
        groups[coords[0]][coords[1:]] = seconds
    knots = sorted(groups)
    children = [
        _build(
            groups[k], inner, x_min, f"{where}, {name} {k:g}", source, is_monotone_in_batch, raised
        )
        for k in knots
    ]
    if name == "batch" and is_monotone_in_batch:
        for i in range(1, len(children)):
            below, curve = children[i - 1], children[i]
            assert isinstance(below, Curve) and isinstance(curve, Curve)  # batch is next to last
            children[i] = maximum(curve, below)
            if raised is not None and _is_raised(children[i], curve, x_min):
                raised.append(knots[i])
    return Table(knots, children, is_kinked)


def _is_raised(new: Curve, old: Curve, x_min: float) -> bool:
    """Whether ``new`` (``maximum(old, ...)``) lies above ``old`` anywhere on the axis from
    ``x_min`` on: at a knot, at ``x_min``, or beyond the last knot (a steeper upper slope).
    (Lines of two batches may cross below ``x_min``, a negative context: never queried.)"""
    tol = 1e-12
    points = [x for x in new.xs if x >= x_min] + [x_min]
    return (
        any(new.value(x) > old.value(x) * (1 + tol) + tol for x in points)
        or new.hi_slope > old.hi_slope * (1 + tol) + tol
    )


@dataclass(frozen=True)
class BatchRaise:
    """Batches of one table whose curve ``_build`` raised to a smaller batch's."""

    ops: str
    batches: tuple[float, ...]
    num_batches: int

    def line(self) -> str:
        shown = ", ".join(f"{b:g}" for b in self.batches[:6])
        more = ", ..." if len(self.batches) > 6 else ""
        return (
            f"{self.ops}: {len(self.batches)} of {self.num_batches} batch curves (batch "
            f"{shown}{more}) raised to a smaller batch's where they fell below it, beyond their "
            "own measured points (each batch extrapolates with its own end slopes)"
        )


@dataclass(frozen=True)
class MonotoneLift:
    """Measured points of one table that ``monotone_envelope`` raised."""

    ops: str
    num_lifted: int
    num_points: int
    max_lift: float  # the largest rise, relative to the measured seconds

    def line(self) -> str:
        return (
            f"{self.ops}: {self.num_lifted} of {self.num_points} measured points raised to the "
            f"cost of a smaller batch or context (by at most {self.max_lift:.1%}: measurement "
            "noise made more work look cheaper)"
        )


# Per rollout table: how many leading coordinates a point must share with the points that bound
# it from below (tokens per sequence: a verify or drafter width may run another code path, and
# the measured H200 profile's drafter is faster at top-k 4 than at top-k 1, so widths are not
# compared). Training tables keep their measured values: no rollout bound rests on them.
ENVELOPE_FIXED = {"target": 1, "drafter": 1, "prefill": 0, "sd_switch": 0}


def monotone_envelope(
    points: dict[tuple[float, ...], float], num_fixed: int = 0
) -> tuple[dict[tuple[float, ...], float], int, float]:
    """Each point's seconds raised to the most of any point with the same first ``num_fixed``
    coordinates and no more of the others (batch, context): a larger batch or a longer context
    never takes less time, so a measured dip (noise: the H200 profile's batch-1 decode takes
    4.07 ms at 512 context and 4.02 ms at 2,048) is not physics. The lower bound on a rollout
    (``tltsim.sim.metrics.critical_path_s``, ``work_bound_s``) rests on this, and the
    interpolation (``tltsim.cost.interp``) of monotone points is monotone. Returns the points,
    how many were raised and the largest relative rise."""
    groups: dict[tuple[float, ...], list[tuple[float, ...]]] = defaultdict(list)
    for key in points:  # one group per width: pairs across widths are never compared
        groups[key[:num_fixed]].append(key)
    out, num_lifted, max_lift = {}, 0, 0.0
    for keys in groups.values():
        coords = np.array([k[num_fixed:] for k in keys], dtype=float)  # (N, D)
        seconds = np.array([points[k] for k in keys])
        below = np.all(coords[None, :, :] <= coords[:, None, :], axis=2)  # [i, j]: j <= i
        lifted = np.max(np.where(below, seconds[None, :], -np.inf), axis=1)
        rise = (lifted - seconds) / np.maximum(seconds, 1e-300)
        out.update(zip(keys, lifted.tolist(), strict=True))
        num_lifted += int(np.count_nonzero(rise > 0))
        max_lift = max(max_lift, float(rise.max(initial=0.0)))
    return out, num_lifted, max_lift


def profile_tables(
    profile: Profile,
) -> tuple[dict[str, Table], tuple[MonotoneLift, ...], tuple[BatchRaise, ...]]:
    """The interpolation tables of ``profile`` per table name, the measured points lifted to
    the monotone envelope and the batch curves raised to a smaller batch's (each a ``line()``)."""
    tables, lifts, raises = {}, [], []
    for name, ops in _MEMBERS.items():
        rows = [r for r in profile.rows if r.op in ops]
        if rows:
            points = {_coords(name, r): r.seconds for r in rows}
            num_lifted, max_lift = 0, 0.0
            if name in ENVELOPE_FIXED:
                points, num_lifted, max_lift = monotone_envelope(points, ENVELOPE_FIXED[name])
            where = f"op {'/'.join(ops)}"
            if num_lifted:
                lifts.append(MonotoneLift(where, num_lifted, len(points), max_lift))
            raised: list[float] = []
            tables[name] = _build(
                points,
                AXES[name],
                _X_MIN.get(name, 0.0),
                where,
                profile.source,
                is_monotone_in_batch=name in ENVELOPE_FIXED,
                raised=raised,
            )
            if raised:
                num_batches = len({_coords(name, r)[AXIS_OF_BATCH[name]] for r in rows})
                raises.append(BatchRaise(where, tuple(sorted(set(raised))), num_batches))
    return tables, tuple(lifts), tuple(raises)
