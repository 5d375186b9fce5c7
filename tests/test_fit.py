"""``tltsim fit``: recover known drafter-dynamics parameters from synthetic measured traces,
the per-step maximum-likelihood estimate, the dynamics recursion, and one-line bad input.

Synthetic traces are drawn from the simulator's own model with known parameters; recovery is
checked against both the reported standard errors and an absolute tolerance.

Run: .venv/bin/python -m pytest tests/test_fit.py -q
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from tltsim.cli.main import main
from tltsim.errors import UsageError
from tltsim.fidelity.fit import FitConfig, estimate_accept_rate, fit_trace, load_dynamics
from tltsim.fidelity.fit_dynamics import StepAcceptance, predict
from tltsim.policy import SpecDecision
from tltsim.sim.acceptance import DrafterDynamics, accept_len_pmf
from tltsim.trace.files import load_trace, save_trace
from tltsim.trace.measured import MeasuredStep, PolicyRecord
from tltsim.trace.schema import Prompt, Response, Step, Trace, trace_to_dict

TRUE = DrafterDynamics(
    max_accept_rate=0.85,
    initial_accept_rate=0.75,
    stale_accept_rate=0.45,
    drift_per_step=0.08,
    learn_tokens=2e5,
    sibling_rate=0.35,
)
# 20 steps of a frozen drafter (drift toward stale), then 15 of spot training (recovery).
TRAINED = [0] * 20 + [100_000] * 15


def synthetic_trace(
    dynamics: DrafterDynamics,
    trained: list[int],
    strategy: str,
    seed: int = 0,
    num_prompts: int = 16,
    verifies_per_response: int = 50,
    measured_strategy: bool = True,
) -> Trace:
    """Per step: acceptance from ``dynamics``; per response, ``verifies_per_response`` verify
    outcomes drawn from the exact accept-length distribution, as tltrun records them."""
    rng = np.random.default_rng(seed)
    decision = SpecDecision.parse(strategy)
    rates = predict(dynamics, [StepAcceptance(i, {}, n) for i, n in enumerate(trained)])
    steps = []
    for i, rate in enumerate(rates):
        pmf = accept_len_pmf(decision, rate, dynamics.sibling_rate)
        prompts = []
        for p in range(num_prompts):
            responses = []
            for _ in range(4):
                hist = rng.multinomial(verifies_per_response, pmf)
                tokens = int(hist @ np.arange(1, hist.size + 1))
                responses.append(Response(tokens=tokens, accept_hist=tuple(int(h) for h in hist)))
            prompts.append(Prompt(f"p{p}", 100, tuple(responses)))
        policy = PolicyRecord(name="static", iterations_per_strategy={strategy: 99})
        measured = MeasuredStep(
            drafter_trained_tokens=trained[i], policy=policy if measured_strategy else None
        )
        steps.append(Step(i, tuple(prompts), measured))
    return Trace({"source": "synthetic"}, tuple(steps))


def assert_recovered(
    fitted: DrafterDynamics, stderr: dict, names: tuple[str, ...], rel: float = 0.25
) -> None:
    for name in names:
        got, want = getattr(fitted, name), getattr(TRUE, name)
        assert abs(got - want) <= 4 * stderr[name], (name, got, want, stderr[name])
        assert abs(got - want) <= rel * abs(want), (name, got, want)


ALL = (
    "initial_accept_rate",
    "max_accept_rate",
    "stale_accept_rate",
    "drift_per_step",
    "learn_tokens",
)


def test_chain_fit_recovers_all_five_parameters() -> None:
    result = fit_trace(synthetic_trace(TRUE, TRAINED, "4_1_4"), FitConfig(), "synthetic")
    assert set(result.fit.fitted) == set(ALL) and result.sibling_rate_se is None
    assert_recovered(result.dynamics, result.fit.stderr, ALL)
    assert 0.3 < result.fit.chi2_per_dof < 2.5  # binomial noise only: chi^2/dof near 1
    assert result.dynamics.sibling_rate == DrafterDynamics().sibling_rate  # held: chains only


def test_frozen_drafter_holds_what_it_cannot_determine() -> None:
    """No training: max_accept_rate and learn_tokens are not identifiable and stay at base."""
    trace = synthetic_trace(TRUE, [0] * 25, "4_1_4", seed=1)
    result = fit_trace(trace, FitConfig(), "synthetic")
    assert set(result.fit.fitted) == {"initial_accept_rate", "stale_accept_rate", "drift_per_step"}
    assert "no drafter training" in result.fit.held["learn_tokens"]
    assert result.dynamics.learn_tokens == DrafterDynamics().learn_tokens
    assert_recovered(
        result.dynamics, result.fit.stderr, ("initial_accept_rate", "drift_per_step"), rel=0.2
    )
    assert abs(result.dynamics.stale_accept_rate - TRUE.stale_accept_rate) < 0.08
    # below the fitted initial rate the base max cannot stay: it is raised, and said so
    low = dataclasses.replace(TRUE, max_accept_rate=0.7, initial_accept_rate=0.7)
    raised = fit_trace(trace, FitConfig(), "synthetic", base=low)
    assert raised.dynamics.max_accept_rate == raised.dynamics.initial_accept_rate > 0.7
    assert (
        "raised from the base 0.7 to the fitted initial rate" in raised.fit.held["max_accept_rate"]
    )


def test_a_value_a_bound_or_a_held_value_sets_is_not_called_fitted(tmp_path, capsys) -> None:
    """Hunt: four steps of a drafter accepting ~0.3, trained between them: stale_accept_rate is
    held at the base 0.5, the floor of max_accept_rate, which the fit printed as 'fitted' at
    exactly 0.5; drift and learn_tokens, free, acted on nothing. Said now, in print and JSON;
    a fit the data sets (the five-parameter recovery) has no caveat."""
    low = dataclasses.replace(
        TRUE, max_accept_rate=0.35, initial_accept_rate=0.3, stale_accept_rate=0.25
    )
    trace = synthetic_trace(low, [0, 3000, 3000, 3000], "4_1_4", num_prompts=4)
    result = fit_trace(trace, FitConfig(), "synthetic")
    assert "too few steps" in result.fit.held["stale_accept_rate"]
    assert result.dynamics.max_accept_rate == pytest.approx(0.5, abs=1e-6)
    assert result.fit.caveats["max_accept_rate"].startswith(
        "at its floor, the held stale_accept_rate 0.5: hold that lower (--base)"
    )
    save_trace(trace, tmp_path / "t.json")
    assert main(["fit", str(tmp_path / "t.json"), "--out", str(tmp_path / "fit.json")]) == 0
    assert "fitted (at its floor, the held stale_accept_rate 0.5" in capsys.readouterr().out
    written = json.loads((tmp_path / "fit.json").read_text())["fit"]["caveats"]
    assert written == result.fit.caveats
    good = fit_trace(synthetic_trace(TRUE, TRAINED, "4_1_4"), FitConfig(), "synthetic")
    assert good.fit.caveats == {}
    # the other end (review): every draft accepted pins max_accept_rate at 1
    sure = dataclasses.replace(
        TRUE, max_accept_rate=1.0, initial_accept_rate=1.0, stale_accept_rate=1.0
    )
    ones = fit_trace(
        synthetic_trace(sure, [0] + [3000] * 5, "4_1_4", num_prompts=4), FitConfig(), "s"
    )
    assert ones.fit.caveats["max_accept_rate"].startswith("at its bound 1")


def test_a_parameter_the_data_cannot_move_leaves_the_others_standard_errors() -> None:
    """README tour: a 20-step run's fit (drift at its bound 0, so the stale rate moved nothing)
    printed every standard error as infinite (one zero Jacobian column made the information
    matrix singular), and --accept-rate-range fit refused the file. Only the unmoved one is."""
    from tltsim.fidelity.fit_dynamics import _stderr

    class Linear:  # residuals 2a - 1 and 3a: b moves nothing
        free = ("a", "b")

        def residuals_theta(self, t):
            return np.array([2 * t["a"] - 1, 3 * t["a"]])

    t = {"a": 0.5, "b": 0.3}
    stderr = _stderr(Linear(), t, Linear().residuals_theta(t), 1.0)
    assert stderr["b"] == math.inf
    assert stderr["a"] == pytest.approx(1 / math.sqrt(2**2 + 3**2), rel=1e-4)  # (J^T J)^-1/2


def test_tree_fit_recovers_sibling_rate() -> None:
    trace = synthetic_trace(TRUE, TRAINED[:6] + TRAINED[-6:], "4_2_6", seed=2)
    result = fit_trace(
        trace, FitConfig(fixed=("learn_tokens", "max_accept_rate")), "synthetic", base=TRUE
    )
    assert "sibling_rate" in result.to_json("x")["fit"]["fitted"]
    assert abs(result.dynamics.sibling_rate - TRUE.sibling_rate) < 4 * result.sibling_rate_se + 0.01
    assert abs(result.dynamics.initial_accept_rate - TRUE.initial_accept_rate) < 0.02


@pytest.mark.parametrize(("strategy", "rate"), [("8_4_32", 0.75), ("8_4_48", 0.65)])
def test_tree_standard_errors_cover_the_estimates_spread(strategy: str, rate: float) -> None:
    """The model's tree changes shape with a, so the likelihood jumps and the maximum sits at
    a jump: the standard error must come from the curvature within one shape (across the jump
    it was up to 400x too small; 95% intervals covered a = 0.75 in half the draws)."""
    decision = SpecDecision.parse(strategy)
    pmf = accept_len_pmf(decision, rate, 0.25)
    rng = np.random.default_rng(0)
    z = []
    for _ in range(40):
        hist = rng.multinomial(1600, pmf).astype(np.float64)
        a, se, _ = estimate_accept_rate({decision: hist}, 0.25)
        z.append((a - rate) / se)
    z = np.abs(np.array(z))
    assert np.mean(z < 1.96) >= 0.85 and z.max() < 4.5, z.round(1)


@pytest.mark.parametrize("seed", [100, 139])
def test_default_tree_fit_is_consistent_with_its_own_model(seed: int) -> None:
    """TLT's default tree: data drawn from the fit's own model fit with chi^2/dof near 1 and a
    finite sibling-rate error (curvatures across the tree's jumps gave chi^2/dof 277 and an
    infinite or 0.0007 error on these seeds)."""
    trace = synthetic_trace(TRUE, [0] * 12, "8_4_48", seed=seed, num_prompts=8)
    result = fit_trace(trace, FitConfig(), "synthetic", base=TRUE)
    assert result.fit.chi2_per_dof < 3
    assert 0.002 < result.sibling_rate_se < 0.05
    assert abs(result.dynamics.sibling_rate - TRUE.sibling_rate) < 4 * result.sibling_rate_se


def test_chain_estimate_is_the_likelihood_maximum() -> None:
    """The closed form S / (S + F) maximises the exact accept-length likelihood."""
    decision = SpecDecision.parse("5_1_5")
    hist = np.array([30.0, 22.0, 15.0, 9.0, 7.0, 17.0])
    a, se, _ = estimate_accept_rate({decision: hist}, 0.25)
    accepted, rejected = hist @ np.arange(6), hist[:5].sum()
    assert a == pytest.approx(accepted / (accepted + rejected))

    def loglik(x: float) -> float:
        return float(hist @ np.log(accept_len_pmf(decision, x)))

    assert loglik(a) > loglik(a + 1e-3) and loglik(a) > loglik(a - 1e-3)
    assert se == pytest.approx(np.sqrt(a * (1 - a) / (accepted + rejected)))


def test_predict_follows_the_simulator_order() -> None:
    """Rollout at the current rate, then training on the step's tokens, then one drift per RL
    update up to the next recorded step (steps 0, 1, 3: two drifts before step 3)."""
    dyn = DrafterDynamics(
        max_accept_rate=0.9,
        initial_accept_rate=0.7,
        stale_accept_rate=0.5,
        drift_per_step=0.1,
        learn_tokens=1000,
    )
    got = predict(
        dyn, [StepAcceptance(0, {}, 1000), StepAcceptance(1, {}, 0), StepAcceptance(3, {}, 0)]
    )
    a1 = 0.9 - 0.2 * np.exp(-1)  # trained on 1000 tokens
    a1 -= 0.1 * (a1 - 0.5)  # drift into step 1
    a3 = a1
    for _ in range(2):
        a3 -= 0.1 * (a3 - 0.5)
    assert got == pytest.approx([0.7, a1, a3])


def test_cli_fit_writes_loadable_json(tmp_path: Path, capsys) -> None:
    trace_path, out = tmp_path / "measured.json", tmp_path / "fit.json"
    save_trace(synthetic_trace(TRUE, TRAINED, "3_1_3", seed=3), trace_path)
    assert main(["fit", str(trace_path), "--out", str(out), "--fixed", "stale_accept_rate"]) == 0
    printed = capsys.readouterr().out
    assert "drift_per_step" in printed and "held: held by --fixed" in printed
    saved = json.loads(out.read_text())
    assert saved["config"]["fixed"] == ["stale_accept_rate"]
    dyn = load_dynamics(out)
    assert dyn.stale_accept_rate == DrafterDynamics().stale_accept_rate
    assert abs(dyn.initial_accept_rate - TRUE.initial_accept_rate) < 0.03


def _refuse_constant(name: str) -> None:
    raise AssertionError(f"not strict JSON: {name}")


def test_an_exact_fit_writes_strict_json_and_says_no_degree_of_freedom(tmp_path, capsys):
    """Two steps and two fitted parameters leave no degree of freedom: chi2 per dof is not a
    number, printed as '-' and written as null (a bare NaN is not JSON)."""
    trace_path, out = tmp_path / "two.json", tmp_path / "fit.json"
    save_trace(synthetic_trace(TRUE, TRAINED[:2], "3_1_3", seed=3), trace_path)
    assert main(["fit", str(trace_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "chi2 per degree of freedom: - (no degree of freedom left: 2 steps, 2 parameters)"
        in printed
    )
    saved = json.loads(out.read_text(), parse_constant=_refuse_constant)
    assert saved["fit"]["chi2_per_dof"] is None and len(saved["fit"]["steps"]) == 2
    assert load_dynamics(out) == fit_trace(load_trace(trace_path), FitConfig()).dynamics


def _bad(tmp_path: Path, trace: Trace | dict) -> Path:
    path = tmp_path / "bad.json"
    if isinstance(trace, Trace):
        save_trace(trace, path)
    else:
        path.write_text(json.dumps(trace))
    return path


def _with_step(trace: Trace, index: int, measured: dict) -> dict:
    """The trace's JSON document with step ``index``'s measured block replaced by ``measured``
    (JSON: the block may be one that fails to load)."""
    doc = trace_to_dict(trace)
    doc["steps"][index]["measured"] = measured
    return doc


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (
            lambda t: _with_step(
                t, 2, measured={"policy": {"iterations_per_strategy": {"2_1_2": 5, "3_1_3": 4}}}
            ),
            "step 2: mixed strategies 2_1_2, 3_1_3",
        ),
        (
            lambda t: _with_step(t, 1, measured={}),
            "step 1: responses have accept_hist but no strategy is recorded",
        ),
        (
            lambda t: _with_step(t, 0, measured={"strategy": "2_1_2"}),
            "step 0: accept_hist has 4 entries but strategy 2_1_2 accepts at most 2 draft tokens",
        ),
        (  # a chain verifying fewer tokens than it drafts accepts no more than it verifies
            lambda t: _with_step(t, 0, measured={"strategy": "3_1_2"}),
            "step 0: accept_hist has 4 entries but strategy 3_1_2 accepts at most 2 draft tokens",
        ),
        (
            lambda t: _with_step(
                t, 0, measured={"strategy": "3_1_3", "drafter_trained_tokens": -5}
            ),
            "step 0: field 'measured.drafter_trained_tokens'",
        ),
        (
            lambda t: Trace(
                t.meta, tuple(Step(s.step, (Prompt("p", 10, (Response(5),)),)) for s in t.steps)
            ),
            "no SD verifies recorded",
        ),
    ],
)
def test_bad_measured_trace_is_one_line_exit_2(
    tmp_path: Path, capsys, mutate, expected: str
) -> None:
    trace = synthetic_trace(TRUE, [0, 0, 0], "3_1_3", num_prompts=2)
    path = _bad(tmp_path, mutate(trace))
    assert main(["fit", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and expected in err, err


def _with_history_arm(trace: Trace, strategy: str, history: dict[str, list[int]] | None) -> Trace:
    """The trace with each step's verifies recorded by strategy: its responses' summed
    histogram under ``strategy``, plus ``history`` (history-drafter arms) when given."""
    steps = []
    for s in trace.steps:
        total = [0] * max(len(r.accept_hist) for p in s.prompts for r in p.responses)
        for p in s.prompts:
            for r in p.responses:
                total = [
                    t + (r.accept_hist[i] if i < len(r.accept_hist) else 0)
                    for i, t in enumerate(total)
                ]
        by_strategy = {strategy: tuple(total), **{k: tuple(h) for k, h in (history or {}).items()}}
        measured = dataclasses.replace(s.measured, accept_hist_by_strategy=by_strategy)
        steps.append(dataclasses.replace(s, measured=measured))
    return dataclasses.replace(trace, steps=tuple(steps))


def test_history_arms_are_left_out_of_the_eagle_fit_with_one_warning(tmp_path: Path, capsys):
    """A history arm that accepts everything would pull every step's rate up: the fit ignores
    it (same result as without it), says so in one warning line, and a trace with history
    verifies only is one error line."""
    from tltsim.fidelity.fit import SkippedArmWarning

    base = synthetic_trace(TRUE, [0] * 6, "3_1_3", num_prompts=4)
    plain = _with_history_arm(base, "3_1_3", None)
    mixed = _with_history_arm(base, "3_1_3", {"history:6_1_6": [0, 0, 0, 0, 0, 0, 500]})
    want = fit_trace(plain, FitConfig(), "plain")
    with pytest.warns(SkippedArmWarning, match=r"left out 3000 verifies of history:6_1_6"):
        got = fit_trace(mixed, FitConfig(), "mixed")
    assert [s.accept_rate for s in got.steps] == [s.accept_rate for s in want.steps]
    assert got.dynamics == want.dynamics
    path = tmp_path / "mixed.json"
    save_trace(mixed, path)
    assert main(["fit", str(path)]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "history:6_1_6" in err, err
    only = _with_history_arm(base, "history:3_1_3", None)
    path = _bad(tmp_path, only)
    assert main(["fit", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no EAGLE-drafter verifies recorded" in err, err


def test_bad_config_and_dynamics_file(tmp_path: Path, capsys) -> None:
    trace_path = tmp_path / "t.json"
    save_trace(synthetic_trace(TRUE, [0, 0, 0], "3_1_3", num_prompts=2), trace_path)
    assert main(["fit", str(trace_path), "--fixed", "warp_speed"]) == 2
    assert "unknown field(s) warp_speed" in capsys.readouterr().err
    bad = tmp_path / "dyn.json"
    bad.write_text(
        json.dumps(
            {"format": "tlt-drafter-dynamics", "version": 1, "dynamics": {"drift_per_step": 2.0}}
        )
    )
    with pytest.raises(UsageError, match="drift_per_step must be in"):
        load_dynamics(bad)
    bad.write_text(
        json.dumps({"format": "tlt-drafter-dynamics", "version": 1, "dynamics": {"warp": 1}})
    )
    with pytest.raises(UsageError, match="dynamics.warp"):
        load_dynamics(bad)


def test_fit_without_scipy_is_one_line_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:
    """scipy is the `fit` extra: without it `tltsim fit` says so in one error line."""
    trace_path = tmp_path / "t.json"
    save_trace(synthetic_trace(TRUE, [0, 0, 0], "3_1_3", num_prompts=2), trace_path)
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # import scipy.optimize fails
    assert main(["fit", str(trace_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "needs scipy" in err, err
