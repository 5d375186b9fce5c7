"""One sim–runtime contract: the simulator and the torch engine feed the same policy class the
same observations for the same rollout (``tltsim.policy`` defines them once).

Two RL steps of a small trace run through ``tltsim.sim.simulator.simulate`` (exact mode: one
decide() per iteration) and through three ``RolloutEngine`` instances of a tiny model (the
trace's lengths via ``ignore_eos``; the same round-robin placement and batching cap), each with
TLTAdaptive (threshold 1: SD switches on in the tail) and SpotTrainerPolicy wrapped in recorders.
Compared, decision by decision: batch sizes, queue, mean context, accept-length estimate,
decisions, feedback, and the idle-worker events (idle set, buffer tokens, update size); then
field names and types.

What makes the two comparable exactly: the simulator's drafter accepts nothing (acceptance 0)
and so does the engine's (an all-zero drafter drafts token 0, which this target never emits:
its LM-head row is zero), so every iteration advances each request by one token on both sides.
The finish order of the instances is the same by construction (instance 0 short responses,
instance 2 long ones); the runtime's spot-trainer phases are replayed from each engine's
harvest through ``tltrun.train.spot``'s own ``phase_row`` / ``idle_obs``.

Run: ``python -m pytest tests/test_contract.py -q``.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from simtools import make_trace, roofline
from tiny_models import VOCAB, tiny_model

from tltrun.model.drafter import EagleDrafter
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import Request, SamplingParams
from tltrun.train.drafter_training import DrafterTrainConfig, TrainRecord
from tltrun.train.spot import idle_obs, phase_row
from tltsim.policy import SpecPolicy, SpotTrainerPolicy, TLTAdaptive
from tltsim.sim.acceptance import DrafterDynamics
from tltsim.sim.config import SimConfig
from tltsim.sim.simulator import simulate

NUM_INSTANCES = 3
MAX_RUNNING = 2
# lengths[step][prompt][sample]: round robin sends sample k of every prompt to instance k, so
# instance 0 finishes first and instance 2 last, whatever the clock. No response of length 1
# (tltrun admits again only after the next decode iteration; the simulator right away).
LENGTHS = [
    [[3, 9, 22], [2, 7, 25], [4, 10, 19]],
    [[2, 8, 24], [3, 11, 21], [2, 6, 26]],
]
PROMPT_TOKENS = [[7, 5, 9], [6, 8, 4]]
TLT = {"threshold": 1, "warmup_checks": 2, "strategies": ("3_1_3", "2_1_2")}
TLT["bucket_starts"] = (1, 2)  # batch 1: 3_1_3, batch 2: 2_1_2 (one arm each: no bandit)


class RecordingSpec(SpecPolicy):
    """Records what the wrapped policy was asked and told (``calls``: kind, object)."""

    def __init__(self, inner: SpecPolicy):
        self.inner, self.name = inner, inner.name
        self.calls: list[tuple[str, object]] = []

    def start_rollout(self, step: int) -> None:
        self.inner.start_rollout(step)

    def decide(self, obs):
        decision = self.inner.decide(obs)
        self.calls.append(("decide", (obs, decision)))
        return decision

    def observe(self, feedback) -> None:
        self.calls.append(("observe", feedback))
        self.inner.observe(feedback)

    def max_hold_iters(self, obs, decision):
        return self.inner.max_hold_iters(obs, decision)


class RecordingTrainer:
    name = "recording-spot"

    def __init__(self):
        self.inner = SpotTrainerPolicy()
        self.events: list[tuple[object, object]] = []

    def decide(self, obs):
        decision = self.inner.decide(obs)
        self.events.append((obs, decision))
        return decision


def simulated() -> tuple[RecordingSpec, RecordingTrainer, SimConfig]:
    config = SimConfig(
        num_gpus=NUM_INSTANCES,
        max_running_requests=MAX_RUNNING,
        placement="round_robin",
        exact=True,
        is_timeline_recorded=False,
    )
    spec, trainer = RecordingSpec(TLTAdaptive(seed=0, **TLT)), RecordingTrainer()
    never = DrafterDynamics(max_accept_rate=0.0, initial_accept_rate=0.0, stale_accept_rate=0.0)
    simulate(make_trace(LENGTHS, PROMPT_TOKENS), config, roofline(), spec, trainer, never)
    return spec, trainer, config


def never_accepted_pair() -> tuple[torch.nn.Module, EagleDrafter]:
    """A target that never emits token 0 greedily and a drafter that always drafts it."""
    target = tiny_model(seed=0)
    with torch.no_grad():
        target.lm_head.weight[0] = 0.0  # logit 0, below the best of 96 spread-out logits
    drafter = EagleDrafter.for_target(target, seed=1)
    with torch.no_grad():
        for p in drafter.parameters():
            p.zero_()  # output 0: all logits tie at 0 and the greedy draft is token 0
    return target, drafter


def measured() -> tuple[list[RecordingSpec], list, int]:
    """The runtime's view: one engine and policy per instance (as ``tltrun train`` workers),
    then each step's spot-trainer phases from the engines' harvests."""
    target, drafter = never_accepted_pair()
    rng = random.Random(0)
    specs, engines = [], []
    for i in range(NUM_INSTANCES):
        cfg = EngineConfig(
            max_running_requests=MAX_RUNNING,
            max_model_len=64,
            sampling=SamplingParams(temperature=0.0),
            instance=i,
            is_harvesting=True,
            max_verify_tokens=4,
        )
        engines.append(RolloutEngine(target, drafter, cfg))
        specs.append(RecordingSpec(TLTAdaptive(seed=0, **TLT)))
    trainer = RecordingTrainer()
    batch_size = DrafterTrainConfig().batch_size
    previous: list[list[TrainRecord]] = [[] for _ in range(NUM_INSTANCES)]
    for step, (lengths, prompts) in enumerate(zip(LENGTHS, PROMPT_TOKENS, strict=True)):
        ids = [tuple(rng.randrange(4, VOCAB) for _ in range(n)) for n in prompts]
        walls, num_iterations, current = [], [], []
        for i, (eng, spec) in enumerate(zip(engines, specs, strict=True)):
            # round robin over the step's responses in prompt-major order: sample i of each
            requests = [
                Request(f"s{step}p{p}", ids[p], group[i], ignore_eos=True)
                for p, group in enumerate(lengths)
            ]
            result = eng.generate(requests, spec, step=step)
            assert [len(o.output_token_ids) for o in result.outputs] == [g[i] for g in lengths]
            sd = [it for it in result.iterations if it.strategy != "off" and not it.is_prefill]
            assert all(n == 0 for it in sd for n in it.accept_lens)  # no draft ever accepted
            walls.append(result.wall_s)
            num_iterations.append(len(result.iterations))
            current.append(
                [TrainRecord(h.token_ids, h.num_prompt_tokens, h.hidden) for h in eng.pop_harvest()]
            )
        # the finish order: workers run side by side in tltrun, so the one with the fewest
        # iterations ends first (the engines ran one after the other here, and wall seconds
        # on a shared machine would make the order flaky)
        order = sorted(range(NUM_INSTANCES), key=num_iterations.__getitem__)
        for j in range(1, NUM_INSTANCES):  # phase j: the first j finishers are idle
            members = sorted(order[:j])
            table = torch.stack(
                [phase_row(j, current[m] + previous[m], 1.0, 0, walls[m]) for m in members]
            )
            obs = idle_obs(step, members, table, NUM_INSTANCES, batch_size)
            trainer.events.append((obs, trainer.inner.decide(obs)))
        previous = current
    return specs, trainer.events, batch_size


@pytest.fixture(scope="module")
def both():
    return simulated(), measured()


def per_instance(calls, kind: str) -> dict[int, list]:
    out: dict[int, list] = {}
    for k, item in calls:
        if k == kind:
            obs = item[0] if kind == "decide" else item
            out.setdefault(obs.instance, []).append(item)
    return out


def decide_view(decides: list) -> list[tuple]:
    """What the policy was asked, less the clock (simulated vs wall seconds)."""
    return [
        (o.step, o.num_active, o.num_waiting, o.mean_context_tokens, o.accept_len_ema, d.strategy)
        for o, d in decides
    ]


def feedback_view(feedback: list) -> list[tuple]:
    """What the policy was told, less the iteration's seconds."""
    return [(f.step, f.num_active, f.decision, f.accepted_tokens, f.num_iters) for f in feedback]


def test_decode_observations_and_feedback_match_decision_by_decision(both):
    (sim_spec, _, _), (run_specs, _, _) = both
    sim_decides = per_instance(sim_spec.calls, "decide")
    sim_feedback = per_instance(sim_spec.calls, "observe")
    for i, spec in enumerate(run_specs):
        run_decides = per_instance(spec.calls, "decide")[i]
        run_feedback = per_instance(spec.calls, "observe")[i]
        assert decide_view(sim_decides[i]) == decide_view(run_decides), f"instance {i}"
        assert feedback_view(sim_feedback[i]) == feedback_view(run_feedback), f"instance {i}"
        if i == NUM_INSTANCES - 1:  # the long responses: SD switched on in their tail
            assert {"off", "3_1_3"} <= {d.strategy for _, d in run_decides}


def test_idle_worker_events_match(both):
    (_, sim_trainer, config), (_, run_events, batch_size) = both
    assert len(sim_trainer.events) == len(run_events) == 2 * (NUM_INSTANCES - 1)
    for (sim, _), (run, _) in zip(sim_trainer.events, run_events, strict=True):
        for name in ("step", "idle_instances", "num_instances", "num_rollout_active_instances"):
            assert getattr(sim, name) == getattr(run, name), name
        # the same tokens: response tokens of the idle instances, this step's and the last one's
        assert sim.buffer_tokens == run.buffer_tokens
        assert sim.instance_buffer_tokens == run.instance_buffer_tokens
        # one batch per idle instance (the runtime's: batch_size records of that instance's
        # mean response length; the simulator's: drafter_update_tokens per GPU)
        num_idle = len(sim.idle_instances)
        assert sim.instance_update_tokens == (config.drafter_update_tokens * config.tp,) * num_idle
        num_records = len(LENGTHS[run.step]) * (run.step + 1)  # per instance: this step and last
        assert run.instance_update_tokens == tuple(
            batch_size * max(tokens // num_records, 1) for tokens in run.instance_buffer_tokens
        )
    # instance 0 is idle first in step 1, with its responses of steps 1 and 0
    first = next(sim for sim, _ in sim_trainer.events if sim.step == 1)
    assert first.idle_instances == (0,)
    assert first.buffer_tokens == sum(g[0] for g in LENGTHS[1]) + sum(g[0] for g in LENGTHS[0])


def test_the_same_fields_and_types_cross_the_boundary(both):
    (sim_spec, sim_trainer, _), (run_specs, run_events, _) = both

    def signature(obj) -> dict[str, type]:
        return {f.name: type(getattr(obj, f.name)) for f in dataclasses.fields(obj)}

    sim_obs, _ = next(item for kind, item in sim_spec.calls if kind == "decide")
    run_obs, _ = next(item for kind, item in run_specs[0].calls if kind == "decide")
    assert signature(sim_obs) == signature(run_obs)
    sim_fb = next(item for kind, item in sim_spec.calls if kind == "observe")
    run_fb = next(item for kind, item in run_specs[0].calls if kind == "observe")
    assert signature(sim_fb) == signature(run_fb)
    assert signature(sim_fb)["accepted_tokens"] is float
    assert signature(sim_trainer.events[0][0]) == signature(run_events[0][0])
