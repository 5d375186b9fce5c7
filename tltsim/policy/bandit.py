"""The BEG-MAB bandit of TLT's adaptive rollout engine (arXiv 2511.16665; fastrl's
``eagle_mab.py``): per batch-size bucket, an epsilon-greedy choice among its arms (SD strategies,
each with a drafter) by median reward per reward group. ``TLTAdaptive`` (``tltsim.policy.tlt``)
asks it once per decode iteration, or once per span in the simulator's fast mode. Standard
library only.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections import deque

from tltsim.policy.spec import SpecDecision
from tltsim.policy.tlt_config import TLTConfig

# Reward statistics are kept per fine batch-size group, as fastrl's MABGroupManager does
# (third-party/sglang/.../speculative/eagle_mab.py): 1..31, then steps of 8 to 120, then of 32 to 256.
REWARD_GROUPS = tuple(range(1, 32)) + tuple(range(32, 128, 8)) + tuple(range(128, 257, 32))


def bucket_arms(
    buckets: tuple[tuple[int, int | None, tuple[SpecDecision, ...]], ...], batch: int
) -> tuple[SpecDecision, ...]:
    """Arms of the bucket serving ``batch`` (``TLTConfig.buckets()`` format)."""
    for start, end, arms in buckets:
        if start <= batch and (end is None or batch <= end):
            return arms
    raise ValueError(f"batch must be >= 1, got {batch}")


def greedy_arm(arms: tuple[SpecDecision, ...], windows: list[deque[float]]) -> SpecDecision:
    """The arm with the highest median reward over its window (the first on ties)."""
    medians = [statistics.median(w) for w in windows]
    return arms[medians.index(max(medians))]


def greedy_hold(windows: list[deque[float]], greedy: int, maxlen: int) -> int:
    """The fewest rewards appended to arm ``greedy``'s window that could make another arm
    greedy: each worst case (-inf, and a full window dropping its largest value), so no
    rewards the arm really earns change the choice sooner. A driver that asks once per span
    re-asks then: the arm's own rewards during a span can end its greedy run (a drafter that
    drifted since its window filled), which a per-iteration driver sees at once."""
    if len(windows) < 2:
        return maxlen + 1
    # it stays greedy while its median beats the arms before it and ties those after it
    before = max((statistics.median(w) for w in windows[:greedy]), default=-math.inf)
    after = max((statistics.median(w) for w in windows[greedy + 1 :]), default=-math.inf)
    values = sorted(windows[greedy])
    n = len(values)

    def is_replaced(k: int) -> bool:  # k worst-case rewards appended: another arm is greedy
        kept = values[: n - max(0, n + k - maxlen)]  # a full window drops the largest
        merged = [-math.inf] * k + kept
        m = len(merged)
        median = (
            merged[m // 2] if m % 2 else (merged[m // 2 - 1] + merged[m // 2]) / 2
        )  # statistics.median's rule
        return median <= before or median < after

    lo, hi = 1, maxlen + 1  # is_replaced(maxlen + 1): every value is -inf
    while lo < hi:  # the smallest k with is_replaced(k) (monotone in k)
        mid = (lo + hi) // 2
        if is_replaced(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class BegMab:
    """Bucketed epsilon-greedy bandit (BEG-MAB) of one engine instance. The batch size picks the
    bucket (its arms); reward windows are kept per (reward group, arm). Selection: an arm with
    no reward yet first, else an exploration (a uniformly random arm) or the arm with the
    highest median reward over its window. A bucket with one arm needs no bandit (and draws no
    random number), as in fastrl; TLT's default strategies give one arm per bucket.

    Explorations come in blocks of ``TLTConfig.explore_iters`` iterations (1: fastrl's
    per-iteration draw). Instead of one draw per iteration, the bandit draws the number of
    greedy iterations before the next block, geometric with the per-block probability epsilon
    scaled by the block length (the same share epsilon of iterations explores). That is the
    same process for a driver that asks once per iteration and for one that asks once per
    span (the simulator's fast mode): ``hold_iters`` says how many iterations the last
    selection stands for, and ``advance`` counts the extra iterations a span ran."""

    def __init__(self, config: TLTConfig, rng: random.Random):
        self.config = config
        self.rng = rng
        self.buckets = config.buckets()
        self.rewards: dict[tuple[int, SpecDecision], deque[float]] = {}
        # greedy iterations before the next exploration (math.inf: never; None: not drawn yet)
        self.greedy_left: float | None = None
        self.explore_arm: SpecDecision | None = None  # the arm of the block under way
        self.explore_left = 0  # iterations of that block after the current one
        self.is_exploring = False  # whether the last selection was an exploration
        self.is_bandit = False  # whether the last selection had several arms to choose from
        self.is_trying = False  # whether the last selection was an arm's first try
        # the last greedy selection's reward windows and arm index: ``hold_iters`` derives
        # from them how long it may stand (only span drivers ask; a per-iteration one never)
        self._greedy: tuple[list[deque[float]], int] | None = None
        # whether this rollout may explore arms of a drafter other than the greedy arm's
        # (always under drafter_explore="iteration"; drawn per rollout under "rollout")
        self.is_drafter_round = True
        if self._is_rollout_exploring():
            self.start_rollout()

    def _is_rollout_exploring(self) -> bool:
        return self.config.drafter_explore == "rollout" and len(self.config.drafters) > 1

    def start_rollout(self) -> None:
        """A new rollout: under ``drafter_explore="rollout"``, draw whether it may explore the
        other drafter's arms (probability epsilon; a rollout that may not ends any exploration
        block the last one left under way). No draw otherwise (the stream stays fastrl's)."""
        if self._is_rollout_exploring():
            self.is_drafter_round = self.rng.random() < self.config.epsilon
            if not self.is_drafter_round:  # an exploration block does not run into it
                self.explore_arm, self.explore_left = None, 0

    def arms(self, batch: int) -> tuple[SpecDecision, ...]:
        return bucket_arms(self.buckets, batch)

    def _window(self, batch: int, arm: SpecDecision) -> deque[float]:
        group = REWARD_GROUPS[max(0, bisect.bisect_right(REWARD_GROUPS, batch) - 1)]
        key = (group, arm)
        if key not in self.rewards:
            self.rewards[key] = deque(maxlen=self.config.window)
        return self.rewards[key]

    def _draw_gap(self) -> float:
        """Greedy iterations before the next exploration block: blocks of ``b`` iterations
        explore with probability ``epsilon`` each, so ``b`` x Geometric(epsilon) failures."""
        eps, block = self.config.epsilon, self.config.explore_iters
        if eps <= 0.0:
            return math.inf  # never explores
        if eps >= 1.0:
            return 0
        u = 1.0 - self.rng.random()  # (0, 1]
        return block * int(math.log(u) / math.log1p(-eps))

    def select(self, batch: int) -> SpecDecision:
        arms = self.arms(batch)
        self.is_exploring = self.is_trying = False
        self.is_bandit = len(arms) > 1
        if len(arms) == 1:
            return arms[0]
        windows = [self._window(batch, arm) for arm in arms]
        for arm, window in zip(arms, windows, strict=True):
            if not window:
                self.is_trying = True
                return arm
        if self.explore_arm is not None and self.explore_left > 0 and self.explore_arm in arms:
            self.explore_left -= 1
            self.is_exploring = True
            return self.explore_arm
        self.explore_arm, self.explore_left = None, 0
        if self.greedy_left is None:
            self.greedy_left = self._draw_gap()
        if self.greedy_left <= 0:
            self.greedy_left = None
            explorable = arms
            if not self.is_drafter_round:  # this rollout explores the greedy drafter's arms only
                drafter = greedy_arm(arms, windows).drafter
                explorable = tuple(a for a in arms if a.drafter == drafter)
            self.explore_arm = self.rng.choice(explorable)
            self.explore_left = self.config.explore_iters - 1
            self.is_exploring = True
            return self.explore_arm
        self.greedy_left -= 1
        arm = greedy_arm(arms, windows)
        self._greedy = (windows, arms.index(arm))
        return arm

    def hold_iters(self) -> int | None:
        """Iterations the last selection stands for, counting its own, or None while nothing
        can change it (one arm). An exploration stands for its block; a greedy choice until
        the next exploration or until its own rewards could make another arm greedy
        (``greedy_hold``), whichever comes first."""
        if not self.is_bandit:
            return None
        if self.is_trying:  # one iteration: its reward may change the next selection
            return 1
        if self.is_exploring:
            return 1 + self.explore_left
        hold = greedy_hold(*self._greedy, self.config.window) if self._greedy else 1
        if self.greedy_left is None or self.greedy_left == math.inf:
            return hold
        return min(1 + int(self.greedy_left), hold)

    def advance(self, num_iters: int) -> None:
        """Count ``num_iters`` more iterations of the last selection (a span driver's extra)."""
        if num_iters <= 0 or not self.is_bandit or self.is_trying:
            return
        if self.is_exploring:
            self.explore_left = max(0, self.explore_left - num_iters)
        elif self.greedy_left is not None and self.greedy_left != math.inf:
            self.greedy_left = max(0, self.greedy_left - num_iters)

    def record(self, batch: int, arm: SpecDecision, reward: float, num_iters: int = 1) -> None:
        if arm in self.arms(batch):
            self._window(batch, arm).extend([reward] * min(num_iters, self.config.window))

    def state_dict(self) -> dict:
        """The reward windows, the random stream and the exploration under way as plain data
        (``TLTAdaptive.state_dict``)."""
        version, internal, gauss_next = self.rng.getstate()
        gap = self.greedy_left
        return {
            "rng": [version, list(internal), gauss_next],
            "rewards": [
                {"group": group, "strategy": arm.arm, "rewards": list(window)}
                for (group, arm), window in self.rewards.items()
            ],
            "greedy_left": None if gap is None else (-1 if gap == math.inf else gap),
            "explore_arm": None if self.explore_arm is None else self.explore_arm.arm,
            "explore_left": self.explore_left,
            "is_exploring": self.is_exploring,
            "is_bandit": self.is_bandit,
            "is_trying": self.is_trying,
            "is_drafter_round": self.is_drafter_round,
        }

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss_next = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss_next))
        self.rewards = {
            (e["group"], SpecDecision.parse(e["strategy"])): deque(
                e["rewards"], maxlen=self.config.window
            )
            for e in state["rewards"]
        }
        # states saved before exploration blocks existed carry none of these: nothing under way
        gap = state.get("greedy_left")
        self.greedy_left = math.inf if gap == -1 else gap
        arm = state.get("explore_arm")
        self.explore_arm = None if arm is None else SpecDecision.parse(arm)
        self.explore_left = state.get("explore_left", 0)
        self.is_exploring = state.get("is_exploring", False)
        self.is_bandit = state.get("is_bandit", False)
        self.is_trying = state.get("is_trying", False)
        self.is_drafter_round = state.get("is_drafter_round", True)
