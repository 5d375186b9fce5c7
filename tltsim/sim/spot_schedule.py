"""Spot drafter training in the simulator: idle instances train the drafter until rollout ends.

``tltsim.sim.simulator`` asks the trainer policy (``tltsim.policy.SpotTrainerPolicy``) for a
``TrainDecision`` each time an instance runs out of rollout work, recording ``(time, decision)``.
Once the rollout's end is known, ``spot_schedule`` turns those decisions into who trained when:

* a worker named by a decision starts training ``startup_s`` after it was first named in this
  rollout (loading the drafter and its optimizer state, joining the trainers' group);
* training is data parallel: each active worker adds ``tokens_per_s`` (one instance's drafter
  training throughput, from ``cost.drafter_train_s``) to the drafter's trained tokens;
* a decision allows at most ``max_updates`` updates of ``update_tokens`` per worker in the
  step, the updates earlier decisions of the step ran included (the policy's data cap, counted
  as tltrun's spot trainer counts drafter versions; each decision restarted it, which trained
  up to 2.5x the runtime's tokens); trainers stop early when it is used up;
* every trainer is preempted when the rollout ends (the barrier); a later decision replaces
  an earlier one (workers it does not name stop).

Run: not standalone; see ``tltsim.sim.simulator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tltsim.policy import TrainDecision


@dataclass(frozen=True, kw_only=True)
class TrainingSpan:
    """One worker's uninterrupted stretch of drafter training, rollout-relative seconds."""

    instance: int
    start_s: float
    end_s: float


@dataclass(kw_only=True)
class SpotOutcome:
    trained_s: np.ndarray  # per instance: seconds spent training the drafter
    segments: list[TrainingSpan]  # worker-major, in time order per worker
    tokens: int  # tokens the drafter trained on


def spot_schedule(
    decisions: list[tuple[float, TrainDecision]],
    num_instances: int,
    rollout_s: float,
    startup_s: float,
    tokens_per_s: float,
    update_tokens: int,
) -> SpotOutcome:
    """Who trained when, given the decisions (time-ordered) and the rollout's end.

    Decision k holds from t_k to e_k (the next decision or the rollout's end); worker w trains
    in it from b[k, w] = max(t_k, ready_w) while its tokens, rate x sum_w max(0, t - b[k, w])
    (piecewise linear, kinks at the sorted b[k, :]), stay below what its cap leaves after the
    step's earlier decisions.
    """
    decisions = [(t, d) for t, d in decisions if t < rollout_s]
    trained = np.zeros(num_instances)
    if not decisions or tokens_per_s <= 0:
        return SpotOutcome(trained_s=trained, segments=[], tokens=0)
    times = np.array([t for t, _ in decisions])  # (K,)
    ends = np.append(times[1:], rollout_s)  # (K,)
    member = np.zeros((len(decisions), num_instances), dtype=bool)  # (K, N)
    for k, (_, d) in enumerate(decisions):
        if d.is_training:
            member[k, list(d.workers)] = True
    named = member.any(axis=0)
    ready = np.where(named, times[member.argmax(axis=0)] + startup_s, np.inf)  # (N,)
    begin = np.minimum(np.maximum(times[:, None], ready[None, :]), ends[:, None])  # (K, N)
    starts = np.where(member, begin, np.inf)
    stop = ends.copy()
    done = 0.0  # updates the step's earlier decisions ran
    for k, (_, d) in enumerate(decisions):
        n = int(member[k].sum())
        if not n:
            continue
        cap = max(0.0, d.max_updates - done) * update_tokens * n  # tokens decision k allows
        row = _cap_times(starts[k : k + 1], ends[k : k + 1], np.array([cap]), tokens_per_s)
        stop[k] = min(ends[k], float(row[0]))
        done += (
            tokens_per_s
            * float(np.clip(stop[k] - begin[k], 0.0, None)[member[k]].sum())
            / (update_tokens * n)
        )
    dur = np.where(member, np.clip(stop[:, None] - begin, 0.0, None), 0.0)  # (K, N)
    trained = dur.sum(axis=0)
    return SpotOutcome(
        trained_s=trained,
        segments=_segments(begin, dur),
        tokens=round(tokens_per_s * float(trained.sum())),  # 189.99999 of a cap of 190 is 190
    )


def _cap_times(starts: np.ndarray, ends: np.ndarray, caps: np.ndarray, rate: float) -> np.ndarray:
    """Per row k: when rate x sum_i max(0, t - starts[k, i]) reaches caps[k] (inf where it
    does not before ends[k]); starts is inf where a worker is not in the decision."""
    s = np.sort(starts, axis=1)  # (K, N)
    valid = np.isfinite(s)
    csum = np.cumsum(np.where(valid, s, 0.0), axis=1)
    count = np.arange(1, s.shape[1] + 1)[None, :]  # trainers active after the i-th start
    nxt = np.minimum(
        np.concatenate((s[:, 1:], np.full((s.shape[0], 1), np.inf)), axis=1), ends[:, None]
    )
    reached = valid & (rate * (count * nxt - csum) >= caps[:, None])
    i = reached.argmax(axis=1)
    rows = np.arange(s.shape[0])
    t_cap = (caps / rate + csum[rows, i]) / count[0, i]
    return np.where(reached.any(axis=1), t_cap, np.inf)


def _segments(begin: np.ndarray, dur: np.ndarray) -> list[TrainingSpan]:
    """Training stretches per worker, joining a decision's stretch to the next decision's when
    it runs on without a break (worker-major order)."""
    b, d = begin.T, dur.T  # (N, K)
    end = b + d
    on = d > 0
    cont = np.zeros_like(on)
    cont[:, 1:] = on[:, 1:] & on[:, :-1] & (np.abs(end[:, :-1] - b[:, 1:]) < 1e-9)
    starts = on & ~cont
    ids = np.cumsum(starts.ravel()) - 1  # stretch of each (worker, decision) cell
    keep = on.ravel()
    seg_end = np.zeros(int(starts.sum()))
    np.maximum.at(seg_end, ids[keep], end.ravel()[keep])
    workers, decisions = np.nonzero(starts)
    return [
        TrainingSpan(instance=int(w), start_s=float(b[w, k]), end_s=float(e))
        for w, k, e in zip(workers, decisions, seg_end, strict=True)
    ]
