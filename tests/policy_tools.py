"""Helpers of the policy tests: a decode observation and a bandit feedback in one line each."""

from __future__ import annotations

from tltsim.policy import DecodeObs, SpecDecision, SpecFeedback


def obs(num_active: int, instance: int = 0, now_s: float = 0.0, step: int = 0) -> DecodeObs:
    return DecodeObs(now_s=now_s, step=step, instance=instance, num_active=num_active)


def feedback(
    num_active: int, decision: SpecDecision, accepted: float, iteration_s: float, num_iters: int = 1
) -> SpecFeedback:
    return SpecFeedback(
        step=0,
        instance=0,
        num_active=num_active,
        decision=decision,
        accepted_tokens=accepted,
        iteration_s=iteration_s,
        num_iters=num_iters,
    )
