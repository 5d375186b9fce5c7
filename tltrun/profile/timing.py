"""How ``tltrun profile`` times a point: ``Series`` (one timed quantity) and ``Measure`` (warm-up,
interleaved rounds, and the row's statistic), shared by both rollout backends and the trainer ops.

The profile's ops and grid are ``tltrun.profile.measure``'s; the torch and vLLM rollout ops
(``tltrun.profile.torch_engine``, ``tltrun.profile.vllm_engine``) build ``Series`` and hand them
to ``Measure.interleaved``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tltsim.cost.profile import ProfileRow
from tltsim.errors import InputWarning

STATISTICS = ("median", "mean")
# "wall": elapsed seconds. "cpu": this process's CPU seconds, which on a machine shared with
# other jobs leave out the time spent waiting for a core: with one torch thread it is what the
# work takes on a core of its own. The run to predict must use the same clock (the torch engine
# takes one: RolloutEngine(clock=...)); vLLM computes in a worker process, so wall only.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class Series:
    """One timed quantity: ``fn`` is timed; ``reset`` (untimed) follows every call so that each
    starts from the same state; ``setup`` (untimed) prepares it whenever its turn comes."""

    key: tuple
    fn: Callable[[], Any]
    reset: Callable[[], None] = lambda: None
    setup: Callable[[], None] = lambda: None
    # False: warm-up calls in the first round only (and one where another op ran before it:
    # Measure._num_warmup)
    is_warmed_each_round: bool = True
    # Timed calls per sample, back to back (``reset`` between them untimed); the sample is
    # their mean. > 1 for ops a rollout runs back to back (``ProfileRunConfig.back_to_back_calls``).
    num_calls: int = 1


@dataclass
class Interruption:
    """Set by ``Measure.interleaved`` when Ctrl-C (SIGINT; ``tltrun profile`` turns SIGTERM into
    it too) ends a measurement after at least one complete round: what it returned are the
    completed rounds' samples, which the caller writes before it stops."""

    is_set: bool = False


@dataclass(frozen=True)
class Measure:
    """How every point is timed and summarised (shared by the backends)."""

    num_warmup: int
    num_repeats: int
    statistic: str
    clock: str = "wall"
    # time.perf_counter() after which no further round starts (each series keeps the rounds it
    # completed, at least one): a profile under a time limit ends with fewer samples, not none
    deadline: float | None = None
    # where an interrupted measurement says so (None: Ctrl-C propagates as it comes)
    interruption: Interruption | None = None

    def samples(
        self,
        fn: Callable[[], Any],
        reset: Callable[[], None] = lambda: None,
        sync: Callable[[], None] = lambda: None,
    ) -> np.ndarray:
        """Seconds of ``num_repeats`` consecutive calls of ``fn`` after ``num_warmup`` untimed
        ones, ``reset`` after each."""
        return self.interleaved([Series((), fn, reset, is_warmed_each_round=False)], sync)[()]

    def interleaved(
        self,
        series: list[Series],
        sync: Callable[[], None] = lambda: None,
        progress: Callable[[str], None] = lambda what: None,
        between_rounds: Callable[[int], None] = lambda r: None,
        between_series: Callable[[int, int, int], None] | None = None,
        on_round: Callable[[dict[tuple, np.ndarray]], None] = lambda timed: None,
    ) -> dict[tuple, np.ndarray]:
        """``num_repeats`` rounds; in each, every series is set up, warmed up (``num_warmup``
        untimed calls) and timed once. Rounds spread each point's samples over the whole
        measurement, so a slow or fast spell of a shared machine (other jobs' load changes
        over minutes) reaches every point alike instead of a few neighbours on the grid.
        ``between_rounds(r)`` runs after round r, ``between_series(r, i, n)`` after series i
        of the n in round r (a benchmark interleaves its measured run, coarse or fine).
        ``on_round(timed)`` gets the samples of the rounds completed so far after each round
        (the caller writes them, so a killed run keeps them)."""
        out: dict[tuple, list[float]] = {s.key: [] for s in series}
        num_done = 0  # complete rounds
        try:
            for r in range(self.num_repeats):
                self._round(r, series, out, sync, progress, between_series)
                num_done = r + 1
                on_round({key: np.asarray(v[:num_done]) for key, v in out.items()})
                between_rounds(r)
                if self.deadline is not None and time.perf_counter() > self.deadline:
                    if r + 1 < self.num_repeats:
                        progress(f"time budget: {r + 1} of {self.num_repeats} rounds")
                    break
        except KeyboardInterrupt:
            if num_done == 0 or self.interruption is None:
                raise
            self.interruption.is_set = True  # the interrupted round's samples are dropped
        return {key: np.asarray(v[:num_done]) for key, v in out.items()}

    def _round(self, r: int, series, out, sync, progress, between_series) -> None:
        """Round ``r``: every series set up, warmed up where due and timed once."""
        clock = CLOCKS[self.clock]
        progress(f"round {r + 1}/{self.num_repeats}")
        for i, s in enumerate(series):
            s.setup()
            for _ in range(self._num_warmup(r, series, i)):
                s.fn()
                sync()
                s.reset()
            total = 0.0
            for _ in range(s.num_calls):
                start = clock()
                s.fn()
                sync()
                total += clock() - start
                s.reset()
            out[s.key].append(total / s.num_calls)
            if between_series is not None:
                between_series(r, i, len(series))

    def _num_warmup(self, r: int, series: list[Series], i: int) -> int:
        """Untimed calls before series ``i``'s timed one in round ``r``. A series not warmed
        each round (an actor update: warm-ups would triple the profile's time) still gets one
        in later rounds where it opens the round (after the caller's per-round write) or
        follows another op: its first call there read a few % high (CPU, session 32's hunt)."""
        s = series[i]
        if r == 0 or s.is_warmed_each_round:
            return self.num_warmup
        is_after_other = len(series) > 1 and (i == 0 or series[i - 1].key[:1] != s.key[:1])
        return min(1, self.num_warmup) if is_after_other else 0

    def row(self, op: str, batch: int, context: int, tokens_per_seq: int, samples) -> ProfileRow:
        """The statistic and the 10th / 90th percentiles (numpy's linear interpolation) of
        ``samples``; a mean outside [p10, p90] (a few extreme outliers) is clipped into it."""
        s = np.asarray(samples, dtype=np.float64)
        p10, p50, p90 = (max(float(v), 1e-9) for v in np.percentile(s, [10, 50, 90]))
        value = p50 if self.statistic == "median" else min(max(float(s.mean()), p10), p90)
        return ProfileRow(op, batch, context, tokens_per_seq, value, p10, p90, int(s.size))


def warn_if_floored(
    what: str, draft_steps: int, step_s: float, verify_s: float, it_s: float
) -> None:
    """One warning where a verify row, ``it - draft_steps x drafter`` floored at 10% of the
    iteration, makes ``draft_steps x drafter + verify`` exceed the iteration measured (noise in
    the drafter's or the iteration's samples): the profile then charges more than it timed."""
    if draft_steps * step_s + verify_s > 1.05 * it_s:
        warnings.warn(
            f"{what}: {draft_steps} x drafter {1e3 * step_s:.3g} ms is most of the measured "
            f"iteration ({1e3 * it_s:.3g} ms); its verify row is floored at 10% of the "
            "iteration, so the profile charges more than was measured (a noisy point: more "
            "--num-repeats)",
            InputWarning,
            stacklevel=3,
        )
