"""``tltrun profile --backend torch``: the rollout ops of ``tltrun.rollout.engine.RolloutEngine``, timed on
the engine's own code and state (what each op covers: ``tltrun.profile.measure``'s docstring).

Not run directly: ``tltrun profile`` (``tltrun.profile.measure.run_profile``) calls ``profile_torch``.
It drives the engine through its public pieces only (``start_rollout`` and ``step``, ``prefill``,
``draft``, ``reprefill_drafter``, ``sync``): the profile must time exactly what
``RolloutEngine.generate`` runs per iteration, not a re-implementation of it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from tltrun.model.attention import UNPADDED_ATTN_IMPLS
from tltrun.profile.timing import Series, warn_if_floored
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig, default_attn_impl
from tltrun.rollout.interface import Request, SamplingParams
from tltsim.cost.profile import ProfileRow
from tltsim.policy import NoSpec, SpecDecision, SpecPolicy, StaticSpec


def fill_engine(engine: RolloutEngine, context: int, gen: torch.Generator) -> None:
    """Seeded random KV caches, hidden states and tokens in every slot up to ``context``
    (+1 pending token): the state any ``EngineProbe`` up to that context reads. A forward's
    cost does not depend on the values; a real prefill would cost minutes per grid. The values
    are drawn where they live, layer by layer, from a generator on the engine's device (seeded
    from ``gen`` when that is elsewhere): a 1.5B profile's cache drawn on the host, one CPU
    thread, took ~10 s of a GPU session."""
    device = engine.device
    if gen.device != device:
        gen = torch.Generator(device).manual_seed(int(torch.randint(2**62, (), generator=gen)))
    for cache in (engine.cache, engine.draft_cache):
        if cache is None:
            continue
        for buf in (cache.k, cache.v):
            for layer in range(buf.shape[0]):
                view = buf[layer, :, :, :context]
                view.copy_(0.5 * torch.randn(view.shape, generator=gen, device=device))
    vocab = engine.model.config.vocab_size
    tokens = engine.tokens[:, : context + 1]
    tokens.copy_(torch.randint(vocab, tokens.shape, generator=gen, device=device))
    if engine.hidden is not None:
        view = engine.hidden[:, :context]
        view.copy_(torch.randn(view.shape, generator=gen, device=device))


class EngineProbe:
    """``batch`` running sequences of ``context`` cached tokens each in a ``fill_engine``-ed
    ``RolloutEngine``, and the rollback that puts the engine into exactly that state (before
    its turn, and after every timed iteration): a rollout under the series' policy whose
    requests were admitted and prefilled (the prefill's state faked by ``fill_engine``). The
    sequences sit in slots 0..batch-1 of the engine's ``max_running_requests``: profile with
    the run's cap as the largest batch."""

    def __init__(self, engine: RolloutEngine, batch: int, context: int, margin: int, gen):
        self.engine = engine
        self.context = context
        vocab = engine.model.config.vocab_size
        self.requests = [
            Request(
                f"q{i}",
                tuple(torch.randint(vocab, (context,), generator=gen).tolist()),
                margin,
                True,
            )
            for i in range(batch)
        ]
        # slots 0..batch-1: where the engine keeps a running batch (Scheduler.compact)
        self.slots = torch.arange(batch, device=engine.device)
        self.is_drafter = engine.draft_cache is not None
        self.cache_lens = torch.zeros_like(engine.cache.lens)
        self.cache_lens[self.slots] = context
        # as after an SD iteration: the drafter has cached every pair but the newest
        self.draft_lens = self.cache_lens - 1 if self.is_drafter else None
        self.running = []
        self.rollback()

    def rollback(self, policy: SpecPolicy | None = None) -> None:
        """A fresh rollout under ``policy`` (NoSpec if None) with every request running, one
        output token each (the prefill's, pending in ``tokens[slot, context]``), and cache
        lengths and drafter freshness as at construction (entries past a cache length are
        garbage by the engine's invariant, so nothing else needs undoing)."""
        engine = self.engine
        # the rollout first: under a new policy it captures that policy's graphs, and capture
        # writes scratch entries into slots it takes for free and sets their lengths to 0
        # (seen on an H200: every SD configuration then drafted with zero pending pairs)
        engine.start_rollout(self.requests, policy or NoSpec())
        engine.cache.lens.copy_(self.cache_lens)
        if self.is_drafter:
            engine.draft_cache.lens.copy_(self.draft_lens.clamp(min=0))
        self.running = engine.scheduler.admit()
        for seq in self.running:
            seq.append([int(engine.tokens[seq.slot, self.context])], engine.eos_ids, 0.0)
            seq.is_drafter_fresh = self.is_drafter

    def iteration(self) -> None:
        """One ``RolloutEngine.step`` once nothing is waiting: a decode iteration under the
        rollout's policy, then the release of finished requests."""
        self.engine.step()

    def draft(self, decision: SpecDecision) -> None:
        """The drafting of a speculative iteration (``RolloutEngine.draft``)."""
        self.engine.draft(self.slots, decision)

    def reprefill(self, decision: SpecDecision) -> None:
        self.engine.reprefill_drafter(self.running, decision)

    def forget_drafter(self) -> None:
        """The drafter has seen nothing of the sequences: the state in which SD switches on."""
        self.rollback()
        self.engine.draft_cache.lens[self.slots] = 0


def point_series(
    probe: EngineProbe, decisions: list[SpecDecision], num_calls: int = 1
) -> list[Series]:
    """Everything timed at one (batch, context): keys (kind, batch, context[, strategy]).
    Iterations and drafting, which a rollout runs back to back, take ``num_calls`` consecutive
    calls per sample; the SD switch (once per rollout) one."""
    b, c = len(probe.running), int(probe.cache_lens[probe.slots[0]])
    r = probe.rollback
    n = num_calls
    series = [Series(("decode", b, c), probe.iteration, r, r, num_calls=n)]
    if not probe.is_drafter:
        return series
    for d in decisions:
        start = partial(probe.rollback, StaticSpec(strategy=d.strategy))
        series.append(Series(("iteration", b, c, d), probe.iteration, start, start, num_calls=n))
    for d in _deepest(decisions):
        series.append(Series(("draft", b, c, d), lambda d=d: probe.draft(d), r, r, num_calls=n))
    f = probe.forget_drafter
    series.append(Series(("switch", b, c), lambda: probe.reprefill(decisions[0]), f, f))
    return series


def _deepest(decisions: list[SpecDecision]) -> list[SpecDecision]:
    """Per top-k, the strategy with the most draft steps (its draft time / steps is the row)."""
    best: dict[int, SpecDecision] = {}
    for d in decisions:
        if d.topk not in best or d.draft_steps > best[d.topk].draft_steps:
            best[d.topk] = d
    return list(best.values())


def point_rows(
    b: int, c: int, decisions, timed: dict, row, is_warned: bool = False
) -> list[ProfileRow]:
    """decode, drafter, verify and sd_switch rows of one (batch, context) (module docstring of
    tltrun.profile.measure: the simulator's draft_steps x drafter + verify is every strategy's
    T_it, unless a verify row is floored: ``is_warned`` says so, for the final rows)."""
    ctx = b * c
    rows = [row("decode", b, ctx, 1, timed[("decode", b, c)])]
    if ("switch", b, c) not in timed:
        return rows
    for deepest in _deepest(decisions):
        per_step = timed[("draft", b, c, deepest)] / deepest.draft_steps
        rows.append(row("drafter", b, ctx, deepest.topk, per_step))
        # the row's own statistic: a constant shift moves a median and a mean alike, so
        # draft_steps x drafter + verify is the iteration's statistic (not so with the
        # median subtracted from a mean: off by draft_steps x (mean - median))
        step_s = rows[-1].seconds
        for d in decisions:
            if d.topk == deepest.topk:
                it = timed[("iteration", b, c, d)]
                rest = np.maximum(it - d.draft_steps * step_s, 0.1 * it)
                rows.append(row("verify", b, ctx, d.verify_tokens + 1, rest))
                if is_warned:
                    it_s = row("verify", b, ctx, 1, it).seconds  # the iteration's statistic
                    what = f"strategy {d.strategy} at batch {b}, context {c}"
                    warn_if_floored(what, d.draft_steps, step_s, rows[-1].seconds, it_s)
    rows.append(row("sd_switch", b, ctx, c, timed[("switch", b, c)]))
    return rows


def prefill_series(engine: RolloutEngine, batch: int, tokens: int, gen) -> Series:
    """``RolloutEngine.prefill`` of ``batch`` fresh prompts of ``tokens`` tokens (as the
    engine groups them by ``max_prefill_tokens``; each first token sampled)."""
    vocab = engine.model.config.vocab_size
    requests = [
        Request(f"f{i}", tuple(torch.randint(vocab, (tokens,), generator=gen).tolist()), 2, True)
        for i in range(batch)
    ]
    state = {}

    def admit() -> None:
        engine.start_rollout(requests, NoSpec())
        state["seqs"] = engine.scheduler.admit()

    return Series(("prefill", batch, tokens), lambda: engine.prefill(state["seqs"]), admit, admit)


def attention_context(attn_impl: str | None, device: str) -> str:
    """The tlt-profile ``attention_context`` of the torch engine with ``attn_impl`` (None: the
    engine's default on ``device``): ``"summed"`` where each sequence attends to its own context
    (flex_attention by length, issue #18), ``"padded"`` for the dense implementations, which
    read the batch's longest context for every sequence."""
    impl = default_attn_impl(device) if attn_impl is None else attn_impl
    # flex skips blocks past each length on CUDA only: eager flex off CUDA scores the whole
    # slot width (its cache context keeps the batch's longest key length), dense as SDPA
    is_unpadded = impl in UNPADDED_ATTN_IMPLS and (impl != "flex" or _is_cuda(device))
    return "summed" if is_unpadded else "padded"


def _is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _margin(decisions: list[SpecDecision]) -> int:
    """Room per sequence for the largest draft tree and its bonus token, twice: never finishes."""
    return 2 * (max([d.draft_steps for d in decisions], default=0) + 2)


def engine_config(cfg, decisions: list[SpecDecision]) -> EngineConfig:
    """The engine ``profile_torch`` times the grid of ``cfg`` on (``decisions``: its SD
    strategies, none without a drafter); ``tltrun profile`` checks its KV cache fits first."""
    longest = max(max(cfg.context_per_seq), max(cfg.prefill_tokens_per_seq))
    return EngineConfig(
        max_running_requests=max(max(cfg.batches), max(cfg.prefill_batches)),
        max_model_len=longest + _margin(decisions),
        sampling=SamplingParams(temperature=cfg.temperature),
        seed=cfg.seed,
        device=cfg.device,
        dtype=cfg.dtype_name,
        attn_impl=cfg.attn_impl,
        max_prefill_tokens=cfg.max_prefill_tokens,
        max_verify_tokens=max([d.verify_tokens for d in decisions], default=1),
    )


def profile_torch(
    cfg,
    target,
    drafter,
    measure,
    progress: Callable[[str], None],
    between_rounds: Callable[[int], None] = lambda r: None,
    between_series: Callable[[int, int, int], None] | None = None,
    on_rows: Callable[[list[ProfileRow]], None] = lambda rows: None,
) -> list[ProfileRow]:
    """Rollout rows of the grid of ``cfg`` (a ``tltrun.profile.measure.ProfileRunConfig``) for the
    torch engine, timed in interleaved rounds by ``measure`` (``tltrun.profile.timing.Measure``).
    ``on_rows(rows)`` gets the rows of the rounds completed so far after each round."""
    decisions = cfg.decisions if drafter is not None else []
    gen = torch.Generator().manual_seed(cfg.seed)
    engine = RolloutEngine(target, drafter, engine_config(cfg, decisions))
    # one graph pool for every policy the series alternate between (CUDA): each series'
    # rollback would otherwise capture its policy's pool anew
    engine.prepare_graphs([NoSpec(), *(StaticSpec(strategy=d.strategy) for d in decisions)])
    series: list[Series] = []
    with torch.no_grad():
        fill_engine(engine, max(cfg.context_per_seq), gen)
        for b in cfg.batches:
            for c in cfg.context_per_seq:
                probe = EngineProbe(engine, b, c, _margin(decisions), gen)
                series += point_series(probe, decisions, cfg.back_to_back_calls)
        for b in cfg.prefill_batches:
            for t in cfg.prefill_tokens_per_seq:
                series.append(prefill_series(engine, b, t, gen))

        def rows_of(timed: dict, is_warned: bool = False) -> list[ProfileRow]:
            rows = []
            for b in cfg.batches:
                for c in cfg.context_per_seq:
                    rows += point_rows(b, c, decisions, timed, measure.row, is_warned)
            for b in cfg.prefill_batches:
                for t in cfg.prefill_tokens_per_seq:
                    rows.append(measure.row("prefill", b, 0, t, timed[("prefill", b, t)]))
            return rows

        timed = measure.interleaved(
            series,
            engine.sync,
            progress,
            between_rounds,
            between_series,
            on_round=lambda timed: on_rows(rows_of(timed)),
        )
    return rows_of(timed, is_warned=True)


__all__ = [
    "EngineProbe",
    "attention_context",
    "fill_engine",
    "point_rows",
    "point_series",
    "profile_torch",
]
