"""Measured profiles: ProfileCost interpolation and extrapolation, closed-form spans, agreement
with the roofline it was generated from. The profile files' schema checks and the CLI's one-line
errors: tests/test_profile_schema.py, which builds its profiles with the helpers below.

Run: .venv/bin/python -m pytest tests/test_profile.py -q
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tltsim.cli.fidelity import extrapolation_lines
from tltsim.cost.interp import Curve, maximum, measured_curve, minimum
from tltsim.cost.measured import (
    ProfileCost,
    ProfileExtrapolationWarning,
    compare_to_roofline,
    cost_seconds,
    profile_from_cost,
    summarize_comparison,
)
from tltsim.cost.profile import Profile, ProfileGrid, ProfileRow, grid_points
from tltsim.cost.roofline import RooflineCost
from tltsim.cost.specs import get_hardware, get_model
from tltsim.policy import SpecDecision

META = {
    "hardware": "H100-SXM",
    "backend": "torch",
    "tp": 1,
    "model": "Qwen2.5-7B",
    "software": {"python": "3.12", "torch": "2.13.0"},
    "date": "2026-01-01T00:00:00Z",
}
# A small doubling grid with no KV cap, so every batch shares the context axis.
SMALL = ProfileGrid(
    batches=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    context_per_seq=(128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
    verify_tokens_per_seq=(2, 3, 5, 9, 17, 33),
    drafter_tokens_per_seq=(1, 2, 4, 8),
    prefill_batches=(1, 2, 4, 8, 16, 32, 64),
    prefill_tokens_per_seq=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    max_context_tokens=1 << 26,
)


def bilinear(op: str, b: int, c: int, t: int) -> float:
    """An exactly bilinear (per axis) cost in batch, context per sequence and tokens_per_seq:
    the scheme must reproduce it everywhere, extrapolation included."""
    per_seq = c / b
    if op in ("decode", "verify", "drafter"):
        scale = 0.5 if op == "drafter" else 1.0
        return scale * (2e-3 + 1e-5 * b * t + 3e-7 * per_seq + 2e-8 * b * per_seq + 1e-6 * t)
    if op in ("prefill", "sd_switch"):
        tokens = t if op == "prefill" else per_seq
        return 1e-3 + 2e-6 * b * tokens + 5e-5 * b
    return 0.05 + 1e-5 * b * t + 1e-9 * t * t * b  # train ops: affine in tokens at fixed length


def bilinear_profile(grid: ProfileGrid = SMALL) -> Profile:
    rows = tuple(
        ProfileRow(op, b, c, t, s, s, s, 3)
        for op, b, c, t in grid_points(grid)
        for s in [bilinear(op, b, c, t)]
    )
    return Profile(rows, dict(META), "bilinear.csv")


@lru_cache(maxsize=1)
def bilinear_cost() -> ProfileCost:
    return ProfileCost(bilinear_profile(), is_warned=False)


@lru_cache(maxsize=4)
def noisy_cost(seed: int) -> ProfileCost:
    """A roofline profile with +-5% noise per point: not convex, not monotone everywhere."""
    rng = np.random.default_rng(seed)
    rows = tuple(
        ProfileRow(r.op, r.batch, r.context_tokens, r.tokens_per_seq, s, s, s, 1)
        for r in profile_from_cost(grid_points(SMALL), roofline())
        for s in [r.seconds * rng.uniform(0.95, 1.05)]
    )
    return ProfileCost(Profile(rows, META, "noisy.csv"), is_warned=False)


def roofline(name: str = "Qwen2.5-7B", hw: str = "H100-SXM", tp: int = 1) -> RooflineCost:
    return RooflineCost(get_model(name), get_hardware(hw), tp=tp)


# --- interpolation ----------------------------------------------------------------------------


def _envelope_by_hand(rows: tuple[ProfileRow, ...], r: ProfileRow) -> float:
    """What ProfileCost must return at measured point ``r``: rollout ops the most seconds of
    any row of its table (decode and verify share one) with the same tokens per sequence, no
    larger batch and no longer context per sequence; training ops as measured."""
    if r.op in ("train", "drafter_train"):
        return r.seconds
    table = {"decode": "target", "verify": "target"}.get(r.op, r.op)
    return max(
        q.seconds
        for q in rows
        if {"decode": "target", "verify": "target"}.get(q.op, q.op) == table
        and (q.tokens_per_seq == r.tokens_per_seq or r.op in ("prefill", "sd_switch"))
        and q.batch <= r.batch
        and q.context_tokens / q.batch <= r.context_tokens / r.batch
        and (r.op != "prefill" or q.tokens_per_seq <= r.tokens_per_seq)
    )


def test_grid_points_of_a_noisy_profile_are_its_monotone_envelope() -> None:
    """Knots are measured points, raised where noise made a larger batch or a longer context
    cheaper (more work never takes less time: the rollout lower bound rests on it); the
    lift is reported per table."""
    rng = np.random.default_rng(0)
    base = profile_from_cost(grid_points(SMALL), roofline())
    rows = tuple(
        ProfileRow(r.op, r.batch, r.context_tokens, r.tokens_per_seq, s, s, s, 1)
        for r in base
        for s in [r.seconds * rng.uniform(0.9, 1.1)]
    )
    cost = ProfileCost(Profile(rows, META, "noisy.csv"))
    num_lifted = 0
    for r in rows:
        got = cost_seconds(r.op, r.batch, r.context_tokens, r.tokens_per_seq, cost)
        want = _envelope_by_hand(rows, r)
        assert got == pytest.approx(want, rel=1e-9), r
        num_lifted += want > r.seconds
    assert not cost.extrapolations and num_lifted > 0
    assert sum(lift.num_lifted for lift in cost.monotone_lifts) == num_lifted
    lines = extrapolation_lines(cost)
    assert any(line.startswith("profile: op decode/verify: ") for line in lines), lines
    assert not any("train" in line for line in lines)  # training rows are kept as measured
    # at a fixed width the cost never falls along batch or context, between the knots too
    for t in (1, 9):
        for b in (1, 3, 64):
            ys = [cost.decode_iter_s(b, b * c, t) for c in np.linspace(128, 32_768, 400)]
            assert all(y1 >= y0 for y0, y1 in zip(ys, ys[1:], strict=False)), (t, b)


@settings(max_examples=200, deadline=None)
@given(
    b=st.integers(1, 2000),
    per_seq=st.floats(1.0, 200_000.0),
    t=st.integers(1, 60),
    topk=st.integers(1, 12),
)
def test_bilinear_costs_are_reproduced_inside_and_outside_the_grid(
    b: int, per_seq: float, t: int, topk: int
) -> None:
    """Linear inside, and linear (not flat) extrapolation outside: exact for a bilinear cost."""
    cost = bilinear_cost()
    c = b * per_seq
    assert cost.decode_iter_s(b, c, t) == pytest.approx(bilinear("verify", b, c, t), rel=1e-9)
    assert cost.drafter_iter_s(b, c, topk) == pytest.approx(
        bilinear("drafter", b, c, topk), rel=1e-9
    )
    assert cost.sd_switch_s(min(b, 64), min(b, 64) * per_seq) == pytest.approx(
        bilinear("sd_switch", min(b, 64), min(b, 64) * per_seq, 1), rel=1e-9
    )


def test_extrapolation_warns_once_per_op_and_axis_and_counts() -> None:
    cost = ProfileCost(bilinear_profile())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for context_per_seq in (40_000.0, 50_000.0, 60_000.0):
            cost.decode_iter_s(4, 4 * context_per_seq)
        cost.decode_iter_s(1024, 1024 * 200.0)  # batch beyond 512
    messages = [
        str(w.message) for w in caught if issubclass(w.category, ProfileExtrapolationWarning)
    ]
    assert len(messages) == 2, messages
    assert (
        "decode: context tokens per sequence 40000 is outside the measured range [128, 32768]"
        in messages[0]
    )
    assert "decode: batch 1024 is outside the measured range [1, 512]" in messages[1]
    rec = cost.extrapolations[("decode", "context tokens per sequence")]
    assert (rec.num_calls, rec.min_requested, rec.max_requested) == (3, 40_000.0, 60_000.0)
    lines = extrapolation_lines(cost)
    assert len(lines) == 2 and "in 3 calls" in lines[0]


def test_upper_extrapolation_never_decreases_and_is_never_negative() -> None:
    """Noise that tilts the last two points down must not make longer contexts cheaper."""
    xs, ys = [128.0, 256.0, 512.0], [1.0, 2.0, 1.9]
    curve = measured_curve(xs, ys)
    assert curve.value(10_000.0) == pytest.approx(1.9)
    steep = measured_curve([100.0, 200.0], [0.1, 10.0])  # would cross zero below x = 99
    assert steep.value(0.0) >= 0 and steep.value(50.0) >= 0


def test_convex_kink_is_rebuilt_exactly() -> None:
    """max(2, x - 3) on knots 1, 2, 4, 8, 16: the kink at 5 lies inside (4, 8) and neighbouring
    segments are pure, so the refined interpolant is exact; the chord would give 4.5 at 6."""
    xs = [1.0, 2.0, 4.0, 8.0, 16.0]
    curve = measured_curve(xs, [max(2.0, x - 3) for x in xs])
    for x in np.linspace(1, 16, 61):
        assert curve.value(x) == pytest.approx(max(2.0, x - 3), abs=1e-12)
    chord = measured_curve(xs, [max(2.0, x - 3) for x in xs], is_kinked=False)
    assert chord.value(6.0) == pytest.approx(3.5)


# --- spans: closed form == per-iteration sum ----------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    b=st.integers(1, 600),
    per_seq=st.floats(10.0, 40_000.0),
    n=st.integers(0, 3000),
    noise_seed=st.integers(0, 2),
)
def test_decode_span_equals_per_iteration_sum(
    b: int, per_seq: float, n: int, noise_seed: int
) -> None:
    cost = noisy_cost(noise_seed)
    c = b * per_seq
    loop = math.fsum(cost.decode_iter_s(b, c + i * b, 1) for i in range(n))
    assert cost.decode_span_s(b, c, n) == pytest.approx(loop, rel=1e-9, abs=1e-12)
    decision = SpecDecision.parse("4_2_6")
    growth = b * 2.7
    loop = math.fsum(cost.sd_iter_s(b, c + i * growth, decision) for i in range(min(n, 300)))
    assert cost.sd_span_s(b, c, decision, min(n, 300), growth) == pytest.approx(
        loop, rel=1e-9, abs=1e-12
    )


@settings(max_examples=200, deadline=None)
@given(
    xs=st.lists(st.integers(-50, 50).map(float), min_size=1, max_size=6, unique=True),
    ys_a=st.lists(st.floats(-5, 5), min_size=6, max_size=6),
    ys_b=st.lists(st.floats(-5, 5), min_size=6, max_size=6),
    slopes=st.tuples(*[st.floats(-2, 2)] * 4),
    probe=st.floats(-200, 200),
)
def test_pointwise_max_min_of_curves(xs, ys_a, ys_b, slopes, probe) -> None:
    xs = sorted(xs)
    a = Curve(xs, ys_a[: len(xs)], slopes[0], slopes[1])
    b = Curve([x + 0.5 for x in xs], ys_b[: len(xs)], slopes[2], slopes[3])
    assert maximum(a, b).value(probe) == pytest.approx(
        max(a.value(probe), b.value(probe)), abs=1e-7
    )
    assert minimum(a, b).value(probe) == pytest.approx(
        min(a.value(probe), b.value(probe)), abs=1e-7
    )


# --- the real check: a profile generated from the roofline reproduces it ------------------------


def _interior(rng: np.random.Generator, knots: tuple[int, ...]) -> float:
    """A random point away from the first and last segment of an axis (there a regime change
    cannot be located from the data, see tltsim.cost.measured)."""
    return float(np.exp(rng.uniform(np.log(knots[1]), np.log(knots[-2]))))


@pytest.mark.parametrize(
    "preset",
    [
        ("Qwen2.5-7B", "H100-SXM", 1),
        ("Qwen2.5-0.5B", "A100-80GB", 1),
        ("Llama-3.1-70B", "H100-SXM", 4),
    ],
)
def test_roofline_profile_reproduces_the_roofline_off_grid(preset) -> None:
    """Iteration costs (decode, verify, drafter, whole SD iterations, decode spans) within 1% at
    random off-grid interior points; prefill within 15% (chords along the quadratic T axis)."""
    rc = roofline(*preset)
    cost = ProfileCost(
        Profile(tuple(profile_from_cost(grid_points(SMALL), rc)), META, "roofline.csv")
    )
    rng = np.random.default_rng(1)
    worst: dict[str, float] = {}

    def check(name: str, got: float, want: float, tol: float) -> None:
        err = abs(got / want - 1)
        worst[name] = max(worst.get(name, 0.0), err)
        assert err < tol, (name, got, want)

    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileExtrapolationWarning)  # all points are in range
        for _ in range(300):
            b = int(round(_interior(rng, SMALL.batches)))
            c = b * _interior(rng, SMALL.context_per_seq)
            for t in (1, 2, 4, 7, 9, 13, 17):
                check("verify", cost.decode_iter_s(b, c, t), rc.decode_iter_s(b, c, t), 0.01)
            for k in (1, 2, 3, 4):
                check("drafter", cost.drafter_iter_s(b, c, k), rc.drafter_iter_s(b, c, k), 0.01)
            d = SpecDecision.parse(str(rng.choice(["4_1_4", "6_2_8", "5_4_16"])))
            check("sd_iter", cost.sd_iter_s(b, c, d), rc.sd_iter_s(b, c, d), 0.01)
            check("decode_span", cost.decode_span_s(b, c, 500), rc.decode_span_s(b, c, 500), 0.01)
            bp = int(round(_interior(rng, SMALL.prefill_batches)))
            tp = int(round(_interior(rng, SMALL.prefill_tokens_per_seq)))
            check("prefill", cost.prefill_s(bp * tp, 0.0, bp), rc.prefill_s(bp * tp, 0.0, bp), 0.15)
    assert worst["verify"] < 0.01 and worst["prefill"] < 0.15


def test_compare_to_roofline_ratios() -> None:
    rc = roofline()
    rows = profile_from_cost(grid_points(SMALL), rc)
    doubled = tuple(
        ProfileRow(
            r.op,
            r.batch,
            r.context_tokens,
            r.tokens_per_seq,
            2 * r.seconds,
            2 * r.seconds,
            2 * r.seconds,
            1,
        )
        for r in rows
    )
    frame = compare_to_roofline(Profile(doubled, META, "x.csv"), rc)
    assert len(frame) == len(rows) and np.allclose(frame["ratio"], 2.0)
    summary = summarize_comparison(frame)
    assert list(summary["op"]) == [
        "decode",
        "verify",
        "drafter",
        "prefill",
        "sd_switch",
        "train",
        "drafter_train",
    ]
    assert np.allclose(summary["median_ratio"], 2.0)


def test_training_beyond_one_update_costs_that_many_updates() -> None:
    """Train rows time one update; a step of 100 updates' worth of sequences costs 100 of the
    largest measured update, optimizer step included each time (no warning: expected use)."""
    rows = tuple(
        ProfileRow(op, b, 0, s, t, t, t, 1)
        for op in ("train", "drafter_train")
        for s in (512, 2048)
        for b in (1, 2, 4, 8)
        for t in [0.5 + 1e-4 * b * s]
    )
    base = Profile(
        tuple(r for r in bilinear_profile().rows if r.op not in ("train", "drafter_train")) + rows,
        META,
        "t.csv",
    )
    cost = ProfileCost(base)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileExtrapolationWarning)
        assert cost.train_s(100 * 8 * 512, 512) == pytest.approx(100 * (0.5 + 1e-4 * 8 * 512))
        assert cost.train_s(3 * 512, 512) == pytest.approx(0.5 + 1e-4 * 3 * 512)  # one update
        # Length 0 (unknown): the shortest measured, 512: 16 sequences, two updates of 8.
        assert cost.drafter_train_s(4 * 2048, 0.0) == pytest.approx(2 * (0.5 + 1e-4 * 8 * 512))
    assert not cost.extrapolations


def test_prefill_on_a_cache_and_switch_without_rows() -> None:
    rc = roofline()
    rows = tuple(r for r in profile_from_cost(grid_points(SMALL), rc) if r.op != "sd_switch")
    cost = ProfileCost(Profile(rows, META, "no_switch.csv"))
    # Without sd_switch rows the switch costs the target's re-prefill of the running requests.
    assert cost.sd_switch_s(16, 16 * 3000.0) == cost.prefill_s(48_000, 0.0, 16)
    # On a cache, the new tokens cost at least a fresh prefill, and about what the roofline says.
    fresh, cached = cost.prefill_s(8 * 256, 0.0, 8), cost.prefill_s(8 * 256, 8 * 3000.0, 8)
    assert cached >= fresh
    assert cached == pytest.approx(rc.prefill_s(8 * 256, 8 * 3000.0, 8), rel=0.1)


def test_single_measured_value_is_held_with_a_warning() -> None:
    rows = tuple(ProfileRow("train", b, 0, 512, t, t, t, 1) for b in (1, 2) for t in [0.1 * b])
    base = Profile(
        tuple(r for r in bilinear_profile().rows if r.op != "train") + rows, META, "one_len.csv"
    )
    cost = ProfileCost(base)
    with pytest.warns(
        ProfileExtrapolationWarning, match="train: sequence tokens 2048 .* holding it constant"
    ):
        assert cost.train_s(2 * 2048, 2048) == pytest.approx(0.1 * 2)


def _rising(ys: list[float]) -> bool:
    """Nondecreasing up to rounding (interpolated and knot values differ in the last bits)."""
    return all(y1 >= y0 * (1 - 1e-9) for y0, y1 in zip(ys, ys[1:], strict=False))


def test_more_sequences_never_cost_less_beyond_the_grid_either() -> None:
    """Each batch's curve extrapolates with its own end slopes: the H200 profile priced a prefill
    of sixteen 16-token prompts (below its 256..1024 grid) at 3 ms and one at 37 ms, and the
    drafter at 20,000 tokens of context (above it) cheaper at batch 64 than at 16. A batch's
    curve is now never below the previous batch's, inside or outside the grid."""
    from pathlib import Path

    from tltsim.cost.profile import load_profile

    path = Path(__file__).resolve().parents[1] / "profiles" / "h200_qwen2.5-1.5b_random.csv"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileExtrapolationWarning)
        cost = ProfileCost(load_profile(path))
        batches = [1, 2, 3, 5, 8, 12, 16, 24, 32, 64, 100, 128]
        for per_seq in (2, 16, 100, 256, 600, 1024, 4096):
            ys = [cost.prefill_s(b * per_seq, 0.0, b) for b in batches]
            assert _rising(ys), ("prefill", per_seq, ys)
        for per_seq in (1, 64, 1000, 8192, 20_000, 60_000):
            for t in (1, 4):
                ys = [cost.drafter_iter_s(b, b * per_seq, t) for b in batches]
                assert _rising(ys), ("drafter", per_seq, t, ys)
            ys = [cost.decode_iter_s(b, b * per_seq, 1) for b in batches]
            assert _rising(ys), ("decode", per_seq, ys)
    # a measured point is still its measured (envelope) value
    row = next(r for r in cost.profile.rows if r.op == "prefill" and r.batch == 16)
    assert cost.prefill_s(16 * row.tokens_per_seq, 0.0, 16) == pytest.approx(row.seconds)
    # and the raise is said, per table (an exactly bilinear profile needs none)
    lines = cost.extrapolation_report()
    said = "op prefill: 1 of 2 batch curves (batch 16) raised to a smaller batch's"
    assert any(line.startswith(said) for line in lines), lines
    assert not ProfileCost(bilinear_profile()).batch_raises
