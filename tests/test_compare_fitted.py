"""``tltsim compare --drafter-dynamics FILE``: the fitted dynamics replace a measured run's
acceptance, and the history drafter's model fitted beside them (else the run's own) goes with
them. The measured traces and profile: tests/test_compare.py's helpers.

Run: .venv/bin/python -m pytest tests/test_compare_fitted.py -q
"""

# ruff: noqa: F811 (profile_path: the fixture imported from test_compare)
from __future__ import annotations

import dataclasses

import pytest
from test_compare import lengths_trace, profile_path, self_measured  # noqa: F401

from tltsim.cost.measured import ProfileCost
from tltsim.cost.profile import load_profile
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.simulator import simulate


@pytest.mark.filterwarnings("ignore::tltsim.cost.measured.ProfileExtrapolationWarning")
def test_fitted_dynamics_keep_the_fitted_history_model(profile_path, monkeypatch):
    """--drafter-dynamics FILE replaced the run's acceptance by the fitted EAGLE dynamics and
    dropped the history model fitted beside them: the simulator fell back to its defaults (a
    fitted 4.2 tokens per verify simulated as 1.3-1.8)."""
    from tltsim.fidelity import compare as compare_module
    from tltsim.fidelity.measured_run import measured_run
    from tltsim.sim.history_acceptance import HistoryModel

    trace = self_measured(lengths_trace(), "static", {"strategy": "4_1_4"}, profile_path, 1, 32)
    run = measured_run(trace, "m.json")
    seen = []

    def spy(*args, history=None, **kwargs):
        seen.append(history)
        return simulate(*args, history=history, **kwargs)

    monkeypatch.setattr(compare_module, "simulate", spy)
    cost = ProfileCost(load_profile(profile_path))
    cfg = compare_module.CompareConfig(profile=str(profile_path))
    fitted = dataclasses.replace(HistoryModel(), base_logit=2.5)
    compare_module.simulate_run(run, cost, cfg, DrafterDynamics(), fitted)
    assert seen and all(h is fitted for h in seen)
    seen.clear()  # no history in the file: the run's own fit, not the simulator's defaults
    compare_module.simulate_run(run, cost, cfg, DrafterDynamics(), None)
    assert all(h is run.acceptance.history for h in seen)
