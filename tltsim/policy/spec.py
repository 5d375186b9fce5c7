"""Speculative-decoding policy interface: observations, decisions, feedback, the accept-length
estimate both drivers keep, and the two fixed policies (``NoSpec``, ``StaticSpec``). Standard
library only. See ``tltsim.policy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# ---------------------------------------------------------------------------------------------
# Speculative-decoding policy: observations, decisions, feedback
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DecodeObs:
    """What an engine instance knows just before a decode iteration."""

    now_s: float  # driver's clock (simulated or wall), seconds since the rollout began
    step: int  # RL step index
    instance: int  # engine instance (rollout worker) index
    num_active: int  # running requests in this instance's batch
    num_waiting: int = 0  # queued requests not yet admitted
    mean_context_tokens: float = 0.0  # mean (prompt + generated) tokens per running request
    # update_accept_len_ema over this rollout's SD iterations so far; 0 = none yet
    accept_len_ema: float = 0.0


# Weight of one SD iteration in DecodeObs.accept_len_ema: an effective memory of 1 / 0.1 = 10
# iterations (half-life ln 0.5 / ln 0.9 = 6.6), the length of TLTAdaptive's warm-up
# (warmup_checks = 10): it follows a change of strategy or batch size within about one warm-up,
# while averaging the per-iteration spread of small batches (a batch of one emits 1..d+1 tokens).
ACCEPT_LEN_EMA_WEIGHT = 0.1


def update_accept_len_ema(prev: float, mean_len: float, num_iters: int = 1) -> float:
    """The accept-length estimate every driver reports in ``DecodeObs.accept_len_ema``.

    ``mean_len`` is the tokens emitted per request per verify (accepted drafts + the bonus or
    correction token) over ``num_iters`` SD iterations; ``prev`` the estimate before them (0: no SD
    iteration yet this rollout, then the estimate starts at ``mean_len``). A span of n iterations
    of the same mean weighs as n single updates: 1 - (1 - w)^n."""
    if prev == 0.0:
        return mean_len
    w = ACCEPT_LEN_EMA_WEIGHT
    weight = w if num_iters == 1 else 1.0 - (1.0 - w) ** num_iters
    return prev + weight * (mean_len - prev)


@dataclass(frozen=True, kw_only=True)
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
    # Which drafter proposes (issue #20): "eagle", the learned drafter, or "history", the
    # model-free n-gram/suffix drafter (tltrun.model.history_drafter), whose tree is at most
    # topk distinct continuations of draft_steps tokens, verify_tokens nodes of them. The
    # strategy name does not include it: records carry the drafter beside the strategy.
    drafter: str = "eagle"

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(
                f"SpecDecision: drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}"
            )
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

    @property
    def arm(self) -> str:
        """The strategy with a non-default drafter in front (``"history:6_1_6"``): a bandit
        arm's name; ``parse`` reads it back. Equals ``strategy`` for the EAGLE drafter."""
        if self.enabled and self.drafter != "eagle":
            return f"{self.drafter}:{self.strategy}"
        return self.strategy

    @classmethod
    def parse(cls, name: str, drafter: str = "eagle") -> SpecDecision:
        """``"8_4_48"`` -> 8 draft steps, topk 4, 48 verify tokens; ``"off"`` -> disabled;
        ``"history:6_1_6"`` (an ``arm`` name) -> the history drafter's 6_1_6."""
        if name == "off":
            return OFF
        if ":" in name:
            drafter, name = name.split(":", 1)
        parts = name.split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(
                f"strategy {name!r}: expected 'DRAFTSTEPS_TOPK_VERIFYTOKENS' such as '8_4_48', or 'off'"
            )
        d, k, v = (int(p) for p in parts)
        return cls(enabled=True, draft_steps=d, topk=k, verify_tokens=v, drafter=drafter)


# The drafters a SpecDecision may name (issue #20).
DRAFTERS = ("eagle", "history")
OFF = SpecDecision(enabled=False)


@dataclass(frozen=True, kw_only=True)
class SpecFeedback:
    """What happened in the iteration a decision was made for."""

    step: int
    instance: int
    num_active: int  # batch size of the iteration
    decision: SpecDecision
    # tokens emitted by the whole batch this iteration (incl. bonus tokens); a float because a
    # span's per-iteration mean is one (rounding it biased a bandit's reward at small batches)
    accepted_tokens: float
    iteration_s: float  # seconds the iteration took (measured by tltrun, modelled by tltsim)
    # A driver may report a span of identical decisions at once (tltsim's fast mode); then
    # accepted_tokens and iteration_s are per-iteration means over the num_iters iterations.
    num_iters: int = 1
    # True: these iterations continue the previous feedback's span, with no decide() call
    # between (tltsim reports a span's first iteration apart when it carried a drafter
    # re-prefill): a policy counting its calls (TLTAdaptive's warm-up and exploration schedule)
    # counts all num_iters here, not num_iters - 1 (the call decide() made counted one)
    is_continued: bool = False


class PolicyStateError(ValueError):
    """A saved policy state that another policy, or other settings or seed, learned: it does
    not apply to this policy (a resume that changed them starts the policy afresh)."""


def check_no_state(name: str, state: dict) -> None:
    """``load_state_dict`` of a policy that keeps no state: anything saved is another's."""
    if state:
        raise PolicyStateError(f"policy {name!r} keeps no state, got fields {sorted(state)}")


@runtime_checkable
class SpecPolicy(Protocol):
    """What every driver may call on a speculative-decoding policy (``tltsim.policy`` lists the
    order). Subclass it to inherit the defaults: no-op ``start_rollout`` / ``observe``, no cap
    on a decision's span, and no vLLM export."""

    name: str

    def start_rollout(self, step: int) -> None:
        """An RL step's rollout begins (every instance)."""

    def decide(self, obs: DecodeObs) -> SpecDecision: ...

    def observe(self, feedback: SpecFeedback) -> None:
        """What the iteration (or span) decided for ``feedback.decision`` really did."""

    def max_hold_iters(self, obs: DecodeObs, decision: SpecDecision) -> int | None:
        """For drivers that ask once per span of iterations (tltsim's fast mode): at most how
        many iterations ``decision`` may stand without asking again; None: until the batch
        changes (a policy whose decision depends only on the observation)."""
        return None

    def vllm_dynamic_table(self, max_batch: int) -> list[list[int]]:
        """Rows [min_batch, max_batch, k] of vLLM's ``num_speculative_tokens_per_batch_size``
        (k = 0: no speculation), contiguous over 1..``max_batch``; called through
        ``tltsim.policy.to_vllm_dynamic_table``, which checks ``max_batch``."""
        raise ValueError(f"to_vllm_dynamic_table: no export for policy {self.name!r}")

    def state_dict(self) -> dict:
        """What the policy learned, as plain JSON-able data: a checkpoint holds data, not a
        pickled object, so it survives a module move. The settings are not state: the run's
        config rebuilds the policy, then ``load_state_dict`` restores this. Default: none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` into a policy built with the same settings and seed."""
        check_no_state(self.name, state)


class NoSpec(SpecPolicy):
    """The veRL baseline: never speculate."""

    name = "nospec"

    def start_rollout(self, step: int) -> None:
        pass

    def decide(self, obs: DecodeObs) -> SpecDecision:
        return OFF

    def vllm_dynamic_table(self, max_batch: int) -> list[list[int]]:
        return [[1, max_batch, 0]]

    def observe(self, feedback: SpecFeedback) -> None:
        pass


class StaticSpec(SpecPolicy):
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
            else SpecDecision(
                enabled=True, draft_steps=draft_steps, topk=topk, verify_tokens=verify_tokens
            )
        )
        if not self.decision.enabled:
            raise ValueError("StaticSpec: the strategy must enable SD (use NoSpec for 'off')")

    def start_rollout(self, step: int) -> None:
        pass

    def decide(self, obs: DecodeObs) -> SpecDecision:
        return self.decision

    def vllm_dynamic_table(self, max_batch: int) -> list[list[int]]:
        """Exact for a chain; a tree ``d_k_v`` runs as vLLM's chain of ``d`` drafts. vLLM's
        dynamic table drives its EAGLE drafter only, so a history decision has no export."""
        if self.decision.drafter != "eagle":
            raise ValueError(
                f"to_vllm_dynamic_table: the {self.decision.drafter} drafter ({self.decision.arm}) "
                "has no vLLM dynamic-table export (the table drives vLLM's EAGLE drafter only)"
            )
        return [[1, max_batch, self.decision.draft_steps]]

    def observe(self, feedback: SpecFeedback) -> None:
        pass
