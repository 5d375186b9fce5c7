"""The history drafter's view of one RL step in the simulator (issue #20): what the model-free
drafter of each request could copy from, as ``tltsim.sim.history_acceptance.HistoryModel`` keys it.

A request's history key is ``f + 2 h``: ``f`` the fraction of its group's siblings whose rollout
has finished where its drafter sees them (``HistoryModel.scope``: its own instance, as tltrun's
per-engine index, or the whole cluster), ``h`` whether earlier rollouts of its prompt are
indexed there (from earlier steps of the simulation). Replaying a measured run, a response
may carry its own measured rate instead (keys >= 4: ``4 + rate``). Each distinct key is one
accept-length distribution, kept for the step.

``tltsim.sim.instance.StepRun`` owns one per step; the instances report each completion
(``record_finished``) and their batches ask for keys and distributions (``tltsim.sim.batch``).
Tests: ``python -m pytest tests/test_history_sim.py -q``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tltsim.policy import SpecDecision
from tltsim.sim.batch import AcceptDist
from tltsim.sim.history_acceptance import HistoryModel, history_accept_len_pmf


class StepHistory:
    """Per prompt, its responses in the step; per scope (an instance, or -1 for the cluster),
    the finished responses per prompt and whether earlier rollouts of each prompt are indexed
    (asked of ``indexed(prompt_ids, scope)`` on first use)."""

    def __init__(
        self,
        model: HistoryModel,
        prompt_index: np.ndarray,
        prompt_ids: tuple[str, ...],
        *,
        rates: np.ndarray | None,
        indexed: Callable[[tuple[str, ...], int], np.ndarray],
    ):
        self.model = model
        self.prompt_index = prompt_index  # per response: its prompt (index in the step)
        self.prompt_ids = prompt_ids
        self.rates = rates  # per response, its measured history rate (nan: none), or None
        self._indexed = indexed
        self.group_sizes = np.bincount(prompt_index) if prompt_index.size else None
        self.finish_instance = np.full(prompt_index.size, -1)  # who finished each response
        self.num_done = 0
        self._finished: dict[int, tuple[int, np.ndarray]] = {}  # scope -> (num_done, counts)
        self._has_history: dict[int, np.ndarray] = {}
        self._dists: dict[tuple[SpecDecision, float], AcceptDist] = {}  # (decision, key)

    def record_finished(self, ids: np.ndarray, instance: int) -> None:
        """Responses ``ids`` finished on ``instance``: their tokens are indexed there now."""
        self.finish_instance[ids] = instance
        self.num_done += int(ids.size)

    def _scope(self, instance: int) -> int:
        return instance if self.model.scope == "instance" else -1

    def _finished_counts(self, scope: int) -> np.ndarray:
        """Finished responses per prompt that the history index of ``scope`` holds (-1: every
        instance's), recounted only after a completion."""
        cached = self._finished.get(scope)
        if cached is not None and cached[0] == self.num_done:
            return cached[1]
        done = self.finish_instance >= 0 if scope < 0 else self.finish_instance == scope
        counts = np.bincount(self.prompt_index[done], minlength=self.group_sizes.size)
        self._finished[scope] = (self.num_done, counts)
        return counts

    def keys(self, ids: np.ndarray, instance: int) -> np.ndarray:
        """Per request ``ids``: f + 2 h, f the fraction of its siblings finished where its
        drafter sees them, h whether earlier rollouts of its prompt are indexed there
        (``HistoryModel``). A finished sibling is one whose rollout ended (a request never
        counts itself: it is running)."""
        scope = self._scope(instance)
        groups = self.prompt_index[ids.astype(np.int64)]
        siblings = np.maximum(self.group_sizes[groups] - 1, 1)
        f = self._finished_counts(scope)[groups] / siblings
        has = self._has_history.get(scope)
        if has is None:
            has = self._has_history[scope] = self._indexed(self.prompt_ids, scope)
        return np.minimum(f, 1.0) + 2.0 * has[groups]

    def host_s(self, num_proposals: float, num_tokens: float) -> float:
        """Host seconds of the history drafter: proposals and indexing emitted tokens."""
        return (
            num_proposals * self.model.propose_s_per_seq + num_tokens * self.model.index_s_per_token
        )

    def dists(
        self, decision: SpecDecision, ids: np.ndarray, instance: int
    ) -> list[tuple[AcceptDist, np.ndarray]]:
        """(distribution, positions in ``ids`` that draw from it) per distinct history key (or,
        replaying a measured run, per response's own rate), kept for the step by
        (decision, key)."""
        keys = self.keys(ids, instance)
        if self.rates is not None:
            rates = self.rates[ids.astype(np.int64)]
            keys = np.where(np.isnan(rates), keys, 4.0 + rates)  # own rate: keys >= 4
        out = []
        for key in np.unique(keys).tolist():
            dist = self._dists.get((decision, key))
            if dist is None:
                if key >= 4.0:
                    pmf = history_accept_len_pmf(decision, key - 4.0, self.model.sibling_rate)
                else:
                    h = key >= 2.0
                    pmf = self.model.accept_len_pmf(decision, key - 2.0 * h, h)
                dist = self._dists[(decision, key)] = AcceptDist.of(pmf)
            out.append((dist, np.flatnonzero(keys == key)))
        return out
