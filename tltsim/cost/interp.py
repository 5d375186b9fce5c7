"""Piecewise-linear interpolation over measured grids, with closed-form sums over iterations.

The numeric core of ``tltsim.cost.measured.ProfileCost``. A ``Curve`` is an exact piecewise-linear
function: chords between knots, straight lines beyond both ends. ``measured_curve`` builds one
through measured points; a ``Table`` interpolates over one more coordinate between child Curves
or Tables (children need not share their points: the grid need not be rectangular), and
``Table.slice(outer coordinates)`` returns the exact Curve in the innermost coordinate, so that
``Curve.span`` can sum it over many iterations in closed form (on each linear piece the terms
form an arithmetic series). The simulator advances a batch over many iterations at once, with
context growing by a fixed amount per iteration: this is its hot path.

Interpolation between two knots is the chord, except on axes marked ``is_kinked``: there, where
three consecutive secant slopes increase (the function is locally convex, e.g. a forward pass
turning from memory- to compute-bound inside the segment), the segment is the larger of the two
neighbouring secants extended to the point where they cross, capped by the chord, pointwise
``min(chord, max(left, right))``. That is exact for a maximum of two affine functions (the
roofline's form, ``max(FLOPs / FLOP/s, bytes / bandwidth)``) when the kink has a full segment on
either side; elsewhere it is the chord. On smooth curved axes (prefill: attention grows as T^2)
it would under-charge, so those axes use chords.

Beyond the knots each coordinate extrapolates linearly from its last two points; the upper
extrapolation never decreases and nothing goes below zero: measured seconds are positive, and
more work never takes less time even when measurement noise tilts the last two points
(``profile_tables`` also raises a larger batch's curve to a smaller one's, beyond the grid too).

    from tltsim.cost.interp import Table, measured_curve
    t = Table([1, 4], [measured_curve([0, 10], [1.0, 2.0]), measured_curve([0, 10], [2.0, 5.0])])
    t.slice((2.5,)).value(5.0)            # 2.5
    t.slice((2.5,)).span(0.0, 1.0, 3)     # value at 0 + value at 1 + value at 2
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import pairwise

# Slopes closer than this (relative) count as equal: differences at rounding level are no kink.
_REL_TOL = 1e-9


class Curve:
    """Exact piecewise-linear y(x): chords between knots ``xs`` (strictly increasing, >= 1),
    lines of slope ``lo_slope`` / ``hi_slope`` below the first / above the last knot.
    ``lo`` / ``hi``: the range its values come from measurements in, the knots' unless
    ``measured`` says otherwise (a pointwise maximum adds knots where two lines cross beyond
    the measured points; extrapolation is still reported against the measured range)."""

    __slots__ = ("xs", "ys", "lo_slope", "hi_slope", "_slopes", "lo", "hi")

    def __init__(
        self,
        xs: Sequence[float],
        ys: Sequence[float],
        lo_slope: float,
        hi_slope: float,
        measured: tuple[float, float] | None = None,
    ):
        if not xs or len(xs) != len(ys) or any(b <= a for a, b in pairwise(xs)):
            raise ValueError(
                f"Curve: need strictly increasing knots and one y per knot, got {list(xs)}"
            )
        self.xs = tuple(float(x) for x in xs)
        self.lo, self.hi = measured if measured is not None else (self.xs[0], self.xs[-1])
        self.ys = tuple(float(y) for y in ys)
        self.lo_slope, self.hi_slope = float(lo_slope), float(hi_slope)
        inner = [
            (y1 - y0) / (x1 - x0)
            for (x0, x1), (y0, y1) in zip(pairwise(self.xs), pairwise(self.ys), strict=True)
        ]
        # Piece p covers [xs[p-1], xs[p]) and is anchored at knot max(p-1, 0).
        self._slopes = (self.lo_slope, *inner, self.hi_slope)

    def _line(self, piece: int) -> tuple[float, float, float]:
        anchor = max(piece - 1, 0)
        return self.xs[anchor], self.ys[anchor], self._slopes[piece]

    def value(self, x: float) -> float:
        x0, y0, slope = self._line(bisect_right(self.xs, x))
        return y0 + slope * (x - x0)

    def span(self, v0: float, dv: float, n: int) -> float:
        """``sum(value(v0 + i*dv) for i in range(n))`` exactly, for ``dv >= 0``."""
        if n <= 0:
            return 0.0
        if dv <= 0:
            return n * self.value(v0)
        total, start = 0.0, 0
        for piece in range(len(self.xs) + 1):
            # Indices i in [start, end) have v0 + i*dv below knot ``piece`` (the last piece: all).
            end = (
                n
                if piece == len(self.xs)
                else min(max(math.ceil((self.xs[piece] - v0) / dv), start), n)
            )
            count = end - start
            if count > 0:
                x0, y0, slope = self._line(piece)
                total += (
                    count * (y0 + slope * (v0 - x0)) + slope * dv * (start + end - 1) * count / 2.0
                )
            start = end
            if start >= n:
                break
        return total


ZERO = Curve((0.0,), (0.0,), 0.0, 0.0)


def measured_curve(
    xs: Sequence[float], ys: Sequence[float], x_min: float = 0.0, is_kinked: bool = True
) -> Curve:
    """The interpolant through measured points (>= 2): chords (convex kinks refined when
    ``is_kinked``), linear extrapolation from the end segments, the upper one never
    decreasing and the lower one reaching at most zero at the axis minimum ``x_min``."""
    if len(xs) < 2:
        raise ValueError(f"measured_curve: need >= 2 points, got {len(xs)}")
    xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    if any(b <= a for a, b in pairwise(xs)) or xs[0] < x_min:
        raise ValueError(f"measured_curve: points must increase from x_min={x_min}, got {xs}")
    s = [
        (y1 - y0) / (x1 - x0) for (x0, x1), (y0, y1) in zip(pairwise(xs), pairwise(ys), strict=True)
    ]
    knots, values = [xs[0]], [ys[0]]
    for j in range(len(s)):
        margin = _REL_TOL * max(abs(v) for v in s[max(j - 1, 0) : j + 2])
        if is_kinked and 0 < j < len(s) - 1 and s[j - 1] + margin < s[j] < s[j + 1] - margin:
            # Crossing of the left secant (through x_j) and the right one (through x_{j+1}).
            x = (ys[j + 1] - ys[j] - s[j + 1] * xs[j + 1] + s[j - 1] * xs[j]) / (
                s[j - 1] - s[j + 1]
            )
            if xs[j] < x < xs[j + 1]:
                knots.append(x)
                values.append(ys[j] + s[j - 1] * (x - xs[j]))
        knots.append(xs[j + 1])
        values.append(ys[j + 1])
    lower = s[0]
    if xs[0] > x_min and ys[0] - lower * (xs[0] - x_min) < 0:
        lower = ys[0] / (xs[0] - x_min)
    return Curve(knots, values, lower, max(s[-1], 0.0))


def combine(terms: Sequence[tuple[Curve, float]]) -> Curve:
    """The Curve ``sum(w * curve)``: exact on the union of the knots."""
    terms = [(c, w) for c, w in terms if w != 0.0] or [(ZERO, 1.0)]
    if len(terms) == 1 and terms[0][1] == 1.0:
        return terms[0][0]
    xs = sorted({x for c, _ in terms for x in c.xs})
    ys = [math.fsum(w * c.value(x) for c, w in terms) for x in xs]
    return Curve(
        xs,
        ys,
        sum(w * c.lo_slope for c, w in terms),
        sum(w * c.hi_slope for c, w in terms),
        measured=(min(c.lo for c, _ in terms), max(c.hi for c, _ in terms)),
    )


def _extreme(a: Curve, b: Curve, pick: Callable[[float, float], float]) -> Curve:
    """Pointwise max or min (``pick``) of two Curves: union knots plus every crossing; its
    measured range is ``a``'s (``b`` bounds it: the previous batch, zero)."""
    union = sorted(set(a.xs) | set(b.xs))
    xs = set(union)

    def cross(x0: float, d0: float, slope_a: float, slope_b: float) -> float | None:
        """Where a - b (= d0 at x0) crosses zero beyond the knots; None for lines parallel to
        rounding precision (a crossing far out would only cost precision)."""
        diff = slope_a - slope_b
        return None if abs(diff) <= _REL_TOL * (abs(slope_a) + abs(slope_b)) else x0 - d0 / diff

    for x0, x1 in pairwise(union):
        d0, d1 = a.value(x0) - b.value(x0), a.value(x1) - b.value(x1)
        if d0 * d1 < 0:
            xs.add(x0 + (x1 - x0) * d0 / (d0 - d1))
    lo_x = cross(union[0], a.value(union[0]) - b.value(union[0]), a.lo_slope, b.lo_slope)
    if lo_x is not None and lo_x < union[0]:
        xs.add(lo_x)
    hi_x = cross(union[-1], a.value(union[-1]) - b.value(union[-1]), a.hi_slope, b.hi_slope)
    if hi_x is not None and hi_x > union[-1]:
        xs.add(hi_x)
    knots = sorted(xs)
    ys = [pick(a.value(x), b.value(x)) for x in knots]
    # Beyond the outer knots one line dominates: the one whose value wins one unit further out.
    lo_pick = pick(a.value(knots[0] - 1.0), b.value(knots[0] - 1.0))
    hi_pick = pick(a.value(knots[-1] + 1.0), b.value(knots[-1] + 1.0))
    return Curve(knots, ys, ys[0] - lo_pick, hi_pick - ys[-1], measured=(a.lo, a.hi))


def nondecreasing(curve: Curve) -> Curve:
    """The least nondecreasing Curve on ``curve``'s knots that is nowhere below it: each knot's
    value raised to the largest before it (a segment that fell becomes the chord from that
    level), slopes beyond the ends at least zero."""
    ys, level = [], -math.inf
    for y in curve.ys:
        level = max(level, y)
        ys.append(level)
    return Curve(
        curve.xs, ys, max(curve.lo_slope, 0.0), max(curve.hi_slope, 0.0), (curve.lo, curve.hi)
    )


def maximum(a: Curve, b: Curve) -> Curve:
    return _extreme(a, b, max)


def minimum(a: Curve, b: Curve) -> Curve:
    return _extreme(a, b, min)


class Table:
    """Interpolation in one more coordinate (the first) between ``children`` at ``knots``;
    linear beyond both ends. One child: constant in that coordinate."""

    __slots__ = ("knots", "children", "is_kinked")

    def __init__(
        self, knots: Sequence[float], children: Sequence[Curve | Table], is_kinked: bool = True
    ):
        if not knots or len(knots) != len(children) or any(b <= a for a, b in pairwise(knots)):
            raise ValueError(
                f"Table: need strictly increasing knots and one child per knot, got {list(knots)}"
            )
        self.knots = tuple(float(k) for k in knots)
        self.children = tuple(children)
        self.is_kinked = is_kinked

    @property
    def lo(self) -> float:
        return self.knots[0]

    @property
    def hi(self) -> float:
        return self.knots[-1]

    def _segment(self, u: float) -> tuple[int, float]:
        j = min(max(bisect_right(self.knots, u) - 1, 0), len(self.knots) - 2)
        return j, (u - self.knots[j]) / (self.knots[j + 1] - self.knots[j])

    def slice(self, coords: Sequence[float]) -> Curve:
        """The exact Curve in the innermost coordinate with the outer ones fixed at ``coords``
        (outermost first)."""
        u, rest = coords[0], coords[1:]

        kids: dict[int, Curve] = {}

        def kid(i: int) -> Curve:
            if i not in kids:
                child = self.children[i]
                kids[i] = child.slice(rest) if isinstance(child, Table) else child
            return kids[i]

        if len(self.knots) == 1:
            return kid(0)
        j, w = self._segment(u)
        if w == 0.0 or w == 1.0:
            return kid(j + int(w))
        k = self.knots
        chord = combine([(kid(j), 1.0 - w), (kid(j + 1), w)])
        if w > 1.0:  # beyond the last knot: never below the last measured value
            return maximum(chord, kid(j + 1))
        if w < 0.0 or not self.is_kinked or j == 0 or j + 2 >= len(k):
            return chord
        a = (u - k[j]) / (k[j] - k[j - 1])
        left = combine([(kid(j), 1.0 + a), (kid(j - 1), -a)])
        b = (k[j + 1] - u) / (k[j + 2] - k[j + 1])
        right = combine([(kid(j + 1), 1.0 + b), (kid(j + 2), -b)])
        return minimum(chord, maximum(left, right))

    def value(self, coords: Sequence[float], v: float) -> float:
        return self.slice(coords).value(v)

    def out_of_range(
        self, coords: Sequence[float], v_lo: float, v_hi: float
    ) -> list[tuple[int, float, float, float]]:
        """``(level, requested, grid_lo, grid_hi)`` for every coordinate outside the measured
        range of the children it is interpolated between; level 0 is this table's coordinate,
        the innermost is checked over ``[v_lo, v_hi]`` (a span's first and last value)."""
        u, rest = coords[0], coords[1:]
        found = []
        if not self.lo <= u <= self.hi:
            found.append((0, u, self.lo, self.hi))
        if len(self.knots) == 1:
            used = [0]
        else:
            j, w = self._segment(u)
            used = [j + int(w >= 1.0)] if w in (0.0, 1.0) else [j, j + 1]
        for i in used:
            child = self.children[i]
            if isinstance(child, Table):
                found.extend(
                    (lvl + 1, val, lo, hi)
                    for lvl, val, lo, hi in child.out_of_range(rest, v_lo, v_hi)
                )
            else:
                if v_lo < child.lo:
                    found.append((len(coords), v_lo, child.lo, child.hi))
                if v_hi > child.hi:
                    found.append((len(coords), v_hi, child.lo, child.hi))
        return found


__all__ = ["Curve", "Table", "ZERO", "combine", "maximum", "measured_curve", "minimum"]
