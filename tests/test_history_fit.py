"""The history drafter's acceptance model fitted from measured runs (issue #20, item 3):
``tltsim fit`` recovers a ``HistoryModel`` from a measured TLTBase-like trace and replay uses it;
a fit without history arms has none; a measured history run is replayed with its fitted model;
the fit counts history only on workers whose drafter drafted.

Run: ``python -m pytest tests/test_history_fit.py -q``.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from simtools import roofline

from tltsim.cli.main import main
from tltsim.fidelity.fit import FitConfig, fit_trace, load_history, save_fit
from tltsim.fidelity.measured_run import measured_run
from tltsim.policy import SpecDecision, make_policy
from tltsim.sim.config import SimConfig
from tltsim.sim.history_acceptance import HistoryModel
from tltsim.sim.simulator import simulate
from tltsim.trace.files import load_trace, save_trace
from tltsim.trace.measured import MeasuredStep, PolicyRecord
from tltsim.trace.schema import Prompt, Response, Step, Trace

CHAIN = SpecDecision.parse("history:6_1_6")

# --- fit and measured runs ---------------------------------------------------------------------

TRUE = HistoryModel(base_logit=-0.5, finished_logit=1.5, history_logit=0.8)


def synthetic_history_trace(
    model: HistoryModel,
    seed: int = 0,
    num_steps: int = 4,
    num_prompts: int = 8,
    group: int = 6,
    decision: SpecDecision = CHAIN,
) -> Trace:
    """A measured TLTBase-like trace whose per-response history histograms are drawn from
    ``model``: every response speculates from its first token with history:6_1_6; sibling j
    counts as finished once the response has L_j tokens (lockstep); the prompts of steps
    >= num_steps / 2 recur (their first occurrence is history)."""
    rng = np.random.default_rng(seed)
    steps = []
    for s in range(num_steps):
        first = s < num_steps // 2
        prompts, table = [], {}
        for i in range(num_prompts):
            pid = f"q{s % (num_steps // 2)}_{i}"
            lengths = rng.integers(40, 400, size=group)
            hists = []
            for r, length in enumerate(lengths):
                siblings = np.delete(lengths, r)
                hist = [0] * (decision.draft_steps + 1)
                t = 0
                while t < length:
                    f = float(np.count_nonzero(siblings <= t)) / (group - 1)
                    pmf = model.accept_len_pmf(decision, f, not first)
                    n = int(rng.choice(pmf.size, p=pmf)) + 1
                    n = min(n, int(length) - t)
                    hist[n - 1] += 1
                    t += n
                hists.append({decision.arm: tuple(hist)})
            prompts.append(Prompt(pid, 50, tuple(Response(int(n)) for n in lengths)))
            table[pid] = tuple(hists)
        measured = MeasuredStep(
            rollout_s=1.0,
            policy=PolicyRecord(name="tltbase"),
            max_running_requests=None,
            response_accept_hist_by_strategy=table,
        )
        steps.append(Step(s, tuple(prompts), measured))
    return Trace({"source": "test"}, tuple(steps))


def test_fit_recovers_the_history_model_and_replay_uses_it(tmp_path, capsys) -> None:
    trace = synthetic_history_trace(TRUE)
    result = fit_trace(trace, FitConfig(), "synthetic")
    assert result.fit is None  # no EAGLE verifies: dynamics kept at the base values
    fit = result.history
    assert set(fit.fitted) == {"base_logit", "finished_logit", "history_logit"}
    for name in fit.fitted:
        got, want, se = getattr(fit.model, name), getattr(TRUE, name), fit.stderr[name]
        assert se < 0.5, (name, se)
        assert abs(got - want) < 4 * se, (name, got, want, se)
    assert fit.predicted_accept_len == pytest.approx(fit.mean_accept_len, rel=0.03)
    # the CLI writes it beside the dynamics; replay reads it with --drafter-dynamics
    path, out = tmp_path / "h.json", tmp_path / "fit.json"
    save_trace(trace, path)
    assert load_trace(path).steps[0].measured.response_accept_hist_by_strategy
    assert main(["fit", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "history drafter:" in printed and "base_logit" in printed
    model = load_history(out)
    assert model == fit.model
    replay_out = tmp_path / "r"
    argv = ["replay", str(path), "--num-gpus", "1", "--policy", "tltbase"]
    assert main([*argv, "--drafter-dynamics", str(out), "--out", str(replay_out)]) == 0
    config = json.loads((replay_out / "config.json").read_text())
    assert config["history"] == dataclasses.asdict(model)
    # the fit file itself, by digest (its standard errors set --accept-rate-range fit)
    assert config["drafter_dynamics_file"]["path"] == str(out.resolve())
    assert len(config["drafter_dynamics_file"]["sha256"]) == 64
    # fixed logits are held
    held = fit_trace(trace, FitConfig(fixed=("history_logit",)), "synthetic").history
    assert "history_logit" not in held.fitted
    assert held.model.history_logit == HistoryModel().history_logit


def test_the_fit_recovers_the_sibling_rate_of_history_trees() -> None:
    """Hunt: sibling_rate was never fitted for history trees (held at 0.25), so a top-4
    tree's accept length could not come down to a measured 1.01 (predicted 1.58)."""
    tree = SpecDecision.parse("history:6_3_12")
    true = dataclasses.replace(TRUE, sibling_rate=0.08)
    fit = fit_trace(synthetic_history_trace(true, decision=tree), FitConfig(), "trees").history
    assert "sibling_rate" in fit.fitted
    got, se = fit.model.sibling_rate, fit.stderr["sibling_rate"]
    assert 0 < se < 0.1 and abs(got - 0.08) < 4 * se, (got, se)
    assert fit.predicted_accept_len == pytest.approx(fit.mean_accept_len, rel=0.03)
    chains = fit_trace(synthetic_history_trace(TRUE), FitConfig(), "chains").history
    assert chains.held["sibling_rate"] == "no tree verifies of the history drafter"
    trace = synthetic_history_trace(true, decision=tree)
    held = fit_trace(trace, FitConfig(fixed=("sibling_rate",)), "trees").history
    assert held.held["sibling_rate"] == "fixed by --fixed"  # (--fixed reached no history fit)
    assert held.model.sibling_rate == HistoryModel().sibling_rate


def test_fit_output_without_history_arms_has_no_history(tmp_path) -> None:
    trace = synthetic_history_trace(TRUE, num_steps=2, num_prompts=2)
    result = fit_trace(trace, FitConfig(), "x")
    out = tmp_path / "fit.json"
    save_fit(result, out, "x")
    obj = json.loads(out.read_text())
    obj.pop("history")
    out.write_text(json.dumps(obj))
    assert load_history(out) is None
    obj["history"] = {"model": {"base_logit": "high"}}
    out.write_text(json.dumps(obj))
    from tltsim.errors import UsageError

    with pytest.raises(UsageError, match="history.model"):
        load_history(out)


def test_a_measured_history_run_is_replayed_with_its_fitted_model() -> None:
    trace = synthetic_history_trace(TRUE, num_steps=2, num_prompts=4)
    run = measured_run(trace, "measured.json")
    assert run.policy == "tltbase" and run.settings["drafters"] == ("history",)
    acceptance = run.acceptance
    assert acceptance.history is not None
    rates = acceptance.history_response_rates[0]
    assert set(rates) == {p.id for p in trace.steps[0].prompts}
    assert all(0.0 < r < 1.0 for per in rates.values() for r in per)
    policy = make_policy(run.policy, seed=run.policy_seed, **run.settings)
    sim = SimConfig(num_gpus=1, max_running_requests=64, seed=0)
    result = simulate(run.instance_trace(0), sim, roofline(), policy, None, acceptance)
    accept = [s.mean_accept_len for s in result.steps]
    measured = []
    for step in trace.steps:
        hist = np.zeros(CHAIN.draft_steps + 1)
        for per in step.measured.response_accept_hist_by_strategy.values():
            for h in per:
                hist += np.asarray(h[CHAIN.arm])
        measured.append(float(hist @ np.arange(1, hist.size + 1) / hist.sum()))
    # each response replays its own rate: the step's accept length comes back within noise
    assert accept == pytest.approx(measured, rel=0.1)


def test_the_fit_counts_history_only_on_workers_whose_drafter_drafted() -> None:
    """Only an engine whose history drafter has drafted keeps its rollouts as history
    (RolloutHistory.is_used); one worker's history verifies marked every worker's prompts of
    the step, so an eagle+history run's prompts on an EAGLE-only worker were fitted with h = 1."""
    from tltsim.fidelity.fit_history import history_observations
    from tltsim.trace.measured import MeasuredStep
    from tltsim.trace.schema import Prompt, Response, Step, Trace

    def step(number: int, b_arm: str) -> Step:
        prompts = tuple(Prompt(pid, 4, (Response(20), Response(30))) for pid in ("a", "b"))
        hists = {"a": ({"history:2_1_2": (1, 1, 2)},) * 2, "b": ({b_arm: (1, 1, 2)},) * 2}
        measured = MeasuredStep(
            response_accept_hist_by_strategy=hists,
            instance_prompts=(("a",), ("b",)),  # a on worker 0, b on worker 1, every step
            is_prompt_id_stable=True,
        )
        return Step(number, prompts, measured=measured)

    # step 0: worker 1 drafts with EAGLE only; step 1 and 2: both draft from the history
    trace = Trace(
        meta={}, steps=(step(0, "2_1_2"), step(1, "history:2_1_2"), step(2, "history:2_1_2"))
    )
    seen = {(o.step, o.prompt_id): o.has_history for o in history_observations(trace, "t.json")}
    assert seen[(1, "a")] and not seen[(1, "b")]  # b's step-0 rollouts were kept by no one
    assert seen[(2, "b")]  # from step 1 on, worker 1 keeps them


def test_a_measured_trace_replayed_says_whose_times_and_acceptance_it_uses(tmp_path, capsys):
    """Hunt: a replay of tltrun's measured trace with --profile named the preset's GPU for the
    CPU profile's times, and replayed the default dynamics (accept length 4.47 against a
    measured 1.08) without a word."""
    from pathlib import Path

    profile = Path(__file__).resolve().parents[1] / "profiles" / "h200_qwen2.5-1.5b_random.csv"
    path = tmp_path / "t.json"
    save_trace(synthetic_history_trace(TRUE, num_steps=2, num_prompts=2), path)
    argv = ["replay", str(path), "--num-gpus", "1", "--policy", "tltbase", "--max-steps", "1"]
    assert main([*argv, "--profile", str(profile), "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert f", times from profile {profile}, measured on NVIDIA H200\n" in out
    assert "note: the trace's measured acceptance is not replayed (the default dynamics" in out
    assert main(["fit", str(path), "--out", str(tmp_path / "fit.json")]) == 0
    capsys.readouterr()
    fitted = ["--drafter-dynamics", str(tmp_path / "fit.json"), "--out", str(tmp_path / "b")]
    assert main([*argv, *fitted]) == 0
    assert "not replayed" not in capsys.readouterr().out
