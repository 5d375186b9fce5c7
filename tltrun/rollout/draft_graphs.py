"""EAGLE drafting with static shapes: the drafting half of TLT's SD graphs (issue #18; the
verify half is ``tltrun.rollout.graphs.StaticForward``). One ``StaticDraft`` per (batch bucket,
strategy) of the pool's plan runs the drafter's catch-up on each slot's pending exact pairs and
its ``draft_steps`` tree expansion over slots ``0..B-1`` with no host synchronisation, and
writes the tree (tokens, parents, draft probabilities) into fixed buffers. On CUDA
``tltrun.rollout.graphs.GraphPool`` captures it into the same memory pool as the verify graphs;
on CPU it runs uncaptured, the tested reference of a replay (``tests/test_draft_graphs.py``).

Pending pairs. Before drafting, slot s's drafter lacks the exact pairs (x_{p+1}, f_p) for
p = drafter_len .. target_len - 1 (``tltrun.model.drafter``). After a verify these are the
accepted drafts plus the correction/bonus token: accept length <= tree depth <= draft_steps,
so at most draft_steps + 1. A sequence whose drafter lags further (just admitted, SD was off,
or history-drafter iterations ran) is re-prefilled first (``RolloutEngine.reprefill_drafter``
feeds every pair but the newest), leaving 1. So the pool's bound is the largest draft_steps of
its EAGLE strategies, + 1: one bound for every drafting step, so that a switch from a deeper
strategy to a shallower one (TLTAdaptive's buckets and bandit) still fits; it is also the
engine's ``catchup_pairs()`` with the pool, so a lag within it (a history iteration) is fed
here, without a re-prefill. A batch with more (after an eager SD iteration of a strategy
outside the plan), or with a slot so near the end of the cache that the padded catch-up
would write past it, falls back to the eager
``tltrun.rollout.prefill.eagle_draft``: ``StaticDraft.__call__`` returns None. That check is
the step's one host read, before the replay.

Padding. The catch-up feeds exactly ``max_pending`` pairs per slot: pairs past a slot's own
count are gathered from clamped positions and written past its drafter length (garbage by the
cache's invariant, ``tltrun.model.kvcache``: the commit moves the length by the real count
only), and only the last real pair's logits and output are used. Rows n..B-1 (a batch smaller
than its bucket) are free slots with drafter length 0 and one pending pair: causal attention
over their own entries, never read by a real row (as ``StaticForward``'s padding).

Sampling. Trees and greedy chains draft deterministically (top-k / argmax): no random draw.
A chain at temperature > 0 draws each token from ``engine.generator``; a captured graph needs
that generator registered with it (``torch.cuda.CUDAGraph.register_generator_state``: each
replay then advances its Philox offset, as the default CUDA generator's). Where torch lacks
that method, sampled chains' drafting steps stay uncaptured (the same code, run eagerly). A
padded step's draws are not the eager path's (padding rows draw too), only identically
distributed: every draft is verified against the q it was drawn from, so SD stays lossless.

Run the tests: ``python -m pytest tests/test_draft_graphs.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tltrun.model.attention import causal_mask
from tltrun.model.drafter import EagleDrafter, expand_tree
from tltrun.model.kvcache import KVCache, StaticContext
from tltrun.rollout.interface import SamplingParams
from tltrun.rollout.prefill import SlotEngine
from tltrun.rollout.speculative import DraftTree
from tltrun.rollout.static_decode import IS_GENERATOR_REGISTRABLE, capture_graph
from tltsim.policy import SpecDecision


@dataclass(frozen=True, kw_only=True)
class DraftSources:
    """The engine state drafting reads and writes (``tltrun.rollout.engine``'s per-slot
    invariant): the drafter and its cache, the target cache's lengths, every slot's tokens and
    target hidden states by position, the sampling settings and the engine's generator."""

    drafter: EagleDrafter
    cache: KVCache  # the drafter's (one layer)
    target_lens: torch.Tensor  # (slots,) long: the target cache's lengths
    tokens: torch.Tensor  # (slots, max_tokens) long
    hidden: torch.Tensor  # (slots, max_tokens, C)
    sampling: SamplingParams
    generator: torch.Generator
    impl: str  # attention of the catch-up: "sdpa" | "flex" (StaticContext)


def draft_sources(engine: SlotEngine) -> DraftSources | None:
    """What ``engine``'s drafting steps read and write; None without an EAGLE drafter."""
    if engine.drafter is None:
        return None
    return DraftSources(
        drafter=engine.drafter,
        cache=engine.draft_cache,
        target_lens=engine.cache.lens,
        tokens=engine.tokens,
        hidden=engine.hidden,
        sampling=engine.config.sampling,
        generator=engine.generator,
        impl=engine.config.attention,
    )


def max_pending_pairs(strategies: tuple[str, ...]) -> int:
    """The pending-pair bound of a pool drafting ``strategies``: the largest draft_steps + 1
    (the accepted drafts plus the correction token of a verify; see the module docstring)."""
    return max((SpecDecision.parse(s).draft_steps for s in strategies), default=0) + 1


def num_tree_nodes(decision: SpecDecision) -> int:
    """Nodes of the drafter's tree, root included: ``verify_tokens`` drafted ones, or all the
    tree expansion offers when fewer (topk + (draft_steps - 1) * topk^2 candidates:
    ``tltrun.model.drafter._select``)."""
    offered = decision.topk + (decision.draft_steps - 1) * decision.topk**2
    return min(decision.verify_tokens, offered) + 1


def is_sampled_chain(decision: SpecDecision, sampling: SamplingParams) -> bool:
    """Whether drafting ``decision`` draws random numbers (a chain at temperature > 0)."""
    return decision.is_chain and not sampling.is_greedy


@dataclass(frozen=True, kw_only=True)
class DraftBuffers:
    """Inputs and outputs of every drafting step of a pool, sized for the largest: views of one
    buffer each (only one step runs at a time)."""

    num_pending: torch.Tensor  # (max_batch,) long: pending pairs per slot
    tokens: torch.Tensor  # (max_batch * max_nodes,) long
    parents: torch.Tensor  # (max_batch * max_nodes,) long
    probs: torch.Tensor | None  # (max_batch * max_nodes * V,) float32: sampled chains only

    @classmethod
    def for_steps(
        cls, sources: DraftSources, steps: list[tuple[int, SpecDecision]]
    ) -> DraftBuffers:
        device = sources.cache.lens.device
        rows = max((b * num_tree_nodes(d) for b, d in steps), default=0)
        sampled = [b * num_tree_nodes(d) for b, d in steps if is_sampled_chain(d, sources.sampling)]
        vocab = sources.drafter.config.vocab_size
        return cls(
            num_pending=torch.ones(
                max((b for b, _ in steps), default=0), dtype=torch.long, device=device
            ),
            tokens=torch.zeros(rows, dtype=torch.long, device=device),
            parents=torch.zeros(rows, dtype=torch.long, device=device),
            probs=torch.zeros(max(sampled) * vocab, device=device) if sampled else None,
        )


class StaticDraft:
    """EAGLE drafting of ``decision``'s tree over slots ``0..batch-1`` with static shapes:
    ``run`` is what a graph captures (reads the engine state and ``num_pending``, writes the
    output buffers and commits the caught-up pairs to the drafter cache)."""

    def __init__(
        self,
        sources: DraftSources,
        batch: int,
        decision: SpecDecision,
        max_pending: int,
        buffers: DraftBuffers,
    ):
        cache = sources.cache
        if batch > cache.num_slots or max_pending > cache.max_tokens:
            raise ValueError(
                f"drafting step {batch}x{max_pending} exceeds the drafter cache "
                f"({cache.num_slots} slots x {cache.max_tokens} tokens)"
            )
        self.sources, self.batch, self.decision, self.max_pending = (
            sources,
            batch,
            decision,
            max_pending,
        )
        nodes = num_tree_nodes(decision)
        self.num_pending = buffers.num_pending[:batch]
        self.tokens_out = buffers.tokens[: batch * nodes].view(batch, nodes)
        self.parents_out = buffers.parents[: batch * nodes].view(batch, nodes)
        self.probs_out = None
        if is_sampled_chain(decision, sources.sampling):
            vocab = sources.drafter.config.vocab_size
            self.probs_out = buffers.probs[: batch * nodes * vocab].view(batch, nodes, vocab)
        self._causal = causal_mask(batch, max_pending, cache.lens.device)
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def is_capturable(self) -> bool:
        return self.probs_out is None or IS_GENERATOR_REGISTRABLE

    @torch.no_grad()
    def run(self) -> None:
        """The captured drafting: catch-up on the pending pairs, then the tree expansion."""
        src, batch, width = self.sources, self.batch, self.max_pending
        cache, device = src.cache, src.cache.lens.device
        start = cache.lens[:batch].clone()  # (B,) drafter lengths: the first pending pair
        steps = torch.arange(width, device=device)
        positions = start[:, None] + steps  # (B,P) the pairs' RoPE positions
        pos = positions.clamp(max=cache.max_tokens - 2)  # pairs past a slot's count: any finite
        rows = torch.arange(batch, device=device)[:, None]
        tokens, hidden = src.tokens[rows, pos + 1], src.hidden[rows, pos]  # (B,P), (B,P,C)
        last = (self.num_pending - 1)[:, None]  # (B,1) the newest pending pair: the tree's root
        ctx = StaticContext(cache, batch, self._causal, src.impl)
        logits, out = src.drafter(tokens, hidden, positions, ctx, logit_index=last)
        cache.lens[:batch] += self.num_pending  # commit the real pairs only
        g = out.gather(1, last[..., None].expand(-1, -1, out.shape[-1]))[:, 0]  # (B,C)
        root = tokens.gather(1, last)  # (B,1)
        tree_tokens, parents, probs = expand_tree(
            src.drafter,
            cache,
            slice(0, batch),
            root,
            logits[:, 0],
            g,
            self.decision,
            src.sampling,
            src.generator,
            key_width=cache.max_tokens,
        )
        self.tokens_out.copy_(tree_tokens)
        self.parents_out.copy_(parents)
        if self.probs_out is not None:
            self.probs_out.copy_(probs)

    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        """Warm up on a side stream, then capture (with the engine's generator registered when
        drafting samples). Scratch entries go to free slots: between rollouts only."""
        self._pad(0)
        generator = None if self.probs_out is None else self.sources.generator
        # the warm-up committed its scratch pairs: padded again before the capture
        self.graph = capture_graph(self.run, pool, stream, generator, lambda: self._pad(0))
        self.sources.cache.lens[: self.batch] = 0

    def __call__(self, num_real: int) -> DraftTree | None:
        """The tree of running slots ``0..num_real-1`` (views of the shared output buffers,
        valid until the pool's next drafting step), or None when a slot's pending pairs do not
        fit the static shape: the caller drafts eagerly then."""
        if not 1 <= num_real <= self.batch:
            raise ValueError(f"drafting step of batch {self.batch}: got {num_real} slots")
        src = self.sources
        lens = src.cache.lens[:num_real]
        num = src.target_lens[:num_real] - lens  # (n,) >= 1 by the engine's invariant
        is_fitting = (num >= 1) & (num <= self.max_pending)
        is_fitting &= lens + self.max_pending <= src.cache.max_tokens
        if not bool(is_fitting.all()):  # the step's one host read
            return None
        self.num_pending[:num_real].copy_(num)
        self._pad(num_real)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()
        src.cache.lens[num_real : self.batch] = 0  # padding rows committed a scratch pair
        probs = None if self.probs_out is None else self.probs_out[:num_real]
        tokens, parents = self.tokens_out[:num_real], self.parents_out[:num_real]
        return DraftTree(tokens, parents, probs, is_checked=False)  # tests check the expansion

    def _pad(self, num_real: int) -> None:
        self.num_pending[num_real:].fill_(1)
        self.sources.cache.lens[num_real : self.batch] = 0  # free slots
