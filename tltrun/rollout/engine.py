"""The torch rollout engine: continuous batching over a slot KV cache, with lossless speculative
decoding (EAGLE drafter, chain or tree, one target forward per verify) switched per iteration
by a ``tltsim.policy`` SpecPolicy — the same objects the simulator drives.

A rollout is ``start_rollout(requests, policy)``, then ``step()`` until ``is_rollout_done``,
then ``finish_rollout()`` (``generate`` does exactly that). One ``step()``, as nano-vllm's
``LLMEngine.step()`` glues its scheduler and model runner:

1. admit waiting requests into free slots and prefill them (batched, mixed lengths, at most
   ``max_prefill_tokens`` padded tokens per forward unless one prompt alone is longer: there is
   no chunked prefill, ``tltrun.model.batching``); the prefill samples each first token;
2. build a ``DecodeObs`` and ask the policy for a ``SpecDecision``;
3. SD off: one plain decode iteration. SD on: re-prefill the drafter for requests it has not
   seen (SD switching on) or lags more than ``catchup_pairs()`` pairs behind (recorded as its
   own ``is_drafter_prefill`` IterationRecord, TLT's switching cost; a shorter lag, as after a
   few history-drafter iterations, is fed in the drafting step's first forward), then draft,
   verify the tree in ONE target forward with the tree mask, accept via
   ``tltrun.rollout.speculative.verify``, compact the accepted path in the KV cache.
   A decision with ``drafter="history"`` drafts from the model-free history drafter instead
   (``tltrun.rollout.rollout_history``, issue #20: no EAGLE forward, no drafter re-prefill, no
   drafter needed); its index of the rollouts' tokens is kept across rollouts under
   ``Request.prompt_id``;
4. ``policy.observe(SpecFeedback)`` with the measured wall seconds of the iteration (its
   drafter re-prefill included) and the tokens it emitted; finished requests (EOS unless
   ``ignore_eos``, or ``max_new_tokens``) leave.

On a GPU (issue #18) the defaults are bf16 weights and KV cache (sampling and acceptance in
float32: ``logits_to_probs``), attention by each sequence's own length (``attn_impl="flex"``,
``tltrun.model.attention``) and TLT's bucketed CUDA-graph pool (``tltrun.rollout.graphs``): the
first rollout's policy decides which decode, verify and EAGLE drafting steps are captured
(``tltrun.rollout.draft_graphs``), a batch runs padded up to its bucket's graph (a plain decode
iteration, its sampling included, is one replay: ``tltrun.rollout.static_decode``; so is a
verify with its acceptance: ``tltrun.rollout.static_verify``); everything without a graph runs
eagerly. ``cuda_graphs=True`` on a CPU runs the
same padded static steps eagerly (the tests' path).

The pieces of a step are public too (``prefill``, ``draft``, ``reprefill_drafter``, ``sync``), so
``tltrun.profile.torch_engine`` times the engine's own code without reaching into it. The
prefills and EAGLE drafting themselves are plain functions of the engine's per-slot state in
``tltrun.rollout.prefill``; the settings are ``tltrun.rollout.engine_config.EngineConfig``.

Invariant per running slot (see tltrun.model.kvcache): the target cache holds positions
``0..n-1``, ``tokens[slot, n]`` is the pending last token, ``hidden[slot, p]`` is the target's
post-norm hidden state at position p < n, and the drafter cache holds the exact pairs
``0..m-1`` with m <= n (tltrun.model.drafter explains the catch-up).

Harvest (for drafter training, issue #5): with ``is_harvesting`` every finished request leaves a
``HarvestRecord`` (all token ids, prompt length, the target hidden state at every position but
the last) in ``engine.harvest``; ``pop_harvest()`` hands them over and clears the buffer. The
record, slot compaction and in-place weight loads are ``tltrun.rollout.slot_state``.

Run the tests: ``python -m pytest tests/test_engine.py -q``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tltrun.model.drafter import EagleDrafter
from tltrun.model.kvcache import KVCache
from tltrun.model.transformer import Transformer, fuse_projections, set_compiled_layers
from tltrun.rollout.draft_graphs import draft_sources
from tltrun.rollout.engine_config import DTYPES, EngineConfig
from tltrun.rollout.graphs import CapturePlan, GraphPool, capture_plan, check_policy
from tltrun.rollout.interface import IterationRecord, Request, RolloutResult
from tltrun.rollout.prefill import (
    eagle_draft,
    prefill_prompts,
    reprefill_stale,
    slots_of,
    stale_drafter,
)
from tltrun.rollout.rollout_history import RolloutHistory
from tltrun.rollout.scheduler import Scheduler, Sequence
from tltrun.rollout.slot_state import HarvestRecord, harvest_record, load_in_place, move_slots
from tltrun.rollout.speculative import DraftTree, logits_to_probs, sample
from tltrun.rollout.static_decode import StaticStep, decode_sources
from tltrun.rollout.static_verify import verify_eagerly
from tltsim.policy import DecodeObs, SpecDecision, SpecFeedback, SpecPolicy, update_accept_len_ema


@dataclass
class _Rollout:
    """The rollout in progress: from ``start_rollout`` to ``finish_rollout``."""

    scheduler: Scheduler
    policy: SpecPolicy
    step: int
    t0: float  # engine clock at the start: records and finish times are relative to it
    iterations: list[IterationRecord] = field(default_factory=list)
    accept_len_ema: float = 0.0  # DecodeObs.accept_len_ema (tltsim.policy.update_accept_len_ema)


class RolloutEngine:
    name = "torch"

    def __init__(
        self,
        model: Transformer,
        drafter: EagleDrafter | None,
        config: EngineConfig,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.config = config
        self.clock = clock
        self.device = torch.device(config.device)
        dtype = DTYPES[config.dtype_name]
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.drafter = drafter
        if drafter is not None:
            drafter.to(device=self.device, dtype=dtype).eval()
            drafter.bind(self.model)
        if config.fuse_projections:  # before any capture: fusing re-points the parameters
            for module in (self.model, drafter):
                if module is not None:
                    fuse_projections(module)
        self._apply_layer_settings()
        cfg = model.config
        outside = [i for i in config.eos_token_ids if not 0 <= i < cfg.vocab_size]
        if outside:
            raise ValueError(  # such an id never stops a response
                f"eos_token_ids {list(config.eos_token_ids)} (--eos-token-ids with the model's "
                f"generation_config.json's): {', '.join(map(str, outside))} outside the model's "
                f"vocabulary [0, {cfg.vocab_size})"
            )
        slots = config.max_running_requests
        self.max_tokens = config.max_model_len + config.max_verify_tokens + 1
        self.cache = KVCache.for_model(cfg, slots, self.max_tokens, dtype, self.device)
        self.draft_cache = None
        if drafter is not None:
            self.draft_cache = KVCache.for_model(
                cfg, slots, self.max_tokens, dtype, self.device, num_layers=1
            )
        self.hidden = None  # (slots, max_tokens, C) target hidden states by position
        if drafter is not None or config.is_harvesting:
            self.hidden = torch.zeros(
                slots, self.max_tokens, cfg.hidden_size, dtype=dtype, device=self.device
            )
        self.tokens = torch.zeros(slots, self.max_tokens, dtype=torch.long, device=self.device)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.eos_ids = frozenset(cfg.eos_token_ids) | frozenset(config.eos_token_ids)
        self.harvest: list[HarvestRecord] = []
        self._rollout: _Rollout | None = None
        # Model-free drafter (issue #20), kept across rollouts. Indexed lazily: nothing is
        # indexed until a policy first asks for a history draft, then every rollout is kept.
        self.history = RolloutHistory(config.history_config())
        # TLT's graph pool (tltrun.rollout.graphs), planned from the first rollout's policy and
        # captured then, once; replanned only for a policy whose plan differs
        self.graphs: GraphPool | None = None

    # -----------------------------------------------------------------------------------------
    # Public API
    # -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, requests: list[Request], policy: SpecPolicy, step: int = 0) -> RolloutResult:
        """One whole rollout of ``requests`` under ``policy`` (``RolloutBackend``)."""
        self.start_rollout(requests, policy, step)
        while not self.is_rollout_done:
            self.step()
        return self.finish_rollout()

    def start_rollout(self, requests: list[Request], policy: SpecPolicy, step: int = 0) -> None:
        """Queue ``requests`` as RL step ``step``'s rollout under ``policy`` (which is told
        ``start_rollout``); the clock of its records starts now. Replaces any rollout that
        was not finished."""
        self.config.check_requests(requests, self.model.config.vocab_size)
        check_policy(
            policy, self.config.max_running_requests, max_verify_tokens=self.config.max_verify_tokens,
            vocab_size=self.model.config.vocab_size, has_drafter=self.drafter is not None,
        )  # fmt: skip
        if self._rollout is not None:
            self.history.finish_rollout()
        sched = Scheduler(requests, self.config.max_running_requests)
        if self.config.is_using_graphs:
            self._prepare_graphs(policy)
        self._apply_layer_settings()
        policy.start_rollout(step)
        self._rollout = _Rollout(scheduler=sched, policy=policy, step=step, t0=self.clock())
        self.history.start_rollout(sched.sequences)

    def _apply_layer_settings(self) -> None:
        """Compiled layers (no-grad forwards; training stays eager) as this engine is set, at
        construction and at each rollout's start: engines sharing one model (the GPU
        benchmark's contenders) otherwise all ran the last-constructed one's setting."""
        for module in (self.model, self.drafter):
            if module is not None:
                set_compiled_layers(module, self.config.compile_layers)

    @property
    def scheduler(self) -> Scheduler:
        """The rollout's sequences: waiting, running (slots 0..n-1) and finished."""
        return self._current().scheduler

    @property
    def is_rollout_done(self) -> bool:
        return self._current().scheduler.is_done

    @torch.no_grad()
    def step(self) -> list[IterationRecord]:
        """One turn of the rollout loop: admit waiting requests and prefill them, then one
        decode iteration of the running batch as the policy decides (plain, or the drafter's
        re-prefill plus a speculative iteration), releasing finished requests after each.
        Returns the iterations it ran (also kept for ``finish_rollout``)."""
        rollout = self._current()
        sched = rollout.scheduler
        records: list[IterationRecord] = []
        admitted = sched.admit()
        if admitted:
            records += self.prefill(admitted)
            self._release(sched)
        if sched.running:
            records += self._decode_iteration(rollout)
            self._release(sched)
        rollout.iterations += records
        return records

    def finish_rollout(self) -> RolloutResult:
        """The rollout's outputs and iteration records; the engine is free for the next one."""
        rollout = self._current()
        self._rollout = None
        self.history.finish_rollout()
        return RolloutResult(
            outputs=rollout.scheduler.outputs(),
            iterations=rollout.iterations,
            wall_s=self.clock() - rollout.t0,
            backend=self.name,
            shares_prompts=self.config.share_prompts,
        )

    def prepare_graphs(self, policies: list[SpecPolicy]) -> None:
        """Capture one pool serving every policy of ``policies`` (the union of their plans),
        for a caller that alternates policies between rollouts (``tltrun profile``, the GPU
        benchmark): their rollouts then capture nothing. Between rollouts only, as
        ``start_rollout``; nothing without the graph pool (CPU default, ``--eager``)."""
        if self.config.is_using_graphs:
            self._prepare_graphs(*policies)

    def _prepare_graphs(self, *policies: SpecPolicy) -> None:
        """The pool for the policies' capture plan: kept if its plan covers it, else rebuilt
        (captured on CUDA). Called between rollouts only: capture writes scratch KV entries
        into free slots."""
        cfg = self.config
        sizes, is_drafting = cfg.graph_batch_sizes or None, self.drafter is not None
        plan = CapturePlan.union(
            [capture_plan(p, cfg.max_running_requests, sizes, is_drafting) for p in policies]
        )
        if self.graphs is not None and self.graphs.plan.covers(plan):
            return
        self.graphs = None  # the old pool's memory goes back before the new one is captured
        is_capturing = self.device.type == "cuda"
        self.graphs = GraphPool(
            self.model, self.cache, plan, cfg.attention, is_capturing,
            drafting=draft_sources(self), decoding=decode_sources(self),
        )  # fmt: skip

    def _static_step(self, running: list[Sequence], strategy: str) -> StaticStep | None:
        """The pool's whole verify for this batch (``"off"``: its decode step), or None:
        no pool, no bucket for it, or running slots not 0..n-1 (the scheduler keeps them so)."""
        if self.graphs is None:
            return None
        if any(s.slot != i for i, s in enumerate(running)):
            return None
        n = len(running)
        if strategy == "off":
            return self.graphs.decode_step(n)
        return self.graphs.verify_step(n, strategy)

    def sync(self) -> None:
        """Wait for the device (a no-op on CPU): what a timer must call before reading."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def pop_harvest(self) -> list[HarvestRecord]:
        out, self.harvest = self.harvest, []
        return out

    def discard_harvest(self) -> None:
        """Forget the harvested records (an evaluation's rollout)."""
        self.harvest = []

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """GRPO weight sync: copy a (Hugging Face-named) state dict into the target in place.
        The drafter shares the target's embedding and LM head, so it follows automatically."""
        load_in_place(self.model, state_dict, "target", drop=self.model.config.tied_names)

    @torch.no_grad()
    def update_drafter(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Spot-trainer sync: new drafter weights (tltrun.model.drafter state-dict names)."""
        if self.drafter is None:
            raise ValueError("update_drafter: this engine has no drafter")
        load_in_place(self.drafter, state_dict, "drafter", drop=set())

    # -----------------------------------------------------------------------------------------
    # Loop pieces
    # -----------------------------------------------------------------------------------------

    def _current(self) -> _Rollout:
        if self._rollout is None:
            raise RuntimeError("no rollout in progress: call start_rollout first")
        return self._rollout

    @torch.no_grad()
    def prefill(self, admitted: list[Sequence]) -> list[IterationRecord]:
        """Prefill sequences the rollout's scheduler just admitted (each samples its first
        token): leaders in padded groups of at most ``max_prefill_tokens``, followers of a
        shared prompt from their source's cache (``share_prompts``)."""
        rollout = self._current()
        return prefill_prompts(self, admitted, rollout.scheduler.running, rollout.t0)

    def _decode_iteration(self, rollout: _Rollout) -> list[IterationRecord]:
        sched, policy, step, t0 = rollout.scheduler, rollout.policy, rollout.step, rollout.t0
        running = list(sched.running)
        cfg = self.config
        obs = DecodeObs(
            now_s=self.clock() - t0,
            step=step,
            instance=cfg.instance,
            num_active=len(running),
            num_waiting=len(sched.waiting),
            mean_context_tokens=sum(s.num_tokens for s in running) / len(running),
            accept_len_ema=rollout.accept_len_ema,
        )
        decision = policy.decide(obs)
        records = []
        is_eagle = decision.enabled and decision.drafter == "eagle"
        if decision.enabled:
            if is_eagle and self.drafter is None:
                raise ValueError(
                    f"policy {policy.name!r} turned SD on ({decision.strategy}) but the engine has no drafter"
                )
            if decision.verify_tokens > cfg.max_verify_tokens:
                raise ValueError(
                    f"strategy {decision.strategy}: verify_tokens exceeds max_verify_tokens={cfg.max_verify_tokens}"
                )
        if is_eagle:
            stale = self._stale_drafter(running)
            if stale:
                records.append(self.reprefill_drafter(stale, decision))
        # the cache holds all but each sequence's pending token (no device read for it)
        context_tokens = sum(s.num_tokens for s in running) - len(running)
        start = self.clock()
        if decision.enabled:
            slots = slots_of(running, self.device)
            new_tokens, accept_lens = self._spec_step(running, slots, decision)
        else:
            new_tokens, accept_lens = self._plain_step(running), ()
        self.sync()
        now = self.clock()
        num_kept = sum(
            s.append(toks, self.eos_ids, now - t0)
            for s, toks in zip(running, new_tokens, strict=True)
        )
        wall = self.clock() - start
        if decision.enabled:
            rollout.accept_len_ema = update_accept_len_ema(
                rollout.accept_len_ema, num_kept / len(running)
            )
        # The bandit is rewarded per second of everything the decision cost: a drafter
        # re-prefill it required (SD switching on, or EAGLE after a long history span) counts.
        policy.observe(
            SpecFeedback(
                step=step,
                instance=cfg.instance,
                num_active=len(running),
                decision=decision,
                accepted_tokens=float(num_kept),
                iteration_s=wall + sum(r.wall_s for r in records),
            )
        )
        records.append(
            IterationRecord(
                start_s=start - t0,
                wall_s=wall,
                num_active=len(running),
                num_new_tokens=num_kept,
                context_tokens=context_tokens,
                is_prefill=False,
                strategy=decision.strategy,
                accept_lens=accept_lens,
                drafter=decision.drafter if decision.enabled else None,
            )
        )
        return records

    def _plain_step(self, running: list[Sequence]) -> list[list[int]]:
        static = self._static_step(running, "off")
        if static is not None:  # padded to its bucket; one graph replay on CUDA
            nxt = static(len(running))  # (B,) forward, sampling and writes as below
        else:
            slots = slots_of(running, self.device)
            lens = self.cache.lens[slots]  # (B,)
            ids = self.tokens[slots, lens][:, None]  # (B,1) the pending tokens
            ctx = self.cache.context(slots, 1, impl=self.config.attention)
            logits, hidden = self.model(ids, lens[:, None], ctx)
            if self.hidden is not None:
                self.hidden[slots, lens] = hidden[:, 0]
            self.cache.commit(slots, 1)
            nxt = sample(logits_to_probs(logits[:, 0], self.config.sampling), self.generator)
            self.tokens[slots, lens + 1] = nxt
        for s in running:
            s.is_drafter_fresh = False
        return [[t] for t in nxt.tolist()]

    def catchup_pairs(self) -> int:
        """The most pending drafter pairs per sequence an EAGLE drafting step feeds itself,
        in its first forward (as it feeds a verify's accepted tokens): the config's
        ``catchup_pairs``, by default the graph pool's bound where EAGLE drafting is captured,
        else ``max_verify_tokens`` (a forward no wider per sequence than a verify may be). A
        sequence further behind is re-prefilled first."""
        if self.config.catchup_pairs is not None:
            return self.config.catchup_pairs
        if self.graphs is not None and self.graphs.drafts:
            return self.graphs.max_pending
        return self.config.max_verify_tokens

    def _stale_drafter(self, running: list[Sequence]) -> list[Sequence]:
        return stale_drafter(self, running, self.catchup_pairs())

    @torch.no_grad()
    def reprefill_drafter(self, stale: list[Sequence], decision: SpecDecision) -> IterationRecord:
        """Feed running sequences' pending pairs to the drafter, all but the newest (the
        drafting catch-up feeds that one and drafts from it): TLT's cost of switching SD on."""
        return reprefill_stale(self, stale, decision, self._current().t0)

    @torch.no_grad()
    def draft(self, slots: torch.Tensor, decision: SpecDecision) -> DraftTree:
        """The drafter's tree for running ``slots`` under ``decision`` (after feeding it the
        pending pairs), exactly as a speculative iteration drafts it."""
        return self._eagle_draft(
            slots, decision, torch.equal(slots.cpu(), torch.arange(len(slots)))
        )

    def _eagle_draft(self, slots: torch.Tensor, decision: SpecDecision, is_pool: bool) -> DraftTree:
        """The pool's drafting step (``is_pool``: slots 0..n-1; a graph for this batch and
        strategy; pending pairs within its bound: ``tltrun.rollout.draft_graphs``), else eager."""
        step = None
        if is_pool and self.graphs is not None:
            step = self.graphs.draft_step(len(slots), decision.strategy)
        tree = None if step is None else step(len(slots))
        return eagle_draft(self, slots, decision) if tree is None else tree

    def _spec_step(
        self, running: list[Sequence], slots: torch.Tensor, decision: SpecDecision
    ) -> tuple[list[list[int]], tuple[int, ...]]:
        static = self._static_step(running, decision.strategy)
        if decision.drafter == "history":
            roots = [s.output[-1] for s in running]  # the pending last tokens (tokens[slot, n])
            # eager: verify only as many nodes as the longest proposal (a graph's are fixed)
            tree = self.history.draft(
                running, roots, decision, self.device, is_trimmed=static is None,
                max_drafted=None if static is None else static.num_tokens - 1,
            )  # fmt: skip
        else:
            tree = self._eagle_draft(
                slots, decision, all(s.slot == i for i, s in enumerate(running))
            )
        if static is not None:  # padded to its bucket; one graph replay on CUDA
            accepted, out = static(tree, len(running))
        else:
            accepted, out = verify_eagerly(self, slots, decision, tree)
        # After a history iteration the EAGLE drafter has not seen these pairs: its next
        # drafting step feeds them (``_stale_drafter``: a re-prefill first if too many).
        is_eagle = decision.drafter == "eagle"
        for s, n in zip(running, accepted, strict=True):
            s.is_drafter_fresh = is_eagle
            s.record_accept(n, decision.arm)
        return out, tuple(accepted)

    def _release(self, sched: Scheduler) -> None:
        released = sched.release_finished()
        for seq in released:
            if self.config.is_harvesting:
                self.harvest.append(harvest_record(seq, self.hidden))
        if not released:  # admission fills the lowest free slots: still 0..n-1 in order
            return
        moves = sched.compact()
        if moves:
            move_slots(moves, (self.cache, self.draft_cache), self.tokens, self.hidden)
