"""Shared helpers of the simulator tests: traces from arrays, the roofline cost, hypothesis
strategies over traces and clusters, and a one-call simulate with policy objects by name.

    from simtools import roofline, run, small_traces   # tests/ is on sys.path under pytest
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tltsim.cost.roofline import RooflineCost
from tltsim.cost.specs import get_hardware, get_model
from tltsim.policy import SpotTrainerPolicy, make_policy
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import PLACEMENTS, SimConfig
from tltsim.sim.simulator import simulate
from tltsim.trace.schema import Trace, trace_from_arrays


def roofline(tp: int = 1, model: str = "Qwen2.5-7B", hardware: str = "H100-SXM") -> RooflineCost:
    return RooflineCost(get_model(model), get_hardware(hardware), tp=tp)


def make_trace(
    lengths: list[list[list[int]]], prompt_tokens: list[list[int]] | None = None
) -> Trace:
    """Trace from nested lists: lengths[step][prompt][sample]."""
    arr = np.asarray(lengths, dtype=np.int64)
    prompts = (
        np.full(arr.shape[:2], 200, dtype=np.int64)
        if prompt_tokens is None
        else np.asarray(prompt_tokens, dtype=np.int64)
    )
    return trace_from_arrays(arr, prompts, {"source": "test"})


def run(
    trace: Trace,
    policy: str = "nospec",
    drafter: DrafterDynamics | None = None,
    is_spot: bool = True,
    **config,
):
    """simulate() with fresh policy objects made by name (trainer for SD policies)."""
    cfg = SimConfig(**config)
    spec = make_policy(policy, seed=cfg.seed)
    trainer = SpotTrainerPolicy() if policy != "nospec" and is_spot else None
    return simulate(trace, cfg, roofline(cfg.tp), spec, trainer, drafter)


@st.composite
def small_traces(
    draw, max_steps: int = 2, max_prompts: int = 6, max_group: int = 4, max_len: int = 3000
) -> Trace:
    """Random long-tail-ish traces: lengths log-uniform in [1, max_len]."""
    steps = draw(st.integers(1, max_steps))
    prompts = draw(st.integers(1, max_prompts))
    group = draw(st.integers(1, max_group))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lengths = (
        np.exp(rng.uniform(0, np.log(max_len), size=(steps, prompts, group)))
        .astype(np.int64)
        .clip(1, max_len)
    )
    prompt_tokens = rng.integers(1, 600, size=(steps, prompts))
    return trace_from_arrays(lengths, prompt_tokens, {"source": "hypothesis"})


@st.composite
def clusters(draw) -> dict:
    """SimConfig keyword arguments: GPU count, TP, batching cap, placement, seed."""
    tp = draw(st.sampled_from([1, 2]))
    num_gpus = tp * draw(st.sampled_from([1, 2, 3, 4, 8]))
    return {
        "num_gpus": num_gpus,
        "tp": tp,
        "max_running_requests": draw(st.sampled_from([1, 3, 8, 64, 1024])),
        "placement": draw(st.sampled_from(PLACEMENTS)),
        "seed": draw(st.integers(0, 1000)),
    }
