"""Shared pieces of the engine tests: the tiny target, a briefly trained drafter (built once
per process, on import), random requests, an engine factory and the policies every lossless
test runs (static chains and trees, and a policy that switches SD on and off)."""

from __future__ import annotations

import random

import torch
from tiny_models import VOCAB, tiny_model

from tltrun.model.drafter import EagleDrafter
from tltrun.model.kvcache import KVCache
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import Request, SamplingParams
from tltrun.rollout.static_decode import DecodeSources
from tltrun.train.drafter_training import DrafterTrainConfig, TrainRecord, train_drafter
from tltsim.policy import NoSpec, SpecDecision, StaticSpec

GREEDY = SamplingParams(temperature=0.0)
TARGET = tiny_model(seed=0)


def make_requests(n: int, seed: int, max_new: int = 32, max_prompt: int = 24) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            f"r{i}",
            tuple(rng.randrange(4, VOCAB) for _ in range(rng.randint(1, max_prompt))),
            rng.randint(1, max_new),
        )
        for i in range(n)
    ]


def engine(drafter=None, model=TARGET, **overrides) -> RolloutEngine:
    fields = dict(max_running_requests=4, max_model_len=96, sampling=GREEDY)
    fields.update(overrides)
    return RolloutEngine(model, drafter, EngineConfig(**fields))


def _trained_drafter() -> EagleDrafter:
    """A drafter trained briefly on the target's greedy outputs: accepts some drafts (first and
    later siblings), rejects others — both paths of the verify/compaction code run."""
    eng = engine(is_harvesting=True, max_running_requests=8)
    eng.generate(make_requests(24, seed=100, max_new=48), NoSpec())
    records = [TrainRecord(r.token_ids, r.num_prompt_tokens, r.hidden) for r in eng.pop_harvest()]
    drafter = EagleDrafter.for_target(TARGET, seed=5)
    cfg = DrafterTrainConfig(num_steps=60, lr=1e-2, batch_size=8, seed=0)  # tiny model: big lr
    train_drafter(drafter, records, cfg, is_progress_shown=False)
    return drafter


DRAFTER = _trained_drafter()


def random_slots(num_slots: int, max_tokens: int, sampling: SamplingParams, seed: int):
    """A target KV cache and the engine state a pool's decode and verify steps read
    (``DecodeSources``), random: KV entries, lengths 1..29, tokens, hidden states."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache.for_model(TARGET.config, num_slots, max_tokens)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    cache.lens.copy_(torch.randint(1, 30, (num_slots,), generator=gen))
    sources = DecodeSources(
        tokens=torch.randint(0, VOCAB, (num_slots, max_tokens), generator=gen),
        hidden=torch.randn(num_slots, max_tokens, TARGET.config.hidden_size, generator=gen),
        sampling=sampling,
        generator=torch.Generator().manual_seed(3),
    )
    return cache, sources


class RecordingPolicy:
    """Cycles through decisions (SD off included) and records every call."""

    name = "recording"

    def __init__(self, decisions):
        self.decisions = decisions
        self.calls: list[tuple[str, object]] = []

    def start_rollout(self, step):
        self.calls.append(("start", step))

    def decide(self, obs):
        decision = self.decisions[sum(c[0] == "decide" for c in self.calls) % len(self.decisions)]
        self.calls.append(("decide", obs))
        return decision

    def observe(self, feedback):
        self.calls.append(("observe", feedback))


SWITCHING = [
    SpecDecision.parse(s)
    for s in ("4_1_4", "off", "off", "3_2_6", "5_4_16", "off", "2_1_2", "4_3_12")
]
POLICIES = {
    "chain-4": lambda: StaticSpec(4, 1, 4),
    "chain-1": lambda: StaticSpec(1, 1, 1),
    "tree-3_2_6": lambda: StaticSpec(3, 2, 6),
    "tree-5_4_16": lambda: StaticSpec(5, 4, 16),
    "switching": lambda: RecordingPolicy(SWITCHING),
}
