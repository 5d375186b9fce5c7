"""The history drafter in the simulator (issue #20, item 3): its acceptance model
(``tltsim.sim.history_acceptance.HistoryModel``), the simulator honouring ``SpecDecision.drafter``
(TLTBase, TLTAdaptive's bandit over both drafters) and ``tltsim replay`` running TLTBase
(``tltsim fit``'s history model and measured history runs: test_history_fit.py).

Run: ``python -m pytest tests/test_history_sim.py -q``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simtools import clusters, make_trace, roofline, small_traces

from tltsim.cli.main import main
from tltsim.cost.roofline import default_sd_iter_s
from tltsim.policy import SpecDecision, TLTAdaptive, make_policy
from tltsim.sim.acceptance import DrafterDynamics, accept_len_pmf
from tltsim.sim.batch import verify_span_s
from tltsim.sim.config import SimConfig
from tltsim.sim.history_acceptance import HistoryModel, history_accept_len_pmf
from tltsim.sim.simulator import simulate
from tltsim.trace.schema import Prompt, Response, Step, Trace

CHAIN = SpecDecision.parse("history:6_1_6")
TREE = SpecDecision.parse("history:6_4_16")

# --- the acceptance model ----------------------------------------------------------------------


@pytest.mark.parametrize("decision", [CHAIN, TREE, SpecDecision.parse("history:4_3_5")])
@pytest.mark.parametrize("has_history", [False, True])
def test_acceptance_rises_with_finished_siblings_and_history(decision, has_history) -> None:
    model = HistoryModel()
    fractions = np.linspace(0, 1, 9)
    rates = [model.accept_rate(f, has_history) for f in fractions]
    lens = [model.expected_accept_len(decision, f, has_history) for f in fractions]
    assert all(b > a for a, b in zip(rates, rates[1:], strict=False))
    assert all(b > a for a, b in zip(lens, lens[1:], strict=False))
    for f in fractions:  # earlier rollouts of the prompt help at every progress
        assert model.accept_rate(f, True) > model.accept_rate(f, False)
        pmf = model.accept_len_pmf(decision, f, has_history)
        assert pmf.size == decision.draft_steps + 1 and np.isclose(pmf.sum(), 1.0)
    flat = dataclasses.replace(model, finished_logit=0.0)  # the coefficient is the dependence
    assert flat.accept_rate(0.0, has_history) == flat.accept_rate(1.0, has_history)


def test_history_chain_is_the_chain_formula_and_trees_match_a_monte_carlo_walk() -> None:
    for a in (0.0, 0.3, 0.75, 1.0):
        assert np.allclose(history_accept_len_pmf(CHAIN, a, 0.25), accept_len_pmf(CHAIN, a))
    # the tree: topk continuations at the root, nodes taken in (depth, branch) order
    rng = np.random.default_rng(0)
    a, b = 0.6, 0.3
    depths = [min(TREE.draft_steps, -(-(TREE.verify_tokens - r) // TREE.topk)) for r in range(4)]
    q = [a] + [(1 - a) * b * (1 - b) ** (r - 1) for r in range(1, 4)]
    counts = np.zeros(TREE.draft_steps + 1)
    for _ in range(40_000):
        u, branch, acc = rng.random(), None, 0.0
        for r, qr in enumerate(q):
            acc += qr
            if u < acc:
                branch = r
                break
        accepted = 0
        if branch is not None:
            accepted = 1
            while accepted < depths[branch] and rng.random() < a:
                accepted += 1
        counts[accepted] += 1
    assert np.abs(counts / counts.sum() - history_accept_len_pmf(TREE, a, b)).max() < 0.01


def test_bad_history_model_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="scope"):
        HistoryModel(scope="galaxy")
    with pytest.raises(ValueError, match="base_logit"):
        HistoryModel(base_logit=float("nan"))
    with pytest.raises(ValueError, match="finished_fraction"):
        HistoryModel().accept_rate(1.5, False)


# --- the simulator -------------------------------------------------------------------------------


class DrafterScaled:
    """A roofline whose drafter forwards cost ``factor`` times as much (a cost model built from
    the protocol's pieces: SD iteration = draft steps x drafter forward + verify)."""

    def __init__(self, factor: float):
        self.base, self.factor = roofline(), factor

    def __getattr__(self, name):
        return getattr(self.base, name)

    def drafter_iter_s(self, batch, context_tokens, tokens_per_seq=1):
        return self.factor * self.base.drafter_iter_s(batch, context_tokens, tokens_per_seq)

    def sd_iter_s(self, batch, context_tokens, decision):
        return default_sd_iter_s(self, batch, context_tokens, decision)

    def sd_span_s(self, batch, context_tokens, decision, num_iters, tokens_per_iter):
        return sum(
            self.sd_iter_s(batch, context_tokens + i * tokens_per_iter, decision)
            for i in range(num_iters)
        )


def _sim(trace, policy, cost=None, history=None, drafter=None, **config):
    cfg = SimConfig(**config)
    spec = policy if not isinstance(policy, str) else make_policy(policy, seed=cfg.seed)
    return simulate(trace, cfg, cost or roofline(), spec, None, drafter, history=history)


def test_verify_span_is_the_sum_of_verify_iterations() -> None:
    cost = roofline()
    for b, ctx, v, n, g in [
        (1, 300.0, 6, 1, 2.5),
        (4, 5_000.0, 16, 40, 9.0),
        (32, 2e5, 8, 300, 64),
    ]:
        want = sum(cost.decode_iter_s(b, ctx + i * g, v + 1) for i in range(n))
        assert verify_span_s(cost, b, ctx, v, n, g) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("exact", [False, True])
def test_history_iterations_charge_no_drafter_cost_and_speed_up_small_batches(exact) -> None:
    # one prompt, four long responses on one GPU: batch <= 4 from the start (TLT's threshold 32)
    trace = make_trace([[[1500, 2200, 3000, 4000]], [[1800, 2500, 2600, 3900]]])
    cheap = _sim(trace, "tltbase", DrafterScaled(1.0), num_gpus=1, exact=exact)
    dear = _sim(trace, "tltbase", DrafterScaled(1000.0), num_gpus=1, exact=exact)
    for a, b in zip(cheap.steps, dear.steps, strict=True):
        assert a.rollout_s == pytest.approx(b.rollout_s, rel=1e-9)
        assert a.reprefill_instance_s == 0.0  # no drafter cache to build
    # the same costs make an EAGLE policy slower: the comparison can fail
    eagle = _sim(trace, "static", DrafterScaled(1.0), num_gpus=1, exact=exact)
    eagle_dear = _sim(trace, "static", DrafterScaled(1000.0), num_gpus=1, exact=exact)
    assert eagle_dear.steps[0].rollout_s > 2 * eagle.steps[0].rollout_s
    nospec = _sim(trace, "nospec", num_gpus=1, exact=exact)
    base = _sim(trace, "tltbase", num_gpus=1, exact=exact)
    speedup = sum(s.rollout_s for s in nospec.steps) / sum(s.rollout_s for s in base.steps)
    assert speedup > 1.0, speedup
    assert all(s.mean_accept_len > 1.0 for s in base.steps)
    assert {d.arm for d in base.strategies_used} == {"history:6_1_6"}


def test_fast_and_exact_modes_agree_for_tltbase() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(200, 3000, size=(2, 6, 4)).tolist()
    trace = make_trace(lengths)
    kw = {"num_gpus": 2, "placement": "chunked"}
    fast = [_sim(trace, "tltbase", seed=s, **kw) for s in range(4)]
    exact = [_sim(trace, "tltbase", seed=s, exact=True, **kw) for s in range(4)]

    def mean(results):
        return np.mean([s.rollout_s for r in results for s in r.steps])

    assert mean(fast) == pytest.approx(mean(exact), rel=0.03)


def test_fast_mode_sees_siblings_finish_on_other_instances_with_a_cluster_index() -> None:
    """--history-scope cluster: a sibling finishing on another instance raises a request's
    accept rate. Fast mode held a span to its own instance's next completion and never saw
    it: mean accept length 1.29 where exact mode gives 5.90 (one prompt, two responses
    placed round-robin on two instances)."""
    trace = make_trace([[[50, 3000]]])
    for scope, low, high in (("instance", 1.0, 2.0), ("cluster", 4.0, 7.0)):
        history = HistoryModel(scope=scope)
        modes = {
            exact: np.mean([
                _sim(trace, "tltbase", history=history, num_gpus=2, seed=s, exact=exact)
                .steps[0].mean_accept_len
                for s in range(5)
            ])
            for exact in (False, True)
        }  # fmt: skip
        assert modes[False] == pytest.approx(modes[True], rel=0.03), (scope, modes)
        assert low < modes[True] < high, (scope, modes)  # the sibling's help, or its absence


def test_siblings_and_earlier_rollouts_raise_the_simulated_accept_length() -> None:
    # 8 prompts x 8 responses on 8 instances: chunked keeps a group on one instance (its
    # drafter sees its siblings finish), round robin spreads every group (it sees none)
    rng = np.random.default_rng(1)
    trace = make_trace(rng.integers(300, 3000, size=(1, 8, 8)).tolist())
    kw = {"num_gpus": 8, "seed": 0}
    chunked = _sim(trace, "tltbase", placement="chunked", **kw).steps[0].mean_accept_len
    spread = _sim(trace, "tltbase", placement="round_robin", **kw).steps[0].mean_accept_len
    shared = HistoryModel(scope="cluster")
    cluster = _sim(trace, "tltbase", history=shared, placement="round_robin", **kw)
    assert chunked > spread and cluster.steps[0].mean_accept_len > spread
    # the same prompt ids in two steps: the second step's drafter has earlier rollouts
    prompts = tuple(
        Prompt(f"q{i}", 200, tuple(Response(int(n)) for n in row))
        for i, row in enumerate(rng.integers(300, 3000, size=(4, 4)))
    )
    again = Trace({}, (Step(0, prompts), Step(1, prompts)))
    steps = _sim(again, "tltbase", num_gpus=1, placement="chunked").steps
    assert steps[1].mean_accept_len > steps[0].mean_accept_len
    no_gain = dataclasses.replace(HistoryModel(), history_logit=0.0)
    flat = _sim(again, "tltbase", history=no_gain, num_gpus=1, placement="chunked").steps
    assert abs(flat[1].mean_accept_len - flat[0].mean_accept_len) < 0.05


def test_tlt_bandit_picks_between_the_drafters_in_the_simulator() -> None:
    rng = np.random.default_rng(2)
    trace = make_trace(rng.integers(500, 4000, size=(2, 2, 4)).tolist())
    config = {"strategies": ("6_1_6",), "bucket_starts": (1,), "drafters": ("eagle", "history")}
    good_history = HistoryModel(base_logit=4.0)  # a ~ 0.98 from the start
    poor_eagle = DrafterDynamics(
        max_accept_rate=0.1, initial_accept_rate=0.1, stale_accept_rate=0.1
    )
    result = _sim(
        trace,
        TLTAdaptive(seed=0, **config),
        history=good_history,
        drafter=poor_eagle,
        num_gpus=1,
        exact=True,
    )
    frame = result.timeline_frame()
    sd = frame[frame.phase == "sd"]
    seconds = (sd.end_s - sd.start_s).groupby(sd.strategy).sum()
    assert set(seconds.index) == {"6_1_6", "history:6_1_6"}  # both arms tried
    assert seconds["history:6_1_6"] > 3 * seconds["6_1_6"]  # the better one wins


class Recorded:
    """A policy that passes everything to ``inner`` and keeps every feedback."""

    def __init__(self, inner):
        self.inner, self.feedback = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def observe(self, feedback):
        self.feedback.append(feedback)
        self.inner.observe(feedback)


@pytest.mark.parametrize("exact", [False, True])
def test_the_bandit_is_charged_every_second_its_decisions_cost(exact) -> None:
    """tltrun's engine charges a drafter re-prefill to the iteration that needed it; the
    simulator mirrors it: feedback seconds x iterations = the SD and re-prefill phases' seconds.
    The EAGLE drafter's catch-up after history iterations runs inside its drafting step (SD
    time), so the only re-prefills are the switch-ons, one per instance and rollout (with
    exploration per iteration, the default, the drafter never lags by more than CATCHUP_PAIRS
    here)."""
    rng = np.random.default_rng(3)
    trace = make_trace(rng.integers(500, 3000, size=(2, 2, 4)).tolist())
    config = {"strategies": ("4_1_4",), "bucket_starts": (1,), "drafters": ("eagle", "history")}
    policy = Recorded(TLTAdaptive(seed=0, epsilon=0.5, **config))
    result = _sim(trace, policy, DrafterScaled(20.0), num_gpus=2, exact=exact)
    frame = result.timeline_frame()
    spent = frame[frame.phase.isin(["sd", "reprefill"])]
    charged = sum(f.iteration_s * f.num_iters for f in policy.feedback if f.decision.enabled)
    assert charged == pytest.approx((spent.end_s - spent.start_s).sum(), rel=1e-9)
    arms = {f.decision.drafter for f in policy.feedback if f.decision.enabled}
    assert arms == {"eagle", "history"}
    switches = frame[frame.phase == "reprefill"].groupby(["step", "instance"]).size()
    assert len(switches) and (switches == 1).all()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=small_traces(), cluster=clusters(), exact=st.booleans(), mixed=st.booleans())
def test_history_policies_keep_the_simulator_invariants(trace, cluster, exact, mixed) -> None:
    policy = TLTAdaptive(seed=0, drafters=("eagle", "history")) if mixed else make_policy("tltbase")
    result = _sim(trace, policy, exact=exact, **cluster)
    again = _sim(
        trace,
        TLTAdaptive(seed=0, drafters=("eagle", "history")) if mixed else make_policy("tltbase"),
        exact=exact,
        **cluster,
    )
    for rec, step, rec2 in zip(result.steps, trace.steps, again.steps, strict=True):
        want = sum(r.tokens for p in step.prompts for r in p.responses)
        assert rec.tokens_generated == want  # lossless: lengths never change
        assert rec.rollout_s >= rec.ideal_rollout_s * (1 - 1e-9)
        assert rec.rollout_s == rec2.rollout_s  # same seed, same result
    for finish in result.finish_s:
        assert np.all(np.isfinite(finish))


# --- replay CLI ----------------------------------------------------------------------------------


def test_replay_runs_tltbase_beside_nospec_and_tlt_on_a_version_1_trace(tmp_path, capsys) -> None:
    path = Path(__file__).parent.parent / "traces" / "synth_reasoning_rl.json"
    assert json.loads(path.read_text())["version"] == 1  # an old trace still loads
    out = tmp_path / "r"
    argv = ["replay", str(path), "--preset", "h100x8-qwen7b", "--max-steps", "2"]
    assert main([*argv, "--policy", "nospec,tltbase,tlt", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tltbase" in text
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["policy"]: r for r in summary["policies"]}
    assert list(rows) == ["nospec", "tltbase", "tlt"]
    assert rows["tltbase"]["speedup_vs_nospec"] > 1.0
    assert rows["tltbase"]["drafter_train_gpu_s"] == 0.0  # nothing to train
    assert all(s.startswith("history:") for s in rows["tltbase"]["strategies_used"])
    config = json.loads((out / "config.json").read_text())
    assert config["history"] == dataclasses.asdict(HistoryModel())
    # --history-* flags reach the model
    out2 = tmp_path / "r2"
    flags = ["--history-base-logit", "2.0", "--policy", "nospec,tltbase", "--out", str(out2)]
    assert main([*argv, *flags]) == 0
    better = {r["policy"]: r for r in json.loads((out2 / "summary.json").read_text())["policies"]}
    assert better["tltbase"]["mean_accept_len"] > rows["tltbase"]["mean_accept_len"]
    assert main([*argv, "--history-scope", "galaxy"]) == 2
    assert "scope" in capsys.readouterr().err
    # --tlt-history-strategies: the history arms of tltbase and of tlt's history drafter
    out3 = tmp_path / "r3"
    own = ["--tlt-drafters", "eagle,history", "--tlt-history-strategies", "3_1_3"]
    assert main([*argv, *own, "--policy", "tltbase,tlt", "--out", str(out3)]) == 0
    used = {r["policy"]: r for r in json.loads((out3 / "summary.json").read_text())["policies"]}
    assert set(used["tltbase"]["strategies_used"]) == {"history:3_1_3"}
    assert {s for s in used["tlt"]["strategies_used"] if s.startswith("history:")} <= {
        "history:3_1_3"
    }
    # without a history drafter in tlt the flag would change nothing there: refused
    assert main([*argv, "--tlt-history-strategies", "3_1_3", "--out", str(out3)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--tlt-history-strategies" in err and "\n" not in err


@pytest.mark.parametrize("explore_iters", [1, 16])
def test_fast_mode_keeps_the_bandits_exploration_schedule(explore_iters) -> None:
    """The simulator's fast mode asks the policy once per span; TLTAdaptive's max_hold_iters
    cuts a span where an exploration block starts or ends, so fast and exact mode explore the
    same share of SD iterations with the same number of blocks (up to the bandit's greedy arm,
    which may differ between the modes as their rewards do)."""
    rng = np.random.default_rng(5)
    trace = make_trace(rng.integers(300, 800, size=(4, 2, 8)).tolist())
    config = {"strategies": ("4_1_4",), "bucket_starts": (1,), "drafters": ("eagle", "history")}
    history = HistoryModel(base_logit=2.0)  # the better arm: EAGLE runs only when explored
    eagle = DrafterDynamics(max_accept_rate=0.4, initial_accept_rate=0.4, stale_accept_rate=0.4)
    counts = {}
    for exact in (True, False):
        policy = Recorded(TLTAdaptive(seed=1, explore_iters=explore_iters, **config))
        _sim(trace, policy, DrafterScaled(5.0), history, eagle, num_gpus=2, exact=exact)
        sd = [f for f in policy.feedback if f.decision.enabled]
        eagle_iters = sum(f.num_iters for f in sd if f.decision.drafter == "eagle")
        counts[exact] = eagle_iters / sum(f.num_iters for f in sd)
    # epsilon 0.1, two arms: ~5% of SD iterations explore EAGLE in both modes
    assert 0.02 < counts[True] < 0.09 and 0.02 < counts[False] < 0.09, counts
    assert counts[False] == pytest.approx(counts[True], abs=0.025), counts
