"""Policy objects: import hygiene, TLTAdaptive switching, spot trainer, vLLM export, factory
(the bandit and checkpoints: test_bandit.py).

Run: .venv/bin/python -m pytest tests/test_policy.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_tools import feedback, obs

from tltsim.policy import (
    ACCEPT_LEN_EMA_WEIGHT,
    NO_TRAINING,
    OFF,
    DecodeObs,
    IdleObs,
    NoDrafterTraining,
    NoSpec,
    SpecDecision,
    SpecPolicy,
    SpotTrainerPolicy,
    StaticSpec,
    TLTAdaptive,
    TLTBase,
    TLTConfig,
    TrainDecision,
    make_policy,
    to_vllm_dynamic_table,
    update_accept_len_ema,
)


def test_policy_import_pulls_in_no_simpy_torch_or_numpy():
    code = "import sys, tltsim.policy; print(sorted(m for m in ('simpy', 'torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_strategy_names_round_trip():
    for name in ("8_4_48", "8_4_8", "5_1_5", "off"):
        assert SpecDecision.parse(name).strategy == name
    for bad in ("8-4-48", "8_4", "x_4_8"):
        with pytest.raises(ValueError, match="DRAFTSTEPS_TOPK_VERIFYTOKENS"):
            SpecDecision.parse(bad)
    with pytest.raises(ValueError, match="exceeds the tree size"):
        SpecDecision(enabled=True, draft_steps=2, topk=2, verify_tokens=7)


def test_all_policies_satisfy_the_protocol():
    for name in ("nospec", "static", "tlt"):
        assert isinstance(make_policy(name, seed=0), SpecPolicy)


# --- TLTAdaptive switching -------------------------------------------------------------------------


def test_tlt_hysteresis_warmup_and_stays_on():
    policy = TLTAdaptive()
    policy.start_rollout(0)
    assert all(policy.decide(obs(40)) == OFF for _ in range(20))  # above the threshold
    assert all(policy.decide(obs(30)) == OFF for _ in range(9))  # 9 checks: still warming up
    assert policy.decide(obs(33)) == OFF  # back above: the count restarts
    assert all(policy.decide(obs(32)) == OFF for _ in range(9))
    assert policy.decide(obs(32, now_s=12.5)).enabled  # 10th consecutive check: SD on
    assert policy.switched_on(0) and policy.switch_time_s(0) == 12.5
    assert policy.decide(obs(200)).enabled  # stays on for the rest of the rollout


def test_tlt_switch_is_per_instance_and_reset_per_rollout():
    policy = TLTAdaptive(warmup_checks=3)
    policy.start_rollout(0)
    for _ in range(3):
        policy.decide(obs(8, instance=0))
    assert policy.switched_on(0) and not policy.switched_on(1)
    assert policy.decide(obs(8, instance=1)) == OFF
    policy.start_rollout(1)
    assert not policy.switched_on(0) and policy.switch_time_s(0) is None
    assert policy.decide(obs(8, instance=0)) == OFF


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 80), min_size=1, max_size=60),
    threshold=st.integers(1, 64),
    warmup=st.integers(1, 12),
)
def test_tlt_switch_matches_reference(sizes, threshold, warmup):
    """SD is on at call i iff some run of ``warmup`` consecutive calls with 1 <= batch <=
    threshold ended at or before i (calls with an empty batch are not checks)."""
    policy = TLTAdaptive(threshold=threshold, warmup_checks=warmup)
    policy.start_rollout(0)
    checks = [b for b in sizes if b >= 1]
    is_on, run = [], 0
    for b in checks:
        run = run + 1 if b <= threshold else 0
        is_on.append(bool(is_on and is_on[-1]) or run >= warmup)
    got = [policy.decide(obs(b)).enabled for b in sizes if b >= 1]
    assert got == is_on


def test_default_buckets_follow_tlt_configuration():
    # fastrl BEG: buckets from batch 1, 2, 5, 21 take the strategies with 48, 32, 16, 8 verify tokens.
    policy = TLTAdaptive(warmup_checks=1)
    policy.start_rollout(0)
    expected = {
        1: "8_4_48",
        2: "8_4_32",
        4: "8_4_32",
        5: "8_4_16",
        20: "8_4_16",
        21: "8_4_8",
        32: "8_4_8",
    }
    for batch, strategy in expected.items():
        assert policy.decide(obs(batch)).strategy == strategy
        assert policy.default_decision(batch).strategy == strategy


def test_strategies_too_few_for_the_buckets_name_the_bucket_starts():
    """Hunt: --tlt-strategies 2_1_2 alone said "4 buckets need as many distinct verify_tokens
    values", not which setting made 4 buckets."""
    from tltsim.policy import TLTConfig

    with pytest.raises(ValueError, match=r"4 buckets \(bucket_starts \(1, 2, 5, 21\)\) need"):
        TLTConfig(strategies=("2_1_2",))
    TLTConfig(strategies=("2_1_2",), bucket_starts=(1,))


def test_history_strategies_are_the_history_drafters_arms_in_every_bucket():
    """The history drafter's arms need not follow EAGLE's per-bucket strategies (issue #20):
    with history_strategies every bucket offers those, after the bucket's EAGLE arms."""
    fastrl = ("4_1_4", "3_1_3", "2_1_2", "1_1_1")
    cfg = TLTConfig(
        strategies=fastrl, drafters=("eagle", "history"), history_strategies=("8_1_8", "4_1_4")
    )
    arms = [[a.arm for a in bucket[2]] for bucket in cfg.buckets()]
    assert arms == [[s, "history:8_1_8", "history:4_1_4"] for s in fastrl]
    # not given: the history drafter pairs with each bucket's strategies, as before
    paired = TLTConfig(strategies=fastrl, drafters=("eagle", "history")).buckets()
    assert [[a.arm for a in b[2]] for b in paired] == [[s, f"history:{s}"] for s in fastrl]
    # TLTBase: its buckets by its strategies, its arms the history strategies
    base = TLTBase(strategies=fastrl, history_strategies=("6_1_6",)).config.buckets()
    assert [[a.arm for a in b[2]] for b in base] == [["history:6_1_6"]] * 4
    # a bucket with several history arms is a bandit: each arm is tried, then the best kept
    policy = TLTAdaptive(
        seed=1,
        warmup_checks=1,
        epsilon=0.0,
        strategies=("4_1_4",),
        bucket_starts=(1,),
        drafters=("history",),
        history_strategies=("8_1_8", "2_1_2"),
    )
    policy.start_rollout(0)
    seen = []
    for _ in range(6):
        d = policy.decide(obs(4))
        reward = {"8_1_8": 5.0, "2_1_2": 2.0}.get(d.strategy, 0.0)
        policy.observe(feedback(4, d, reward, 1.0))
        seen.append(d.arm)
    assert seen[:2] == ["history:8_1_8", "history:2_1_2"]
    assert set(seen[2:]) == {"history:8_1_8"}


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"history_strategies": ("8_1_8",)}, "need 'history' among the drafters"),
        ({"drafters": ("eagle", "history"), "history_strategies": ("off",)}, "'off' excluded"),
        ({"drafters": ("history",), "history_strategies": ("history:4_1_4",)}, "drafter name"),
        ({"drafters": ("history",), "history_strategies": ("4_1_4", "4_1_4")}, "distinct"),
        ({"drafters": ("history",), "history_strategies": ("4_x_4",)}, "4_x_4"),
    ],
)
def test_history_strategies_are_checked(settings, match):
    with pytest.raises(ValueError, match=match):
        TLTConfig(**settings)


def test_max_hold_iters_covers_the_missing_warmup_checks():
    policy = TLTAdaptive()
    policy.start_rollout(0)
    first = obs(16)
    decision = policy.decide(first)
    # one check done, nine missing: the OFF decision may stand for nine iterations
    assert policy.max_hold_iters(first, decision) == 9
    assert policy.max_hold_iters(obs(64), policy.decide(obs(64))) is None
    for _ in range(10):
        decision = policy.decide(first)
    assert decision.enabled and policy.max_hold_iters(first, decision) is None


@pytest.mark.parametrize("hold_cap", [1, 3, 100])
def test_span_driver_switches_on_the_same_iteration_as_per_iteration_driver(hold_cap):
    """A driver that asks once per span (the simulator's fast mode) and reports num_iters must
    see SD switch on at exactly the iteration a per-iteration driver (tltrun) sees it."""

    def switch_iteration(span_driver: bool) -> int:
        policy = TLTAdaptive(warmup_checks=10)
        policy.start_rollout(0)
        it = 0
        while True:
            o = obs(16)
            d = policy.decide(o)
            if d.enabled:
                return it
            hold = min(hold_cap, policy.max_hold_iters(o, d) or hold_cap) if span_driver else 1
            policy.observe(feedback(16, d, 16.0 * hold, 0.01 * hold, num_iters=hold))
            it += hold

    assert switch_iteration(span_driver=True) == switch_iteration(span_driver=False) == 9


def test_config_validation():
    with pytest.raises(ValueError, match="distinct verify_tokens"):
        TLTConfig(strategies=("8_4_48", "6_4_48"))
    with pytest.raises(ValueError, match="start at 1"):
        TLTConfig(bucket_starts=(2, 5, 9, 21))
    with pytest.raises(ValueError, match="epsilon"):
        TLTConfig(epsilon=1.5)


# --- spot trainer --------------------------------------------------------------------------------


def idle(**overrides) -> IdleObs:
    base = {
        "now_s": 50.0,
        "step": 0,
        "idle_instances": (3, 1),
        "num_instances": 4,
        "num_rollout_active_instances": 2,
        "instance_buffer_tokens": (50_000, 50_000),
        "update_s": 2.0,
        "instance_update_tokens": (4096, 4096),
        "available_s": 30.0,
    }
    num_idle = len(overrides.get("idle_instances", base["idle_instances"]))
    base["instance_buffer_tokens"] = (50_000,) * num_idle
    base["instance_update_tokens"] = (4096,) * num_idle
    base.update(overrides)
    return IdleObs(**base)


def test_spot_trainer_uses_idle_instances_within_time_and_data():
    decision = SpotTrainerPolicy().decide(idle())
    assert decision.workers == (1, 3) and decision.max_updates == 15  # 30 s / 2 s per update
    data_bound = SpotTrainerPolicy().decide(idle(available_s=None))
    assert data_bound.max_updates == 10 * 50_000 // 4096  # max_epochs passes over each buffer
    assert SpotTrainerPolicy(max_trainers=1).decide(idle()).workers == (1,)  # tie: lower index
    # one trainer runs as many passes over its own buffer as two would over theirs
    one = SpotTrainerPolicy(max_trainers=1).decide(idle(available_s=None))
    assert one.max_updates == 10 * 50_000 // 4096


def test_spot_trainer_caps_each_trainer_at_max_epochs_of_its_own_buffer():
    """Each trainer samples its own buffer: the smallest one chosen sets the updates."""
    policy = SpotTrainerPolicy(max_epochs=2)
    uneven = {
        "idle_instances": (0, 1, 2),
        "num_rollout_active_instances": 1,
        "instance_buffer_tokens": (128, 40_000, 60_000),
        "instance_update_tokens": (64, 1000, 1000),
        "available_s": None,
    }
    # all three: 2 x 128 / 64 = 4 updates (12 batches of 2,064 tokens); instances 1 and 2:
    # 2 x 40,000 / 1,000 = 80 updates of 2,000 tokens each; 2 alone: 120 x 1,000
    decision = policy.decide(idle(**uneven))
    assert decision == TrainDecision(workers=(1, 2), max_updates=80)
    for worker in decision.workers:  # no trainer passes over its buffer more than max_epochs
        i = uneven["idle_instances"].index(worker)
        passes = decision.max_updates * uneven["instance_update_tokens"][i]
        assert passes <= 2 * uneven["instance_buffer_tokens"][i]
    # with a binding time cap every buffer that allows it trains
    timed = policy.decide(idle(**{**uneven, "available_s": 8.0}))  # 4 updates
    assert timed == TrainDecision(workers=(0, 1, 2), max_updates=4)
    # ties in tokens trained go to more trainers (the same tokens in fewer updates)
    tie = policy.decide(
        idle(
            **{
                **uneven,
                "instance_buffer_tokens": (100, 2000, 4000),
                "instance_update_tokens": (100, 100, 100),
            }
        )
    )
    assert tie == TrainDecision(workers=(1, 2), max_updates=40)  # 80 batches, as 2 alone


def test_idle_obs_refuses_misaligned_buffers():
    with pytest.raises(ValueError, match="one entry per idle instance"):
        idle(instance_buffer_tokens=(1,))
    with pytest.raises(ValueError, match="repeats"):
        idle(idle_instances=(1, 1))
    obs = IdleObs.from_buffers(
        now_s=0.0,
        step=0,
        buffer_tokens={2: 30, 0: 10},
        num_instances=3,
        update_s=1.0,
        instance_update_tokens={0: 5, 2: 7},
    )
    assert obs.idle_instances == (0, 2) and obs.instance_buffer_tokens == (10, 30)
    assert obs.instance_update_tokens == (5, 7) and obs.tokens_per_update == 12
    assert obs.buffer_tokens == 40


def test_spot_trainer_declines():
    policy = SpotTrainerPolicy(min_idle_instances=3, train_every_steps=2)
    assert policy.decide(idle(idle_instances=(0, 1, 2), step=1)) == NO_TRAINING  # off-step
    assert policy.decide(idle(step=2)) == NO_TRAINING  # too few idle instances
    assert policy.decide(idle(idle_instances=(0, 1, 2), step=2)).is_training
    assert (
        SpotTrainerPolicy().decide(idle(num_rollout_active_instances=0)) == NO_TRAINING
    )  # preempted
    assert SpotTrainerPolicy().decide(idle(available_s=1.0)) == NO_TRAINING  # no update fits
    assert SpotTrainerPolicy().decide(idle(instance_buffer_tokens=(0, 0))) == NO_TRAINING
    assert NoDrafterTraining().decide(idle()) == NO_TRAINING
    with pytest.raises(ValueError, match="update_s"):
        SpotTrainerPolicy().decide(idle(update_s=0.0))


# --- vLLM export and factory -------------------------------------------------------------------


def assert_well_formed(table: list[list[int]], max_batch: int) -> None:
    assert table[0][0] == 1 and table[-1][1] == max_batch
    for row, nxt in zip(table, table[1:], strict=False):
        assert nxt[0] == row[1] + 1 and row[2] != nxt[2]  # contiguous, equal k merged
    assert all(lo <= hi and k >= 0 for lo, hi, k in table)


@settings(max_examples=200, deadline=None)
@given(max_batch=st.integers(1, 1024), threshold=st.integers(1, 100))
def test_vllm_table_well_formed(max_batch, threshold):
    strategies = ("8_4_48", "6_4_32", "4_4_16", "3_1_3")
    policy = TLTAdaptive(threshold=threshold, strategies=strategies)
    table = to_vllm_dynamic_table(policy, max_batch)
    assert_well_formed(table, max_batch)
    per_batch = {b: k for lo, hi, k in table for b in range(lo, hi + 1)}
    for batch in range(1, max_batch + 1):
        expected = 0 if batch > threshold else policy.default_decision(batch).draft_steps
        assert per_batch[batch] == expected


def test_vllm_table_defaults_and_fixed_policies():
    assert to_vllm_dynamic_table(make_policy("tlt"), 256) == [[1, 32, 8], [33, 256, 0]]
    assert to_vllm_dynamic_table(make_policy("tlt"), 16) == [[1, 16, 8]]
    assert to_vllm_dynamic_table(NoSpec(), 64) == [[1, 64, 0]]
    assert to_vllm_dynamic_table(StaticSpec(5, 1, 5), 64) == [[1, 64, 5]]


def test_a_new_policy_gets_the_protocol_defaults():
    """A SpecPolicy subclass needs only decide(): no span cap, no vLLM export (one clear
    error, no isinstance chain to extend), no-op start_rollout / observe."""

    class Always(SpecPolicy):
        name = "always"

        def decide(self, obs):
            return SpecDecision.parse("3_1_3")

    policy = Always()
    assert isinstance(policy, SpecPolicy)
    policy.start_rollout(0)
    policy.observe(feedback(4, policy.decide(obs(4)), 6.0, 0.1))
    assert policy.max_hold_iters(obs(4), policy.decide(obs(4))) is None
    with pytest.raises(ValueError, match="no export for policy 'always'"):
        to_vllm_dynamic_table(policy, 8)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        to_vllm_dynamic_table(NoSpec(), 0)


def test_accept_len_ema_starts_at_the_first_mean_and_a_span_is_its_iterations():
    assert update_accept_len_ema(0.0, 3.0) == 3.0  # nothing known yet
    assert update_accept_len_ema(3.0, 5.0) == pytest.approx(3.0 + ACCEPT_LEN_EMA_WEIGHT * 2.0)
    one_by_one = 2.0
    for _ in range(7):
        one_by_one = update_accept_len_ema(one_by_one, 4.5)
    assert update_accept_len_ema(2.0, 4.5, num_iters=7) == pytest.approx(one_by_one)


def test_observations_and_decisions_are_keyword_only():
    with pytest.raises(TypeError):
        DecodeObs(0.0, 0, 0, 4)  # type: ignore[misc]
    with pytest.raises(TypeError):
        SpecDecision(True, 3, 1, 3)  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrainDecision((0,), 5)  # type: ignore[misc]


def test_make_policy():
    assert make_policy("static", strategy="8_4_16").decide(obs(4)).strategy == "8_4_16"
    assert make_policy("tlt", seed=3, threshold=16).config.threshold == 16
    with pytest.raises(ValueError, match="unknown policy 'eagle'"):
        make_policy("eagle")
    with pytest.raises(ValueError, match="unknown setting"):
        make_policy("tlt", thresh=3)
    with pytest.raises(ValueError, match="must enable SD"):
        make_policy("static", strategy="off")
