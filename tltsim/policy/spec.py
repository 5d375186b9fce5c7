"""Speculative-decoding policy interface: observations, decisions, feedback, and the two fixed
policies (``NoSpec``, ``StaticSpec``). Standard library only. See ``tltsim.policy``.
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

    ``verify_tokens`` counts drafted nodes; the verify forward also feeds the root (the last
    accepted token), i.e. verify_tokens + 1 tokens per request (``tltsim.cost.roofline``). SGLang's
    speculative_num_draft_tokens, the third number in TLT's names, counts the root too, so our
    8_4_48 verifies one node more than fastrl's: a ~2% difference in verify cost, accepted so that
    a chain stays (k, 1, k). EAGLE-2-style drafting offers at most topk + (draft_steps - 1) *
    topk^2 candidates (a beam of topk per layer); the acceptance model verifies all of them when
    verify_tokens is larger, the rest being padding.
    """

    enabled: bool
    draft_steps: int = 0
    topk: int = 1
    verify_tokens: int = 0

    def __post_init__(self) -> None:
        if self.enabled:
            if self.draft_steps < 1 or self.topk < 1 or self.verify_tokens < 1:
                raise ValueError(
                    f"SpecDecision: enabled SD needs draft_steps, topk, verify_tokens >= 1, got {self}"
                )
            # A tree of depth d with branching topk has at most sum_{i=1..d} topk^i nodes.
            if self.verify_tokens > sum(self.topk**i for i in range(1, self.draft_steps + 1)):
                raise ValueError(
                    f"SpecDecision: verify_tokens={self.verify_tokens} exceeds the tree size for {self}"
                )

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
            raise ValueError(
                f"strategy {name!r}: expected 'DRAFTSTEPS_TOPK_VERIFYTOKENS' such as '8_4_48', or 'off'"
            )
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
    # A driver may report a span of identical decisions at once (tltsim's fast mode); then
    # accepted_tokens and iteration_s are per-iteration means over the num_iters iterations.
    num_iters: int = 1


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

    def __init__(
        self,
        draft_steps: int = 8,
        topk: int = 4,
        verify_tokens: int = 32,
        strategy: str | None = None,
    ):
        self.decision = (
            SpecDecision.parse(strategy)
            if strategy
            else SpecDecision(True, draft_steps, topk, verify_tokens)
        )
        if not self.decision.enabled:
            raise ValueError("StaticSpec: the strategy must enable SD (use NoSpec for 'off')")

    def start_rollout(self, step: int) -> None:
        pass

    def decide(self, obs: DecodeObs) -> SpecDecision:
        return self.decision

    def observe(self, feedback: SpecFeedback) -> None:
        pass
