"""The torch rollout engine's prefills (``tltrun.rollout.engine``), as plain functions of the
engine's per-slot state (``SlotEngine``: its models, KV caches, token and hidden-state rows,
sampler and clock):

* ``prefill_prompts``: the prompts of newly admitted sequences, leaders in padded groups of
  at most ``max_prefill_tokens`` (``tltrun.model.batching``), followers of a shared prompt (a
  GRPO group, ``EngineConfig.share_prompts``) copied from their source's cache; each samples
  its first token;
* ``reprefill_stale``: TLT's cost of switching SD on, the EAGLE drafter fed the pairs it has
  not seen (a group's shared prompt pairs once);
* ``eagle_draft``: the drafting catch-up (the newest pending pairs) and the drafter's tree.

Each returns what the engine records; the engine owns the loop (``RolloutEngine.step``).

Run the tests: ``python -m pytest tests/test_engine.py -q``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tltrun.model.batching import padded_groups, right_pad
from tltrun.model.drafter import EagleDrafter, draft, drafter_prefill
from tltrun.model.kvcache import KVCache
from tltrun.model.transformer import Transformer
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import IterationRecord, NonFiniteLogitsError
from tltrun.rollout.scheduler import Sequence
from tltrun.rollout.speculative import DraftTree, logits_to_probs, sample
from tltsim.policy import SpecDecision


class SlotEngine(Protocol):
    """What the prefills read and write of a ``RolloutEngine`` (its public state; see the
    per-slot invariant in ``tltrun.rollout.engine``)."""

    config: EngineConfig
    device: torch.device
    clock: Callable[[], float]
    model: Transformer
    drafter: EagleDrafter | None
    cache: KVCache
    draft_cache: KVCache | None
    hidden: torch.Tensor | None  # (slots, max_tokens, C)
    tokens: torch.Tensor  # (slots, max_tokens) long
    generator: torch.Generator
    eos_ids: frozenset[int]
    max_tokens: int

    def sync(self) -> None: ...


def slots_of(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """The KV slots of ``seqs``, as a (B,) long tensor."""
    return torch.tensor([s.slot for s in seqs], dtype=torch.long, device=device)


def prompt_sources(
    admitted: list[Sequence], running: list[Sequence], share_prompts: bool
) -> tuple[list[Sequence], list[tuple[Sequence, Sequence]]]:
    """Split admitted sequences into leaders (prefilled) and (follower, source) pairs: a
    follower's prompt equals an earlier running sequence's (its cache rows 0..P-1 hold that
    prompt: a running sequence only appends) or an admitted leader's."""
    if not share_prompts:
        return admitted, []
    new = {id(s) for s in admitted}
    sources: dict[tuple[int, ...], Sequence] = {}
    for s in running:
        if id(s) not in new:
            sources.setdefault(s.request.prompt_token_ids, s)
    leaders, followers = [], []
    for s in admitted:
        prompt = s.request.prompt_token_ids
        if prompt in sources:
            followers.append((s, sources[prompt]))
        else:
            sources[prompt] = s
            leaders.append(s)
    return leaders, followers


@torch.no_grad()
def prefill_prompts(
    engine: SlotEngine, admitted: list[Sequence], running: list[Sequence], t0: float
) -> list[IterationRecord]:
    """Prefill sequences the rollout's scheduler just admitted (each samples its first
    token): leaders in padded groups of at most ``max_prefill_tokens``, followers of a
    shared prompt from their source's cache (``share_prompts``)."""
    leaders, followers = prompt_sources(admitted, running, engine.config.share_prompts)
    records = []
    lengths = [s.num_prompt_tokens for s in leaders]
    for group in padded_groups(lengths, engine.config.max_prefill_tokens):
        seqs = [leaders[i] for i in group]
        start = engine.clock()
        slots = slots_of(seqs, engine.device)
        engine.cache.reset(slots)
        if engine.draft_cache is not None:
            engine.draft_cache.reset(slots)
        ids, lens = right_pad([s.request.prompt_token_ids for s in seqs], 0, engine.device)
        width = ids.shape[1]
        for s in seqs:
            s.is_drafter_fresh = False
        engine.tokens[slots, :width] = ids
        positions = torch.arange(width, device=engine.device).expand(len(seqs), -1)
        ctx = engine.cache.context(slots, width, num_new=lens, impl=engine.config.attention)
        logits, hidden = engine.model(ids, positions, ctx, logit_index=(lens - 1)[:, None])
        if engine.hidden is not None:
            engine.hidden[slots, :width] = hidden
        engine.cache.commit(slots, lens)
        first = sample(
            logits_to_probs(logits[:, 0], engine.config.sampling), engine.generator
        )  # (B,)
        engine.tokens[slots, lens] = first
        engine.sync()
        now = engine.clock()
        for s, tok in zip(seqs, checked_tokens(seqs, logits[:, 0], first), strict=True):
            s.append([tok], engine.eos_ids, now - t0)
        wall = engine.clock() - start
        records.append(
            IterationRecord(
                start_s=start - t0,
                wall_s=wall,
                num_active=len(seqs),
                num_new_tokens=len(seqs),
                context_tokens=int(lens.sum()),
                is_prefill=True,
                strategy="off",
            )
        )
    if followers:
        records.append(_prefill_followers(engine, followers, t0))
    return records


def checked_tokens(seqs: list, logits: torch.Tensor, first: torch.Tensor) -> list[int]:
    """The first tokens ``first`` (B,) sampled from ``logits`` (B, V), read in the same one
    device read as whether each row's logits were finite; a row that was not is
    ``NonFiniteLogitsError`` naming its request."""
    is_bad = ~torch.isfinite(logits).all(dim=-1)  # (B,)
    rows = torch.stack((first, is_bad.long()), dim=1).tolist()  # (B, 2)
    for s, (_, bad) in zip(seqs, rows, strict=True):
        if bad:
            raise NonFiniteLogitsError(
                f"request {s.request.id}: the model's logits for its prompt are NaN or inf in "
                f"{str(logits.dtype).removeprefix('torch.')} (an activation beyond float16's "
                "range of 65,504, or broken weights); run in bfloat16 or float32"
            )
    return [tok for tok, _ in rows]


def _prefill_followers(
    engine: SlotEngine, pairs: list[tuple[Sequence, Sequence]], t0: float
) -> IterationRecord:
    """Prefill followers from their sources' caches: copy the KV of prompt positions
    0..P-2, the hidden states there and the drafter's KV of the pairs among them it holds,
    then run the last prompt token of every follower in one decode-shaped forward, which
    samples each its own first token (vLLM's prefix cache likewise recomputes the last
    prompt token of a full hit)."""
    start = engine.clock()
    seqs = [f for f, _ in pairs]
    dst = slots_of(seqs, engine.device)
    src = slots_of([s for _, s in pairs], engine.device)
    last = torch.tensor([f.num_prompt_tokens - 1 for f in seqs], device=engine.device)  # P-1
    width = int(last.max())
    cache = engine.cache
    cache.copy_positions(src, dst, width)
    cache.lens[dst] = last
    engine.tokens[dst, : width + 1] = engine.tokens[src, : width + 1]
    if engine.hidden is not None:
        engine.hidden[dst, :width] = engine.hidden[src, :width]
    if engine.draft_cache is not None:
        # drafter pairs p < P-1 read prompt tokens and prompt hidden states only
        held = torch.minimum(engine.draft_cache.lens[src], last)
        engine.draft_cache.copy_positions(src, dst, int(held.max()))
        engine.draft_cache.lens[dst] = held
    ids = engine.tokens[dst, last][:, None]
    ctx = cache.context(dst, 1, impl=engine.config.attention)
    logits, hidden = engine.model(ids, last[:, None], ctx)
    if engine.hidden is not None:
        engine.hidden[dst, last] = hidden[:, 0]
    cache.commit(dst, 1)
    first = sample(logits_to_probs(logits[:, 0], engine.config.sampling), engine.generator)
    engine.tokens[dst, last + 1] = first
    engine.sync()
    now = engine.clock()
    for s, tok in zip(seqs, checked_tokens(seqs, logits[:, 0], first), strict=True):
        s.is_drafter_fresh = False
        s.append([tok], engine.eos_ids, now - t0)
    wall = engine.clock() - start
    return IterationRecord(
        start_s=start - t0,
        wall_s=wall,
        num_active=len(seqs),
        num_new_tokens=len(seqs),
        context_tokens=int(last.sum()) + len(seqs),
        is_prefill=True,
        strategy="off",
    )


def _pending_pairs(
    engine: SlotEngine, slots: torch.Tensor, num: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter input pairs (x_{p+1}, f_p) for p = drafter_len .. drafter_len + num - 1."""
    start = engine.draft_cache.lens[slots]  # (B,)
    width = int(num.max())
    if width < 1:  # the engine's invariant: the target is always ahead by the pending token
        raise RuntimeError(
            f"drafter of slots {slots.tolist()} has no pending pair (target lengths "
            f"{engine.cache.lens[slots].tolist()}, drafter lengths {start.tolist()})"
        )
    pos = (start[:, None] + torch.arange(width, device=engine.device)[None]).clamp(
        max=engine.max_tokens - 2
    )
    rows = slots[:, None]
    return engine.tokens[rows, pos + 1], engine.hidden[rows, pos]


@torch.no_grad()
def stale_drafter(engine: SlotEngine, running: list[Sequence], cap: int) -> list[Sequence]:
    """Running sequences to re-prefill the drafter for: those it has seen nothing of (SD
    switching on: the re-prefill feeds a group's shared prompt once) and those it lags more
    than ``cap`` pairs behind (``RolloutEngine.catchup_pairs``: a long span of history or plain
    iterations). A shorter lag (EAGLE after a few history iterations) is caught up inside the
    drafting step, sparing the separate drafter forward each switch between the drafters cost."""
    behind = [s for s in running if not s.is_drafter_fresh]
    if not behind:
        return []
    slots = slots_of(behind, engine.device)
    seen = engine.draft_cache.lens[slots]
    lag = (engine.cache.lens[slots] - seen).tolist()
    return [s for s, n, m in zip(behind, lag, seen.tolist(), strict=True) if n > cap or m == 0]


def reprefill_stale(
    engine: SlotEngine, stale: list[Sequence], decision: SpecDecision, t0: float
) -> IterationRecord:
    """Feed running sequences' pending pairs to the drafter, all but the newest (the
    drafting catch-up feeds that one and drafts from it): TLT's cost of switching SD on."""
    start = engine.clock()
    fed = _share_drafter_prompts(engine, stale) if engine.config.share_prompts else 0
    slots = slots_of(stale, engine.device)
    num = engine.cache.lens[slots] - engine.draft_cache.lens[slots] - 1
    _feed_drafter(engine, slots, num)
    engine.sync()
    wall = engine.clock() - start
    return IterationRecord(
        start_s=start - t0,
        wall_s=wall,
        num_active=len(stale),
        num_new_tokens=0,
        context_tokens=fed + int(num.clamp(min=0).sum()),
        is_prefill=True,
        strategy=decision.strategy,
        is_drafter_prefill=True,
    )


def _feed_drafter(engine: SlotEngine, slots: torch.Tensor, num: torch.Tensor) -> None:
    """drafter_prefill of ``num`` pending pairs per slot (none where num <= 0), in groups of
    at most max_prefill_tokens padded pairs."""
    todo = (num > 0).nonzero(as_tuple=True)[0].tolist()
    for group in padded_groups([int(num[i]) for i in todo], engine.config.max_prefill_tokens):
        idx = torch.tensor([todo[i] for i in group], device=engine.device)
        toks, hid = _pending_pairs(engine, slots[idx], num[idx])
        drafter_prefill(
            engine.drafter,
            engine.draft_cache,
            slots[idx],
            toks,
            hid,
            num[idx],
            engine.config.attention,
        )


def _share_drafter_prompts(engine: SlotEngine, stale: list[Sequence]) -> int:
    """Stale siblings (same prompt, empty drafter cache) get the drafter's prompt pairs
    0..P-2 from one forward over their group's first member, copied to the others. Their
    prompt hidden states are bit-identical (``_prefill_followers`` copied them), so the
    copy is what each would have computed. Returns the pairs fed."""
    empty = (engine.draft_cache.lens[slots_of(stale, engine.device)] == 0).tolist()
    groups: dict[tuple[int, ...], list[Sequence]] = {}
    for s, is_empty in zip(stale, empty, strict=True):
        if is_empty and s.num_prompt_tokens >= 2:
            groups.setdefault(s.request.prompt_token_ids, []).append(s)
    groups = {p: g for p, g in groups.items() if len(g) >= 2}
    if not groups:
        return 0
    leaders = [g[0] for g in groups.values()]
    num = torch.tensor([s.num_prompt_tokens - 1 for s in leaders], device=engine.device)
    _feed_drafter(engine, slots_of(leaders, engine.device), num)
    members = [(m, g[0]) for g in groups.values() for m in g[1:]]
    dst = slots_of([m for m, _ in members], engine.device)
    src = slots_of([lead for _, lead in members], engine.device)
    engine.draft_cache.copy_positions(src, dst, int(num.max()))
    engine.draft_cache.lens[dst] = engine.draft_cache.lens[src]
    return int(num.sum())


@torch.no_grad()
def eagle_draft(engine: SlotEngine, slots: torch.Tensor, decision: SpecDecision) -> DraftTree:
    """The EAGLE drafter's tree for running ``slots`` under ``decision`` (after feeding it the
    pending pairs), exactly as a speculative iteration drafts it."""
    cfg = engine.config
    num = engine.cache.lens[slots] - engine.draft_cache.lens[slots]  # >= 1 pending exact pairs
    toks, hid = _pending_pairs(engine, slots, num)
    return draft(
        engine.drafter,
        engine.draft_cache,
        slots,
        toks,
        hid,
        num,
        decision,
        cfg.sampling,
        engine.generator,
        cfg.attention,
    )
