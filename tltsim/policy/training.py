"""Spot drafter training: which idle instances train the drafter, and for how many updates.
Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tltsim.policy.spec import check_no_state

# ---------------------------------------------------------------------------------------------
# Spot drafter training on idle instances
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class IdleObs:
    """What the driver knows when instances run out of rollout work.

    Both drivers (``tltsim.sim.simulator`` and ``tltrun.train.spot``) build it with
    ``IdleObs.from_buffers``, and count tokens as the runtime's spot trainer trains on them:

    * ``buffer_tokens``: response tokens, the positions the drafter's loss covers
      (``tltrun.train.drafter_training.make_batch``: every response token, no prompt token), of
      what the idle instances can train on. Each idle instance's trainer samples from its own
      harvest of this RL step's rollout and of the previous one's (all its responses: an idle
      instance has finished its share), so ``buffer_tokens`` sums that over the idle instances.
      Responses still running elsewhere are not in it.
    * ``tokens_per_update``: response tokens one update of all the idle instances consumes
      together (data parallel, one batch each): idle instances x one instance's batch.
      The runtime's batch is ``DrafterTrainConfig.batch_size`` buffered responses of the
      buffer's mean length; the simulator's, ``SimConfig.drafter_update_tokens`` per GPU.

    So ``SpotTrainerPolicy``'s data cap, ``max_epochs x buffer_tokens / tokens_per_update``
    updates, is ``max_epochs`` passes over the same buffer in either driver for the same
    rollout; the number of updates differs only as far as the two drivers' batch sizes do.
    """

    now_s: float  # driver's clock, seconds since the rollout began
    step: int  # RL step index
    idle_instances: tuple[int, ...]  # instances that finished their share of this rollout
    num_instances: int
    num_rollout_active_instances: int  # instances still generating; 0 = the rollout has ended
    buffer_tokens: int  # response tokens the idle instances can train on (class docstring)
    update_s: float  # seconds one drafter update takes on the workers that would train
    tokens_per_update: int  # response tokens one update of all idle instances consumes
    available_s: float | None = None  # estimated seconds until the rollout ends; None = unknown

    @classmethod
    def from_buffers(
        cls,
        *,
        now_s: float,
        step: int,
        buffer_tokens: Mapping[int, int],
        num_instances: int,
        update_s: float,
        instance_update_tokens: int,
        available_s: float | None = None,
    ) -> IdleObs:
        """The observation when the instances keyed in ``buffer_tokens`` are idle, each with
        its buffer's response tokens (this step's and the previous step's responses) and
        ``instance_update_tokens`` response tokens per update of one instance."""
        idle = tuple(sorted(buffer_tokens))
        return cls(
            now_s=now_s,
            step=step,
            idle_instances=idle,
            num_instances=num_instances,
            num_rollout_active_instances=num_instances - len(idle),
            buffer_tokens=sum(buffer_tokens.values()),
            update_s=update_s,
            tokens_per_update=instance_update_tokens * len(idle),
            available_s=available_s,
        )


@dataclass(frozen=True, kw_only=True)
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
    min_idle_instances: int = field(
        default=1, metadata={"help": "idle instances needed before spot training starts"}
    )
    # TLT trains the drafter in the idle time of every rollout (arXiv 2511.16665: "trained
    # continuously on idle GPUs"). fastrl's reference yaml lists training_interval_steps: 10, whose
    # exact meaning we could not confirm from its code; set 10 here to mimic that reading.
    train_every_steps: int = field(
        default=1, metadata={"help": "train the drafter only in RL steps divisible by N"}
    )
    max_trainers: int | None = field(
        default=None,
        metadata={"help": "idle instances that train at once (default: all, data parallel)"},
    )
    min_buffer_tokens: int = field(
        default=1, metadata={"help": "no training while fewer harvested tokens are buffered"}
    )
    # fastrl speculative.train.max_epochs
    max_epochs: int = field(
        default=10, metadata={"help": "passes over the harvested buffer per RL step at most"}
    )

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

    def state_dict(self) -> dict:
        """No state (``SpecPolicy.state_dict`` explains the checkpoint contract)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        check_no_state(self.name, state)


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
        # data cap: max_epochs passes over the buffer by the workers that train (an update
        # consumes each worker's share; dividing by every idle instance's share let one of
        # four trainers run a quarter of a pass)
        per_update = obs.tokens_per_update * len(workers) // len(idle)
        updates = cfg.max_epochs * obs.buffer_tokens // per_update
        if obs.available_s is not None:
            updates = min(updates, math.floor(max(obs.available_s, 0.0) / obs.update_s))  # time cap
        return TrainDecision(workers=workers, max_updates=updates) if updates >= 1 else NO_TRAINING

    def state_dict(self) -> dict:
        """No state: a decision depends on the observation and the config only."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        check_no_state(self.name, state)
