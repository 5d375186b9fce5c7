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

The model-free history drafter (issue #20) has its own model, ``tltsim.sim.history_acceptance``.
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
    check_rate("accept_rate", accept_rate)
    check_rate("sibling_rate", sibling_rate)
    probs, miss = [accept_rate], 1.0 - accept_rate
    for _ in range(1, topk):
        probs.append(miss * sibling_rate)
        miss *= 1.0 - sibling_rate
    return tuple(probs)


def check_rate(name: str, value: float) -> None:
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
        check_rate("accept_rate", accept_rate)
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
        check_rate("accept_rate", accept_rate)
        depth = min(decision.draft_steps, decision.verify_tokens)
        pmf = np.zeros(decision.draft_steps + 1)
        powers = accept_rate ** np.arange(depth + 1)
        pmf[:depth] = powers[:depth] * (1.0 - accept_rate)
        pmf[depth] = powers[depth]
        return pmf
    tree = build_tree(
        decision.draft_steps, decision.topk, decision.verify_tokens, accept_rate, sibling_rate
    )
    return tree_accept_len_pmf(tree, accept_rate, sibling_rate)


def tree_accept_len_pmf(tree: DraftTree, accept_rate: float, sibling_rate: float) -> np.ndarray:
    """``accept_len_pmf`` of a tree of fixed shape (its parents, ranks and depths) at rates
    (a, b): each node's value is recomputed as its parent's times q[rank]. With the shape built
    at the same (a, b) this is ``accept_len_pmf``; with the shape held fixed it is smooth in a
    and b, where ``accept_len_pmf`` jumps whenever another node set becomes the best
    (``tltsim.fidelity.fit`` takes its curvatures this way)."""
    q = rank_probs(accept_rate, sibling_rate, tree.topk)
    value = [1.0] * len(tree.parent)
    covered = [0.0] * len(tree.parent)  # sum of q over each node's verified children
    for node in range(1, len(tree.parent)):  # parents precede children
        value[node] = value[tree.parent[node]] * q[tree.rank[node]]
        covered[tree.parent[node]] += q[tree.rank[node]]
    pmf = np.zeros(tree.draft_steps + 1)
    for node, v in enumerate(value):
        pmf[tree.depth[node]] += v * max(0.0, 1.0 - covered[node])
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
            check_rate(name, getattr(self, name))
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


__all__ = [
    "DEFAULT_ACCEPT_RATE",
    "DEFAULT_SIBLING_RATE",
    "DraftTree",
    "accept_len_pmf",
    "DrafterDynamics",
    "DrafterState",
    "build_tree",
    "check_rate",
    "chain_expected_accept_len",
    "expected_accept_len",
    "rank_probs",
    "sample_accept_lengths",
]
