"""What a simulation returns: per-step records, per-instance rows, timeline segments, summary.

``tltsim.sim.simulator.simulate`` fills a ``SimResult``; ``tltsim replay`` writes it as ``steps.csv``,
``instances.csv``, ``timeline.parquet`` (``Segment`` rows) and ``summary.json``; ``analysis/`` plots those files.
Also home of ``ideal_bound`` / ``ideal_rollout_s``, the lower bound on rollout time every policy is
compared with: max(work bound, critical path).

Glossary: an *instance* is one engine (a TP group of ``tp`` GPUs); the *bubble* is GPU-seconds
an instance sits idle during rollout because its share finished before the slowest one; the
*tail* is time an instance decodes with fewer than ``tail_threshold`` (32) active requests.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from tltsim.policy import SpecDecision
from tltsim.sim.batch import iteration_s

# Timeline segment kinds (the Gantt chart's colours). "idle" and "spot_train" are written after
# the barrier, when the rollout's end is known.
PHASES = ("prefill", "decode", "sd", "reprefill", "spot_train", "idle", "checkpoint", "train")

TIMELINE_COLUMNS = ("step", "instance", "start_s", "end_s", "phase", "num_active", "strategy")


@dataclass(slots=True, kw_only=True)
class Segment:
    """One stretch of one instance's timeline: a row of ``timeline.parquet`` (TIMELINE_COLUMNS).
    Mutable on purpose: exact mode extends ``end_s`` while identical iterations repeat."""

    step: int
    instance: int
    start_s: float  # rollout-relative seconds
    end_s: float
    phase: str  # one of PHASES
    num_active: int = 0  # requests in the batch (0 outside rollout work)
    # the SD decision of an "sd" stretch (named when the timeline becomes a table), else ""
    strategy: SpecDecision | str = ""

    def as_tuple(self) -> tuple:
        """The row in TIMELINE_COLUMNS order."""
        return (
            self.step,
            self.instance,
            self.start_s,
            self.end_s,
            self.phase,
            self.num_active,
            self.strategy,
        )


@dataclass(kw_only=True)
class StepRecord:
    """One RL step. Times are seconds; ``*_gpu_s`` are GPU-seconds (instance-seconds x tp)."""

    step: int
    start_s: float  # simulated clock when the step's rollout began
    rollout_s: float  # rollout start -> barrier (slowest instance done)
    checkpoint_s: float  # spot trainers saving the drafter after preemption (0 without SD)
    train_s: float  # actor update, data parallel over all instances
    step_s: float  # rollout_s + checkpoint_s + train_s
    num_responses: int
    prompt_tokens: int
    tokens_generated: int
    max_response_tokens: int
    busy_gpu_s: float  # GPU-seconds doing rollout work (prefill, decode, SD, re-prefill)
    bubble_gpu_s: float  # GPU-seconds idle during rollout (before any spot training)
    tail_instance_s: float  # instance-seconds decoding with 0 < active < tail_threshold
    max_tail_s: float  # the longest such time on one instance
    first_idle_s: float  # rollout time at which the first instance ran out of work
    decode_instance_s: float  # instance-seconds of decode iterations (plain + SD)
    sd_instance_s: float  # of which SD iterations
    reprefill_instance_s: float  # drafter-cache rebuilds when SD switched on
    sd_tokens: int  # tokens emitted by SD iterations
    sd_verifies: int  # request-iterations of SD (one verify of one request)
    drafter_acceptance: float  # per-token draft acceptance during this step's rollout
    drafter_train_gpu_s: float  # GPU-seconds spot trainers spent training the drafter
    idle_gpu_s: float  # bubble GPU-seconds left idle after spot training (incl. start-up)
    drafter_trained_tokens: int  # tokens the drafter trained on during this step
    ideal_rollout_s: float  # lower bound: max of the two below, see ideal_bound()
    ideal_work_s: float = 0.0  # the work bound (work spread evenly, cheapest iterations)
    ideal_critical_path_s: float = 0.0  # the longest response decoded alone, drafts all accepted
    peak_kv_tokens: int = 0  # the most KV tokens one instance's running requests held at once

    @property
    def sd_on_fraction(self) -> float:
        return self.sd_instance_s / self.decode_instance_s if self.decode_instance_s > 0 else 0.0

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per request per SD verify (incl. the bonus token); 0 without SD."""
        return self.sd_tokens / self.sd_verifies if self.sd_verifies else 0.0

    def as_row(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["sd_on_fraction"] = self.sd_on_fraction
        row["mean_accept_len"] = self.mean_accept_len
        return row


@dataclass(kw_only=True)
class InstanceShare:
    """One instance's requests in one step: what the ideal bound needs."""

    num_requests: int
    prompt_tokens: int  # prompt tokens prefilled at least (each group's once when shared)
    decode_tokens: int  # response tokens after the first (which prefill emits)
    min_prompt_tokens: int
    num_prefills: int  # prompts prefilled at least
    # (prompt_tokens, response_tokens) of the requests no other request of the share dominates
    # (longer prompt and longer response): the critical path's candidates (response_frontier)
    frontier: tuple[tuple[int, int], ...] = ()


@dataclass(kw_only=True)
class SimResult:
    policy: str
    config: Any  # SimConfig (kept as Any to avoid an import cycle)
    steps: list[StepRecord]
    instance_rows: list[
        tuple
    ]  # (step, instance, busy_s, tail_s, decode_s, sd_s, spot_train_s, idle_s, tokens)
    timeline: list[Segment]
    finish_s: list[np.ndarray]  # per step: each response's finish time since rollout start
    strategies_used: set[SpecDecision] = field(default_factory=set)
    shares: list[list[InstanceShare]] = field(default_factory=list)
    wall_s: float = 0.0

    def steps_frame(self) -> pd.DataFrame:
        return pd.DataFrame([s.as_row() for s in self.steps])

    def instances_frame(self) -> pd.DataFrame:
        cols = (
            "step",
            "instance",
            "busy_s",
            "tail_s",
            "decode_s",
            "sd_s",
            "spot_train_s",
            "idle_s",
            "tokens",
        )
        return pd.DataFrame(self.instance_rows, columns=list(cols))

    def timeline_frame(self) -> pd.DataFrame:
        frame = pd.DataFrame(
            [seg.as_tuple() for seg in self.timeline], columns=list(TIMELINE_COLUMNS)
        )
        names: dict[int, str] = {}  # a policy returns few distinct decision objects
        for s in frame["strategy"]:
            if not isinstance(s, str) and id(s) not in names:
                names[id(s)] = s.arm
        frame["strategy"] = [s if isinstance(s, str) else names[id(s)] for s in frame["strategy"]]
        return frame

    @property
    def total_s(self) -> float:
        return sum(s.step_s for s in self.steps)

    def summary(self) -> dict[str, Any]:
        """Whole-run figures (the side-by-side table's columns)."""
        steps = self.steps
        num = len(steps)
        total = self.total_s
        rollout = sum(s.rollout_s for s in steps)
        bubble = sum(s.bubble_gpu_s for s in steps)
        rollout_gpu_s = sum(s.rollout_s for s in steps) * self.config.num_gpus
        decode = sum(s.decode_instance_s for s in steps)
        verifies = sum(s.sd_verifies for s in steps)
        return {
            "policy": self.policy,
            "num_steps": num,
            "num_responses": sum(s.num_responses for s in steps),
            "tokens_generated": sum(s.tokens_generated for s in steps),
            "total_s": total,
            "mean_step_s": total / num if num else 0.0,
            "mean_rollout_s": rollout / num if num else 0.0,
            "mean_train_s": sum(s.train_s for s in steps) / num if num else 0.0,
            "rollout_share": rollout / total if total > 0 else 0.0,
            "bubble_gpu_s": bubble,
            "bubble_fraction": bubble / rollout_gpu_s if rollout_gpu_s > 0 else 0.0,
            "drafter_train_gpu_s": sum(s.drafter_train_gpu_s for s in steps),
            "idle_gpu_s": sum(s.idle_gpu_s for s in steps),
            "sd_on_fraction": sum(s.sd_instance_s for s in steps) / decode if decode > 0 else 0.0,
            "mean_accept_len": sum(s.sd_tokens for s in steps) / verifies if verifies else 0.0,
            "mean_ideal_rollout_s": sum(s.ideal_rollout_s for s in steps) / num if num else 0.0,
            "mean_ideal_work_s": sum(s.ideal_work_s for s in steps) / num if num else 0.0,
            "mean_ideal_critical_path_s": (
                sum(s.ideal_critical_path_s for s in steps) / num if num else 0.0
            ),
            "strategies_used": sorted(d.arm for d in self.strategies_used),
            "wall_s": self.wall_s,
        }


def step_outputs(
    run: Any,
    prompt_tokens: np.ndarray,
    response_tokens: np.ndarray,
    instances: Sequence[Any],
    spot: Any,
    rollout_s: float,
    checkpoint_s: float,
    train_s: float,
    tp: int,
) -> tuple[StepRecord, list[tuple], list[InstanceShare]]:
    """One step's record, per-instance rows and instance shares, from the finished
    ``tltsim.sim.instance.InstanceRollout`` objects and the spot-training outcome."""
    rows, shares = [], []
    for inst in instances:
        trained = float(spot.trained_s[inst.index])
        idle_s = rollout_s - inst.finish_s
        rows.append(
            (
                run.step,
                inst.index,
                inst.busy_s,
                inst.tail_s,
                inst.decode_s,
                inst.sd_s,
                trained,
                idle_s - trained,
                inst.tokens,
            )
        )
        num = int(inst.response_tokens.size)
        prompts = inst.prompt_tokens
        if run.config.share_prompts:  # a group's prompt is prefilled at least once
            prompts = np.asarray(list(inst.group_prompt.values()), dtype=np.int64)
        shares.append(
            InstanceShare(
                num_requests=num,
                prompt_tokens=int(prompts.sum()),
                decode_tokens=int(inst.response_tokens.sum()) - num,
                min_prompt_tokens=int(inst.prompt_tokens.min()) if num else 0,
                num_prefills=int(prompts.size),
                frontier=response_frontier(inst.prompt_tokens, inst.response_tokens),
            )
        )
    bubble = sum(rollout_s - inst.finish_s for inst in instances)
    trained = float(spot.trained_s.sum())
    record = StepRecord(
        step=run.step,
        start_s=run.t0,
        rollout_s=rollout_s,
        checkpoint_s=checkpoint_s,
        train_s=train_s,
        step_s=rollout_s + checkpoint_s + train_s,
        num_responses=int(response_tokens.size),
        prompt_tokens=int(prompt_tokens.sum()),
        tokens_generated=sum(inst.tokens for inst in instances),
        max_response_tokens=int(response_tokens.max()) if response_tokens.size else 0,
        busy_gpu_s=sum(inst.busy_s for inst in instances) * tp,
        bubble_gpu_s=bubble * tp,
        tail_instance_s=sum(inst.tail_s for inst in instances),
        max_tail_s=max(inst.tail_s for inst in instances),
        first_idle_s=min(inst.finish_s for inst in instances),
        decode_instance_s=sum(inst.decode_s for inst in instances),
        sd_instance_s=sum(inst.sd_s for inst in instances),
        reprefill_instance_s=sum(inst.reprefill_s for inst in instances),
        sd_tokens=int(round(sum(inst.sd_tokens for inst in instances))),
        sd_verifies=sum(inst.sd_verifies for inst in instances),
        drafter_acceptance=run.acceptance,
        drafter_train_gpu_s=trained * tp,
        idle_gpu_s=(bubble - trained) * tp,
        drafter_trained_tokens=spot.tokens,
        ideal_rollout_s=0.0,  # filled in by simulate() once the strategies used are known
        peak_kv_tokens=int(max(inst.peak_kv_tokens for inst in instances)),
    )
    return record, rows, shares


def min_cost_per_token(
    cost: Any, max_batch: int, min_prompt_tokens: int, strategies: Sequence[SpecDecision]
) -> np.ndarray:
    """``out[b]`` = the cheapest seconds per emitted token of any iteration with batch <= b.

    Plain decoding emits one token per request per iteration; an SD iteration at most
    ``min(draft_steps, verify_tokens) + 1`` (every draft accepted plus the bonus token). Context
    is taken as ``b * min_prompt_tokens``: iteration cost grows with context, and every running
    request holds at least its prompt, so this is a lower bound for any iteration of batch b.
    """
    out = np.full(max_batch + 1, math.inf)
    best = math.inf
    for b in range(1, max_batch + 1):
        ctx = float(b * min_prompt_tokens)
        best = min(best, cost.decode_iter_s(b, ctx, 1) / b)
        for d in strategies:
            if d.enabled:
                best = min(
                    best,
                    iteration_s(cost, b, ctx, d) / (b * (min(d.draft_steps, d.verify_tokens) + 1)),
                )
        out[b] = best
    return out


def work_bound_s(
    shares: Sequence[InstanceShare],
    cost: Any,
    max_running_requests: int,
    strategies: Sequence[SpecDecision] = (),
) -> float:
    """The work bound: each instance's own requests at the cheapest per-token iteration it could
    ever run (batch at most min(max_running_requests, its requests), see min_cost_per_token),
    one prefill of all its prompts (each group's once when prompts are shared), and that work
    spread evenly over the instances (no tail):
    rollout >= max_i busy_i >= mean_i busy_i >= mean_i bound_i.
    """
    if not shares:
        return 0.0
    max_batch = min(max_running_requests, max(s.num_requests for s in shares))
    min_prompt = (
        min(s.min_prompt_tokens for s in shares if s.num_requests)
        if any(s.num_requests for s in shares)
        else 0
    )
    per_token = min_cost_per_token(cost, max(max_batch, 1), min_prompt, strategies)
    total = 0.0
    for s in shares:
        if s.num_requests == 0:
            continue
        batch = min(max_running_requests, s.num_requests)
        total += (
            cost.prefill_s(s.prompt_tokens, 0.0, s.num_prefills)
            + s.decode_tokens * per_token[batch]
        )
    return total / len(shares)


def response_frontier(
    prompt_tokens: np.ndarray, response_tokens: np.ndarray
) -> tuple[tuple[int, int], ...]:
    """The (prompt, response) pairs no other pair dominates (both at least as long): the
    critical path grows with both, so its maximum over responses is reached on one of these."""
    pairs = sorted(
        set(zip(prompt_tokens.tolist(), response_tokens.tolist(), strict=True)), reverse=True
    )
    out, longest = [], 0
    for prompt, response in pairs:  # prompts descending: keep responses above all seen so far
        if response > longest:
            out.append((int(prompt), int(response)))
            longest = response
    return tuple(out)


# Chunks of a response's decode tokens that share one context in critical_path_s: the bound
# loses at most 1/NUM_PATH_CHUNKS of the context growth's cost (about 0.5% for 32k tokens).
NUM_PATH_CHUNKS = 32


def critical_path_s(
    prompt_tokens: int,
    response_tokens: int,
    cost: Any,
    strategies: Sequence[SpecDecision] = (),
) -> float:
    """Lower bound on the time from a rollout's start until a response of ``response_tokens``
    on a prompt of ``prompt_tokens`` has finished, under any policy using ``strategies``.

    Proof. The response's instance runs one thing at a time. (1) Before its first token, a
    prefill holding its prompt ran on that instance (its own, or its group leader's when prompts
    are shared, which is no shorter): at least ``prefill_s(prompt_tokens, 0, 1)``, a prefill of
    more tokens and sequences costing no less. (2) Its other ``response_tokens - 1`` tokens come
    in order, one iteration after another; an iteration with strategy s emits at most
    ``k_s = min(draft_steps, verify_tokens) + 1`` of them (all drafts accepted plus the bonus
    token; 1 without SD) and costs at least its batch-1 cost ``c_s(1, ctx)`` at this response's
    context ctx (iteration cost does not fall with batch or with context, which the batch's
    summed or padded context only adds to). Charge each token ``c_s(1, ctx) / k_s`` of its
    iteration's cost: that is at least ``rate(ctx) = min_s c_s(1, ctx) / k_s``. An iteration
    emitting decode token j started at context >= prompt + 1 + j - k_max, so a token of a chunk
    starting at decode token j0 is charged at least ``rate(prompt + 1 + max(0, j0 - k_max))``
    (rate does not fall with context). Summing (1) and the chunks gives the bound; the
    rollout, which ends after every response, is at least its maximum over responses.
    """
    num_decode = response_tokens - 1
    time_s = cost.prefill_s(prompt_tokens, 0.0, 1) if prompt_tokens > 0 else 0.0
    if num_decode <= 0:
        return time_s
    options = [(d, min(d.draft_steps, d.verify_tokens) + 1) for d in strategies if d.enabled]
    max_tokens = max([k for _, k in options], default=1)
    chunk = math.ceil(num_decode / NUM_PATH_CHUNKS)
    for first in range(0, num_decode, chunk):
        ctx = float(prompt_tokens + 1 + max(0, first - max_tokens))
        rate = cost.decode_iter_s(1, ctx, 1)
        for decision, k in options:
            rate = min(rate, iteration_s(cost, 1, ctx, decision) / k)
        time_s += min(chunk, num_decode - first) * rate
    return time_s


@dataclass(frozen=True, kw_only=True)
class IdealBound:
    """One step's lower bound on rollout time and its two terms (seconds)."""

    work_s: float  # work_bound_s: all work at the cheapest iterations, spread evenly
    critical_path_s: float  # the slowest response alone at batch 1, every draft accepted

    @property
    def rollout_s(self) -> float:
        return max(self.work_s, self.critical_path_s)


def ideal_bound(
    shares: Sequence[InstanceShare],
    cost: Any,
    max_running_requests: int,
    strategies: Sequence[SpecDecision] = (),
) -> IdealBound:
    """Lower bound on one step's rollout time under ANY policy using ``strategies``: the
    rollout lasts at least as long as the work bound (``work_bound_s``) and at least as long as
    any one response's critical path (``critical_path_s``), so at least their maximum."""
    pairs = [pair for s in shares for pair in s.frontier]
    frontier = response_frontier(
        np.array([p for p, _ in pairs], dtype=np.int64),
        np.array([r for _, r in pairs], dtype=np.int64),
    )
    path = max(
        (critical_path_s(prompt, response, cost, strategies) for prompt, response in frontier),
        default=0.0,
    )
    return IdealBound(
        work_s=work_bound_s(shares, cost, max_running_requests, strategies), critical_path_s=path
    )


def ideal_rollout_s(
    shares: Sequence[InstanceShare],
    cost: Any,
    max_running_requests: int,
    strategies: Sequence[SpecDecision] = (),
) -> float:
    """``ideal_bound(...).rollout_s``: max(work bound, critical path)."""
    return ideal_bound(shares, cost, max_running_requests, strategies).rollout_s
