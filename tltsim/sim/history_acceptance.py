"""Acceptance model of the model-free history drafter (issue #20): ``HistoryModel``, a per-token
match rate from the group's progress and the prompt's history, and ``history_accept_len_pmf``
(chains as ``tltsim.sim.acceptance``'s EAGLE chains; trees as ``topk`` alternative
continuations branching at the root).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tltsim.policy import SpecDecision
from tltsim.sim.acceptance import DEFAULT_SIBLING_RATE, check_rate, rank_probs

HISTORY_SCOPES = ("instance", "cluster")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def history_accept_len_pmf(
    decision: SpecDecision, accept_rate: float, sibling_rate: float
) -> np.ndarray:
    """Exact accept-length distribution of a history draft (``pmf[i] = P(L = i + 1)``, length
    draft_steps + 1). A history draft is a point mass per node, and its tree is ``topk``
    alternative continuations that branch at the root only (``tltrun.model.history_drafter.
    propose_tree``; ``tree_nodes`` verifies nodes in (depth, branch) order, so branch r keeps
    D_r nodes, the first ones D_r = ceil((verify_tokens - r + 1) / topk) capped at draft_steps).
    The target's next token is branch r's first token with probability q_r (``rank_probs``:
    q_1 = a, then (1 - a) b (1 - b)^(r-2)); after that every further token of the branch matches
    with probability a, independently. Accepting j tokens of branch r: q_r a^(j-1) (1 - a) for
    j < D_r, q_r a^(D_r - 1) for j = D_r; no branch right: L = 1. With topk = 1 this is the
    chain formula of ``accept_len_pmf``."""
    if not decision.enabled:
        return np.ones(1)
    check_rate("accept_rate", accept_rate)
    d, k, v = decision.draft_steps, decision.topk, decision.verify_tokens
    pmf = np.zeros(d + 1)
    q = rank_probs(accept_rate, sibling_rate, k)
    missed = 1.0
    for r in range(min(k, v)):
        depth = min(d, -(-(v - r) // k))  # nodes of branch r among the first v
        missed -= q[r]
        for j in range(1, depth):
            pmf[j] += q[r] * accept_rate ** (j - 1) * (1.0 - accept_rate)
        pmf[depth] += q[r] * accept_rate ** (depth - 1)
    pmf[0] += max(missed, 0.0)
    return pmf


@dataclass(frozen=True)
class HistoryModel:
    """Acceptance of the model-free history drafter (``tltrun.model.history_drafter``; issue
    #20). A history draft copies what followed the sequence's last n tokens elsewhere in its
    group's history, so how often it is right depends on how much history there is to copy:

        a_h = sigmoid(base_logit + finished_logit * f + history_logit * h)

    per drafted token (the i.i.d. per-token model EAGLE's chain formula uses), where f is the
    fraction of the response's siblings (the other responses of its prompt in this step) that
    have finished and are in its drafter's index, and h = 1 when responses of the same prompt
    id from an earlier RL step are in the index (the prompt recurs: a new epoch over the data),
    else 0. Accept lengths then follow ``history_accept_len_pmf``: chains as EAGLE chains,
    trees as ``topk`` alternative continuations branching at the root.

    The index lives in one engine: tltrun keeps one ``HistoryDrafter`` per engine instance, so
    with ``scope = "instance"`` (default) only siblings and earlier rollouts that ran on the
    same instance count; ``"cluster"`` models a history shared by every instance (as SPEC-RL and
    RhymeRL share cached rollouts). Not modelled: the index's eviction bound
    (``--history-max-tokens``, 1M tokens per engine by default: earlier rollouts are assumed
    kept) and running siblings' partial outputs (the index holds them too, but they are short
    of what the response needs next while it is ahead of them)."""

    # Published work on rollout-history drafting (SPEC-RL arXiv 2509.23232: 2-3x less rollout
    # time; RhymeRL arXiv 2508.18588: 2.6x; DAS arXiv 2511.13841: up to 50% less rollout time;
    # SuffixDecoding arXiv 2411.04975) reports speedups; we found no per-token match rate we
    # could verify in their tables (read through abstracts and summaries only), nor an accept
    # length of the TLT paper's TLT-Base (arXiv 2511.16665). The three logits are therefore OUR
    # OWN MEASUREMENT, on a toy: ``tltsim fit`` (tltsim.fidelity.fit_history) of a ``tltrun
    # train --policy tltbase`` run (torch engine, 1 worker, 8 RL steps of 4 prompts x 8
    # responses, chain 6_1_6, --tlt-threshold 64 so every iteration drafted, max 512 new tokens)
    # of a 4-layer 64-wide model from ``tltrun sft --num-steps 1500`` on the built-in task,
    # over 8 fixed built-in-task problems (--data, 4 epochs: each prompt recurred), the trace's
    # prompt ids mapped to the drafter's prompt keys from the run's rollout dump (train traces
    # now name groups by that key themselves, MeasuredStep.is_prompt_id_stable): 256
    # responses, 10,227 verifies, measured accept length 2.09 (the fitted model gives 2.24).
    # A run on fresh prompts (6 steps x 4 x 8) gave base -1.15 and finished +5.57 (history not
    # identifiable). A tiny model's samples of one arithmetic problem are far more alike than a
    # 7B model's reasoning: for a real cluster, fit these from a measured run.
    base_logit: float = field(
        default=-1.25,  # +-0.04 (a = 0.22 with no finished sibling and no history)
        metadata={"help": "logit of the per-token match rate with no finished sibling, no history"},
    )
    finished_logit: float = field(
        default=5.07,  # +-0.30 (a = 0.98 once every sibling has finished)
        metadata={"help": "logit added at finished-sibling fraction 1 (linear in the fraction)"},
    )
    history_logit: float = field(
        default=1.11,  # +-0.05 (a = 0.46 with earlier rollouts of the prompt alone)
        metadata={"help": "logit added when earlier rollouts of the prompt are indexed"},
    )
    # Assumption, as DEFAULT_SIBLING_RATE for EAGLE: a tree's other branches continue other
    # occurrences of the context; no measurement of how often they are right.
    sibling_rate: float = field(
        default=DEFAULT_SIBLING_RATE,
        metadata={
            "help": "chance that the next alternative continuation is right when all before missed"
        },
    )
    # 1: the fitted rate itself; other values are the ends of a replay's --accept-rate-range
    # band (tltsim.sim.intervals.accept_band), as its factors scale EAGLE's accept rates
    rate_factor: float = field(
        default=1.0,
        metadata={"help": "factor on the per-token match rate (capped at 1)"},
    )
    scope: str = field(
        default="instance",
        metadata={
            "help": "whose history a drafter indexes: its own instance's (tltrun) or the "
            "cluster's (simulated an iteration at a time while siblings run elsewhere: as "
            "slow as --exact)",
            "choices": HISTORY_SCOPES,
        },
    )
    # Measured: benchmarks/bench_history.py --sizes 1000,20000 --repeats 5 on this 2-core CPU
    # (pure Python): propose 2.3 us (chain of 6) / 3.0-3.2 us (tree of 4 x 6) per sequence,
    # index update 2.6-4.1 us per token, independent of the history's size. No drafter forward.
    # Re-measured with drafts by the most frequent continuation (2026-11-27, 1k-1M history
    # tokens, benchmarks/RESULTS.md): chain 1.3-1.4 us, tree 1.6-3.8 us, index update 2.1-3.0
    # us per token; the walk per token is bounded by the deepest context a draft reads since
    # (2026-11-27, session 19): 2.2-3.8 us per token over 1k-1M tokens, 3.3-6.6 us in a
    # response looping on 1-3 tokens (unbounded: 13-620 us, growing with the loop); the
    # defaults stayed. With the cross-prompt index (tltrun's default since session 20,
    # 2026-11-27: every token indexed twice, a proposal walks up to three automata; the same
    # script, both settings alternating): chain 1.9-2.6 us (1.7-1.8 without), index update
    # 5.1-5.9 us per token (2.5-3.1 without), so the index default follows it.
    propose_s_per_seq: float = field(
        default=3e-6, metadata={"help": "host seconds to propose one sequence's history draft"}
    )
    index_s_per_token: float = field(
        default=6e-6, metadata={"help": "host seconds to index one emitted token"}
    )

    def __post_init__(self) -> None:
        for name in ("base_logit", "finished_logit", "history_logit"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"HistoryModel: {name} must be finite, got {getattr(self, name)}")
        check_rate("sibling_rate", self.sibling_rate)
        if not 0.0 < self.rate_factor < math.inf:
            raise ValueError(f"HistoryModel: rate_factor must be > 0, got {self.rate_factor}")
        if self.scope not in HISTORY_SCOPES:
            raise ValueError(
                f"HistoryModel: scope must be one of {', '.join(HISTORY_SCOPES)}, got {self.scope!r}"
            )
        for name in ("propose_s_per_seq", "index_s_per_token"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ValueError(f"HistoryModel: {name} must be >= 0, got {getattr(self, name)}")

    def accept_rate(self, finished_fraction: float, has_history: bool) -> float:
        """a_h: per-token match rate at this group progress and history (class docstring)."""
        if not 0.0 <= finished_fraction <= 1.0:
            raise ValueError(f"finished_fraction must be in [0, 1], got {finished_fraction}")
        logit = (
            self.base_logit
            + self.finished_logit * finished_fraction
            + self.history_logit * float(has_history)
        )
        return min(1.0, self.rate_factor * sigmoid(logit))

    def accept_len_pmf(
        self, decision: SpecDecision, finished_fraction: float, has_history: bool
    ) -> np.ndarray:
        rate = self.accept_rate(finished_fraction, has_history)
        return history_accept_len_pmf(decision, rate, self.sibling_rate)

    def expected_accept_len(
        self, decision: SpecDecision, finished_fraction: float, has_history: bool
    ) -> float:
        pmf = self.accept_len_pmf(decision, finished_fraction, has_history)
        return float(pmf @ np.arange(1, pmf.size + 1))


__all__ = ["HISTORY_SCOPES", "HistoryModel", "history_accept_len_pmf", "sigmoid"]
