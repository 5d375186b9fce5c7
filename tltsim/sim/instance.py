"""One engine instance's rollout in one RL step: continuous batching, plain and SD decoding.

``InstanceRollout.process`` is a SimPy process (a generator of timeouts) driven by
``tltsim.sim.simulator``. The instance admits queued requests FIFO up to ``max_running_requests`` (one
prefill per admission, which also emits each request's first token), then decodes: before each
decode span it asks the ``SpecPolicy`` for a decision, runs the span on its batch
(``tltsim.sim.batch``), reports what happened through ``policy.observe``, and yields the span's
seconds to SimPy.

Fast mode (the default) yields one timeout per *span*: the iterations up to the next change of
batch composition (a completion; admissions happen right after one). Spans a policy cuts short
(``max_hold_iters``) without a completion are accumulated and yielded with the next one. Exact
mode (``SimConfig.exact``) yields one timeout per iteration and asks the policy before each one.

Policy granularity in fast mode (a documented coarsening): the policy is asked once per span,
since nothing it observes changes inside one except the slowly growing context, the clock and
the accept-length EMA. A policy whose decision depends on how many iterations have passed
(TLTAdaptive's warm-up count, its bandit's exploration schedule) or on what they earned (a
greedy arm its own rewards may demote, ``tltsim.policy.bandit.greedy_hold``) caps a span with
its ``max_hold_iters(obs, decision)`` (a ``SpecPolicy`` method); the feedback of a span carries
its ``num_iters`` and per-iteration means (floats, unrounded), so a bandit's reward is the
span's mean throughput.

History-drafter decisions (issue #20): the instance's batch draws each request's accept lengths
from ``tltsim.sim.history_acceptance.HistoryModel`` at its own key, the fraction of its siblings that
finished where its drafter can see them and whether earlier rollouts of its prompt are indexed
(``tltsim.sim.step_history.StepHistory.keys``); such iterations run no drafter forward and never re-prefill a
drafter (tltrun's engine builds no EAGLE cache for them). The next EAGLE span's first drafting
step feeds the pairs they emitted (at most ``CATCHUP_PAIRS`` per request, else a drafter
forward first), and the bandit's feedback charges that, and any re-prefill, to the decision
that needed it, as tltrun's engine does.

The timeline is a list of ``tltsim.sim.metrics.Segment`` records, one per stretch of an
instance in one phase (exact mode extends the open one while iterations repeat).

``StepRun`` is what the instances of one RL step share (clock, cost model, policy, timeline); the
simulator builds one per step and hands it to each ``InstanceRollout``.

Run: not standalone; see ``tltsim.sim.simulator.simulate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tltsim.policy import (
    DecodeObs,
    SpecDecision,
    SpecFeedback,
    TrainDecision,
    update_accept_len_ema,
)
from tltsim.sim.acceptance import accept_len_pmf
from tltsim.sim.batch import AcceptDist, ExactBatch, FastBatch
from tltsim.sim.metrics import Segment
from tltsim.sim.prefill import admission_s, reprefill_work, shared_tokens
from tltsim.sim.step_history import StepHistory

# Pending drafter pairs per request an EAGLE drafting step feeds in its first forward; a longer
# lag is re-prefilled first. tltrun's RolloutEngine.catchup_pairs: its EngineConfig's
# max_verify_tokens default (64) on the eager path the simulator's cost models describe.
CATCHUP_PAIRS = 64


class InstanceRollout:
    """State of one instance during one rollout; ``process()`` is its SimPy process."""

    def __init__(
        self,
        run: StepRun,
        index: int,
        ids: np.ndarray,
        prompt_tokens: np.ndarray,
        response_tokens: np.ndarray,
        groups: np.ndarray,
    ):
        self.run = run
        self.index = index
        self.ids = ids  # response index within the step (for finish times)
        self.prompt_tokens = prompt_tokens
        self.response_tokens = response_tokens
        self.groups = groups  # each response's prompt index: responses of a group share it
        self.active_groups: dict[int, int] = {}  # prompt index -> running responses
        self.group_prompt = dict(zip(groups.tolist(), prompt_tokens.tolist(), strict=True))
        self.batch = ExactBatch(run, index) if run.config.exact else FastBatch(run, index)
        self.busy_s = 0.0
        self.tail_s = 0.0
        self.decode_s = 0.0
        self.sd_s = 0.0
        self.reprefill_s = 0.0
        self.sd_tokens = 0.0
        self.sd_verifies = 0
        self.num_finished = 0
        self.finish_s = 0.0  # rollout-relative time the last request finished
        self.is_sd_on = False  # EAGLE drafter cache built (re-prefill paid) in this rollout
        # once the drafter cache is built: tokens emitted by plain and history iterations
        # since EAGLE's last one, and requests admitted since (their prompts unseen by it)
        self.lag_tokens = 0.0
        self.num_unseen = 0
        self.unseen_tokens = 0.0
        self.accept_len_ema = 0.0
        # the most KV tokens the running requests held at once (each request's own prompt and
        # what it generated: a real engine's KV capacity caps it; tltsim.sim.replay.kv_note)
        self.peak_kv_tokens = 0.0

    @property
    def tokens(self) -> int:
        """Tokens generated so far (fast mode sums mean progress: round to the integer)."""
        return int(round(self.batch.tokens))

    # -- bookkeeping -------------------------------------------------------------------------

    def _charge(
        self,
        start_s: float,
        dt: float,
        phase: str,
        num_active: int,
        strategy: SpecDecision | str = "",
    ) -> None:
        """Account ``dt`` busy seconds and append (or extend) a timeline segment. ``strategy`` is
        the SD decision (its name is taken when the timeline becomes a table)."""
        run = self.run
        self.busy_s += dt
        if num_active < run.config.tail_threshold:
            self.tail_s += dt
        if run.timeline is not None:
            seg = run.open_segment[self.index]
            if (
                seg is not None
                # step-relative times (now - t0) differ in the last bits after step 0: an
                # exact-mode replay kept one row per iteration there (7M rows, 2.3 GB)
                and abs(seg.end_s - start_s) <= 1e-9 * max(1.0, abs(start_s))
                and seg.phase == phase
                and seg.num_active == num_active
                and seg.strategy is strategy
            ):
                seg.end_s = start_s + dt  # exact mode: merge consecutive identical iterations
            else:
                seg = Segment(
                    step=run.step,
                    instance=self.index,
                    start_s=start_s,
                    end_s=start_s + dt,
                    phase=phase,
                    num_active=num_active,
                    strategy=strategy,
                )
                run.timeline.append(seg)
                run.open_segment[self.index] = seg

    def _retire(self, now_s: float) -> None:
        done = self.batch.retire()
        if done.size:
            self.run.finish_s[done] = now_s
            self.run.history.record_finished(done, self.index)
            self.num_finished += int(done.size)
            for g in self.run.prompt_index[done].tolist():
                left = self.active_groups[g] - 1
                if left:
                    self.active_groups[g] = left
                else:
                    del self.active_groups[g]

    def _admission_s(self, prompts: np.ndarray, groups: np.ndarray) -> float:
        """Seconds to admit requests with these prompt lengths and groups.

        Without prompt sharing: one prefill of all prompts. With it (``SimConfig.share_prompts``)
        a group's prompt is prefilled once, by its first admitted response, unless a response of
        the group is already running; every other response (a follower) reuses the cached
        prompt's whole ``prefix_block_tokens`` blocks, short of its last token, and computes the
        rest: with token granularity one decode-shaped forward over the followers (tltrun's
        torch engine), else a prefill on top of the cached blocks (vLLM's prefix cache). A
        follower with no whole block to reuse prefills like a leader."""
        block = self.run.config.prefix_block_tokens
        cached = shared_tokens(prompts, block)
        lead = np.ones(prompts.size, dtype=bool)
        if self.run.config.share_prompts:
            _, first = np.unique(groups, return_index=True)
            is_first = np.zeros(prompts.size, dtype=bool)
            is_first[first] = True
            running = np.array([g in self.active_groups for g in groups.tolist()], dtype=bool)
            lead = ~((~is_first | running) & (cached > 0))
        for g in groups.tolist():
            self.active_groups[g] = self.active_groups.get(g, 0) + 1
        return admission_s(self.run.cost, prompts, cached, lead, self.batch.is_padded)

    def _reprefill(self) -> tuple[float, float]:
        """(sequences, tokens) of the SD switch's re-prefill over the running requests."""
        contexts, ids = self.batch.contexts()
        groups = self.run.prompt_index[ids]
        prompts = np.array([self.group_prompt[g] for g in groups.tolist()], dtype=np.int64)
        config = self.run.config
        return reprefill_work(
            contexts,
            groups if config.share_prompts else None,
            prompts,
            config.prefix_block_tokens,
            self.batch.is_padded,
        )

    def _drafter_upkeep_s(self, decision: SpecDecision, b: int) -> tuple[float, float]:
        """(re-prefill seconds before the span, catch-up seconds inside its first drafting
        step) that an EAGLE ``decision`` needs to bring the drafter's KV cache up to date,
        as tltrun's engine does (``tltrun.rollout.prefill.stale_drafter``)."""
        if not (decision.enabled and decision.drafter == "eagle"):
            return 0.0, 0.0
        run, batch = self.run, self.batch
        if not self.is_sd_on:
            # SD switches on: rebuild the drafter's KV cache over the running requests, then
            # run the decided iteration (one decide() per iteration, as tltrun's engine). The
            # history drafter needs no such cache; tltrun's engine re-prefills EAGLE's when a
            # first EAGLE decision comes after history ones, as here.
            self.is_sd_on = True
            self.lag_tokens, self.num_unseen, self.unseen_tokens = 0.0, 0, 0.0
            return run.reprefill_s(*self._reprefill()), 0.0
        switch_s = catchup_s = 0.0
        if self.num_unseen:
            # requests admitted since: the drafter has seen nothing of them, and one drafter
            # forward feeds it their prompts (their target prefill ran at admission)
            num = min(self.num_unseen, b)
            per_seq = max(1, int(math.ceil(self.unseen_tokens / self.num_unseen)))
            switch_s += run.cost.drafter_iter_s(num, 0.0, per_seq)
            self.num_unseen, self.unseen_tokens = 0, 0.0
        if self.lag_tokens > 0:
            # The EAGLE drafter catches up on the pairs plain and history iterations emitted:
            # within CATCHUP_PAIRS per request, in the drafting step's first forward (tltrun's
            # RolloutEngine.catchup_pairs), else one drafter forward over them first.
            per_seq = max(1, int(math.ceil(self.lag_tokens / b)))
            ctx = batch.cost_context()[0]
            self.lag_tokens = 0.0
            if per_seq <= CATCHUP_PAIRS:
                catchup_s = max(
                    0.0,
                    run.cost.drafter_iter_s(b, ctx, per_seq + 1)
                    - run.cost.drafter_iter_s(b, ctx, 1),
                )
            else:
                switch_s += run.cost.drafter_iter_s(b, ctx, per_seq)
        return switch_s, catchup_s

    def _is_keyed_elsewhere(self, decision: SpecDecision) -> bool:
        """Whether another instance can change this one's accept lengths mid-span: a history
        decision with a cluster-wide index (``HistoryModel.scope``), while some running
        request has a sibling unfinished on another instance (its completion there raises the
        request's history key). Fast mode then runs one iteration per SimPy event, so that
        the batch re-keys after each completion anywhere, as exact mode does; a span was
        held to this instance's own next completion, and the keys moved only then."""
        run = self.run
        if not (decision.enabled and decision.drafter == "history"):
            return False
        if run.history.model.scope != "cluster" or not self.active_groups:
            return False
        unfinished = np.isnan(run.finish_s)
        groups = run.prompt_index
        num_groups = run.history.group_sizes.size
        everywhere = np.bincount(groups[unfinished], minlength=num_groups)
        here = np.bincount(groups[self.ids[unfinished[self.ids]]], minlength=num_groups)
        running = np.fromiter(self.active_groups, dtype=np.int64)
        return bool((everywhere[running] > here[running]).any())

    def _sd_stats(self, decision, dt: float, num_iters: int, emitted: float, b: int) -> None:
        run = self.run
        if decision is not run.last_decision:  # hashing a dataclass per span is slow
            run.strategies_used.add(decision)
            run.last_decision = decision
        self.sd_s += dt
        self.sd_tokens += emitted
        self.sd_verifies += b * num_iters
        mean_len = emitted / (b * num_iters)
        self.accept_len_ema = update_accept_len_ema(self.accept_len_ema, mean_len, num_iters)

    # -- the SimPy process ---------------------------------------------------------------------

    def process(self):
        run, batch = self.run, self.batch
        env, policy = run.env, run.policy
        max_running = run.config.max_running_requests
        num = int(self.response_tokens.size)
        next_queued = 0
        is_yield_each = run.config.exact  # exact mode: one SimPy event per iteration
        pending = (
            0.0  # fast mode: seconds of spans that ended without a completion, not yet yielded
        )
        while True:
            now = env.now - run.t0 + pending
            if batch.num_active < max_running and next_queued < num:
                take = min(max_running - batch.num_active, num - next_queued)
                sl = slice(next_queued, next_queued + take)
                next_queued += take
                dt = self._admission_s(self.prompt_tokens[sl], self.groups[sl])
                if self.is_sd_on:  # the next EAGLE iteration prefills the drafter over them
                    self.num_unseen += take
                    self.unseen_tokens += float(self.prompt_tokens[sl].sum())
                batch.admit(self.prompt_tokens[sl], self.response_tokens[sl], self.ids[sl])
                self.peak_kv_tokens = max(self.peak_kv_tokens, batch.context_tokens)
                self._charge(now, dt, "prefill", batch.num_active)
                yield env.timeout(pending + dt)
                pending = 0.0
                self._retire(env.now - run.t0)
                continue
            b = batch.num_active
            if b == 0:
                break
            obs = DecodeObs(
                now_s=now,
                step=run.step,
                instance=self.index,
                num_active=b,
                num_waiting=num - next_queued,
                mean_context_tokens=batch.context_tokens / b,
                accept_len_ema=self.accept_len_ema,
            )
            decision = policy.decide(obs)
            switch_s, catchup_s = self._drafter_upkeep_s(decision, b)
            if switch_s > 0:
                self.reprefill_s += switch_s
                self._charge(now, switch_s, "reprefill", b)
                pending += switch_s
                now = env.now - run.t0 + pending
            hold = run.hold_iters(obs, decision)
            is_watching = self._is_keyed_elsewhere(decision)
            if is_watching:
                hold = 1  # one iteration at a time: see _is_keyed_elsewhere
            dt, num_iters, emitted = batch.advance(decision, hold)
            self.peak_kv_tokens = max(self.peak_kv_tokens, batch.context_tokens)
            if self.is_sd_on and not (decision.enabled and decision.drafter == "eagle"):
                self.lag_tokens += emitted  # pairs the EAGLE drafter has not seen
            # tltrun's engine rewards the bandit per second of all the decision cost: the
            # span's first iteration carries the re-prefill and the catch-up
            run.feedback(obs, decision, emitted, dt, num_iters, first_extra_s=switch_s + catchup_s)
            dt += catchup_s  # SD time: it runs inside the first drafting step
            self.decode_s += dt
            if decision.enabled:
                self._sd_stats(decision, dt, num_iters, emitted, b)
                self._charge(now, dt, "sd", b, decision)
            else:
                self._charge(now, dt, "decode", b)
            pending += dt
            # Nothing outside this instance can tell whether a span without a completion was
            # yielded on its own (instances only interact at completions and the barrier,
            # except through a cluster-wide history index: _is_keyed_elsewhere).
            if is_yield_each or is_watching or batch.has_finished():
                yield env.timeout(pending)
                pending = 0.0
                self._retire(env.now - run.t0)
        if self.num_finished != num:
            raise AssertionError(
                f"step {run.step} instance {self.index}: {self.num_finished} of {num} responses finished"
            )
        self.finish_s = env.now - run.t0
        run.instance_done(self)


@dataclass
class StepArrays:
    """One trace step flattened: per response, in prompt-major order."""

    step: int
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    prompt_index: np.ndarray  # the response's prompt (index in the step): its group
    prompt_ids: tuple[str, ...] = ()  # per prompt of the step: its trace id


class StepRun:
    """Everything the instances of one RL step's rollout share (one per step, per simulation)."""

    def __init__(self, sim: Any, arrays: StepArrays, t0: float, rates: np.ndarray | None = None):
        # ``sim`` is tltsim.sim.simulator's _Simulation, typed Any: naming it here would make
        # this module import its own caller.
        self.sim = sim
        self.request_rate = rates  # per response (nan: draws from accept_dist), or None
        self.env = sim.env
        self.config = sim.config
        self.cost = sim.cost
        self.policy = sim.spec_policy
        self.rng = sim.rng
        self.step = arrays.step
        self.t0 = t0
        self.timeline = sim.timeline
        self.open_segment: list[Segment | None] = [None] * sim.config.num_instances
        self.finish_s = np.full(arrays.response_tokens.size, np.nan)
        self.prompt_index = arrays.prompt_index
        self.strategies_used = sim.strategies_used
        self.last_decision: SpecDecision | None = None
        self.acceptance = sim.drafter_acceptance()
        self._dist_cache: dict[Any, AcceptDist] = {}  # decision or (decision, rate)
        # the history drafter's view of the step (HistoryModel, issue #20)
        self.history = StepHistory(
            sim.history,
            arrays.prompt_index,
            arrays.prompt_ids,
            rates=sim.request_history_rates(arrays),
            indexed=sim.history_indexed,
        )
        self.done: list[InstanceRollout] = []
        # each finished instance's response tokens (its whole share is harvested), summed once:
        # re-summed for every finished instance at every idle event, they cost O(n^2) sums
        self.done_tokens: dict[int, int] = {}
        self.instances: list[InstanceRollout] = []
        self.train_decisions: list[tuple[float, TrainDecision]] = []  # (rollout time, decision)
        self.mean_seq_tokens = float(
            arrays.prompt_tokens.sum() + arrays.response_tokens.sum()
        ) / max(1, arrays.response_tokens.size)
        # seconds of one data-parallel drafter update (per instance: drafter_update_tokens x tp)
        self.update_s = sim.cost.drafter_train_s(
            sim.config.drafter_update_tokens * sim.config.tp, self.mean_seq_tokens
        )

    def accept_dist(self, decision: SpecDecision) -> AcceptDist:
        """Accept-length distribution of ``decision`` at this step's drafter acceptance."""
        dist = self._dist_cache.get(decision)
        if dist is None:
            dist = self._dist_cache[decision] = self.sim.accept_dist(decision, self.acceptance)
        return dist

    def request_dists(
        self, decision: SpecDecision, ids: np.ndarray, instance: int = 0
    ) -> list[tuple[AcceptDist, np.ndarray | None]]:
        """(distribution, positions in ``ids`` that draw from it; None: all) for SD under
        ``decision`` on ``instance``: ``accept_dist`` unless responses carry their own rates;
        for the history drafter, one per history key (``StepHistory.keys``)."""
        if decision.drafter == "history":
            return self.history.dists(decision, ids, instance)
        if self.request_rate is None:
            return [(self.accept_dist(decision), None)]
        rates = self.request_rate[ids.astype(np.int64)]
        out = []
        unknown = np.isnan(rates)
        if unknown.any():
            out.append((self.accept_dist(decision), np.flatnonzero(unknown)))
        for rate in np.unique(rates[~unknown]).tolist():
            key = (decision, rate)
            dist = self._dist_cache.get(key)
            if dist is None:
                pmf = accept_len_pmf(decision, rate, self.sim.drafter.sibling_rate)
                dist = self._dist_cache[key] = AcceptDist.of(pmf)
            out.append((dist, np.flatnonzero(rates == rate)))
        return out

    def hold_iters(self, obs: DecodeObs, decision: SpecDecision) -> int | None:
        """How many iterations the policy lets a decision stand (None: until the batch changes)."""
        return self.policy.max_hold_iters(obs, decision)

    def feedback(
        self,
        obs: DecodeObs,
        decision: SpecDecision,
        accepted: float,
        span_s: float,
        num_iters: int,
        first_extra_s: float = 0.0,
    ) -> None:
        """Report a span to the policy: per-iteration means over its ``num_iters`` iterations,
        the first iteration also charged ``first_extra_s`` (a drafter re-prefill the decision
        required), reported on its own as tltrun's engine reports each iteration."""
        per_accepted, per_s = accepted / num_iters, span_s / num_iters
        spans = (
            [(1, per_s + first_extra_s), (num_iters - 1, per_s)]
            if first_extra_s > 0
            else [(num_iters, per_s)]
        )
        for i, (n, iteration_s) in enumerate(spans):
            if n < 1:
                continue
            self.policy.observe(
                SpecFeedback(
                    step=self.step,
                    instance=obs.instance,
                    num_active=obs.num_active,
                    decision=decision,
                    accepted_tokens=per_accepted,
                    iteration_s=iteration_s,
                    num_iters=n,
                    is_continued=i > 0,  # one decide() call for the whole span
                )
            )

    def reprefill_s(self, num_seqs: float, context_tokens: float) -> float:
        return self.sim.reprefill_s(num_seqs, context_tokens)

    def instance_done(self, inst: InstanceRollout) -> None:
        """An instance ran out of work: it is idle until the barrier, or a spot trainer."""
        self.done.append(inst)
        self.done_tokens[inst.index] = int(inst.response_tokens.sum())
        self.sim.instance_idle(self, inst)
