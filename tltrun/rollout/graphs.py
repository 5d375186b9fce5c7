"""The rollout engine's CUDA-graph pool (TLT's Adaptive Rollout Engine keeps "a memory-efficient
pool of pre-captured CUDA graphs", arXiv 2511.16665; issue #18).

Three parts, the first two plain Python (unit-tested on CPU, ``tests/test_graphs.py``):

* ``capture_plan(policy, max_batch)``: which graphs to capture, from the policy itself, so that
  nothing is captured the policy can never choose. ``TLTAdaptive``: decode graphs for the batch
  buckets above its SD threshold, and SD graphs per (batch bucket, strategy) at or below it,
  with only the strategies of the policy buckets that bucket serves; ``StaticSpec``: its one
  strategy at every bucket; ``NoSpec`` (and any other policy): decode graphs only. An SD graph
  is a verify graph plus, for an engine with an EAGLE drafter (``is_drafting``) and a strategy
  some EAGLE arm of that bucket uses, a drafting graph (``tltrun.rollout.draft_graphs``).
* ``CapturePlan.decode_bucket`` / ``spec_bucket``: the smallest captured bucket that holds a
  batch; the batch is padded up to it (free slots with length 0: ``StaticForward``).
* ``GraphPool``: one ``StaticForward`` per planned shape and one ``StaticDraft`` per planned
  drafting step, all inputs and outputs in buffers shared by every shape (only one runs at a
  time), captured on CUDA into ONE memory pool
  (``torch.cuda.graph(..., pool=...)``), largest first so the smaller graphs reuse its blocks
  (SGLang captures largest to smallest for the same reason: docs/advanced_features/
  cuda_graphs.md). On CPU nothing is captured: the same static forwards run eagerly, which is
  how the padding is tested.

What a graph holds, for an engine: a whole plain decode iteration (``StaticDecode``: pending
tokens in, the forward, sampling, the hidden-state, token and cache-length writes), a whole SD
verify (``StaticVerify``: the draft tree's ``verify_tokens + 1`` nodes through the forward with
its tree mask, acceptance, the accepted path's writes and KV compaction), or the EAGLE
drafter's catch-up and tree expansion (``StaticDraft``: its pending pairs padded to a fixed
count, a batch with more drafts eagerly). nano-vllm's ``ModelRunner`` graphs the model forward
only; here the host's work between replays is the draft tree's copy in and one read of the
results. A pool made without the engine's state (``decoding``; tests) captures the bare
forwards. The draws inside graphs (sampled decode and verify, sampled draft chains) come from
the engine's generator registered with the graph. Weight updates copy into the parameters in place (``RolloutEngine.update_weights`` /
``update_drafter``), which the graphs read at replay.

Run the tests: ``python -m pytest tests/test_graphs.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tltrun.model.attention import causal_mask
from tltrun.model.kvcache import KVCache, StaticContext
from tltrun.model.transformer import Transformer
from tltrun.rollout.draft_graphs import (
    DraftBuffers,
    DraftSources,
    StaticDraft,
    is_sampled_chain,
    max_pending_pairs,
    num_tree_nodes,
)
from tltrun.rollout.static_decode import DecodeSources, StaticDecode, capture_graph
from tltrun.rollout.static_verify import StaticVerify, VerifyBuffers
from tltsim.policy import SpecDecision, SpecPolicy, StaticSpec, TLTAdaptive, bucket_arms

# vLLM's default CUDA-graph capture sizes: 1, 2, 4, then multiples of 8 up to 256 (then of 16,
# beyond this engine's 256-request default): vllm/config/vllm.py ``_set_cudagraph_sizes``
# ("cudagraph_capture_sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, ...))").
VLLM_BATCH_BUCKETS = (1, 2, 4, *range(8, 257, 8))


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """vLLM's capture sizes up to ``max_batch``, plus ``max_batch`` itself (every batch the
    engine can run has a bucket)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    small = tuple(b for b in VLLM_BATCH_BUCKETS if b < max_batch)
    return (*small, max_batch)


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= ``batch`` (buckets increasing), None if the batch is larger."""
    return next((b for b in buckets if b >= batch), None)


@dataclass(frozen=True, kw_only=True)
class CapturePlan:
    """Graph shapes to capture: plain decode per batch bucket, SD verify per (bucket, strategy),
    EAGLE drafting per (bucket, strategy) (``draft_graphs``, a subset of ``spec_graphs``). A
    strategy is ``SpecDecision.strategy`` (``"8_4_32"``): the EAGLE and history drafters' trees
    of one strategy share its verify graph; the history drafter has no drafting graph."""

    decode_buckets: tuple[int, ...] = ()
    spec_graphs: tuple[tuple[int, str], ...] = ()
    draft_graphs: tuple[tuple[int, str], ...] = ()

    @property
    def num_graphs(self) -> int:
        return len(self.decode_buckets) + len(self.spec_graphs) + len(self.draft_graphs)

    @property
    def strategies(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for _, s in self.spec_graphs))

    def decode_bucket(self, batch: int) -> int | None:
        return bucket_for(batch, self.decode_buckets)

    def spec_bucket(self, batch: int, strategy: str) -> int | None:
        return bucket_for(batch, tuple(b for b, s in self.spec_graphs if s == strategy))

    def draft_bucket(self, batch: int, strategy: str) -> int | None:
        return bucket_for(batch, tuple(b for b, s in self.draft_graphs if s == strategy))

    def covers(self, other: CapturePlan) -> bool:
        """Whether every graph of ``other`` is in this plan: a pool captured for this plan
        serves ``other``'s policy (at least as finely bucketed), with no capture of its own."""
        return (
            set(other.decode_buckets) <= set(self.decode_buckets)
            and set(other.spec_graphs) <= set(self.spec_graphs)
            and set(other.draft_graphs) <= set(self.draft_graphs)
        )

    @staticmethod
    def union(plans: list[CapturePlan]) -> CapturePlan:
        """One plan with every graph of ``plans``."""
        return CapturePlan(
            decode_buckets=tuple(sorted({b for p in plans for b in p.decode_buckets})),
            spec_graphs=tuple(sorted({g for p in plans for g in p.spec_graphs})),
            draft_graphs=tuple(sorted({g for p in plans for g in p.draft_graphs})),
        )

    def only(self, strategies: tuple[str, ...], is_decode: bool = True) -> CapturePlan:
        """This plan restricted to ``strategies`` (and its decode graphs if ``is_decode``): the
        single-strategy and per-strategy pools of ``benchmarks/bench_gpu_engine.py``."""
        return CapturePlan(
            decode_buckets=self.decode_buckets if is_decode else (),
            spec_graphs=tuple((b, s) for b, s in self.spec_graphs if s in strategies),
            draft_graphs=tuple((b, s) for b, s in self.draft_graphs if s in strategies),
        )


def capture_plan(
    policy: SpecPolicy,
    max_batch: int,
    buckets: tuple[int, ...] | None = None,
    is_drafting: bool = False,
) -> CapturePlan:
    """What ``policy`` can ever run at batch sizes 1..``max_batch``, over ``buckets``
    (default ``batch_buckets(max_batch)``). A graph bucket B serves the batches above the
    previous bucket up to B, so its SD graphs are the arms of every policy bucket meeting
    that range. TLTAdaptive's warm-up iterations (SD still off at or below the threshold) pad
    up to the first decode bucket above the threshold, or run eagerly when there is none.
    ``is_drafting`` (the engine has an EAGLE drafter): each SD graph whose strategy an EAGLE
    arm of its bucket uses also gets a drafting graph."""
    buckets = batch_buckets(max_batch) if buckets is None else buckets
    # a wrapper that changes only what the policy is told (tltrun.train.spot.ModelledFeedback,
    # --deterministic) decides as the policy it wraps: it planned decode graphs only, so every
    # SD iteration of a deterministic CUDA run ran eagerly
    while hasattr(policy, "inner"):
        policy = policy.inner
    if isinstance(policy, TLTAdaptive):
        cfg = policy.config
        policy_buckets = cfg.buckets()
        decode = tuple(b for b in buckets if b > cfg.threshold)
        spec: list[tuple[int, str]] = []
        drafting: list[tuple[int, str]] = []
        prev = 0
        for b in buckets:
            lo, hi = prev + 1, min(b, cfg.threshold)
            prev = b
            if lo > hi:
                continue
            arms: dict[str, bool] = {}  # strategy -> whether an EAGLE arm uses it
            for batch in _policy_bucket_starts(policy_buckets, lo, hi):
                for a in bucket_arms(policy_buckets, batch):
                    arms[a.strategy] = arms.get(a.strategy, False) or a.drafter == "eagle"
            spec += [(b, s) for s in arms]
            drafting += [(b, s) for s, is_eagle in arms.items() if is_eagle and is_drafting]
        return CapturePlan(
            decode_buckets=decode, spec_graphs=tuple(spec), draft_graphs=tuple(drafting)
        )
    if isinstance(policy, StaticSpec):
        spec = tuple((b, policy.decision.strategy) for b in buckets)
        is_eagle = is_drafting and policy.decision.drafter == "eagle"
        return CapturePlan(spec_graphs=spec, draft_graphs=spec if is_eagle else ())
    # NoSpec, and a policy whose decisions are not known in advance: decode graphs only; its SD
    # iterations, if any, run eagerly
    return CapturePlan(decode_buckets=tuple(buckets))


def check_policy(
    policy: SpecPolicy, max_batch: int, *, max_verify_tokens: int, vocab_size: int,
    has_drafter: bool,
) -> None:  # fmt: skip
    """Refuse, when a rollout starts, a policy that could decide what the engine cannot run:
    an EAGLE strategy without a drafter, more verify tokens than ``max_verify_tokens``, a top-k
    wider than the vocabulary. The engine checks each decision again as it comes (a policy
    whose decisions ``capture_plan`` cannot know); this finds them before any response."""
    plan = capture_plan(policy, max_batch, is_drafting=True)
    for strategy in plan.strategies:
        decision = SpecDecision.parse(strategy)
        if decision.verify_tokens > max_verify_tokens:
            raise ValueError(
                f"policy {policy.name!r}: strategy {strategy} verifies {decision.verify_tokens} "
                f"tokens, more than max_verify_tokens={max_verify_tokens}"
            )
        if decision.topk > vocab_size:
            raise ValueError(
                f"policy {policy.name!r}: strategy {strategy} drafts the top {decision.topk} "
                f"tokens of a vocabulary of {vocab_size}"
            )
    if plan.draft_graphs and not has_drafter:
        raise ValueError(
            f"policy {policy.name!r} drafts with the EAGLE drafter (strategy "
            f"{plan.draft_graphs[0][1]}) but the engine has none (pass a drafter)"
        )


def _policy_bucket_starts(policy_buckets, lo: int, hi: int) -> list[int]:
    """One batch size per policy bucket that meets [lo, hi]."""
    return [
        max(start, lo)
        for start, end, _ in policy_buckets
        if start <= hi and (end is None or end >= lo)
    ]


class StaticForward:
    """The target's forward over slots ``0..batch-1`` x ``num_tokens`` tokens with static
    shapes: inputs are copied into fixed buffers, ``run`` is what a graph captures. Real rows
    are the first ``n``; rows ``n..batch-1`` are padding: free slots whose cache length is set
    to 0, token 0, depth 0 and a causal tree mask, so they attend to their own token only and
    no real row reads them (``StaticContext``)."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        batch: int,
        num_tokens: int,
        impl: str,
        buffers: _SharedBuffers,
    ):
        self.model, self.cache, self.batch, self.num_tokens, self.impl = (
            model,
            cache,
            batch,
            num_tokens,
            impl,
        )
        rows = batch * num_tokens
        self.ids = buffers.ids[:rows].view(batch, num_tokens)
        self.depth = buffers.depth[:rows].view(batch, num_tokens)
        self.tree_mask = buffers.tree_mask[: rows * num_tokens].view(batch, num_tokens, num_tokens)
        self.logits_out = buffers.logits[:rows].view(batch, num_tokens, -1)
        self.hidden_out = buffers.hidden[:rows].view(batch, num_tokens, -1)
        self._causal = causal_mask(1, num_tokens, cache.lens.device)[0]  # (T,T)
        self.graph: torch.cuda.CUDAGraph | None = None

    is_capturable = True  # draws nothing

    def run(self) -> None:
        """The captured forward: positions from the cache lengths at run time."""
        positions = self.cache.lens[: self.batch, None] + self.depth  # (B,T)
        ctx = StaticContext(self.cache, self.batch, self.tree_mask, self.impl)
        logits, hidden = self.model(self.ids, positions, ctx)
        self.logits_out.copy_(logits)  # into the shared output buffer: the pool frees the rest
        self.hidden_out.copy_(hidden)

    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        """Warm up on a side stream (cuBLAS workspaces, compiled kernels), then capture."""
        self._pad(0)
        self.graph = capture_graph(self.run, pool, stream, None)

    def __call__(
        self,
        ids: torch.Tensor,  # (n,T) the real rows' tokens
        depth: torch.Tensor | None = None,  # (n,T) RoPE offsets from each slot's length
        tree_mask: torch.Tensor | None = None,  # (n,T,T) bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (n,T,V) and hidden states (n,T,C) of the real rows: views of the shared
        output buffers, valid until the pool's next forward."""
        n = ids.shape[0]
        if not 1 <= n <= self.batch or ids.shape[1] != self.num_tokens:
            raise ValueError(
                f"static forward {self.batch}x{self.num_tokens}: got {tuple(ids.shape)}"
            )
        self.ids[:n].copy_(ids)
        if depth is None:
            self.depth[:n].zero_()
        else:
            self.depth[:n].copy_(depth)
        self.tree_mask[:n].copy_(self._causal if tree_mask is None else tree_mask)
        self._pad(n)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()
        return self.logits_out[:n], self.hidden_out[:n]

    def _pad(self, n: int) -> None:
        self.ids[n:].zero_()
        self.depth[n:].zero_()
        self.tree_mask[n:].copy_(self._causal)
        self.cache.lens[n : self.batch] = 0  # free slots: their cache contents are garbage


@dataclass
class _SharedBuffers:
    """Inputs and outputs of every static forward, sized for the largest: views of one buffer
    each, so N graphs cost one set (only one forward runs at a time)."""

    ids: torch.Tensor  # (rows,) long
    depth: torch.Tensor  # (rows,) long
    tree_mask: torch.Tensor  # (rows * T,) bool
    logits: torch.Tensor  # (rows, V)
    hidden: torch.Tensor  # (rows, C)


def verify_nodes(strategy: str) -> int:
    """Nodes (root included) a verify of ``strategy`` forwards: the EAGLE drafter's tree has
    fewer than verify_tokens + 1 when its beam offers fewer candidates (3_2_12: 10); a history
    draft under a graph is padded to the full verify_tokens (``RolloutHistory.draft``)."""
    decision = SpecDecision.parse(strategy)
    return num_tree_nodes(decision) if decision.drafter == "eagle" else decision.verify_tokens + 1


class GraphPool:
    """The planned static forwards and drafting steps of one engine, captured into one CUDA
    memory pool when ``is_capturing`` (CUDA only), else run eagerly (CPU: the tested reference
    of the replay). ``drafting``: the engine state the drafting steps read (needed when the
    plan has ``draft_graphs``)."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        plan: CapturePlan,
        impl: str,
        is_capturing: bool,
        pool=None,
        drafting: DraftSources | None = None,
        decoding: DecodeSources | None = None,
    ):
        device = cache.lens.device
        if is_capturing and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the cache is on {device}")
        if plan.draft_graphs and drafting is None:
            raise ValueError("the capture plan has drafting graphs but no drafter was given")
        self.plan = plan
        shapes = [(b, 1) for b in plan.decode_buckets]
        shapes += [(b, verify_nodes(s)) for b, s in plan.spec_graphs]
        for b, _ in shapes:
            if b > cache.num_slots:
                raise ValueError(f"graph bucket {b} exceeds the cache's {cache.num_slots} slots")
        max_rows = max((b * t for b, t in shapes), default=0)
        max_mask = max((b * t * t for b, t in shapes), default=0)
        cfg = model.config
        dtype = model.lm_head.weight.dtype
        self.buffers = _SharedBuffers(
            ids=torch.zeros(max_rows, dtype=torch.long, device=device),
            depth=torch.zeros(max_rows, dtype=torch.long, device=device),
            tree_mask=torch.zeros(max_mask, dtype=torch.bool, device=device),
            logits=torch.zeros(max_rows, cfg.vocab_size, dtype=dtype, device=device),
            hidden=torch.zeros(max_rows, cfg.hidden_size, dtype=dtype, device=device),
        )
        self.decode = {
            b: StaticForward(model, cache, b, 1, impl, self.buffers) for b in plan.decode_buckets
        }
        self.verify = {
            (b, s): StaticForward(model, cache, b, verify_nodes(s), impl, self.buffers)
            for b, s in plan.spec_graphs
        }
        # an engine's decode iterations: forward and epilogue as one step (captured instead of
        # the bare decode forward, which then runs only uncaptured: tests, profiles)
        self.decode_steps = {
            b: StaticDecode(fwd, decoding) for b, fwd in self.decode.items() if decoding
        }
        self.max_pending = max_pending_pairs(tuple(s for _, s in plan.draft_graphs))
        steps = [(b, SpecDecision.parse(s)) for b, s in plan.draft_graphs]
        self.draft_buffers = None if drafting is None else DraftBuffers.for_steps(drafting, steps)
        self.verify_steps = {} if decoding is None else self._verify_steps(decoding)
        self.drafts = {
            (b, d.strategy): StaticDraft(drafting, b, d, self.max_pending, self.draft_buffers)
            for b, d in steps
        }
        self.pool = None
        self.captured_bytes = 0
        if is_capturing:
            generators = {id(s.generator): s.generator for s in (drafting, decoding) if s}
            self._capture_all(device, pool, list(generators.values()))

    @torch.no_grad()  # no autograd records inside the graphs (start_rollout may run with grad)
    def _capture_all(self, device: torch.device, pool, generators: list[torch.Generator]) -> None:
        """Capture every graph. The sampling generators' states are restored afterwards: each
        warm-up draws eagerly, so a run resumed from a checkpoint (capturing at its first
        rollout) drew other numbers from then on than the uninterrupted run (captured at
        step 0); the registered graphs keep reading the restored state object."""
        states = [(g, g.get_state()) for g in generators]
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        stream = torch.cuda.Stream(device)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        decode = [self.decode_steps.get(b, fwd) for b, fwd in self.decode.items()]
        verify = [self.verify_steps.get(key, fwd) for key, fwd in self.verify.items()]
        forwards = [g for g in (*decode, *verify) if g.is_capturable]
        # largest first: later, smaller graphs reuse the pool blocks the first ones freed
        for fwd in sorted(forwards, key=lambda f: f.batch * f.num_tokens, reverse=True):
            fwd.capture(self.pool, stream)
        drafts = [d for d in self.drafts.values() if d.is_capturable]
        for step in sorted(drafts, key=lambda d: d.batch * d.decision.verify_tokens, reverse=True):
            step.capture(self.pool, stream)
        torch.cuda.synchronize(device)
        self.captured_bytes = torch.cuda.memory_reserved(device) - before
        for generator, state in states:
            generator.set_state(state)

    def decode_forward(self, batch: int) -> StaticForward | None:
        b = self.plan.decode_bucket(batch)
        return None if b is None else self.decode[b]

    def decode_step(self, batch: int) -> StaticDecode | None:
        """The whole decode iteration for ``batch`` running slots (engines only), or None."""
        b = self.plan.decode_bucket(batch)
        return None if b is None else self.decode_steps.get(b)

    def _verify_steps(self, decoding: DecodeSources) -> dict[tuple[int, str], StaticVerify]:
        """A whole verify per planned (bucket, strategy), its draft-tree inputs shared."""
        sampled = {
            key: is_sampled_chain(SpecDecision.parse(key[1]), decoding.sampling)
            for key in self.verify
        }
        shapes = [(b, fwd.num_tokens, sampled[(b, s)]) for (b, s), fwd in self.verify.items()]
        vocab = self.buffers.logits.shape[-1]
        # sampled chains' draft distributions: the drafting steps' output buffer, read in place
        # (the same views where the buckets coincide, as the plan makes them; StaticVerify)
        drafted = None if self.draft_buffers is None else self.draft_buffers.probs
        self.verify_buffers = VerifyBuffers.for_steps(
            shapes, vocab, self.buffers.ids.device, probs=drafted
        )
        return {
            (b, s): StaticVerify(
                fwd, SpecDecision.parse(s), decoding, self.verify_buffers, sampled[(b, s)]
            )
            for (b, s), fwd in self.verify.items()
        }

    def verify_step(self, batch: int, strategy: str) -> StaticVerify | None:
        """The whole verify for ``batch`` running slots under ``strategy`` (engines only)."""
        b = self.plan.spec_bucket(batch, strategy)
        return None if b is None else self.verify_steps.get((b, strategy))

    def verify_forward(self, batch: int, strategy: str) -> StaticForward | None:
        b = self.plan.spec_bucket(batch, strategy)
        return None if b is None else self.verify[(b, strategy)]

    def draft_step(self, batch: int, strategy: str) -> StaticDraft | None:
        """The EAGLE drafting step for ``batch`` running slots under ``strategy``, or None."""
        b = self.plan.draft_bucket(batch, strategy)
        return None if b is None else self.drafts[(b, strategy)]
