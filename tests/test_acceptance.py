"""Acceptance model (chain formula, tree model, sampler) and drafter dynamics.

Monte-Carlo checks walk the drafting process itself in plain Python (independent of the
library's closed forms) and accept a deviation of at most 4 standard errors of the mean.

Run: .venv/bin/python -m pytest tests/test_acceptance.py -q
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tltsim.policy import OFF, SpecDecision
from tltsim.sim.acceptance import (
    DEFAULT_SIBLING_RATE,
    DrafterDynamics,
    DrafterState,
    accept_len_pmf,
    build_tree,
    chain_expected_accept_len,
    expected_accept_len,
    rank_probs,
    sample_accept_lengths,
)

MC_SAMPLES = 20_000


def walk_chain(rng: random.Random, accept_rate: float, draft_steps: int) -> int:
    """Verify drafted tokens left to right; stop at the first rejection; add the bonus token."""
    accepted = 0
    while accepted < draft_steps and rng.random() < accept_rate:
        accepted += 1
    return accepted + 1


def walk_tree(
    rng: random.Random, decision: SpecDecision, accept_rate: float, sibling_rate: float
) -> int:
    """At each depth the target picks a token; it is the drafter's rank-r guess with probability
    q_r. Follow the verified child of that rank; stop when there is none."""
    tree = build_tree(
        decision.draft_steps, decision.topk, decision.verify_tokens, accept_rate, sibling_rate
    )
    children = {(tree.parent[n], tree.rank[n]): n for n in range(1, len(tree.parent))}
    q = rank_probs(accept_rate, sibling_rate, decision.topk)
    node, length = 0, 1
    while True:
        u, rank = rng.random(), None
        for r, p in enumerate(q):
            if u < p:
                rank = r
                break
            u -= p
        if rank is None or (node, rank) not in children:
            return length
        node, length = children[(node, rank)], length + 1


def assert_mc_mean(samples: list[int], expected: float) -> None:
    mean = sum(samples) / len(samples)
    sd = float(np.std(samples))
    assert abs(mean - expected) <= 4 * sd / math.sqrt(len(samples)) + 1e-12, (mean, expected)


# --- chain ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("accept_rate", [0.3, 0.6, 0.8, 0.95])
@pytest.mark.parametrize("draft_steps", [1, 4, 8])
def test_chain_formula_matches_monte_carlo(accept_rate, draft_steps):
    rng = random.Random(f"chain:{accept_rate}:{draft_steps}")
    samples = [walk_chain(rng, accept_rate, draft_steps) for _ in range(MC_SAMPLES)]
    assert_mc_mean(samples, chain_expected_accept_len(accept_rate, draft_steps))


@settings(max_examples=100, deadline=None)
@given(a=st.floats(0, 1), k=st.integers(1, 12))
def test_chain_formula_agrees_with_tree_model_and_pmf(a, k):
    chain = SpecDecision(enabled=True, draft_steps=k, topk=1, verify_tokens=k)
    closed = chain_expected_accept_len(a, k)
    assert closed == pytest.approx(1 + sum(a**i for i in range(1, k + 1)), rel=1e-9)
    assert expected_accept_len(chain, a) == pytest.approx(closed, rel=1e-9)
    assert build_tree(k, 1, k, a).expected_accept_len == pytest.approx(closed, rel=1e-9)
    pmf = accept_len_pmf(chain, a)
    assert pmf @ np.arange(1, k + 2) == pytest.approx(closed, rel=1e-9)


# --- tree ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["8_4_48", "8_4_16", "8_4_8", "6_10_60", "3_2_6"])
@pytest.mark.parametrize(("accept_rate", "sibling_rate"), [(0.8, DEFAULT_SIBLING_RATE), (0.5, 0.5)])
def test_tree_model_matches_monte_carlo(strategy, accept_rate, sibling_rate):
    decision = SpecDecision.parse(strategy)
    rng = random.Random(f"tree:{strategy}:{accept_rate}")
    samples = [walk_tree(rng, decision, accept_rate, sibling_rate) for _ in range(MC_SAMPLES)]
    assert_mc_mean(samples, expected_accept_len(decision, accept_rate, sibling_rate))
    # The exact pmf matches the empirical distribution too (4 binomial standard errors).
    pmf = accept_len_pmf(decision, accept_rate, sibling_rate)
    counts = np.bincount(samples, minlength=pmf.size + 1)[1:] / MC_SAMPLES
    assert np.all(np.abs(counts - pmf) <= 4 * np.sqrt(pmf * (1 - pmf) / MC_SAMPLES) + 1e-9)


tree_shapes = st.tuples(st.integers(1, 8), st.integers(1, 6), st.integers(1, 64)).map(
    lambda t: SpecDecision(
        enabled=True,
        draft_steps=t[0],
        topk=t[1],
        verify_tokens=min(t[2], sum(t[1] ** i for i in range(1, t[0] + 1))),
    )
)


@settings(max_examples=150, deadline=None)
@given(decision=tree_shapes, a=st.floats(0, 1), b=st.floats(0, 1))
def test_tree_structure_invariants(decision, a, b):
    tree = build_tree(decision.draft_steps, decision.topk, decision.verify_tokens, a, b)
    q = rank_probs(a, b, decision.topk)
    beam = (
        decision.topk + (decision.draft_steps - 1) * decision.topk**2
        if decision.topk > 1
        else decision.draft_steps
    )
    assert tree.num_nodes == min(decision.verify_tokens, beam)
    for node in range(1, len(tree.parent)):
        parent = tree.parent[node]
        assert parent < node  # parents are verified and precede their children
        assert tree.depth[node] == tree.depth[parent] + 1 <= decision.draft_steps
        assert tree.value[node] == pytest.approx(tree.value[parent] * q[tree.rank[node]], abs=1e-15)
    pmf = accept_len_pmf(decision, a, b)
    assert pmf.size == decision.draft_steps + 1 and pmf.sum() == pytest.approx(1.0)
    assert np.all(pmf >= -1e-12)
    assert pmf @ np.arange(1, pmf.size + 1) == pytest.approx(tree.expected_accept_len, rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(decision=tree_shapes, a=st.floats(0, 0.99), frac=st.floats(0, 1))
def test_more_verify_tokens_or_acceptance_never_lowers_expectation(decision, a, frac):
    # With b <= a (a sibling is never likelier than the top guess) a better top-1 acceptance
    # cannot hurt; with b > a it can (raising a moves mass from rank 2 to rank 1).
    b = a * frac
    base = expected_accept_len(decision, a, b)
    if decision.verify_tokens < sum(decision.topk**i for i in range(1, decision.draft_steps + 1)):
        more = dataclasses.replace(decision, verify_tokens=decision.verify_tokens + 1)
        assert expected_accept_len(more, a, b) >= base - 1e-12
    assert expected_accept_len(decision, a + 0.01, b) >= base - 1e-12
    assert 1.0 <= base <= decision.draft_steps + 1


def test_default_sibling_rate_puts_eagle2_default_tree_in_published_range():
    # EAGLE-2's reference tree: depth 6, top-10, 60 verified nodes; its reported accept lengths
    # are about 4-5.5 (see DEFAULT_SIBLING_RATE).
    assert 4.0 <= expected_accept_len(SpecDecision.parse("6_10_60"), 0.8) <= 5.5


def test_trees_beat_chains_of_the_same_depth():
    chain = expected_accept_len(SpecDecision.parse("8_1_8"), 0.8)
    tree = expected_accept_len(SpecDecision.parse("8_4_48"), 0.8)
    assert chain < tree < 9


# --- sampler -------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    decision=tree_shapes,
    a=st.floats(0, 1),
    b=st.floats(0, 1),
    n=st.integers(0, 300),
    seed=st.integers(0, 2**32 - 1),
)
def test_sampled_accept_lengths_within_bounds(decision, a, b, n, seed):
    lengths = sample_accept_lengths(np.random.default_rng(seed), n, decision, a, b)
    assert lengths.shape == (n,) and lengths.dtype == np.int64
    assert np.all(lengths >= 1) and np.all(lengths <= decision.draft_steps + 1)


@pytest.mark.parametrize("strategy", ["8_4_48", "5_1_5", "8_4_8"])
def test_sampler_mean_matches_model(strategy):
    decision = SpecDecision.parse(strategy)
    lengths = sample_accept_lengths(np.random.default_rng(7), 100_000, decision, 0.7)
    assert_mc_mean(lengths.tolist(), expected_accept_len(decision, 0.7))


def test_sampler_edge_cases_and_seeding():
    chain = SpecDecision.parse("5_1_5")
    rng = np.random.default_rng(0)
    assert np.all(sample_accept_lengths(rng, 50, chain, 1.0) == 6)
    assert np.all(sample_accept_lengths(rng, 50, chain, 0.0) == 1)
    assert np.all(sample_accept_lengths(rng, 50, OFF, 0.9) == 1)
    tree = SpecDecision.parse("8_4_32")
    first = sample_accept_lengths(np.random.default_rng(3), 64, tree, 0.8)
    again = sample_accept_lengths(np.random.default_rng(3), 64, tree, 0.8)
    assert np.array_equal(first, again)
    with pytest.raises(ValueError, match="accept_rate"):
        expected_accept_len(tree, 1.5)


# --- drafter dynamics ------------------------------------------------------------------------------


def test_drafter_dynamics_refuse_a_learn_tokens_that_is_not_positive():
    """NaN passed the check and failed mid-run (accept_rate nan after the first training)."""
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="learn_tokens must be > 0"):
            DrafterDynamics(learn_tokens=bad)
    # a drafter that never learns: below its maximum, training leaves it where it is
    never = DrafterDynamics(learn_tokens=math.inf, initial_accept_rate=0.5, max_accept_rate=0.9)
    assert never.after_training(never.initial_state(), 10**6).accept_rate == pytest.approx(0.5)


def test_frozen_drafter_decays_toward_stale_rate():
    dyn = DrafterDynamics()
    state, rates = dyn.initial_state(), []
    for _ in range(200):
        state = dyn.after_rl_step(state)
        rates.append(state.accept_rate)
    assert all(b < a for a, b in zip(rates, rates[1:], strict=False))
    assert rates[-1] >= dyn.stale_accept_rate and rates[-1] == pytest.approx(
        dyn.stale_accept_rate, abs=1e-3
    )
    assert state.num_rl_steps == 200


def test_spot_trained_drafter_recovers():
    dyn = DrafterDynamics()
    frozen = trained = dyn.initial_state()
    for _ in range(30):
        frozen = dyn.after_rl_step(frozen)
        trained = dyn.after_training(dyn.after_rl_step(trained), 2_000_000)
    assert trained.accept_rate > frozen.accept_rate
    assert trained.accept_rate == pytest.approx(dyn.max_accept_rate, abs=0.01)
    assert trained.trained_tokens == 60_000_000


@settings(max_examples=100, deadline=None)
@given(a=st.floats(0, 0.8), n1=st.integers(0, 10**7), n2=st.integers(0, 10**7))
def test_training_is_monotone_and_saturating(a, n1, n2):
    dyn = DrafterDynamics()
    state = DrafterState(a)
    lo, hi = sorted((n1, n2))
    after_lo, after_hi = dyn.after_training(state, lo), dyn.after_training(state, hi)
    assert a - 1e-12 <= after_lo.accept_rate <= after_hi.accept_rate <= dyn.max_accept_rate + 1e-12


def test_dynamics_validation():
    with pytest.raises(ValueError, match="stale_accept_rate <= max_accept_rate"):
        DrafterDynamics(stale_accept_rate=0.9)
    with pytest.raises(ValueError, match="learn_tokens"):
        DrafterDynamics(learn_tokens=0)
    with pytest.raises(ValueError, match="num_tokens"):
        DrafterDynamics().after_training(DrafterState(0.5), -1)
