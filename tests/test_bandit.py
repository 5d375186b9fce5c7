"""TLTAdaptive's BEG-MAB bandit (arm choice, exploration blocks, drafter exploration, span
driver) and policy checkpoints (state_dict round trips).

Run: .venv/bin/python -m pytest tests/test_bandit.py -q
"""

from __future__ import annotations

import random

import pytest
from policy_tools import feedback, obs

from tltsim.policy import (
    OFF,
    BegMab,
    NoDrafterTraining,
    NoSpec,
    SpecDecision,
    SpecFeedback,
    SpotTrainerPolicy,
    StaticSpec,
    TLTAdaptive,
    TLTConfig,
    make_policy,
)

# --- BEG-MAB -------------------------------------------------------------------------------------

ARMS_ONE_BUCKET = {"strategies": ("8_4_32", "6_4_32", "4_4_32"), "bucket_starts": (1,)}
ARM_MEANS = {"8_4_32": 100.0, "6_4_32": 120.0, "4_4_32": 90.0}


def drive_bandit(
    policy: TLTAdaptive, noise: random.Random, rounds: int, batch: int = 8
) -> list[str]:
    chosen = []
    for _ in range(rounds):
        decision = policy.decide(obs(batch))
        tokens = max(0, round(ARM_MEANS[decision.strategy] + noise.gauss(0.0, 30.0)))
        policy.observe(feedback(batch, decision, float(tokens), 1.0))
        chosen.append(decision.strategy)
    return chosen


def test_bandit_converges_to_best_arm():
    policy = TLTAdaptive(seed=1, warmup_checks=1, **ARMS_ONE_BUCKET)
    policy.start_rollout(0)
    chosen = drive_bandit(policy, random.Random(2), 3000)
    assert set(chosen[:3]) == set(ARM_MEANS)  # untried arms first
    late = chosen[-1000:]
    # Exploit picks the best median; exploration (epsilon = 0.1) picks each arm a third of the time.
    assert late.count("6_4_32") / len(late) > 0.85


def test_same_seed_same_decisions_different_seed_differs():
    runs = []
    for seed in (5, 5, 6):
        policy = TLTAdaptive(seed=seed, warmup_checks=1, **ARMS_ONE_BUCKET)
        policy.start_rollout(0)
        runs.append(drive_bandit(policy, random.Random(9), 500))
    assert runs[0] == runs[1] and runs[0] != runs[2]


MIX = {"strategies": ("4_1_4",), "bucket_starts": (1,), "drafters": ("eagle", "history")}
MIX_REWARD = {"eagle": 2.0, "history": 3.0}  # tokens per second of each drafter's arm


def runs_of(decisions: list[SpecDecision]) -> list[tuple[str, int]]:
    """(drafter, length) of each maximal run of equal consecutive decisions."""
    out: list[tuple[str, int]] = []
    for d in decisions:
        if out and out[-1][0] == d.drafter:
            out[-1] = (d.drafter, out[-1][1] + 1)
        else:
            out.append((d.drafter, 1))
    return out


def per_iteration(policy: TLTAdaptive, iters: int, batch: int = 4) -> list[SpecDecision]:
    """A driver that asks before every iteration (tltrun's engine)."""
    policy.start_rollout(0)
    out = []
    for _ in range(iters):
        d = policy.decide(obs(batch))
        policy.observe(feedback(batch, d, MIX_REWARD[d.drafter] if d.enabled else 0.0, 1.0))
        out.append(d)
    return out


def per_span(policy: TLTAdaptive, iters: int, batch: int = 4) -> list[SpecDecision]:
    """A driver that asks once per span, as long as ``max_hold_iters`` lets a decision stand
    (the simulator's fast mode; the batch never changes here)."""
    policy.start_rollout(0)
    out: list[SpecDecision] = []
    while len(out) < iters:
        o = obs(batch)
        d = policy.decide(o)
        hold = policy.max_hold_iters(o, d)
        n = min(iters - len(out), hold if hold is not None else iters)
        reward = MIX_REWARD[d.drafter] if d.enabled else 0.0
        policy.observe(feedback(batch, d, reward, 1.0, num_iters=n))
        out.extend([d] * n)
    return out


def test_exploration_share_is_epsilon_and_blocks_cut_the_drafter_switches():
    """An exploration holds its random arm for explore_iters iterations: the share of
    non-greedy iterations stays about epsilon / 2 (half the random picks are the greedy arm),
    but EAGLE is entered about 16 times less often with blocks of 16."""
    iters = 20_000
    shares, entries = {}, {}
    for block in (1, 16):
        policy = TLTAdaptive(seed=3, warmup_checks=1, explore_iters=block, **MIX)
        seq = per_iteration(policy, iters)[1:]  # the warm-up iteration is OFF
        runs = runs_of(seq)
        eagle = [n for drafter, n in runs if drafter == "eagle"]
        shares[block] = sum(eagle) / len(seq)
        entries[block] = len(eagle)
        if block == 16:  # blocks run whole (a random pick of the greedy arm extends its run)
            assert all(n % 16 == 0 for n in eagle[1:])
    for block in (1, 16):
        assert 0.035 < shares[block] < 0.065, shares  # epsilon 0.1, 2 arms: 0.05
    assert 10 < entries[1] / entries[16] < 25, entries


def test_rollout_drafter_exploration_tries_the_other_drafter_in_an_epsilon_share_of_rollouts():
    """drafter_explore="rollout": a rollout explores the other drafter's arms with probability
    epsilon (drawn at its start, per instance), and a rollout not drawn never leaves the greedy
    arm's drafter; under "iteration" (fastrl) nearly every rollout does."""
    rollouts, iters = 400, 60
    tried = {}
    for mode in ("iteration", "rollout", "rollout/blocks"):
        mode, _, blocks = mode.partition("/")
        policy = TLTAdaptive(seed=5, warmup_checks=1, drafter_explore=mode,
                             explore_iters=16 if blocks else 1, **MIX)  # fmt: skip
        count = 0
        for _ in range(rollouts):
            seq = per_iteration(policy, iters)[1:]  # the warm-up iteration is OFF
            bandit = policy._bandit(0)
            eagle = sum(d.drafter == "eagle" for d in seq)
            if mode == "rollout" and not bandit.is_drafter_round:
                assert eagle == 0  # the greedy arm is history's: nothing else explored
            count += eagle > 0
        tried[mode + blocks] = count / rollouts
    assert tried["iteration"] > 0.9, tried  # 59 draws at epsilon 0.1, half of them EAGLE
    # epsilon 0.1 of rollouts are drafter rounds, each trying EAGLE with probability ~0.95
    # (blocks of 16: ~0.3); the first rollout tries every arm once (an empty window)
    assert 0.05 < tried["rollout"] < 0.15, tried
    assert 0.0 < tried["rolloutblocks"] < 0.1, tried  # no block runs on into a rollout not drawn


def test_rollout_drafter_exploration_keeps_fastrls_stream_without_a_second_drafter():
    """One drafter: nothing is drawn per rollout, the decisions are fastrl's rule exactly."""
    one = {"strategies": ("4_1_4", "3_1_3"), "bucket_starts": (1, 3)}
    runs = {
        mode: [
            d.arm
            for _ in range(5)
            for d in per_iteration(
                TLTAdaptive(seed=1, warmup_checks=1, drafter_explore=mode, **one), 200
            )  # fmt: skip
        ]
        for mode in ("iteration", "rollout")
    }
    assert runs["iteration"] == runs["rollout"]
    with pytest.raises(ValueError, match="drafter_explore"):
        TLTConfig(drafter_explore="step")


def test_explore_iters_must_be_a_positive_integer():
    assert TLTConfig().explore_iters == 1  # fastrl: per iteration
    for bad in (0, -2, 1.5, True, None):
        with pytest.raises(ValueError, match="explore_iters"):
            TLTConfig(explore_iters=bad)


@pytest.mark.parametrize("explore_iters", [1, 4, 16])
def test_span_driver_decides_exactly_as_a_per_iteration_driver(explore_iters):
    """max_hold_iters cuts a span where the bandit's next exploration block starts or ends and
    observe(num_iters) advances the schedule, so asking once per span gives the very decisions
    of asking every iteration (same seed, same rewards)."""
    settings = {"warmup_checks": 3, "epsilon": 0.2, "explore_iters": explore_iters, **MIX}
    a = per_iteration(TLTAdaptive(seed=11, **settings), 3000)
    b = per_span(TLTAdaptive(seed=11, **settings), 3000)
    assert [d.arm for d in a] == [d.arm for d in b]
    assert {d.drafter for d in a if d.enabled} == {"eagle", "history"}


def _drifting_arm_run(policy: TLTAdaptive, is_span: bool) -> list[str]:
    """Two rollouts at batch 1: 8_4_48 earns 10 tokens/s in the first, 5 in the second (a
    drafter that drifted), 4_4_48 earns 9 in both; the arms of every iteration."""
    out: list[str] = []
    for step, iters in enumerate((20, 100)):
        policy.start_rollout(step)
        done = 0
        while done < iters:
            o = obs(1, step=step)
            d = policy.decide(o)
            hold = policy.max_hold_iters(o, d) if is_span else 1
            n = iters - done if hold is None else min(hold, iters - done)
            reward = (10.0 if step == 0 else 5.0) if d.arm == "8_4_48" else 9.0
            policy.observe(feedback(1, d, reward, 1.0, num_iters=n))
            out += [d.arm] * n
            done += n
    return out


@pytest.mark.parametrize("epsilon, seed", [(0.0, 0), (0.1, 0), (0.1, 3), (0.1, 7)])
def test_span_driver_leaves_a_greedy_arm_its_own_rewards_demote(epsilon, seed):
    """A span held the greedy arm until the next exploration (forever at epsilon 0) though its
    own rewards in the span pulled its median below another arm's: the per-iteration driver
    switched within ~20 iterations, the span driver stayed (up to 2.7x the iterations)."""
    settings = {"strategies": ("8_4_48", "4_4_48"), "bucket_starts": (1,), "warmup_checks": 1}
    a = _drifting_arm_run(TLTAdaptive(seed=seed, epsilon=epsilon, **settings), is_span=False)
    b = _drifting_arm_run(TLTAdaptive(seed=seed, epsilon=epsilon, **settings), is_span=True)
    assert a == b
    assert a[20:].count("4_4_48") > 50  # the per-iteration driver does switch: teeth


def test_bandit_statistics_per_batch_group_and_window():
    bandit = BegMab(TLTConfig(window=5, **ARMS_ONE_BUCKET), random.Random(0))
    arm = SpecDecision.parse("6_4_32")
    bandit.record(3, arm, 10.0, num_iters=50)  # a span of 50 iterations, window keeps 5
    assert list(bandit.rewards[(3, arm)]) == [10.0] * 5
    bandit.record(40, arm, 1.0)  # batch 40 falls in the 40..47 group
    assert list(bandit.rewards[(40, arm)]) == [1.0]
    bandit.record(3, SpecDecision.parse("8_4_48"), 5.0)  # not an arm of this bucket: ignored
    assert (3, SpecDecision.parse("8_4_48")) not in bandit.rewards


def test_observe_ignores_plain_iterations():
    policy = TLTAdaptive(**ARMS_ONE_BUCKET)
    policy.observe(feedback(8, OFF, 8.0, 0.01))
    assert not policy._bandit(0).rewards


# --- checkpoints: state_dict ---------------------------------------------------------------------


def test_tlt_state_dict_round_trip_reproduces_future_decisions():
    """A TLTAdaptive rebuilt from its settings and restored from its JSON state_dict (after the
    bandit learned, mid-rollout) decides exactly as the original from then on; a fresh one
    with the same seed does not (the state is what carries the learning)."""
    import json

    settings = {"warmup_checks": 1, "epsilon": 0.3, "window": 50, **ARMS_ONE_BUCKET}
    policy = make_policy("tlt", seed=4, **settings)
    policy.start_rollout(0)
    drive_bandit(policy, random.Random(1), 200)
    for k in range(20):  # a second instance, in another reward group
        decision = policy.decide(obs(3, instance=1))
        policy.observe(
            SpecFeedback(step=0, instance=1, num_active=3, decision=decision,
                         accepted_tokens=2.5 + k % 3, iteration_s=0.5)
        )  # fmt: skip
    state = json.loads(json.dumps(policy.state_dict()))  # plain data: survives JSON exactly
    restored = make_policy("tlt", seed=4, **settings)
    restored.load_state_dict(state)
    assert restored.state_dict() == policy.state_dict() and restored.switched_on(1)
    fresh = make_policy("tlt", seed=4, **settings)
    fresh.start_rollout(0)
    after = [drive_bandit(p, random.Random(7), 300) for p in (policy, restored, fresh)]
    assert after[0] == after[1] and after[0] != after[2]
    assert restored.state_dict() == policy.state_dict()
    with pytest.raises(ValueError, match="seed 4"):
        make_policy("tlt", seed=5, **settings).load_state_dict(state)
    with pytest.raises(ValueError, match="window=50"):
        make_policy("tlt", seed=4, **{**settings, "window": 40}).load_state_dict(state)


@pytest.mark.parametrize("drafter_explore", ["iteration", "rollout"])
def test_tlt_state_dict_restores_an_exploration_block_under_way(drafter_explore):
    import json

    settings = {"warmup_checks": 1, "epsilon": 0.3, "explore_iters": 8, **MIX,
                "drafter_explore": drafter_explore}  # fmt: skip
    policy = make_policy("tlt", seed=2, **settings)
    seq = per_iteration(policy, 400)
    bandit = policy._bandit(0)
    while not (bandit.is_exploring and bandit.explore_left > 0):  # stop inside a block
        d = policy.decide(obs(4))
        policy.observe(feedback(4, d, MIX_REWARD[d.drafter], 1.0))
    state = json.loads(json.dumps(policy.state_dict()))
    restored = make_policy("tlt", seed=2, **settings)
    restored.load_state_dict(state)
    assert restored.state_dict() == policy.state_dict()

    def go(p):
        out = []
        for _ in range(300):
            d = p.decide(obs(4))
            p.observe(feedback(4, d, MIX_REWARD[d.drafter], 1.0))
            out.append(d.arm)
        return out

    assert go(policy) == go(restored) and len(seq) == 400


@pytest.mark.parametrize(
    "policy", [NoSpec(), StaticSpec(strategy="4_1_4"), SpotTrainerPolicy(), NoDrafterTraining()]
)
def test_stateless_policies_checkpoint_nothing(policy):
    assert policy.state_dict() == {}
    policy.load_state_dict({})
    with pytest.raises(ValueError, match="keeps no state"):
        policy.load_state_dict({"bandits": []})


def test_a_span_reported_in_two_parts_advances_the_schedule_as_one():
    """tltsim's fast mode reports a span's first iteration apart when it carried a drafter
    re-prefill; both parts follow one decide() call, so together they advance the exploration
    schedule by the span's iterations less the one decide() counted (the second part's
    num_iters - 1 lost one iteration per split)."""
    import dataclasses

    kw = dict(strategies=("8_4_32", "4_4_32"), bucket_starts=(1,), epsilon=0.02, warmup_checks=1)

    def greedy_left(split: bool) -> int:
        policy = TLTAdaptive(seed=0, **kw)
        for _ in range(2):  # each arm once
            policy.observe(feedback(4, policy.decide(obs(4)), 8.0, 0.01))
        decision = policy.decide(obs(4))  # a greedy choice, held for a span of 5
        parts = [(1, False), (4, True)] if split else [(5, False)]
        for n, is_continued in parts:
            fb = feedback(4, decision, 8.0, 0.01, num_iters=n)
            policy.observe(dataclasses.replace(fb, is_continued=is_continued))
        return policy._bandits[0].greedy_left

    assert greedy_left(split=True) == greedy_left(split=False)
