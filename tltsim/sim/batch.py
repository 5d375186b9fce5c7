"""The running batch of one engine instance: how decode iterations move requests forward.

Two implementations behind one interface (``admit``, ``advance``, ``retire``), used by
``tltsim.sim.instance.InstanceRollout``:

* ``ExactBatch`` (``SimConfig.exact``): one iteration per call. Plain decoding emits one token
  per request; an SD iteration draws each request's accept length from the acceptance model and
  never passes its remaining tokens. Integer bookkeeping; the reference.
* ``FastBatch`` (default): advances to the next batch-composition change in one call. Accept
  lengths are i.i.d. per request and do not depend on who else is in the batch, so while the
  decision (strategy) stays the same each request's completion is fixed by the iteration at
  which it finishes. ``FastBatch`` samples that iteration once per request per decision
  ("epoch") and then moves from completion to completion with no random draws: a span of n
  iterations costs ``cost.decode_span_s`` / ``cost.sd_span_s`` in closed form, and a request in
  flight is credited its mean progress (its remaining tokens spread evenly over its remaining
  iterations: the mean of the random walk given where it ends). When the decision changes, every
  request's remaining tokens are taken at that mean and re-sampled under the new decision.

What a cost call is given as context (``cost_context``): the batch's summed context, or, for a
cost model of an engine whose attention pads the batch to its longest sequence
(``tltsim.cost.roofline.is_context_padded``), batch size x the longest context. FastBatch grows
the latter over a span at the longest request's mean rate (one token per iteration when SD is
off); ExactBatch recomputes it every iteration.

History-drafter decisions (``SpecDecision.drafter == "history"``, issue #20) cost the target's
verify alone (``verify_span_s``: no drafter forward) plus the drafter's host work per sequence
and emitted token (``tltsim.sim.history_acceptance.HistoryModel``), and each request's accept lengths
depend on its group's progress: FastBatch keeps every request's history key (finished-sibling
fraction and history flag, ``StepHistory.keys``) and re-samples the requests whose key
changed (a sibling finished) at the next span, as it does for all requests when the decision
changes.

Completion iterations (``sample_iterations``): exact first-passage draws (accept lengths summed
until they reach the remaining tokens) when a request needs at most ``MAX_EXACT_PASSAGE_ITERS``
iterations on average; beyond that the renewal-theory normal law
N = Normal((r + E[L(L-1)]/(2 mu)) / mu, r sigma^2 / mu^3) (the mean includes the stationary
overshoot of a lattice walk), clipped to [ceil(r / max L), ceil(r)].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tltsim.cost.roofline import is_context_padded
from tltsim.policy import OFF, SpecDecision

# From 16 expected iterations on, the normal law's mean and spread of N are within 2% / 10% of
# a brute-force walk (tests/test_sim_spec.py checks both paths); below, exact draws are cheap.
MAX_EXACT_PASSAGE_ITERS = 16


@dataclass(frozen=True)
class AcceptDist:
    """An accept-length distribution, P(L = i + 1) = pmf[i], with what sampling needs cached."""

    pmf: np.ndarray
    cdf: np.ndarray
    mean: float
    var: float

    @classmethod
    def of(cls, pmf: np.ndarray) -> AcceptDist:
        pmf = np.asarray(pmf, dtype=np.float64)
        lengths = np.arange(1, pmf.size + 1)
        mean = float(pmf @ lengths)
        var = max(0.0, float(pmf @ (lengths * lengths)) - mean * mean)
        return cls(pmf, np.cumsum(pmf), mean, var)

    @property
    def max_len(self) -> int:
        return int(self.pmf.size)

    def sample(self, rng: np.random.Generator, shape: int | tuple[int, ...]) -> np.ndarray:
        """Inverse-CDF draws, one uniform each (as ``tltsim.sim.acceptance.sample_accept_lengths``)."""
        lengths = np.searchsorted(self.cdf, rng.random(shape) * self.cdf[-1], side="right") + 1
        return np.minimum(lengths, self.pmf.size)


def verify_span_s(
    cost: Any, batch: int, context_tokens: float, verify_tokens: int, num_iters: int, growth: float
) -> float:
    """Seconds of ``num_iters`` target verifies of ``verify_tokens`` drafted nodes (plus the
    root) per request, no drafter forward, context growing by ``growth`` per iteration. The
    ``CostModel`` protocol has no verify-only span, but its SD iteration is ``draft_steps``
    drafter forwards plus one verify (``default_sd_iter_s``; ``RooflineCost`` and
    ``ProfileCost.sd_span_s`` alike), linear in draft_steps: two chains verifying the same v
    nodes with v and v + 1 draft steps differ by exactly one drafter span, so
    verify = (v + 1) S(v) - v S(v + 1)."""
    v = verify_tokens
    chain = SpecDecision(enabled=True, draft_steps=v, topk=1, verify_tokens=v)
    longer = SpecDecision(enabled=True, draft_steps=v + 1, topk=1, verify_tokens=v)
    span = cost.sd_span_s(batch, context_tokens, chain, num_iters, growth)
    longer_span = cost.sd_span_s(batch, context_tokens, longer, num_iters, growth)
    return max((v + 1) * span - v * longer_span, 0.0)


def iteration_s(cost: Any, batch: int, context_tokens: float, decision: SpecDecision) -> float:
    """One iteration's device seconds under ``decision``: ``cost.sd_iter_s``, or for a
    history-drafter decision the verify alone (the drafter's host work is not included)."""
    if decision.enabled and decision.drafter == "history":
        return cost.decode_iter_s(batch, context_tokens, decision.verify_tokens + 1)
    return cost.sd_iter_s(batch, context_tokens, decision)


def sample_iterations(rng: np.random.Generator, rem: np.ndarray, dist: AcceptDist) -> np.ndarray:
    """Iterations each request needs to emit ``rem`` (> 0, float) tokens at accept lengths drawn
    i.i.d. from ``dist`` (see the module docstring); int64, each >= 1."""
    out = np.empty(rem.size, dtype=np.int64)
    if rem.size == 0:
        return out
    mu, var, max_len = dist.mean, dist.var, dist.max_len
    if var == 0.0:  # one possible accept length: deterministic
        out[:] = np.ceil(rem / mu - 1e-9)
        return np.maximum(out, 1)
    short = rem <= MAX_EXACT_PASSAGE_ITERS * mu
    num_short = int(np.count_nonzero(short))
    if num_short == rem.size:
        return _first_passage(rng, rem, dist)
    if num_short:
        out[short] = _first_passage(rng, rem[short], dist)
    r = rem if num_short == 0 else rem[~short]
    overshoot = (var + mu * mu - mu) / (2.0 * mu)  # E[L(L-1)] / (2 mu)
    need = np.rint((r + overshoot) / mu + np.sqrt(r * (var / mu**3)) * rng.standard_normal(r.size))
    need = np.minimum(np.maximum(need, np.ceil(r / max_len)), np.ceil(r))
    if num_short == 0:
        return need.astype(np.int64)
    out[~short] = need
    return out


def _first_passage(rng: np.random.Generator, rem: np.ndarray, dist: AcceptDist) -> np.ndarray:
    """Exact draws: sum accept lengths per request until the sum reaches ``rem``."""
    need = np.zeros(rem.size, dtype=np.int64)
    cum = np.zeros(rem.size)
    todo = np.arange(rem.size)
    done_rows = 0
    while todo.size:
        rows = int(math.ceil(float((rem[todo] - cum[todo]).max()) / dist.mean * 1.25)) + 2
        block = np.cumsum(dist.sample(rng, (rows, todo.size)), axis=0) + cum[todo]  # (rows, k)
        reached = block >= rem[todo]
        hit = reached.any(axis=0)
        need[todo[hit]] = done_rows + np.argmax(reached[:, hit], axis=0) + 1
        cum[todo] = block[-1]
        todo = todo[~hit]
        done_rows += rows
    return need


# Columns of FastBatch.state (one float64 row per running request; integers are exact). KEY:
# the history key the request's FINISH was sampled under (0 unless the decision drafts history).
FINISH, RATE, FULL, ID, KEY = range(5)


class FastBatch:
    """Requests sorted by the iteration (of this instance's counter ``iters``) at which they
    finish; each advances ``rate`` tokens per iteration on average until then. One (n, 5)
    array holds the batch (columns FINISH, RATE, FULL = prompt + response tokens, ID, KEY), so
    a sort, an admission or a retirement is one numpy operation."""

    def __init__(self, run: Any, instance: int = 0):
        self.run = run
        self.instance = instance  # the engine instance (whose history index a request sees)
        self.iters = 0  # iterations this instance has run in this rollout
        self.state = np.empty((0, 5))
        self.decision: SpecDecision = OFF  # what FINISH was sampled under
        self.context_tokens = 0.0
        self.tokens = 0.0  # generated, as the sum of per-span mean progress
        # Python scalars mirroring the array: the per-span path touches no numpy.
        self.num_active = 0
        self.next_finish = 0  # state[0, FINISH]
        self.rate_sum = 0.0  # tokens per iteration over the batch
        self.is_padded = is_context_padded(run.cost)

    def cost_context(self) -> tuple[float, float]:
        """(context of the cost calls, its growth per iteration): the summed context growing
        at ``rate_sum``, or (padded engines) batch x the longest context growing at batch x
        the longest request's rate."""
        if not self.is_padded or self.num_active == 0:
            return self.context_tokens, self.rate_sum
        state = self.state
        context = state[:, FULL] - self.remaining()
        i = int(np.argmax(context))
        b = self.num_active
        return b * float(context[i]), b * float(state[i, RATE])

    def _schedule(
        self, rem: np.ndarray, decision: SpecDecision, ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Finish iterations and per-iteration rates for requests ``ids`` with ``rem`` tokens
        to go."""
        if decision.enabled:
            n = np.zeros(rem.size, dtype=np.int64)
            for dist, rows in self.run.request_dists(decision, ids, self.instance):
                rows = np.flatnonzero(rem > 0) if rows is None else rows[rem[rows] > 0]
                # (responses of one token finished at prefill: 0 iterations)
                n[rows] = sample_iterations(self.run.rng, rem[rows], dist)
        else:
            n = np.ceil(rem - 1e-9).astype(np.int64)  # one token per iteration
        rate = np.divide(rem, n, out=np.zeros(rem.size), where=n > 0)
        return self.iters + n, rate

    def _sort(self) -> None:
        self.state = self.state[np.argsort(self.state[:, FINISH], kind="stable")]
        self.num_active = int(self.state.shape[0])
        self.next_finish = int(self.state[0, FINISH]) if self.num_active else 0
        self.rate_sum = float(self.state[:, RATE].sum())

    def admit(self, prompt: np.ndarray, response: np.ndarray, ids: np.ndarray) -> None:
        """Prefilled requests join; prefill already emitted each one's first token."""
        finish, rate = self._schedule((response - 1).astype(np.float64), self.decision, ids)
        rows = np.column_stack((finish, rate, prompt + response, ids, self._keys(ids)))
        self.state = np.concatenate((self.state, rows))
        self._sort()
        self.context_tokens += float(prompt.sum() + prompt.size)
        self.tokens += prompt.size

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        """History keys of requests ``ids`` under the current decision (0 unless it drafts
        from the history)."""
        if not (self.decision.enabled and self.decision.drafter == "history"):
            return np.zeros(ids.size)
        return self.run.history.keys(ids, self.instance)

    def remaining(self) -> np.ndarray:
        return (self.state[:, FINISH] - self.iters) * self.state[:, RATE]

    def contexts(self) -> tuple[np.ndarray, np.ndarray]:
        """(each running request's context: prompt + tokens so far, its response id)."""
        return self.state[:, FULL] - self.remaining(), self.state[:, ID].astype(np.int64)

    def advance(self, decision: SpecDecision, hold: int | None) -> tuple[float, int, float]:
        """Run until the next completion (or ``hold`` iterations): (seconds, iterations, tokens)."""
        if decision is not self.decision and decision != self.decision:
            self.decision = decision
            finish, rate = self._schedule(self.remaining(), decision, self.state[:, ID])
            self.state[:, FINISH], self.state[:, RATE] = finish, rate
            self.state[:, KEY] = self._keys(self.state[:, ID])
            self._sort()
        elif decision.enabled and decision.drafter == "history" and self.num_active:
            # A sibling finished since these requests were scheduled: their acceptance changed.
            keys = self._keys(self.state[:, ID])
            moved = np.flatnonzero(keys != self.state[:, KEY])
            if moved.size:
                rem = self.remaining()[moved]
                finish, rate = self._schedule(rem, decision, self.state[moved, ID])
                self.state[moved, FINISH], self.state[moved, RATE] = finish, rate
                self.state[moved, KEY] = keys[moved]
                self._sort()
        n = self.next_finish - self.iters
        if hold is not None:
            n = min(n, hold)
        n = max(n, 1)
        growth = self.rate_sum
        cost, b = self.run.cost, self.num_active
        context, context_growth = self.cost_context()
        if decision.enabled and decision.drafter == "history":
            dt = verify_span_s(cost, b, context, decision.verify_tokens, n, context_growth)
            dt += self.run.history.host_s(b * n, n * growth)
        elif decision.enabled:
            dt = cost.sd_span_s(b, context, decision, n, context_growth)
        elif n == 1:  # warm-up checks and other one-iteration holds
            dt = cost.decode_iter_s(b, context, 1)
        else:
            dt = cost.decode_span_s(b, context, n)
        self.iters += n
        self.context_tokens += n * growth
        self.tokens += n * growth
        return dt, n, n * growth

    def has_finished(self) -> bool:
        return self.num_active > 0 and self.next_finish <= self.iters

    def retire(self) -> np.ndarray:
        """Remove and return the ids of requests whose finish iteration has come."""
        state = self.state
        if not self.has_finished():
            return np.empty(0, dtype=np.int64)
        if self.num_active == 1 or state[1, FINISH] > self.iters:  # the common case
            cnt, full, rate = 1, float(state[0, FULL]), float(state[0, RATE])
        else:
            cnt = int(np.searchsorted(state[:, FINISH], self.iters, side="right"))
            full, rate = float(state[:cnt, FULL].sum()), float(state[:cnt, RATE].sum())
        done = state[:cnt, ID].astype(np.int64)
        # A finished request's context is its full length (prompt + response).
        self.context_tokens = max(0.0, self.context_tokens - full)
        self.rate_sum = max(0.0, self.rate_sum - rate)
        self.state = state[cnt:]
        self.num_active -= cnt
        self.next_finish = int(self.state[0, FINISH]) if self.num_active else 0
        return done


class ExactBatch:
    """Integer remaining tokens per request; one iteration per ``advance``."""

    def __init__(self, run: Any, instance: int = 0):
        self.run = run
        self.instance = instance  # the engine instance (whose history index a request sees)
        self.rem = np.empty(0, dtype=np.int64)
        self.ids = np.empty(0, dtype=np.int64)
        self.context_tokens = 0
        self.tokens = 0
        self.full = np.empty(0, dtype=np.int64)
        self.is_padded = is_context_padded(run.cost)

    @property
    def num_active(self) -> int:
        return int(self.rem.size)

    def cost_context(self) -> tuple[float, float]:
        """(context of the cost calls, 0): summed, or batch x the longest (padded engines)."""
        if not self.is_padded or self.rem.size == 0:
            return float(self.context_tokens), 0.0
        return float(self.rem.size * int((self.full - self.rem).max())), 0.0

    def contexts(self) -> tuple[np.ndarray, np.ndarray]:
        """(each running request's context: prompt + tokens so far, its response id)."""
        return (self.full - self.rem).astype(np.float64), self.ids

    def admit(self, prompt: np.ndarray, response: np.ndarray, ids: np.ndarray) -> None:
        self.rem = np.concatenate((self.rem, response - 1))
        self.full = np.concatenate((self.full, prompt + response))
        self.ids = np.concatenate((self.ids, ids))
        self.context_tokens += int(prompt.sum()) + int(prompt.size)
        self.tokens += int(prompt.size)

    def advance(self, decision: SpecDecision, hold: int | None) -> tuple[float, int, float]:
        cost, b = self.run.cost, self.num_active
        context = self.cost_context()[0]
        if decision.enabled:
            dt = iteration_s(cost, b, context, decision)
            adv = np.empty(b, dtype=self.rem.dtype)
            for dist, rows in self.run.request_dists(decision, self.ids, self.instance):
                if rows is None:
                    adv[:] = dist.sample(self.run.rng, b)
                else:
                    adv[rows] = dist.sample(self.run.rng, rows.size)
            adv = np.minimum(adv, self.rem)
            emitted = int(adv.sum())
            self.rem -= adv
            if decision.drafter == "history":
                dt += self.run.history.host_s(b, emitted)
        else:
            dt = cost.decode_iter_s(b, context, 1)
            emitted = b
            self.rem -= 1
        self.context_tokens += emitted
        self.tokens += emitted
        return dt, 1, float(emitted)

    def has_finished(self) -> bool:
        return bool((self.rem == 0).any())

    def retire(self) -> np.ndarray:
        done = self.rem == 0
        if not done.any():
            return self.ids[:0]
        keep = ~done
        finished = self.ids[done]
        full = int(self.full[done].sum())
        self.context_tokens -= full
        self.rem, self.full, self.ids = self.rem[keep], self.full[keep], self.ids[keep]
        return finished
