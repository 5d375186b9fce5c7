"""Golden summary of one sample trace: catches any unintended change in simulated numbers.

    .venv/bin/python -m pytest tests/test_golden.py -q
    TLT_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py   # after an intended change

The golden file holds the per-policy summary and per-step step times of
``traces/synth_reasoning_rl.json`` (first 4 steps) on the ``h100x8-qwen7b`` preset, seed 0.
Regenerate it only on purpose, and say in the commit why the numbers moved.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tltsim.cost.presets import apply_preset
from tltsim.sim.config import SimConfig
from tltsim.sim.replay import RunSettings, run_settings
from tltsim.trace.files import load_trace
from tltsim.trace.schema import Trace

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "replay_synth_h100x8.json"
KEYS = (
    "mean_step_s",
    "mean_rollout_s",
    "bubble_gpu_s",
    "drafter_train_gpu_s",
    "idle_gpu_s",
    "sd_on_fraction",
    "mean_accept_len",
    "mean_ideal_rollout_s",
    "tokens_generated",
)


def current() -> dict:
    trace = load_trace(ROOT / "traces" / "synth_reasoning_rl.json")
    trace = Trace(trace.meta, trace.steps[:4])
    sim = apply_preset(SimConfig(seed=0), "h100x8-qwen7b")
    out = {}
    for policy in ("nospec", "static", "tlt"):
        result = run_settings(RunSettings(sim=sim, policy=policy), trace)
        summary = result.summary()
        out[policy] = {k: summary[k] for k in KEYS} | {
            "step_s": [rec.step_s for rec in result.steps]
        }
    return out


def test_golden_summary() -> None:
    got = current()
    if os.environ.get("TLT_REGEN_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
        pytest.skip(f"regenerated {GOLDEN}")
    want = json.loads(GOLDEN.read_text())
    assert set(got) == set(want)
    for policy, values in want.items():
        for key, value in values.items():
            assert got[policy][key] == pytest.approx(value, rel=1e-6), f"{policy}.{key}"
