"""Acceptance model of speculative decoding (chain and tree drafting) and drafter dynamics.

Accept length = tokens a request emits per verify, INCLUDING the bonus/correction token the
target always contributes: 1 <= accept length <= draft_steps + 1. SD is lossless, so accept
lengths change only how fast a response is produced, never its length.

Tree model (documented choice; ``DrafterDynamics`` holds its two parameters)
----------------------------------------------------------------------------
* At every node the target's next token is the drafter's rank-r candidate with probability
  q_1 = a (the per-token acceptance of the drafter's top-1 guess) and, for r >= 2,
  q_r = (1 - a) * b * (1 - b)^(r - 2): once the top guess is wrong, each further candidate is
  right with conditional probability b (``sibling_rate``). The ranks are disjoint events (the
  target picks one token), and depths are independent.
* The tree is built as EAGLE-2 / SGLang build it (arXiv 2406.16858 Sec. 4; SGLang
  ``eagle_worker.draft_forward``): the root expands its ``topk`` best children; at each further
  draft step the ``topk`` best nodes of the newest layer (by path value) each expand ``topk``
  children; finally the ``verify_tokens`` best nodes of all layers are verified. A node's value
  is the product of q over its path: with a calibrated drafter (EAGLE-2's finding: confidence
  approximates acceptance) that value IS the probability the node is accepted.
* Expected accept length = 1 + sum of the verified nodes' values, exactly: accepted nodes form
  one root path, so by linearity E[#accepted] = sum_v P(v accepted). ``accept_len_pmf`` gives
  the exact distribution and ``sample_accept_lengths`` draws from it; the tests check both
  against a Monte-Carlo walk of the tree.
* For chain drafting (topk = 1) this reduces to 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a).

    from tltsim.sim.acceptance import expected_accept_len, sample_accept_lengths
    expected_accept_len(SpecDecision.parse("8_4_48"), accept_rate=0.8)  # 5.21

The model-free history drafter (issue #20) has its own model, ``HistoryModel``: a per-token
match rate from the group's progress and the prompt's history, and ``history_accept_len_pmf``
(chains as above; trees as ``topk`` alternative continuations branching at the root).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from tltsim.policy import SpecDecision

# EAGLE (arXiv 2401.15077) reports that its one-layer drafter's next-token guess is accepted about
# 80% of the time (its n-alpha acceptance rates on MT-bench, about 0.7-0.8). We read this through
# summaries of the paper and could not check the table entries themselves.
DEFAULT_ACCEPT_RATE = 0.8
# Not a direct measurement: with a = 0.8, b = 0.25 puts EAGLE-2's default tree (depth 6, top-10,
# 60 verified nodes) at an expected accept length of 5.1, inside the 4-5.5 range EAGLE-2 reports
# (arXiv 2406.16858; range read through a summary, not verified against its tables).
DEFAULT_SIBLING_RATE = 0.25


def chain_expected_accept_len(accept_rate: float, draft_steps: int) -> float:
    """(1 - a^(k+1)) / (1 - a): k drafted tokens, each accepted with probability a while all
    before it were, plus the bonus/correction token."""
    a, k = accept_rate, draft_steps
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def rank_probs(accept_rate: float, sibling_rate: float, topk: int) -> tuple[float, ...]:
    """q_1..q_topk: probability that the target's token is the drafter's rank-r candidate."""
    _check_rate("accept_rate", accept_rate)
    _check_rate("sibling_rate", sibling_rate)
    probs, miss = [accept_rate], 1.0 - accept_rate
    for _ in range(1, topk):
        probs.append(miss * sibling_rate)
        miss *= 1.0 - sibling_rate
    return tuple(probs)


def _check_rate(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclass(frozen=True)
class DraftTree:
    """The verified nodes. Node 0 is the root (last accepted token); node i >= 1 hangs under
    ``parent[i]`` as its ``rank[i]``-th candidate (0-based) at ``depth[i]``; ``value[i]`` is the
    probability that the target accepts the path to it. Parents precede children."""

    parent: tuple[int, ...]
    rank: tuple[int, ...]
    depth: tuple[int, ...]
    value: tuple[float, ...]
    topk: int
    draft_steps: int

    @property
    def num_nodes(self) -> int:
        return len(self.parent) - 1

    @property
    def expected_accept_len(self) -> float:
        return 1.0 + math.fsum(self.value[1:])


@lru_cache(maxsize=4096)
def build_tree(
    draft_steps: int,
    topk: int,
    verify_tokens: int,
    accept_rate: float,
    sibling_rate: float = DEFAULT_SIBLING_RATE,
) -> DraftTree:
    """Beam-expanded draft tree (EAGLE-2 / SGLang), then the ``verify_tokens`` best nodes. If the
    beam offers fewer candidates than ``verify_tokens`` all are verified (the rest is padding)."""
    q = rank_probs(accept_rate, sibling_rate, topk)
    # candidate: (value, depth, creation index, parent's creation index or None for the root, rank)
    cands: list[tuple[float, int, int, int | None, int]] = []
    frontier: list[tuple[float, int | None]] = [(1.0, None)]  # (value, creation index) to expand
    for depth in range(1, draft_steps + 1):
        layer = []
        for value, cand_index in frontier:
            for r in range(topk):
                layer.append((value * q[r], depth, len(cands) + len(layer), cand_index, r))
        cands.extend(layer)
        best = sorted(layer, key=lambda c: (-c[0], c[2]))[:topk]
        frontier = [(c[0], c[2]) for c in best]
    # Value never grows along a path and ties go to the shallower node, so the chosen prefix is
    # closed under "parent of": every verified node's parent is verified too.
    chosen = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:verify_tokens]
    chosen.sort(key=lambda c: (c[1], c[2]))
    node_of = {c[2]: i + 1 for i, c in enumerate(chosen)}
    parent = [0] + [0 if c[3] is None else node_of[c[3]] for c in chosen]
    return DraftTree(
        parent=tuple(parent),
        rank=(0,) + tuple(c[4] for c in chosen),
        depth=(0,) + tuple(c[1] for c in chosen),
        value=(1.0,) + tuple(c[0] for c in chosen),
        topk=topk,
        draft_steps=draft_steps,
    )


def expected_accept_len(
    decision: SpecDecision, accept_rate: float, sibling_rate: float = DEFAULT_SIBLING_RATE
) -> float:
    """Expected tokens per request per iteration (incl. bonus); 1.0 with SD off."""
    # The EAGLE drafter's model; history-drafter decisions use HistoryModel (below).
    if not decision.enabled:
        return 1.0
    if decision.is_chain:
        _check_rate("accept_rate", accept_rate)
        return chain_expected_accept_len(
            accept_rate, min(decision.draft_steps, decision.verify_tokens)
        )
    return build_tree(
        decision.draft_steps, decision.topk, decision.verify_tokens, accept_rate, sibling_rate
    ).expected_accept_len


def accept_len_pmf(
    decision: SpecDecision, accept_rate: float, sibling_rate: float = DEFAULT_SIBLING_RATE
) -> np.ndarray:
    """Exact distribution of the accept length: ``pmf[i] = P(accept length = i + 1)``, length
    draft_steps + 1 (``[1.0]`` with SD off). The walk stops at a verified node v with probability
    value(v) x (1 - sum of q over v's verified children's ranks), contributing to depth(v) + 1."""
    if not decision.enabled:
        return np.ones(1)
    if decision.is_chain:
        _check_rate("accept_rate", accept_rate)
        depth = min(decision.draft_steps, decision.verify_tokens)
        pmf = np.zeros(decision.draft_steps + 1)
        powers = accept_rate ** np.arange(depth + 1)
        pmf[:depth] = powers[:depth] * (1.0 - accept_rate)
        pmf[depth] = powers[depth]
        return pmf
    tree = build_tree(
        decision.draft_steps, decision.topk, decision.verify_tokens, accept_rate, sibling_rate
    )
    q = rank_probs(accept_rate, sibling_rate, decision.topk)
    covered = [0.0] * len(tree.parent)  # sum of q over each node's verified children
    for node in range(1, len(tree.parent)):
        covered[tree.parent[node]] += q[tree.rank[node]]
    pmf = np.zeros(decision.draft_steps + 1)
    for node, value in enumerate(tree.value):
        pmf[tree.depth[node]] += value * max(0.0, 1.0 - covered[node])
    return pmf


def sample_accept_lengths(
    rng: np.random.Generator,
    num_seqs: int,
    decision: SpecDecision,
    accept_rate: float,
    sibling_rate: float = DEFAULT_SIBLING_RATE,
) -> np.ndarray:
    """Per-request accept lengths (int64, shape (num_seqs,), each in 1..draft_steps+1) for one
    iteration, i.i.d. from ``accept_len_pmf`` (inverse CDF, one uniform per request). The caller
    clips at each response's remaining trace length: SD never changes a response's length."""
    if not decision.enabled or num_seqs == 0:
        return np.ones(num_seqs, dtype=np.int64)
    cdf = np.cumsum(accept_len_pmf(decision, accept_rate, sibling_rate))
    lengths = np.searchsorted(cdf, rng.random(num_seqs) * cdf[-1], side="right") + 1
    return np.minimum(lengths, cdf.size).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Drafter dynamics: acceptance rises with trained tokens and falls as the target drifts.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrafterState:
    accept_rate: float  # per-token top-1 acceptance a against the CURRENT target
    trained_tokens: int = 0  # tokens the drafter has been trained on so far
    num_rl_steps: int = 0  # target updates it has seen


@dataclass(frozen=True)
class DrafterDynamics:
    """Parametric drafter dynamics; every field can be set from a measured run (``tltsim fit``,
    issue #7). Model:

    * training on n tokens closes the gap to ``max_accept_rate`` exponentially (a saturating
      learning curve): a <- a_max - (a_max - a) * exp(-n / learn_tokens);
    * each RL step moves the target away from what the drafter learned: a fraction
      ``drift_per_step`` of the margin above ``stale_accept_rate`` is lost,
      a <- a - drift * max(a - a_stale, 0). A frozen drafter decays geometrically toward
      ``stale_accept_rate``; a spot-trained one recovers between steps.
    """

    # EAGLE's one-layer drafter, see DEFAULT_ACCEPT_RATE
    max_accept_rate: float = field(
        default=DEFAULT_ACCEPT_RATE,
        metadata={"help": "per-token accept rate a fully trained drafter reaches, in [0, 1]"},
    )
    # Assumption: the drafter starts trained on the step-0 target (TLT trains one before RL).
    initial_accept_rate: float = field(
        default=DEFAULT_ACCEPT_RATE,
        metadata={"help": "per-token accept rate at RL step 0, in [0, max accept rate]"},
    )
    # Assumption, NOT a verified number: a drafter far behind the policy still predicts formatting
    # and common words; we could not read TLT's (arXiv 2511.16665) frozen-drafter curve directly.
    stale_accept_rate: float = field(
        default=0.5, metadata={"help": "accept rate a never-retrained drafter decays toward"}
    )
    # Assumption, NOT a verified number: margin lost per RL step (lr ~1e-6 updates change the
    # policy slowly); half-life ~23 steps. Fit it from a measured frozen-drafter run.
    drift_per_step: float = field(
        default=0.03,
        metadata={"help": "fraction of the margin above the stale rate lost per RL step"},
    )
    # Assumption, NOT a verified number: tokens that close 63% of the gap to max_accept_rate when
    # the drafter is fine-tuned on fresh rollouts (not trained from scratch).
    learn_tokens: float = field(
        default=1.0e6,
        metadata={"help": "training tokens that close 63%% (1 - 1/e) of the gap to the max rate"},
    )
    # tree model's b, see DEFAULT_SIBLING_RATE
    sibling_rate: float = field(
        default=DEFAULT_SIBLING_RATE,
        metadata={
            "help": "chance that the next-ranked draft candidate is the target's token when all "
            "higher-ranked ones missed"
        },
    )

    def __post_init__(self) -> None:
        for name in (
            "max_accept_rate",
            "initial_accept_rate",
            "stale_accept_rate",
            "drift_per_step",
            "sibling_rate",
        ):
            _check_rate(name, getattr(self, name))
        if (
            not self.stale_accept_rate <= self.max_accept_rate
            or not self.initial_accept_rate <= self.max_accept_rate
        ):
            raise ValueError(
                "DrafterDynamics: need stale_accept_rate <= max_accept_rate and initial_accept_rate <= max_accept_rate"
            )
        if not self.learn_tokens > 0:  # a NaN fails too (it failed mid-run: exp(-n / nan))
            raise ValueError(f"DrafterDynamics: learn_tokens must be > 0, got {self.learn_tokens}")

    def initial_state(self) -> DrafterState:
        return DrafterState(self.initial_accept_rate)

    def first_step_training_shows(self) -> int | None:
        """The first RL step whose acceptance spot training can change (None: none can). What
        step k trains serves step k + 1; a drafter that starts at ``max_accept_rate`` (the
        default) has nothing to learn until step 0's update has moved the target (drift), so
        the first step it can help is step 2: a replay of 2 steps weighs only its costs."""
        if math.isinf(self.learn_tokens):
            return None
        if self.initial_accept_rate < self.max_accept_rate:
            return 1
        if self.drift_per_step > 0 and self.initial_accept_rate > self.stale_accept_rate:
            return 2
        return None

    def after_rl_step(self, state: DrafterState) -> DrafterState:
        """The target's weights changed (one RL update)."""
        margin = max(state.accept_rate - self.stale_accept_rate, 0.0)
        return DrafterState(
            state.accept_rate - self.drift_per_step * margin,
            state.trained_tokens,
            state.num_rl_steps + 1,
        )

    def after_training(self, state: DrafterState, num_tokens: int) -> DrafterState:
        """The drafter was trained on ``num_tokens`` tokens from the current target."""
        if num_tokens < 0:
            raise ValueError(f"after_training: num_tokens must be >= 0, got {num_tokens}")
        gap = max(self.max_accept_rate - state.accept_rate, 0.0) * math.exp(
            -num_tokens / self.learn_tokens
        )
        return DrafterState(
            self.max_accept_rate - gap, state.trained_tokens + num_tokens, state.num_rl_steps
        )

    def expected_accept_len(self, state: DrafterState, decision: SpecDecision) -> float:
        return expected_accept_len(decision, state.accept_rate, self.sibling_rate)

    def sample_accept_lengths(
        self, rng: np.random.Generator, num_seqs: int, state: DrafterState, decision: SpecDecision
    ) -> np.ndarray:
        return sample_accept_lengths(rng, num_seqs, decision, state.accept_rate, self.sibling_rate)


# ---------------------------------------------------------------------------------------------
# The history drafter (issue #20): acceptance from the group's progress and the prompt's history.
# ---------------------------------------------------------------------------------------------

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
    _check_rate("accept_rate", accept_rate)
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
            "help": "whose history a drafter indexes: its own instance's (tltrun) or the cluster's",
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
        _check_rate("sibling_rate", self.sibling_rate)
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


__all__ = [
    "DEFAULT_ACCEPT_RATE",
    "DEFAULT_SIBLING_RATE",
    "DraftTree",
    "HISTORY_SCOPES",
    "HistoryModel",
    "accept_len_pmf",
    "DrafterDynamics",
    "DrafterState",
    "history_accept_len_pmf",
    "sigmoid",
    "build_tree",
    "chain_expected_accept_len",
    "expected_accept_len",
    "rank_probs",
    "sample_accept_lengths",
]
