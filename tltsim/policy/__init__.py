"""Policy objects shared by the simulator (tltsim.sim.simulator) and the runtime (tltrun.rollout.engine).

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

   A driver that asks once per span of iterations (tltsim's fast mode) honours
   ``policy.max_hold_iters(obs, decision)`` and reports the span with ``SpecFeedback.num_iters``.
   A driver whose engine takes only a batch-size table (vLLM's dynamic SD) exports it with
   ``to_vllm_dynamic_table(policy, max_batch)``. Both are ``SpecPolicy`` methods with defaults
   (no cap; no export): a new policy subclasses ``SpecPolicy`` and overrides what it offers.

Every driver (the simulator, the torch engine, the vLLM backend) keeps
``DecodeObs.accept_len_ema`` with ``update_accept_len_ema`` after each SD iteration (or span).
Observations, decisions and feedback are keyword-only: fields are always named.

Spot drafter training is driven the same way through ``SpotTrainerPolicy.decide(IdleObs)``;
``IdleObs`` says what its buffer and update sizes count, which both drivers compute alike.

Layout: ``spec`` (interface, NoSpec, StaticSpec, the accept-length estimate), ``tlt``
(TLTAdaptive, BEG-MAB, TLTBase), ``training`` (spot trainer); this module adds the vLLM dynamic-SD
export and ``make_policy``.

    from tltsim.policy import make_policy, to_vllm_dynamic_table
    policy = make_policy("tlt", seed=0)
    to_vllm_dynamic_table(policy, max_batch=256)  # [[1, 32, 8], [33, 256, 0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from tltsim.policy.bandit import REWARD_GROUPS, BegMab, bucket_arms
from tltsim.policy.spec import (
    ACCEPT_LEN_EMA_WEIGHT,
    DRAFTERS,
    OFF,
    DecodeObs,
    NoSpec,
    PolicyStateError,
    SpecDecision,
    SpecFeedback,
    SpecPolicy,
    StaticSpec,
    update_accept_len_ema,
)
from tltsim.policy.tlt import TLTAdaptive, TLTBase, tltbase_settings
from tltsim.policy.tlt_config import TLTConfig
from tltsim.policy.training import (
    NO_TRAINING,
    DrafterTrainingPolicy,
    IdleObs,
    NoDrafterTraining,
    SpotTrainerConfig,
    SpotTrainerPolicy,
    TrainDecision,
)

# ---------------------------------------------------------------------------------------------
# vLLM dynamic-SD export and the policy factory
# ---------------------------------------------------------------------------------------------


def to_vllm_dynamic_table(policy: SpecPolicy, max_batch: int) -> list[list[int]]:
    """Rows [min_batch, max_batch, k] of vLLM's ``num_speculative_tokens_per_batch_size``
    (k = 0: no speculation), contiguous and covering 1..max_batch, adjacent equal k merged:
    the policy's own ``vllm_dynamic_table`` (what each policy loses in the export is said
    there; a policy without one raises ValueError)."""
    if max_batch < 1:
        raise ValueError(f"to_vllm_dynamic_table: max_batch must be >= 1, got {max_batch}")
    return policy.vllm_dynamic_table(max_batch)


POLICY_NAMES = ("nospec", "static", "tlt", "tltbase")
# What default policy lists of the runtime (tltrun bench) run: the policies every backend
# expresses. TLTBase drafts from the rollout history, which vLLM's dynamic-SD table cannot
# express (vLLM's ngram engine approximates it, README), so it runs there only where named.
# tltsim's "--policy all" runs every name of POLICY_NAMES (the simulator models the history
# drafter, tltsim.sim.history_acceptance.HistoryModel).
DEFAULT_POLICY_NAMES = ("nospec", "static", "tlt")


def make_policy(name: str, seed: int = 0, **settings) -> SpecPolicy:
    """ "nospec" | "static" (draft_steps, topk, verify_tokens or strategy="8_4_32", or
    "history:6_1_6" for the history drafter) | "tlt" (TLTConfig fields) | "tltbase" (TLTConfig
    fields; history drafter only). Bad names or settings raise one ValueError naming them."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
    allowed = {
        "nospec": set(),
        "static": {"draft_steps", "topk", "verify_tokens", "strategy"},
        "tlt": {f.name for f in fields(TLTConfig)},
        "tltbase": {f.name for f in fields(TLTConfig)},
    }[name]
    unknown = sorted(set(settings) - allowed)
    if unknown:
        raise ValueError(
            f"policy {name!r}: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed)) or 'none'}"
        )
    if name == "nospec":
        return NoSpec()
    if name == "static":
        return StaticSpec(**settings)
    if name == "tltbase":
        return TLTBase(seed=seed, **settings)
    return TLTAdaptive(seed=seed, **settings)


def is_eagle_drafting(policy: str, drafters: Sequence[str], static_strategy: str) -> bool:
    """Whether policy ``policy`` may draft with the learned EAGLE drafter (``drafters``: tlt's
    bandit drafters; ``static_strategy``: static's strategy): what spot training trains, so the
    simulator (``tltsim.sim.replay``), ``tltrun train`` (``TrainConfig.is_spot_harvesting``) and
    its report spot-train, or say so, by the same rule."""
    if policy == "tlt":
        return "eagle" in drafters
    return policy == "static" and SpecDecision.parse(static_strategy).drafter == "eagle"


__all__ = [
    "PolicyStateError",
    "ACCEPT_LEN_EMA_WEIGHT",
    "BegMab",
    "DRAFTERS",
    "DecodeObs",
    "DrafterTrainingPolicy",
    "IdleObs",
    "NO_TRAINING",
    "NoDrafterTraining",
    "NoSpec",
    "OFF",
    "DEFAULT_POLICY_NAMES",
    "POLICY_NAMES",
    "REWARD_GROUPS",
    "SpecDecision",
    "SpecFeedback",
    "SpecPolicy",
    "SpotTrainerConfig",
    "SpotTrainerPolicy",
    "StaticSpec",
    "TLTAdaptive",
    "is_eagle_drafting",
    "TLTBase",
    "TLTConfig",
    "TrainDecision",
    "bucket_arms",
    "tltbase_settings",
    "make_policy",
    "to_vllm_dynamic_table",
    "update_accept_len_ema",
]
