"""Policy objects shared by the simulator (tltsim.sim) and the runtime (tltrun.engine).

A policy turns an observation into a decision. Both are frozen dataclasses of plain numbers,
so the SimPy model and the torch engine can drive the very same object. Time (``obs.now_s``)
and randomness (a ``random.Random`` handed to the constructor) come in from outside: a policy
never reads a clock or the global RNG, so every run is reproducible from its seed.

Standard library only: importing this module pulls in neither simpy nor torch (tested).

Contract for drivers (simulator and engine alike), per engine instance:

1. ``policy.start_rollout(step)`` once when an RL step's rollout begins (all instances).
2. Before every decode iteration of instance ``i``: ``decision = policy.decide(DecodeObs(...))``.
3. After the iteration: ``policy.observe(SpecFeedback(...))`` with what really happened
   (measured or simulated iteration seconds and accepted tokens).

Spot drafter training is driven the same way through ``SpotTrainerPolicy.decide(IdleObs)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# ---------------------------------------------------------------------------------------------
# Speculative-decoding policy: observations, decisions, feedback
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeObs:
    """What an engine instance knows just before a decode iteration."""

    now_s: float  # driver's clock (simulated or wall), seconds since the rollout began
    step: int  # RL step index
    instance: int  # engine instance (rollout worker) index
    num_active: int  # running requests in this instance's batch
    num_waiting: int = 0  # queued requests not yet admitted
    mean_context_tokens: float = 0.0  # mean (prompt + generated) tokens per running request
    accept_len_ema: float = 0.0  # EMA of tokens emitted per verify (incl. bonus); 0 = unknown


@dataclass(frozen=True)
class SpecDecision:
    """How to run the next iteration. ``enabled=False`` is plain one-token decoding.

    Strategy naming follows TLT's public configuration: ``"{draft_steps}_{topk}_{verify_tokens}"``
    (e.g. 8_4_48 = 8 draft steps, top-4 branching per step, 48 tree nodes verified).
    ``topk == 1`` with ``verify_tokens == draft_steps`` is chain drafting.
    """

    enabled: bool
    draft_steps: int = 0
    topk: int = 1
    verify_tokens: int = 0

    def __post_init__(self) -> None:
        if self.enabled:
            if self.draft_steps < 1 or self.topk < 1 or self.verify_tokens < 1:
                raise ValueError(f"SpecDecision: enabled SD needs draft_steps, topk, verify_tokens >= 1, got {self}")
            # A tree of depth d with branching topk has at most sum_{i=1..d} topk^i nodes.
            if self.verify_tokens > sum(self.topk**i for i in range(1, self.draft_steps + 1)):
                raise ValueError(f"SpecDecision: verify_tokens={self.verify_tokens} exceeds the tree size for {self}")

    @property
    def strategy(self) -> str:
        return f"{self.draft_steps}_{self.topk}_{self.verify_tokens}" if self.enabled else "off"

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @classmethod
    def parse(cls, name: str) -> SpecDecision:
        """``"8_4_48"`` -> SpecDecision(True, 8, 4, 48); ``"off"`` -> disabled."""
        if name == "off":
            return OFF
        parts = name.split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"strategy {name!r}: expected 'DRAFTSTEPS_TOPK_VERIFYTOKENS' such as '8_4_48', or 'off'")
        d, k, v = (int(p) for p in parts)
        return cls(True, d, k, v)


OFF = SpecDecision(enabled=False)


@dataclass(frozen=True)
class SpecFeedback:
    """What happened in the iteration a decision was made for."""

    step: int
    instance: int
    num_active: int  # batch size of the iteration
    decision: SpecDecision
    accepted_tokens: int  # tokens emitted by the whole batch this iteration (incl. bonus tokens)
    iteration_s: float  # seconds the iteration took (measured by tltrun, modelled by tltsim)


@runtime_checkable
class SpecPolicy(Protocol):
    name: str

    def start_rollout(self, step: int) -> None: ...

    def decide(self, obs: DecodeObs) -> SpecDecision: ...

    def observe(self, feedback: SpecFeedback) -> None: ...


class NoSpec:
    """The veRL baseline: never speculate."""

    name = "nospec"

    def start_rollout(self, step: int) -> None:
        pass

    def decide(self, obs: DecodeObs) -> SpecDecision:
        return OFF

    def observe(self, feedback: SpecFeedback) -> None:
        pass


class StaticSpec:
    """SD always on with one fixed strategy ("TLT-Base" in the paper's ablation)."""

    name = "static"

    def __init__(self, draft_steps: int = 8, topk: int = 4, verify_tokens: int = 32):
        self.decision = SpecDecision(True, draft_steps, topk, verify_tokens)

    def start_rollout(self, step: int) -> None:
        pass

    def decide(self, obs: DecodeObs) -> SpecDecision:
        return self.decision

    def observe(self, feedback: SpecFeedback) -> None:
        pass


# TLTAdaptive (BEG-MAB), SpotTrainerPolicy and the vLLM dynamic-SD export are defined below
# this line (issue #3).

__all__ = [
    "DecodeObs",
    "NoSpec",
    "OFF",
    "SpecDecision",
    "SpecFeedback",
    "SpecPolicy",
    "StaticSpec",
]
