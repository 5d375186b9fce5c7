"""The SimPy model without speculation: invariants (hypothesis), fast vs exact mode, bookkeeping.

.venv/bin/python -m pytest tests/test_sim.py -q
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simtools import clusters, make_trace, roofline, run, small_traces

from tltsim.policy import DEFAULT_POLICY_NAMES, OFF, NoSpec
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import SimConfig
from tltsim.sim.metrics import critical_path_s, ideal_bound, response_frontier
from tltsim.sim.simulator import place, simulate
from tltsim.trace.files import load_trace
from tltsim.trace.schema import Trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_timeline(result) -> None:
    """Per (step, instance): segments in order, none overlapping, none running backwards."""
    frame = result.timeline_frame()
    assert (frame.end_s >= frame.start_s - 1e-12).all()
    for (_, _), seg in frame.groupby(["step", "instance"], sort=False):
        starts, ends = seg.start_s.to_numpy(), seg.end_s.to_numpy()
        assert np.all(starts[1:] >= ends[:-1] - 1e-9), "a segment starts before the previous ended"


@FAST
@given(trace=small_traces(), cluster=clusters())
def test_invariants_nospec(trace: Trace, cluster: dict) -> None:
    result = run(trace, "nospec", **cluster)
    starts = [s.start_s for s in result.steps]
    assert starts == sorted(starts), "the clock went backwards between steps"
    for rec, step, fin in zip(result.steps, trace.steps, result.finish_s, strict=True):
        # every response finishes exactly once, inside its step's rollout
        assert fin.size == step.num_responses and not np.isnan(fin).any()
        assert fin.min() >= 0 and fin.max() <= rec.rollout_s + 1e-9
        assert math.isclose(fin.max(), rec.rollout_s, rel_tol=1e-12)
        assert rec.tokens_generated == step.total_response_tokens
        assert rec.step_s >= rec.rollout_s > 0 and rec.train_s > 0
        assert rec.bubble_gpu_s >= -1e-9 and rec.busy_gpu_s > 0
        # busy + idle GPU-seconds account for the whole rollout on every GPU
        assert math.isclose(
            rec.busy_gpu_s + rec.bubble_gpu_s, rec.rollout_s * cluster["num_gpus"], rel_tol=1e-9
        )
        assert rec.rollout_s >= rec.ideal_rollout_s * (1 - 1e-9)  # rounding of the clock
    check_timeline(result)


@FAST
@given(trace=small_traces(), cluster=clusters())
def test_same_seed_same_result_and_independent_simulations(trace: Trace, cluster: dict) -> None:
    first = run(trace, "nospec", **cluster).steps_frame()
    other = run(
        make_trace([[[5, 900, 40]]]), "nospec", num_gpus=2
    )  # a different simulation in between
    again = run(trace, "nospec", **cluster).steps_frame()
    assert first.equals(again)
    assert other.steps[0].tokens_generated == 945


@FAST
@given(
    lengths=st.lists(st.integers(1, 4000), min_size=8, max_size=8).map(lambda xs: xs * 4),
    num_gpus=st.sampled_from([1, 2, 4]),
    max_running=st.sampled_from([2, 8, 1024]),
)
def test_more_instances_never_slower_when_spread_evenly(
    lengths: list[int], num_gpus: int, max_running: int
) -> None:
    # 32 requests, round robin: each instance of the doubled cluster holds a subset of the
    # requests its counterpart held, in the same order.
    trace = make_trace([[lengths]])
    slow = (
        run(trace, "nospec", num_gpus=num_gpus, max_running_requests=max_running).steps[0].rollout_s
    )
    fast = (
        run(trace, "nospec", num_gpus=2 * num_gpus, max_running_requests=max_running)
        .steps[0]
        .rollout_s
    )
    assert fast <= slow * (1 + 1e-12)


def test_fast_matches_exact_on_every_step_of_a_sample_trace() -> None:
    trace = load_trace(TRACES / "azure_conv_rl.json")
    config = SimConfig(num_gpus=8)
    fast = simulate(trace, config, roofline(), NoSpec())
    exact = simulate(trace, dataclasses.replace(config, exact=True), roofline(), NoSpec())
    for f, e in zip(fast.steps, exact.steps, strict=True):
        assert f.step_s == pytest.approx(e.step_s, rel=0.01)
        assert f.rollout_s == pytest.approx(e.rollout_s, rel=1e-9)  # no approximation without SD
    assert [f.tokens_generated for f in fast.steps] == [e.tokens_generated for e in exact.steps]
    # exact mode merges runs of identical iterations into one timeline segment in every step
    # (after step 0 the step-relative times differed in their last bits: a row per iteration)
    rows = np.bincount([seg.step for seg in exact.timeline])
    assert rows.max() <= 2 * rows[0] and len(exact.timeline) <= 3 * len(fast.timeline)


def test_continuous_batching_admits_queued_requests_when_slots_free() -> None:
    # One instance, two slots, lengths 10, 100, 20: the third request starts when the first ends.
    trace = make_trace([[[10, 100, 20]]], [[50]])
    result = run(trace, "nospec", num_gpus=1, max_running_requests=2)
    fin = result.finish_s[0]
    assert fin[0] < fin[2] < fin[1]
    prefills = [seg for seg in result.timeline if seg.phase == "prefill"]
    assert [seg.num_active for seg in prefills] == [2, 2]  # batch after each admission
    assert prefills[1].start_s == pytest.approx(fin[0])  # admitted the moment a slot freed


def test_decode_time_is_the_closed_form_span() -> None:
    # One request of n tokens on one GPU: prefill + (n - 1) iterations of a growing context.
    cost = roofline()
    trace = make_trace([[[1000]]], [[300]])
    rollout = run(trace, "nospec", num_gpus=1).steps[0].rollout_s
    expected = cost.prefill_s(300, 0.0, 1) + sum(
        cost.decode_iter_s(1, 301 + i, 1) for i in range(999)
    )
    assert rollout == pytest.approx(expected, rel=1e-9)


def test_tail_and_bubble_bookkeeping() -> None:
    # Two instances: one holds a 20-token request, the other a 4000-token one.
    trace = make_trace([[[20, 4000]]])
    rec = run(trace, "nospec", num_gpus=2).steps[0]
    rows = run(trace, "nospec", num_gpus=2).instances_frame()
    assert rec.first_idle_s == pytest.approx(rows.busy_s.min())
    assert rec.bubble_gpu_s == pytest.approx(rec.rollout_s - rows.busy_s.min())
    assert rec.max_tail_s == pytest.approx(rec.rollout_s)  # one active request < 32 all along
    assert rec.train_s == pytest.approx(
        roofline().train_s(round((2 * 200 + 4020) / 2), (2 * 200 + 4020) / 2)
    )


@pytest.mark.parametrize("placement", ["round_robin", "chunked", "random"])
def test_placement_assigns_every_request_once(placement: str) -> None:
    owners = place(103, 8, placement, np.random.default_rng(0))
    flat = np.sort(np.concatenate(owners))
    assert np.array_equal(flat, np.arange(103))
    if placement != "random":
        assert max(o.size for o in owners) - min(o.size for o in owners) <= 1


def test_bad_config_is_rejected_with_the_field_name() -> None:
    with pytest.raises(ValueError, match="num_gpus=6 is not a multiple of tp=4"):
        SimConfig(num_gpus=6, tp=4)
    with pytest.raises(ValueError, match="placement"):
        SimConfig(placement="best")


class _RecordingCost:
    """The roofline, recording the context and prefill sizes the simulator asks for."""

    def __init__(self, is_context_padded: bool):
        self.inner = roofline()
        self.is_context_padded = is_context_padded
        self.decode_contexts: list[float] = []
        self.prefills: list[tuple[int, float]] = []

    def decode_iter_s(self, batch, context_tokens, tokens_per_seq=1):
        self.decode_contexts.append(context_tokens)
        return self.inner.decode_iter_s(batch, context_tokens, tokens_per_seq)

    def decode_span_s(self, batch, context_tokens, num_iters):
        self.decode_contexts.append(context_tokens)
        return self.inner.decode_span_s(batch, context_tokens, num_iters)

    def prefill_s(self, num_tokens, context_tokens=0.0, num_seqs=1):
        self.prefills.append((num_tokens, num_seqs))
        return self.inner.prefill_s(num_tokens, context_tokens, num_seqs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("is_padded", [False, True])
def test_padded_engines_are_costed_at_the_longest_context(exact: bool, is_padded: bool) -> None:
    """Prompts of 10 and 100 tokens, responses of 5 and 50: a paged engine's first decode reads
    11 + 101 context tokens, a padded one (tltrun's torch engine) 2 x 101; its prefill pads
    both prompts to 100 tokens. After the short response ends, one request is left: equal.
    (Further calls come from the run's summary metrics.)"""
    trace = make_trace([[[5], [50]]], [[10, 100]])
    cost = _RecordingCost(is_padded)
    cfg = SimConfig(num_gpus=1, max_running_requests=2, exact=exact)
    simulate(trace, cfg, cost, NoSpec(), None, None)
    # then the metrics' own calls; a paged engine's uneven prompts are priced as 110^2 /
    # (10^2 + 100^2) equal ones (their attention pairs), a padded one's as two of 100
    assert cost.prefills[0] == ((200, 2) if is_padded else (110, pytest.approx(12100 / 10100)))
    assert cost.decode_contexts[0] == (2 * 101 if is_padded else 11 + 101)
    # the last call: the long request alone (context 100 + 5 + ... in both cases)
    # padded: the batch grows 2 tokens per iteration, as the summed context does
    if exact:
        first = cost.decode_contexts[:4]
        assert first == [cost.decode_contexts[0] + 2 * i for i in range(4)]
    # the short response is done after 4 iterations: the long one alone, at 100 + 5 tokens
    assert cost.decode_contexts[4 if exact else 1] == 105


@pytest.mark.parametrize("exact", [True, False])
def test_a_short_request_beside_a_long_prompt_never_shortens_its_rollout(exact: bool) -> None:
    """A 16k-token prompt with one response token, then with a 1-token request beside it: the
    prefill priced the pair's attention as two 8k prompts (half the pairs), so the rollout
    with more work was shorter, and below the ideal bound (found by a read-only hunt)."""
    from tltsim.cost.calibrated import preset_cost

    cost = preset_cost("Qwen2.5-7B", "H100-SXM")
    alone = make_trace([[[1]]], [[16_000]])
    both = make_trace([[[1], [1]]], [[16_000, 1]])
    cfg = SimConfig(num_gpus=1, max_running_requests=8, exact=exact)
    one, two = (simulate(t, cfg, cost, NoSpec(), None, None).steps[0] for t in (alone, both))
    assert two.rollout_s >= one.rollout_s
    assert two.rollout_s >= two.ideal_rollout_s and one.rollout_s >= one.ideal_rollout_s


def _prefill_s(result) -> float:
    frame = result.timeline_frame()
    part = frame[frame["phase"] == "prefill"]
    return float((part["end_s"] - part["start_s"]).sum())


def test_a_group_shares_its_prompt_prefill_while_a_sibling_runs() -> None:
    cost = roofline()
    trace = make_trace([[[50, 60, 70, 80]]])  # one prompt (200 tokens), four responses
    shared = run(trace, num_gpus=1)
    # one prefill of the prompt, then the three followers' last prompt token in one forward
    want = cost.prefill_s(200, 0.0, 1) + cost.decode_iter_s(3, 3 * 199, 1)
    assert _prefill_s(shared) == pytest.approx(want)
    assert _prefill_s(run(trace, num_gpus=1, share_prompts=False)) == pytest.approx(
        cost.prefill_s(800, 0.0, 4)
    )
    # one slot: each response starts after its sibling left, so each prefills the prompt
    alone = run(trace, num_gpus=1, max_running_requests=1)
    assert _prefill_s(alone) == pytest.approx(4 * cost.prefill_s(200, 0.0, 1))
    # two slots, 50 and 60 first: 70 is admitted while 60 runs and follows it; 80 follows 70
    pairs = run(trace, num_gpus=1, max_running_requests=2)
    follow = cost.decode_iter_s(1, 199, 1)
    want = cost.prefill_s(200, 0.0, 1) + 3 * follow
    assert _prefill_s(pairs) == pytest.approx(want)


def test_shared_prompts_reuse_whole_blocks_only() -> None:
    cost = roofline()
    trace = make_trace([[[50, 60, 70, 80]]])  # one prompt of 200 tokens, four responses
    # vLLM-like blocks of 16: a follower reuses 192 tokens and prefills the other 8
    blocks = run(trace, num_gpus=1, prefix_block_tokens=16)
    want = cost.prefill_s(200, 0.0, 1) + cost.prefill_s(3 * 8, 3 * 192.0, 3)
    assert _prefill_s(blocks) == pytest.approx(want)
    # blocks longer than the prompt: nothing to share, every response prefills it
    none = run(trace, num_gpus=1, prefix_block_tokens=256)
    assert _prefill_s(none) == pytest.approx(cost.prefill_s(800, 0.0, 4))
    with pytest.raises(ValueError, match="prefix_block_tokens"):
        SimConfig(prefix_block_tokens=0)


# -- the ideal bound: max(work bound, critical path) --------------------------------------------

PERFECT = DrafterDynamics(max_accept_rate=1.0, initial_accept_rate=1.0, stale_accept_rate=1.0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    trace=small_traces(),
    cluster=clusters(),
    policy=st.sampled_from(DEFAULT_POLICY_NAMES),
    is_perfect=st.booleans(),
    exact=st.booleans(),
)
def test_rollout_never_beats_the_ideal_bound(
    trace: Trace, cluster: dict, policy: str, is_perfect: bool, exact: bool
) -> None:
    result = run(trace, policy, drafter=PERFECT if is_perfect else None, exact=exact, **cluster)
    for rec in result.steps:
        assert rec.ideal_rollout_s == max(rec.ideal_work_s, rec.ideal_critical_path_s)
        assert rec.ideal_critical_path_s > 0 and rec.ideal_work_s > 0
        assert rec.rollout_s >= rec.ideal_rollout_s * (1 - 1e-9)  # rounding of the clock


def test_one_long_response_makes_the_critical_path_dominate() -> None:
    # 63 short responses and one of 30k tokens on 8 GPUs: the work is small, the tail is not
    lengths = [[[100] * 8] * 7 + [[100] * 7 + [30_000]]]
    rec = run(make_trace(lengths), "nospec", num_gpus=8).steps[0]
    assert rec.ideal_critical_path_s > 10 * rec.ideal_work_s
    assert rec.ideal_rollout_s == rec.ideal_critical_path_s
    # the old work-only ratio suggested >10x headroom; against the honest bound there is little
    assert rec.rollout_s / rec.ideal_work_s > 10
    assert 1.0 <= rec.rollout_s / rec.ideal_rollout_s < 1.05


def test_many_equal_responses_make_the_work_bound_dominate() -> None:
    # 2048 responses of 500 tokens on one GPU: compute-bound batches of 1024 take far longer
    # than one response alone
    rec = run(make_trace([[[500] * 16] * 128]), "nospec", num_gpus=1).steps[0]
    assert rec.ideal_work_s > 2 * rec.ideal_critical_path_s
    assert rec.ideal_rollout_s == rec.ideal_work_s


@pytest.mark.parametrize("policy", ["nospec", "static"])
def test_critical_path_is_tight_for_one_response_alone(policy: str) -> None:
    # one response on one GPU, every draft accepted: the rollout is its critical path, plus the
    # SD switch's re-prefill and what the bound's chunked context leaves out
    result = run(make_trace([[[8000]]]), policy, num_gpus=1, drafter=PERFECT)
    rec = result.steps[0]
    assert rec.ideal_critical_path_s <= rec.rollout_s <= 1.03 * rec.ideal_critical_path_s
    shares = result.shares[0]
    assert critical_path_s(200, 8000, roofline(), []) == pytest.approx(
        ideal_bound(shares, roofline(), 1024, [OFF]).critical_path_s
    )


def test_response_frontier_keeps_only_undominated_pairs() -> None:
    prompts = np.array([10, 20, 20, 5, 30, 1])
    responses = np.array([900, 50, 800, 1000, 10, 1000])
    assert response_frontier(prompts, responses) == ((30, 10), (20, 800), (10, 900), (5, 1000))


def test_simulator_runs_history_drafter_decisions() -> None:
    """The history drafter has its own acceptance model (#20 item 3; tests/test_history_sim.py):
    TLTBase simulates, every response finishes at its trace length, and replay lists it."""
    from tltsim.sim.replay import policy_names

    trace = make_trace([[[40] * 4, [300] * 4]])
    result = run(trace, "tltbase", num_gpus=1, tp=1)
    assert result.steps[0].num_responses == 8
    assert {d.drafter for d in result.strategies_used} == {"history"}
    assert policy_names("nospec,tltbase") == ("nospec", "tltbase")
    assert policy_names("all") == ("nospec", "static", "tlt", "tltbase")
