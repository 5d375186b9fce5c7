"""Spot drafter training: which idle instances train the drafter, and for how many updates.
Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# ---------------------------------------------------------------------------------------------
# Spot drafter training on idle instances
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IdleObs:
    """What the driver knows when instances run out of rollout work."""

    now_s: float  # driver's clock, seconds since the rollout began
    step: int  # RL step index
    idle_instances: tuple[int, ...]  # instances that finished their share of this rollout
    num_instances: int
    num_rollout_active_instances: int  # instances still generating; 0 = the rollout has ended
    buffer_tokens: int  # harvested tokens available to train the drafter on
    update_s: float  # seconds one drafter update takes on the workers that would train
    tokens_per_update: int  # tokens one drafter update consumes
    available_s: float | None = None  # estimated seconds until the rollout ends; None = unknown


@dataclass(frozen=True)
class TrainDecision:
    """Which idle instances train the drafter now, and at most how many updates they run
    before they must stop (the driver also stops them, preempting, when the rollout ends)."""

    workers: tuple[int, ...] = ()
    max_updates: int = 0

    @property
    def is_training(self) -> bool:
        return bool(self.workers) and self.max_updates > 0


NO_TRAINING = TrainDecision()


@dataclass(frozen=True)
class SpotTrainerConfig:
    # fastrl worker_manager: training starts once min_workers_for_training (default 1) rollout
    # workers have released their memory.
    min_idle_instances: int = 1
    # TLT trains the drafter in the idle time of every rollout (arXiv 2511.16665: "trained
    # continuously on idle GPUs"). fastrl's reference yaml lists training_interval_steps: 10, whose
    # exact meaning we could not confirm from its code; set 10 here to mimic that reading.
    train_every_steps: int = 1
    max_trainers: int | None = None  # None: every idle instance trains (data parallel)
    min_buffer_tokens: int = 1  # nothing to train on below this
    max_epochs: int = 10  # fastrl speculative.train.max_epochs: passes over the buffer per step

    def __post_init__(self) -> None:
        if (
            self.min_idle_instances < 1
            or self.train_every_steps < 1
            or self.min_buffer_tokens < 1
            or self.max_epochs < 1
        ):
            raise ValueError(
                "SpotTrainerConfig: min_idle_instances, train_every_steps, min_buffer_tokens and max_epochs must be >= 1"
            )
        if self.max_trainers is not None and self.max_trainers < 1:
            raise ValueError(
                f"SpotTrainerConfig: max_trainers must be >= 1 or None, got {self.max_trainers}"
            )


@runtime_checkable
class DrafterTrainingPolicy(Protocol):
    name: str

    def decide(self, obs: IdleObs) -> TrainDecision: ...


class NoDrafterTraining:
    """The drafter is never trained during rollouts (a frozen drafter)."""

    name = "frozen"

    def decide(self, obs: IdleObs) -> TrainDecision:
        return NO_TRAINING


class SpotTrainerPolicy:
    """TLT's spot trainer: idle instances train the drafter until the rollout ends."""

    name = "spot"

    def __init__(self, config: SpotTrainerConfig | None = None, **settings):
        if config is not None and settings:
            raise ValueError(
                "SpotTrainerPolicy: pass either a SpotTrainerConfig or its fields, not both"
            )
        self.config = config or SpotTrainerConfig(**settings)

    def decide(self, obs: IdleObs) -> TrainDecision:
        cfg = self.config
        if obs.update_s <= 0 or obs.tokens_per_update < 1:
            raise ValueError(
                f"IdleObs: update_s must be > 0 and tokens_per_update >= 1, got {obs.update_s}, {obs.tokens_per_update}"
            )
        idle = sorted(set(obs.idle_instances))
        if (
            obs.num_rollout_active_instances == 0
            or obs.step % cfg.train_every_steps
            or len(idle) < cfg.min_idle_instances
            or obs.buffer_tokens < cfg.min_buffer_tokens
        ):
            return NO_TRAINING
        workers = tuple(idle[: cfg.max_trainers] if cfg.max_trainers is not None else idle)
        updates = cfg.max_epochs * obs.buffer_tokens // obs.tokens_per_update  # data cap
        if obs.available_s is not None:
            updates = min(updates, math.floor(max(obs.available_s, 0.0) / obs.update_s))  # time cap
        return TrainDecision(workers, updates) if updates >= 1 else NO_TRAINING
