"""One speculative verify as a single device program (issue #18: the host work of an SD
iteration). ``StaticVerify`` wraps the pool's verify forward of a (batch bucket, strategy) with
everything the engine did eagerly around it: the tree's RoPE depths and ancestor mask, the
target's probabilities, the uniforms, the acceptance walk (``verify_with_uniforms`` with the
strategy's ``TreeShape``, so nothing is read back mid-way), the hidden-state and token writes
of the accepted path and the KV-cache compaction (``verify_eagerly``, its reference and the
engine's path without a graph for the batch). Run eagerly around the forward these were 160-170 dispatched ops and
5-9 reads of device values for a chain of 4 at batch 4, 850-1,000 ops and 33-39 reads for an
8_4_32 tree (counted on CPU, session 23): on a GPU each read stalls the host until the device
drains, and each op costs a launch. Captured, the host copies the draft tree in, fills the
real-row count, replays and reads the accepted counts and tokens back in one transfer.

The verify's draws are ``verify``'s: (B, N) accept uniforms, then (B,) sampling uniforms from
the engine's generator (registered with the graph), so a sampled run equals the eager engine's
where every batch has its own bucket; greedy verification draws nothing (at temperature 0 the
target's probabilities are one-hot, and uniforms of 0 accept and sample exactly as any others).

Run the tests: ``python -m pytest tests/test_static_verify.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tltrun.model.drafter import tree_layout
from tltrun.rollout.prefill import SlotEngine
from tltrun.rollout.speculative import (
    DraftTree,
    TreeShape,
    logits_to_probs,
    verify,
    verify_with_uniforms,
)
from tltrun.rollout.static_decode import DecodeSources, StaticStep
from tltsim.policy import SpecDecision


@dataclass(frozen=True, kw_only=True)
class VerifyBuffers:
    """The draft trees every verify step of a pool reads, sized for the largest: views of one
    buffer each (only one step runs at a time)."""

    tokens: torch.Tensor  # (rows,) long
    parents: torch.Tensor  # (rows,) long
    probs: torch.Tensor | None  # (rows * V,) float32: strategies whose EAGLE chain samples

    @classmethod
    def for_steps(
        cls, shapes: list[tuple[int, int, bool]], vocab: int, device, probs=None
    ) -> VerifyBuffers:
        """``shapes``: (batch, nodes, is_sampled_chain) of every verify step of the pool.
        ``probs``: a buffer to use for the draft distributions where it is large enough (the
        drafting steps' output: a sampled chain drafted by its graph is then not copied)."""
        rows = max((b * n for b, n, _ in shapes), default=0)
        sampled = max((b * n for b, n, is_sampled in shapes if is_sampled), default=0) * vocab
        if sampled and (probs is None or probs.numel() < sampled):
            probs = torch.zeros(sampled, device=device)
        return cls(
            tokens=torch.zeros(rows, dtype=torch.long, device=device),
            parents=torch.zeros(rows, dtype=torch.long, device=device),
            probs=probs if sampled else None,
        )


class StaticVerify(StaticStep):
    """The SD verify of ``decision``'s trees over slots ``0..batch-1`` around ``forward`` (the
    pool's ``StaticForward`` of ``batch`` x the strategy's nodes): ``run`` is what a graph
    captures. Real rows are the first ``num_real``; the rest are free slots, verified as
    chains of stale tokens at length 0 and written nowhere but their own KV entries."""

    def __init__(
        self,
        forward,
        decision: SpecDecision,
        sources: DecodeSources,
        buffers: VerifyBuffers,
        is_sampled_chain: bool,
    ):
        self.forward, self.decision, self.sources = forward, decision, sources
        self.batch, self.num_tokens = forward.batch, forward.num_tokens
        self.shape = TreeShape.of(decision)
        batch, nodes = self.batch, self.num_tokens
        device = sources.tokens.device
        self.num_real = torch.zeros((), dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)  # (B,)
        self.tokens_in = buffers.tokens[: batch * nodes].view(batch, nodes)
        self.parents_in = buffers.parents[: batch * nodes].view(batch, nodes)
        self.probs_in = None
        if is_sampled_chain:
            vocab = forward.logits_out.shape[-1]
            self.probs_in = buffers.probs[: batch * nodes * vocab].view(batch, nodes, vocab)
        self._chain = (torch.arange(nodes, device=device) - 1).clamp(min=0)  # padding rows
        width = nodes if self.shape.is_chain else self.shape.max_depth + 1
        self.out = torch.zeros(batch, 1 + width, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    @torch.no_grad()
    def run(self) -> None:
        """The captured verify: no host reads, every index a device tensor."""
        fwd, src, rows, batch = self.forward, self.sources, self.rows, self.batch
        cache = fwd.cache
        lens = cache.lens[:batch]  # (B,) a view: written in place
        is_real, base = self.pad_rows(lens)  # base (B,): the root's position
        parents = torch.where(is_real[:, None], self.parents_in, self._chain)  # (B,N)
        tokens = self.tokens_in
        depth, mask = tree_layout(parents, self.shape.max_depth)  # (B,N), (B,N,N)
        fwd.ids.copy_(tokens)
        fwd.depth.copy_(depth)
        fwd.tree_mask.copy_(mask)
        fwd.run()  # logits_out (B,N,V), hidden_out (B,N,C); KV written at base + node
        probs = logits_to_probs(fwd.logits_out, src.sampling)  # (B,N,V) float32
        num_drafted = self.num_tokens - 1
        if self.is_sampled:  # verify()'s draws, in its order
            u_accept = torch.rand((batch, num_drafted), generator=src.generator, device=rows.device)
            u_sample = torch.rand((batch,), generator=src.generator, device=rows.device)
        else:
            u_accept = torch.zeros(batch, num_drafted, device=rows.device)
            u_sample = torch.zeros(batch, device=rows.device)
        tree = DraftTree(tokens, parents, self.probs_in, is_checked=False)
        result = verify_with_uniforms(tree, probs, u_accept, u_sample, src.verify_impl, self.shape)
        path = result.accepted_nodes  # (B,W)
        pos = base[:, None] + torch.arange(path.shape[1], device=rows.device)  # (B,W)
        at = rows[:, None]
        if src.hidden is not None:
            new = fwd.hidden_out.gather(1, path[..., None].expand(-1, -1, fwd.hidden_out.shape[-1]))
            self.write_real(src.hidden, (at, pos), new, is_real)  # (B,W,C)
        self.write_real(src.tokens, (at, pos + 1), result.out_tokens, is_real)
        cache.compact(rows, path, result.num_accepted, is_static=True)  # lens = base + n + 1
        lens.copy_(torch.where(is_real, lens, 0))
        self.out[:, 0] = result.num_accepted
        self.out[:, 1:] = result.out_tokens

    def __call__(self, tree: DraftTree, num_real: int) -> tuple[list[int], list[list[int]]]:
        """Verify the trees of running slots ``0..num_real-1``: per sequence the accepted
        drafts and the tokens to append (accepted drafts, then the correction or bonus token)."""
        n, nodes = tree.tokens.shape
        if n != num_real or not 1 <= n <= self.batch or nodes != self.num_tokens:
            raise ValueError(
                f"verify step {self.batch}x{self.num_tokens}: got {num_real} slots, trees "
                f"{tuple(tree.tokens.shape)}"
            )
        self.tokens_in[:n].copy_(tree.tokens)
        self.parents_in[:n].copy_(tree.parents)
        if self.probs_in is not None:  # point-mass drafts (history, greedy) as one-hot rows
            if tree.draft_probs is not None:
                _copy_in(self.probs_in[:n], tree.draft_probs)
            else:
                self.probs_in[:n].zero_().scatter_(2, tree.tokens[..., None], 1.0)
        elif tree.draft_probs is not None:
            raise ValueError(f"verify step {self.decision.strategy}: no room for draft probs")
        self.launch(n)
        rows = self.out[:n].tolist()  # the step's one read of device values
        accepted = [row[0] for row in rows]
        return accepted, [row[1 : a + 2] for row, a in zip(rows, accepted, strict=True)]


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src``, where ``src`` may be a view of ``dst``'s buffer: the drafting graph's
    output for this bucket is the same view (nothing to copy); another view of that buffer is
    copied through a temporary (overlapping views of different strides)."""
    if src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride():
        return
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
        src = src.clone()
    dst.copy_(src)


def verify_eagerly(
    engine: SlotEngine, slots: torch.Tensor, decision: SpecDecision, tree: DraftTree
) -> tuple[list[int], list[list[int]]]:
    """What ``StaticVerify.run`` does, eagerly, for any batch and slots and the tree's own depth
    (the engine without a graph for this batch): per sequence the accepted drafts and the
    tokens to append."""
    cfg = engine.config
    lens = engine.cache.lens[slots]  # (B,) n: target cache length; tokens[n] is the root
    depth, tree_mask = tree_layout(tree.parents, decision.draft_steps)
    positions = lens[:, None] + depth  # RoPE: root at n, node at n + depth
    ctx = engine.cache.context(slots, depth.shape[1], tree_mask=tree_mask, impl=cfg.attention)
    logits, hidden = engine.model(tree.tokens, positions, ctx)  # (B,N+1,V), (B,N+1,C)
    result = verify(
        tree, logits_to_probs(logits, cfg.sampling), engine.generator, impl=cfg.verify_impl
    )
    path = result.accepted_nodes  # (B,D+1)
    pos = lens[:, None] + torch.arange(path.shape[1], device=lens.device)[None]  # (B,D+1)
    rows = slots[:, None]
    if engine.hidden is not None:
        engine.hidden[rows, pos] = hidden.gather(
            1, path[..., None].expand(-1, -1, hidden.shape[-1])
        )
    engine.tokens[rows, pos + 1] = result.out_tokens
    engine.cache.compact(slots, path, result.num_accepted)
    rows = torch.cat([result.num_accepted[:, None], result.out_tokens], dim=1).tolist()  # one read
    return [r[0] for r in rows], [r[1 : r[0] + 2] for r in rows]
