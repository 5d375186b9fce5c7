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
(TLTAdaptive's warm-up count) caps a span with an optional ``max_hold_iters(obs, decision)``
method; the feedback of a span carries its ``num_iters`` and per-iteration means, so a bandit's
reward is the span's mean throughput.

Run: not standalone; see ``tltsim.sim.simulator.simulate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tltsim.sim.batch import ExactBatch, FastBatch
from tltsim.policy import DecodeObs, SpecDecision

if TYPE_CHECKING:
    from tltsim.sim.simulator import StepRun

# Weight of one iteration in the driver's accept-length EMA (DecodeObs.accept_len_ema); a span
# of n iterations counts as n updates.
ACCEPT_EMA_WEIGHT = 0.1


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
        self.batch = ExactBatch(run) if run.config.exact else FastBatch(run)
        self.busy_s = 0.0
        self.tail_s = 0.0
        self.decode_s = 0.0
        self.sd_s = 0.0
        self.reprefill_s = 0.0
        self.sd_tokens = 0.0
        self.sd_verifies = 0
        self.num_finished = 0
        self.finish_s = 0.0  # rollout-relative time the last request finished
        self.is_sd_on = False  # drafter cache built (re-prefill paid) in this rollout
        self.accept_len_ema = 0.0

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
                and seg[3] == start_s
                and seg[4] == phase
                and seg[5] == num_active
                and seg[6] is strategy
            ):
                seg[3] = start_s + dt  # exact mode: merge consecutive identical iterations
            else:
                seg = [run.step, self.index, start_s, start_s + dt, phase, num_active, strategy]
                run.timeline.append(seg)
                run.open_segment[self.index] = seg

    def _retire(self, now_s: float) -> None:
        done = self.batch.retire()
        if done.size:
            self.run.finish_s[done] = now_s
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
        padded = self.batch.is_padded
        cost = self.run.cost
        lead = np.ones(prompts.size, dtype=bool)
        cached = self._shared_tokens(prompts)
        if self.run.config.share_prompts:
            _, first = np.unique(groups, return_index=True)
            is_first = np.zeros(prompts.size, dtype=bool)
            is_first[first] = True
            running = np.array([g in self.active_groups for g in groups.tolist()], dtype=bool)
            lead = ~((~is_first | running) & (cached > 0))
        for g in groups.tolist():
            self.active_groups[g] = self.active_groups.get(g, 0) + 1
        dt = 0.0
        if lead.any():
            p = prompts[lead]
            # a padded engine prefills every prompt at the longest one's length
            num = p.size * int(p.max()) if padded else int(p.sum())
            dt += cost.prefill_s(num, 0.0, int(p.size))
        if not lead.all():
            have, new = cached[~lead], prompts[~lead] - cached[~lead]
            ctx = have.size * int(have.max()) if padded else int(have.sum())
            if int(new.max()) == 1:
                dt += cost.decode_iter_s(int(have.size), float(ctx), 1)
            else:
                num = new.size * int(new.max()) if padded else int(new.sum())
                dt += cost.prefill_s(num, float(ctx), int(new.size))
        return dt

    def _shared_tokens(self, prompts: np.ndarray) -> np.ndarray:
        """Prompt tokens a follower reuses: whole blocks, short of the last token."""
        block = self.run.config.prefix_block_tokens
        return (prompts - 1) // block * block

    def _reprefill_context(self) -> float:
        """Context the SD switch re-prefills: the batch's, less the prompt pairs a group's other
        running responses take from its first one (tltrun's drafter re-prefill feeds them once)."""
        context = self.batch.cost_context()[0]
        if not self.run.config.share_prompts:
            return context
        block = self.run.config.prefix_block_tokens
        saved = sum(
            (n - 1) * ((int(self.group_prompt[g]) - 1) // block * block)
            for g, n in self.active_groups.items()
        )
        return max(float(self.batch.num_active), context - saved)

    def _sd_stats(self, decision, dt: float, num_iters: int, emitted: float, b: int) -> None:
        run = self.run
        if decision is not run.last_decision:  # hashing a dataclass per span is slow
            run.strategies_used.add(decision)
            run.last_decision = decision
        self.sd_s += dt
        self.sd_tokens += emitted
        self.sd_verifies += b * num_iters
        mean_len = emitted / (b * num_iters)
        if self.accept_len_ema == 0.0:
            self.accept_len_ema = mean_len
        else:
            w = 1.0 - (1.0 - ACCEPT_EMA_WEIGHT) ** num_iters
            self.accept_len_ema += w * (mean_len - self.accept_len_ema)

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
                batch.admit(self.prompt_tokens[sl], self.response_tokens[sl], self.ids[sl])
                self._charge(now, dt, "prefill", batch.num_active)
                yield env.timeout(pending + dt)
                pending = 0.0
                self._retire(env.now - run.t0)
                continue
            b = batch.num_active
            if b == 0:
                break
            obs = DecodeObs(
                now,
                run.step,
                self.index,
                b,
                num - next_queued,
                batch.context_tokens / b,
                self.accept_len_ema,
            )
            decision = policy.decide(obs)
            if decision.enabled and not self.is_sd_on:
                # SD switches on: rebuild the drafter's KV cache over the running requests.
                self.is_sd_on = True
                dt = run.reprefill_s(b, self._reprefill_context())
                self.reprefill_s += dt
                self._charge(now, dt, "reprefill", b)
                pending += dt
                continue  # ask again: the clock moved
            dt, num_iters, emitted = batch.advance(decision, run.hold_iters(obs, decision))
            run.feedback(obs, decision, emitted, dt, num_iters)
            self.decode_s += dt
            if decision.enabled:
                self._sd_stats(decision, dt, num_iters, emitted, b)
                self._charge(now, dt, "sd", b, decision)
            else:
                self._charge(now, dt, "decode", b)
            pending += dt
            # Nothing outside this instance can tell whether a span without a completion was
            # yielded on its own (instances only interact at completions and the barrier).
            if is_yield_each or batch.has_finished():
                yield env.timeout(pending)
                pending = 0.0
                self._retire(env.now - run.t0)
        if self.num_finished != num:
            raise AssertionError(
                f"step {run.step} instance {self.index}: {self.num_finished} of {num} responses finished"
            )
        self.finish_s = env.now - run.t0
        run.instance_done(self)
