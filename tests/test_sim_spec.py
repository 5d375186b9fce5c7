"""Speculative decoding, TLTAdaptive and spot drafter training in the simulator.

.venv/bin/python -m pytest tests/test_sim_spec.py -q
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from simtools import clusters, make_trace, roofline, run, small_traces

from tltsim.policy import OFF, SpecDecision, TrainDecision
from tltsim.policy.spec import SpecPolicy
from tltsim.sim.acceptance import DrafterDynamics, accept_len_pmf
from tltsim.sim.batch import AcceptDist, sample_iterations
from tltsim.sim.config import SimConfig
from tltsim.sim.instance import CATCHUP_PAIRS
from tltsim.sim.metrics import ideal_rollout_s
from tltsim.sim.simulator import simulate
from tltsim.sim.spot_schedule import SpotOutcome, TrainingSpan, spot_schedule
from tltsim.trace.files import load_trace
from tltsim.trace.schema import Trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Top-1 and sibling acceptance 0: every verify emits only the target's own token.
USELESS = DrafterDynamics(
    max_accept_rate=0.0, initial_accept_rate=0.0, stale_accept_rate=0.0, sibling_rate=0.0
)
PERFECT = DrafterDynamics(max_accept_rate=1.0, initial_accept_rate=1.0, stale_accept_rate=1.0)


@FAST
@given(trace=small_traces(), cluster=clusters())
def test_tokens_equal_the_trace_under_every_policy(trace: Trace, cluster: dict) -> None:
    for policy in ("static", "tlt"):
        result = run(trace, policy, **cluster)
        for rec, step, fin in zip(result.steps, trace.steps, result.finish_s, strict=True):
            assert rec.tokens_generated == step.total_response_tokens
            assert not np.isnan(fin).any()
            assert rec.rollout_s >= rec.ideal_rollout_s * (1 - 1e-9)  # rounding of the clock
            # drafter training and idleness split the bubble exactly
            assert rec.drafter_train_gpu_s + rec.idle_gpu_s == pytest.approx(
                rec.bubble_gpu_s, abs=1e-6
            )
        starts = [s.start_s for s in result.steps]
        assert starts == sorted(starts)


@FAST
@given(trace=small_traces(), cluster=clusters())
def test_useless_drafter_never_beats_nospec(trace: Trace, cluster: dict) -> None:
    # Accept length fixed at 1 token: SD pays drafting and verification for nothing.
    base = run(trace, "nospec", **cluster)
    for policy in ("static", "tlt"):
        spec = run(trace, policy, drafter=USELESS, **cluster)
        for b, s in zip(base.steps, spec.steps, strict=True):
            assert s.rollout_s >= b.rollout_s * (1 - 1e-12)
            if s.sd_verifies:
                assert s.mean_accept_len == pytest.approx(1.0)


@FAST
@given(trace=small_traces(max_len=1500), cluster=clusters())
def test_fast_matches_exact_with_deterministic_acceptance(trace: Trace, cluster: dict) -> None:
    # With every draft accepted the accept length is fixed, so the only approximation left in
    # fast mode is the closed-form span cost.
    for policy in ("static", "tlt"):
        fast = run(trace, policy, drafter=PERFECT, **cluster)
        exact = run(trace, policy, drafter=PERFECT, exact=True, **cluster)
        for f, e in zip(fast.steps, exact.steps, strict=True):
            assert f.step_s == pytest.approx(e.step_s, rel=0.01)
            assert f.tokens_generated == e.tokens_generated


def test_fast_matches_exact_in_expectation_with_random_acceptance() -> None:
    trace = load_trace(TRACES / "azure_conv_rl.json")
    means = {}
    for exact in (False, True):
        # 8 seeds: the means of 4 differed by 3.3% by chance in one step (16 agree to 0.1%)
        runs = [run(trace, "tlt", num_gpus=8, exact=exact, seed=s) for s in range(8)]
        means[exact] = np.mean([[rec.rollout_s for rec in r.steps] for r in runs], axis=0)
        accept = np.mean([r.summary()["mean_accept_len"] for r in runs])
        means[(exact, "accept")] = accept
    assert means[False] == pytest.approx(means[True], rel=0.03)
    assert means[(False, "accept")] == pytest.approx(means[(True, "accept")], rel=0.02)


def test_same_seed_same_numbers_with_sd() -> None:
    trace = load_trace(TRACES / "synth_reasoning_rl.json")
    trace = Trace(trace.meta, trace.steps[:2])
    a = run(trace, "tlt", num_gpus=8, seed=3).steps_frame()
    b = run(trace, "tlt", num_gpus=8, seed=3).steps_frame()
    c = run(trace, "tlt", num_gpus=8, seed=4).steps_frame()
    assert a.equals(b)
    assert not a.rollout_s.equals(c.rollout_s)


def test_tlt_beats_nospec_and_matches_static_on_a_long_tail_trace() -> None:
    trace = load_trace(TRACES / "synth_reasoning_rl.json")
    trace = Trace(trace.meta, trace.steps[:4])
    step = {
        p: [run(trace, p, num_gpus=8, seed=s).summary()["mean_step_s"] for s in range(3)]
        for p in ("nospec", "static", "tlt")
    }
    assert np.mean(step["tlt"]) < 0.8 * np.mean(step["nospec"])
    noise = 3 * np.std(step["static"] + step["tlt"]) + 1e-9
    assert np.mean(step["tlt"]) <= np.mean(step["static"]) + noise


def test_tlt_switches_sd_on_only_in_the_tail() -> None:
    # 64 requests on one instance: SD must stay off while more than 32 are active.
    trace = make_trace([[[100 + 40 * i for i in range(64)]]])
    result = run(trace, "tlt", num_gpus=1)
    frame = result.timeline_frame()
    sd = frame[frame.phase.isin(["sd", "reprefill"])]
    assert len(sd) and sd.num_active.max() <= 32
    assert (frame[frame.phase == "decode"].num_active > 32).any()
    assert 0 < result.steps[0].sd_on_fraction < 1


def test_spot_training_recovers_the_drafter_that_drift_wears_down() -> None:
    trace = load_trace(TRACES / "synth_reasoning_rl.json")
    drafter = DrafterDynamics(drift_per_step=0.3)
    trained = run(trace, "static", num_gpus=8, drafter=drafter)
    frozen = run(trace, "static", num_gpus=8, drafter=drafter, is_spot=False)
    assert all(rec.drafter_trained_tokens > 0 for rec in trained.steps)
    assert all(
        rec.drafter_trained_tokens == 0 and rec.drafter_train_gpu_s == 0 for rec in frozen.steps
    )
    acc_trained = [rec.drafter_acceptance for rec in trained.steps]
    acc_frozen = [rec.drafter_acceptance for rec in frozen.steps]
    assert acc_frozen == sorted(acc_frozen, reverse=True) and acc_frozen[-1] < acc_frozen[0]
    assert acc_trained[-1] > acc_frozen[-1]
    assert trained.summary()["mean_accept_len"] > frozen.summary()["mean_accept_len"]


def test_spot_schedule_startup_cap_and_preemption() -> None:
    # Instance 0 idles at t=10, instance 1 at t=20; the rollout ends at t=40; start-up 2 s.
    go = TrainDecision(workers=(0,), max_updates=1000)
    both = TrainDecision(workers=(0, 1), max_updates=1000)
    out = spot_schedule(
        [(10.0, go), (20.0, both)], 3, 40.0, 2.0, tokens_per_s=100.0, update_tokens=10
    )
    assert out.trained_s.tolist() == pytest.approx([28.0, 18.0, 0.0])
    assert out.tokens == 100 * 46
    assert [(g.instance, g.start_s, g.end_s) for g in out.segments] == [
        (0, 12.0, 40.0),
        (1, 22.0, 40.0),
    ]
    # A cap of 5 updates x 10 tokens x 1 worker at 100 tokens/s: half a second of training.
    capped = spot_schedule(
        [(10.0, TrainDecision(workers=(0,), max_updates=5))], 1, 40.0, 2.0, 100.0, 10
    )
    assert capped.trained_s[0] == pytest.approx(0.5) and capped.tokens == 50
    # 90 tokens by worker 0 alone (1.1 s to 2 s: 1.8 updates of 50), then a decision of 1
    # update per worker with worker 1: the step ran 1.8 already (tltrun's spot trainer counts
    # the step's drafter versions), so nothing more (it restarted the cap: 190 tokens)
    two = [(1.0, TrainDecision(workers=(0,), max_updates=2)),
           (2.0, TrainDecision(workers=(0, 1), max_updates=1))]  # fmt: skip
    assert spot_schedule(two, 3, 10.0, 0.1, 100.0, 50).tokens == 90
    # ... and a cap of 3 leaves 1.2 updates of 2 x 50 tokens: 120 more, reached at 2.65 s
    # (worker 1 ready at 2.1 s), 210 tokens, not the 209.99999 the seconds add up to
    three = [two[0], (2.0, TrainDecision(workers=(0, 1), max_updates=3))]
    assert spot_schedule(three, 3, 10.0, 0.1, 100.0, 50).tokens == 210
    none = spot_schedule([(10.0, TrainDecision())], 1, 40.0, 2.0, 100.0, 10)
    assert none.tokens == 0 and none.segments == []


def test_spot_schedule_matches_a_decision_by_decision_reference() -> None:
    rng = np.random.default_rng(1)
    for case in range(40):
        times = np.sort(rng.uniform(0, 30, size=6))
        order = rng.permutation(8)
        decisions = []
        for k, t in enumerate(times):
            workers = tuple(sorted(order[: k + 2].tolist()))
            if case % 3 == 1:  # some decisions drop workers
                workers = tuple(w for w in workers if rng.random() < 0.7)
            updates = int(rng.integers(1, 400)) if case % 2 else 10**9  # binding caps or none
            decision = TrainDecision(workers=workers, max_updates=updates if workers else 0)
            decisions.append((float(t), decision))
        args = (8, 40.0, 1.5, 200.0, 16)
        got, want = spot_schedule(decisions, *args), oracle_spot_schedule(decisions, *args)
        assert got.trained_s == pytest.approx(want.trained_s, abs=1e-9)
        assert got.tokens == pytest.approx(want.tokens, abs=2)
        got_spans, want_spans = (
            np.array(sorted((g.instance, g.start_s, g.end_s) for g in o.segments)).reshape(-1, 3)
            for o in (got, want)
        )
        assert np.allclose(got_spans, want_spans)


@pytest.mark.parametrize("rem", [3.0, 40.0, 100.0, 400.0, 5000.0])
def test_completion_iterations_match_a_brute_force_walk(rem: float) -> None:
    dist = AcceptDist.of(accept_len_pmf(SpecDecision.parse("8_4_32"), 0.7))
    rng = np.random.default_rng(0)
    fast = sample_iterations(rng, np.full(1500, rem), dist)
    walk = np.cumsum(dist.sample(rng, (1500, int(rem))), axis=1)  # (samples, max iterations)
    brute = np.argmax(walk >= rem, axis=1) + 1
    assert fast.mean() == pytest.approx(brute.mean(), rel=0.02, abs=0.05)
    assert fast.std() == pytest.approx(brute.std(), rel=0.1, abs=0.1)
    assert fast.min() >= np.ceil(rem / dist.max_len)


def test_ideal_bound_covers_sd_with_perfect_drafts() -> None:
    trace = make_trace([[[3000] * 4]])
    result = run(trace, "static", num_gpus=1, drafter=PERFECT)
    strategies = sorted(result.strategies_used, key=lambda d: d.strategy)
    assert strategies == [SpecDecision.parse("8_4_32")]
    bound = ideal_rollout_s(result.shares[0], roofline(), 1024, strategies)
    plain = ideal_rollout_s(result.shares[0], roofline(), 1024, [OFF])
    assert result.steps[0].rollout_s >= bound and bound < plain


def test_sd_switch_costs_a_reprefill() -> None:
    trace = make_trace([[[2000, 2000]]])  # one prompt of 200 tokens, two responses
    rec = run(trace, "static", num_gpus=1, share_prompts=False).steps[0]
    assert rec.reprefill_instance_s == pytest.approx(roofline().sd_switch_s(2, 2 * 201))
    # the second response takes the prompt's 199 drafter tokens from the first: 201 + 2 tokens,
    # priced at their attention pairs (203^2 / (201^2 + 2^2) equal sequences; the even split
    # of 2 sequences gave the 201-token one a quarter of its pairs)
    rec = run(trace, "static", num_gpus=1).steps[0]
    seqs = 203**2 / (201**2 + 2**2)
    assert rec.reprefill_instance_s == pytest.approx(roofline().sd_switch_s(seqs, 203), rel=1e-9)
    nospec = run(trace, "nospec", num_gpus=1).steps[0]
    assert nospec.reprefill_instance_s == 0 and dataclasses.asdict(nospec)["sd_tokens"] == 0


def test_requests_admitted_after_sd_switched_on_pay_a_drafter_prefill() -> None:
    """tltrun's engine prefills the drafter over every request admitted once its cache is
    built (``stale_drafter``: one it has seen nothing of); the simulator charged only the
    batch running at the switch, the same for 1 admission or 64."""
    cost = roofline()
    for exact in (False, True):
        spent = {
            n: run(
                make_trace([[[200] * n]], [[2000]]),
                "static",
                num_gpus=1,
                max_running_requests=1,
                share_prompts=False,
                exact=exact,
            )
            .steps[0]
            .reprefill_instance_s
            for n in (1, 8)
        }
        assert spent[1] == pytest.approx(cost.sd_switch_s(1, 2001))  # the switch alone
        # each later admission: one drafter forward over its prompt (target prefilled already)
        want = spent[1] + 7 * cost.drafter_iter_s(1, 0.0, 2000)
        assert spent[8] == pytest.approx(want, rel=1e-9), (exact, spent)


class _EagleGap(SpecPolicy):
    """EAGLE 4_1_4 each iteration, except ``gap`` plain iterations after the first."""

    name = "eagle-gap"

    def __init__(self, gap: int) -> None:
        self.gap, self.num_calls, self.feedback = gap, 0, []

    def decide(self, obs) -> SpecDecision:
        self.num_calls += 1
        return OFF if 2 <= self.num_calls <= 1 + self.gap else SpecDecision.parse("4_1_4")

    def max_hold_iters(self, obs, decision) -> int:
        return 1

    def observe(self, feedback) -> None:
        self.feedback.append(feedback)


@pytest.mark.parametrize("exact", [False, True])
def test_eagle_after_plain_iterations_catches_up_on_their_pairs(exact: bool) -> None:
    """tltrun's engine feeds the EAGLE drafter the pairs plain iterations emitted: up to
    CATCHUP_PAIRS per request inside the next drafting step's first forward, more in a drafter
    forward of their own before it (``RolloutEngine.catchup_pairs``)."""
    cost, trace = roofline(), make_trace([[[2000]]])  # one request, 200 prompt tokens

    def simulated(gap: int) -> tuple[float, list]:
        policy = _EagleGap(gap)
        rec = simulate(trace, SimConfig(num_gpus=1, exact=exact), cost, policy, None, PERFECT)
        return rec.steps[0].reprefill_instance_s, [f for f in policy.feedback if f.decision.enabled]

    switch_only, _ = simulated(0)
    # 100 > CATCHUP_PAIRS: one drafter forward over the 100 pairs, at the context then
    # (prompt + first token + the first verify's 5 + 100)
    long_gap, _ = simulated(100)
    assert CATCHUP_PAIRS < 100
    want = cost.drafter_iter_s(1, 201 + 5 + 100, 100)
    assert long_gap - switch_only == pytest.approx(want, rel=1e-3)
    # 32 pairs: no forward of their own; the first EAGLE iteration after the gap is longer
    # than the next by the catch-up (its first drafter forward takes 33 tokens, not 1)
    short_gap, sd = simulated(32)
    assert short_gap == pytest.approx(switch_only)
    catchup = cost.drafter_iter_s(1, 238, 33) - cost.drafter_iter_s(1, 238, 1)
    assert 0.5 * catchup < sd[1].iteration_s - sd[2].iteration_s < 1.5 * catchup


# -- reference implementation of spot_schedule (the loop it replaced) --------------------------


def _oracle_cap_time(
    t_k: float, t_end: float, starts: np.ndarray, cap_tokens: float, tokens_per_s: float
) -> float:
    """When the epoch's trained tokens reach ``cap_tokens``: tokens(t) = rate x sum over workers
    of max(0, t - start_w) is piecewise linear and increasing, with kinks at the sorted starts."""
    if tokens_per_s <= 0:
        return t_end
    order = np.sort(starts)
    csum = np.cumsum(order)
    active = np.arange(1, order.size + 1)
    ends = np.append(order[1:], t_end)  # with ``active`` workers training until ``ends``
    tokens_at_end = tokens_per_s * (active * ends - csum)
    i = int(np.searchsorted(tokens_at_end, cap_tokens))
    if i >= order.size:
        return t_end
    return (cap_tokens / tokens_per_s + csum[i]) / active[i]


def test_fast_and_exact_mode_choose_the_same_arms_after_a_drafter_switch() -> None:
    """Every draft accepted (deterministic), TLT's bandit over EAGLE and history arms: fast
    mode reports a span whose first iteration re-prefilled the drafter in two parts, and the
    second part advanced the exploration schedule one iteration short, so the arms the two
    modes chose parted at iteration 21 (found by a read-only hunt)."""
    from tltsim.cost.calibrated import preset_cost
    from tltsim.policy import TLTAdaptive
    from tltsim.sim.history_acceptance import HistoryModel

    class Logged(TLTAdaptive):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.arms: list[str] = []

        def observe(self, feedback):
            self.arms += [feedback.decision.arm] * feedback.num_iters
            super().observe(feedback)

    history = HistoryModel(base_logit=-60.0, finished_logit=0.0, history_logit=0.0)  # no match
    settings = dict(threshold=32, warmup_checks=1, strategies=("4_1_4",), bucket_starts=(1,),
                    drafters=("eagle", "history"), epsilon=0.1)  # fmt: skip
    trace = make_trace([[[1500] * 4]])
    arms = {}
    for exact in (False, True):
        policy = Logged(seed=0, **settings)
        cfg = SimConfig(num_gpus=1, exact=exact)
        simulate(trace, cfg, preset_cost("Qwen2.5-7B", "H100-SXM"), policy, None, PERFECT,
                 history=history)  # fmt: skip
        arms[exact] = policy.arms
    common = min(len(arms[False]), len(arms[True]))
    assert common > 300 and "history:4_1_4" in arms[True]
    assert arms[False][:common] == arms[True][:common]


def oracle_spot_schedule(
    decisions: list[tuple[float, TrainDecision]],
    num_instances: int,
    rollout_s: float,
    startup_s: float,
    tokens_per_s: float,
    update_tokens: int,
) -> SpotOutcome:
    """Reference for spot_schedule: decision by decision, one worker stretch at a time; a
    decision's cap counts the updates the step's earlier decisions ran."""
    done = 0.0
    trained = np.zeros(num_instances)
    ready = np.full(num_instances, np.inf)  # first named + startup
    seg_start = np.full(num_instances, np.nan)  # each worker's current training stretch
    seg_end = np.full(num_instances, np.nan)
    segments: list[tuple[int, float, float]] = []
    total = 0.0
    for k, (t_k, decision) in enumerate(decisions):
        t_end = min(decisions[k + 1][0] if k + 1 < len(decisions) else rollout_s, rollout_s)
        if not decision.is_training or t_end <= t_k:
            continue
        workers = np.asarray(decision.workers, dtype=np.int64)
        ready[workers] = np.minimum(ready[workers], t_k + startup_s)
        starts = np.minimum(np.maximum(t_k, ready[workers]), t_end)
        cap = max(0.0, decision.max_updates - done) * update_tokens * workers.size
        stop = min(t_end, _oracle_cap_time(t_k, t_end, starts, cap, tokens_per_s))
        durations = np.maximum(0.0, stop - starts)
        trained[workers] += durations
        total += tokens_per_s * float(durations.sum())
        done += tokens_per_s * float(durations.sum()) / (update_tokens * workers.size)
        on = durations > 0
        w, a = workers[on], starts[on]
        touching = np.abs(seg_end[w] - a) < 1e-9  # the same stretch goes on under this decision
        for i in np.flatnonzero(~touching & ~np.isnan(seg_end[w])):  # a gap: close the old stretch
            segments.append((int(w[i]), float(seg_start[w[i]]), float(seg_end[w[i]])))
        fresh = w[~touching]
        seg_start[fresh] = a[~touching]
        seg_end[w] = a + durations[on]
    for i in np.flatnonzero(~np.isnan(seg_end)):
        segments.append((int(i), float(seg_start[i]), float(seg_end[i])))
    spans = [TrainingSpan(instance=w, start_s=a, end_s=b) for w, a, b in segments]
    return SpotOutcome(trained_s=trained, segments=spans, tokens=int(total))
