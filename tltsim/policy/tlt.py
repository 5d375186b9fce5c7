"""``TLTAdaptive``: SD only in the long tail of a rollout, with the strategy per batch-size
bucket chosen by the BEG-MAB bandit (TLT, arXiv 2511.16665); its arms may pair strategies with
the learned or the history drafter (``TLTConfig.drafters``, issue #20). ``TLTBase``: the same
switch with the history drafter only. Standard library only.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field, replace

from tltsim.policy.spec import DRAFTERS, OFF, DecodeObs, SpecDecision, SpecFeedback, SpecPolicy

# TLTConfig.drafter_explore: explore other-drafter arms per iteration (fastrl) or per rollout
DRAFTER_EXPLORE = ("iteration", "rollout")

# Reward statistics are kept per fine batch-size group, as fastrl's MABGroupManager does
# (third-party/sglang/.../speculative/eagle_mab.py): 1..31, then steps of 8 to 120, then of 32 to 256.
REWARD_GROUPS = tuple(range(1, 32)) + tuple(range(32, 128, 8)) + tuple(range(128, 257, 32))


@dataclass(frozen=True)
class TLTConfig:
    """TLTAdaptive settings. Defaults are TLT's public configuration (mit-han-lab/fastrl:
    verl/trainer/config/fastrl_trainer.yaml and the patched SGLang it ships)."""

    # speculative.bs_threshold
    threshold: int = field(
        default=32, metadata={"help": "SD stays off while an instance has more active requests"}
    )
    # eagle_worker.py adaptive_spec_warmup_checks
    warmup_checks: int = field(
        default=10,
        metadata={"help": "consecutive iterations at or below the threshold before SD turns on"},
    )
    # spec_steps/topk/verify_tokens 8/4/48 plus mab_configs 8_4_32, 8_4_16, 8_4_8
    strategies: tuple[str, ...] = field(
        default=("8_4_48", "8_4_32", "8_4_16", "8_4_8"),
        metadata={
            "help": "bandit arms DRAFTSTEPS_TOPK_VERIFYTOKENS, one verify-tokens value per "
            "bucket (the most verify tokens serve the smallest batches)"
        },
    )
    # mab_bs_threshold
    bucket_starts: tuple[int, ...] = field(
        default=(1, 2, 5, 21),
        metadata={"help": "smallest batch size of each bandit bucket (increasing, from 1)"},
    )
    # EpsilonGreedyMAB / BucketedEpsilonGreedyMAB default
    epsilon: float = field(
        default=0.1, metadata={"help": "probability of a random arm instead of the best one"}
    )
    # 1 = fastrl's per-iteration exploration. Ours (issue #20): exploring per iteration is free
    # between strategies of one drafter (they share its KV cache) but not always between
    # drafters: an EAGLE try after history iterations pays the drafter's catch-up on the pairs it
    # missed, and its first in a rollout a re-prefill of the running requests. With blocks of b
    # iterations, one block follows b x Geometric(epsilon) greedy iterations: the same share
    # epsilon of iterations explores, b times fewer switches. Whether that pays depends on what
    # a drafter forward costs beyond its tokens (README, history-drafter section: on the CPU
    # bench it does, on the simulator's H100 roofline it does not), so the default stays fastrl's.
    explore_iters: int = field(
        default=1,
        metadata={"help": "iterations an exploration holds its random arm (1: per iteration)"},
    )
    # issue #20: when the bandit may explore an arm of the other drafter. fastrl's bandit has one
    # drafter, so its per-iteration epsilon-greedy explores strategies that share a KV cache for
    # free. Across drafters an exploration is not free: the first EAGLE try in a rollout pays the
    # drafter's re-prefill of the running requests and each later one its catch-up on what
    # history iterations emitted (hanoi, README issue #20 row: at fastrl's epsilon the mix
    # re-prefilled the drafter in nearly every rollout and ran ~5% behind the history drafter
    # alone). "iteration" keeps fastrl's rule for every arm; "rollout" lets a rollout explore the
    # other drafter's arms with probability epsilon, drawn per instance at the rollout's start
    # (strategies of the greedy arm's drafter stay explored per iteration): the switching cost
    # is paid in about an epsilon share of rollouts rather than in nearly all, and the windows
    # still see every arm.
    drafter_explore: str = field(
        default="iteration",
        metadata={
            "help": "when other-drafter arms are explored: iteration (fastrl's epsilon per "
            "iteration, every arm) or rollout (a rollout explores them with probability epsilon)"
        },
    )
    # server_args speculative_mab_window_size
    window: int = field(
        default=300, metadata={"help": "rewards kept per arm and batch-size group (median window)"}
    )
    # issue #20: the bandit's arms are (drafter, strategy) pairs, every strategy of a bucket with
    # every drafter listed here (the first drafter's first strategy is the bucket default)
    drafters: tuple[str, ...] = field(
        default=("eagle",),
        metadata={
            "help": "drafters the bandit chooses between per bucket: eagle (learned), "
            "history (model-free n-gram/suffix)"
        },
    )

    # issue #20: the history drafter's own arms. A history draft costs no drafter forward, and
    # the torch engine verifies only as far as the batch's longest real proposal (README,
    # history drafter), so the case for shorter chains at larger batches (fastrl's buckets,
    # each EAGLE draft step a drafter forward) holds only for the verify: on hanoi's step-0
    # rollouts a lockstep replay of the history drafter gave 2.67 / 3.66 / 5.20 tokens per
    # verify with chains of 2 / 4 / 8 (README, bench_history row), so pairing it with 2_1_2 at
    # a worker's 5-8 responses leaves most of its matches unverified. On a CPU that did not pay
    # (verify costs about what the longer match earns; README, history drafter), so () keeps
    # the pairing.
    history_strategies: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "the history drafter's arms in every bucket (default: each bucket's "
            "strategies, as the learned drafter's)"
        },
    )

    def __post_init__(self) -> None:
        if self.threshold < 1 or self.warmup_checks < 1 or self.window < 1:
            raise ValueError(
                f"TLTConfig: threshold, warmup_checks and window must be >= 1, got {self.threshold}, {self.warmup_checks}, {self.window}"
            )
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"TLTConfig: epsilon must be in [0, 1], got {self.epsilon}")
        if (
            isinstance(self.explore_iters, bool)
            or not isinstance(self.explore_iters, int)
            or self.explore_iters < 1
        ):
            raise ValueError(
                f"TLTConfig: explore_iters must be an integer >= 1, got {self.explore_iters!r}"
            )
        if self.drafter_explore not in DRAFTER_EXPLORE:
            raise ValueError(
                f"TLTConfig: drafter_explore must be one of {', '.join(DRAFTER_EXPLORE)}, got {self.drafter_explore!r}"
            )
        starts = self.bucket_starts
        if (
            not starts
            or starts[0] != 1
            or any(b <= a for a, b in zip(starts, starts[1:], strict=False))
        ):
            raise ValueError(
                f"TLTConfig: bucket_starts must be increasing and start at 1, got {starts}"
            )
        bad = [d for d in self.drafters if d not in DRAFTERS]
        if bad or not self.drafters or len(set(self.drafters)) != len(self.drafters):
            raise ValueError(
                f"TLTConfig: drafters must be distinct names among {', '.join(DRAFTERS)}, got {self.drafters}"
            )
        decisions = [SpecDecision.parse(s) for s in self.strategies]
        if not all(d.enabled for d in decisions):
            raise ValueError("TLTConfig: every strategy must enable SD ('off' is not an arm)")
        if any(":" in s for s in self.strategies):
            raise ValueError(
                f"TLTConfig: strategies name no drafter (got {self.strategies}); list drafters in 'drafters'"
            )
        history = [SpecDecision.parse(s) for s in self.history_strategies]
        if self.history_strategies and "history" not in self.drafters:
            raise ValueError(
                f"TLTConfig: history_strategies {self.history_strategies} need 'history' among the drafters, got {self.drafters}"
            )
        if not all(d.enabled for d in history) or any(":" in s for s in self.history_strategies):
            raise ValueError(
                f"TLTConfig: history_strategies must be strategies without a drafter name, 'off' excluded, got {self.history_strategies}"
            )
        if len(set(history)) != len(history):
            raise ValueError(
                f"TLTConfig: history_strategies must be distinct, got {self.history_strategies}"
            )
        if len({d.verify_tokens for d in decisions}) != len(starts):
            raise ValueError(
                f"TLTConfig: {len(starts)} buckets need as many distinct verify_tokens values among the strategies, got {self.strategies}"
            )

    def buckets(self) -> tuple[tuple[int, int | None, tuple[SpecDecision, ...]], ...]:
        """(min_batch, max_batch or None for no cap, arms). As in fastrl's BEG: strategies are
        grouped by verify_tokens, the group with the most verify tokens serving the smallest
        batches; arms keep the order given in ``strategies`` (the first is the bucket default),
        each strategy with every drafter in ``drafters`` order (drafter-major), except that the
        history drafter's arms are ``history_strategies`` in every bucket where those are given."""
        decisions = [SpecDecision.parse(s) for s in self.strategies]
        history = tuple(SpecDecision.parse(s) for s in self.history_strategies)
        tokens = sorted({d.verify_tokens for d in decisions}, reverse=True)
        ends = [s - 1 for s in self.bucket_starts[1:]] + [None]

        def drafter_arms(drafter: str, v: int) -> tuple[SpecDecision, ...]:
            if drafter == "history" and history:
                chosen = history
            else:
                chosen = tuple(d for d in decisions if d.verify_tokens == v)
            return tuple(replace(d, drafter=drafter) for d in chosen)

        return tuple(
            (start, end, tuple(a for drafter in self.drafters for a in drafter_arms(drafter, v)))
            for start, end, v in zip(self.bucket_starts, ends, tokens, strict=True)
        )


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
        return greedy_arm(arms, windows)

    def hold_iters(self) -> int | None:
        """Iterations the last selection stands for, counting its own, or None while nothing
        the bandit draws can change it (one arm, or no exploration to come)."""
        if not self.is_bandit:
            return None
        if self.is_trying:  # one iteration: its reward may change the next selection
            return 1
        if self.is_exploring:
            return 1 + self.explore_left
        if self.greedy_left is None or self.greedy_left == math.inf:
            return None
        return 1 + self.greedy_left

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


@dataclass
class _InstanceSwitch:
    """Per-instance SD switch of one rollout (reset by start_rollout)."""

    checks: int = 0  # consecutive decide() calls with num_active <= threshold
    is_on: bool = False
    switch_s: float | None = None  # DecodeObs.now_s when SD switched on


class TLTAdaptive(SpecPolicy):
    """TLT's adaptive rollout engine (arXiv 2511.16665; fastrl ``EAGLEWorker.should_enable_sd``).

    Per instance: SD is off while ``num_active > threshold``; once ``num_active <= threshold`` has
    held for ``warmup_checks`` consecutive decide() calls it switches on and stays on for the rest
    of that rollout (long-tail batches only shrink). fastrl runs the switching iteration without
    SD and requeues the batch to re-prefill the drafter; here SD is on from that iteration and the
    driver charges the re-prefill (``CostModel.sd_switch_s``) before it.

    The strategy comes from the instance's ``BegMab``. Reward = accepted tokens x batch size /
    iteration seconds with accepted tokens PER REQUEST (fastrl: mean accept length incl. the
    bonus token x batch / time), i.e. batch-total tokens per second; ``SpecFeedback`` carries
    the batch total, so reward = accepted_tokens / iteration_s. (fastrl smooths the accept length
    with its median across batch groups; we use the measured one.) Bandit statistics persist
    across rollouts (fastrl keeps its MAB manager for the engine's lifetime); the switch resets.
    """

    name = "tlt"

    def __init__(
        self,
        seed: int = 0,
        rng: random.Random | None = None,
        config: TLTConfig | None = None,
        **settings,
    ):
        if config is not None and settings:
            raise ValueError("TLTAdaptive: pass either a TLTConfig or its fields, not both")
        self.config = config or TLTConfig(**settings)
        self.seed = seed
        # One stream per instance, so an instance's choices do not depend on the order in which
        # a driver interleaves instances; a shared ``rng`` may be passed instead.
        self._shared_rng = rng
        self._bandits: dict[int, BegMab] = {}
        self._switches: dict[int, _InstanceSwitch] = {}

    def _bandit(self, instance: int) -> BegMab:
        if instance not in self._bandits:
            rng = self._shared_rng or random.Random(f"tlt:{self.seed}:{instance}")
            self._bandits[instance] = BegMab(self.config, rng)
        return self._bandits[instance]

    def _switch(self, instance: int) -> _InstanceSwitch:
        return self._switches.setdefault(instance, _InstanceSwitch())

    def start_rollout(self, step: int) -> None:
        self._switches.clear()
        for bandit in self._bandits.values():
            bandit.start_rollout()

    def decide(self, obs: DecodeObs) -> SpecDecision:
        if obs.num_active < 1:
            return OFF
        sw = self._switch(obs.instance)
        if not sw.is_on:
            sw.checks = sw.checks + 1 if obs.num_active <= self.config.threshold else 0
            if sw.checks < self.config.warmup_checks:
                return OFF
            sw.is_on, sw.switch_s = True, obs.now_s
        return self._bandit(obs.instance).select(obs.num_active)

    def max_hold_iters(self, obs: DecodeObs, decision: SpecDecision) -> int | None:
        """For drivers that ask once per span of iterations: during the warm-up every iteration
        is a check, so an OFF decision may stand for the checks still missing (``observe`` counts
        the span's ``num_iters`` as that many checks, so the switch lands on the same iteration
        as with a per-iteration driver); an SD decision of a bucket with several arms stands
        until the bandit's next exploration block starts or the one under way ends
        (``BegMab.hold_iters``; ``observe`` advances the schedule likewise); otherwise it stands
        until the batch changes."""
        sw = self._switches.get(obs.instance)
        is_warming = sw is not None and not sw.is_on and obs.num_active <= self.config.threshold
        if is_warming:
            return max(1, self.config.warmup_checks - sw.checks)
        if decision.enabled and obs.instance in self._bandits:
            return self._bandits[obs.instance].hold_iters()
        return None

    def observe(self, feedback: SpecFeedback) -> None:
        sw = self._switches.get(feedback.instance)
        if (
            sw is not None
            and not sw.is_on
            and not feedback.decision.enabled
            and 1 <= feedback.num_active <= self.config.threshold
        ):
            # A span of num_iters OFF iterations is num_iters checks; decide() counted the first.
            sw.checks += feedback.num_iters - 1
        if feedback.decision.enabled and feedback.instance in self._bandits:
            # likewise a span of num_iters SD iterations advances the exploration schedule
            self._bandits[feedback.instance].advance(feedback.num_iters - 1)
        if not feedback.decision.enabled or feedback.iteration_s <= 0 or feedback.num_active < 1:
            return
        reward = feedback.accepted_tokens / feedback.iteration_s
        self._bandit(feedback.instance).record(
            feedback.num_active, feedback.decision, reward, feedback.num_iters
        )

    def switched_on(self, instance: int) -> bool:
        """Whether SD is on for ``instance`` in the current rollout (the "SD switch" marker)."""
        sw = self._switches.get(instance)
        return sw is not None and sw.is_on

    def switch_time_s(self, instance: int) -> float | None:
        """``DecodeObs.now_s`` at which SD switched on for ``instance`` this rollout, or None."""
        sw = self._switches.get(instance)
        return sw.switch_s if sw is not None else None

    def default_decision(self, batch: int) -> SpecDecision:
        """The first arm of the bucket serving ``batch``."""
        return bucket_arms(self.config.buckets(), batch)[0]

    def vllm_dynamic_table(self, max_batch: int) -> list[list[int]]:
        """k = 0 above ``threshold`` and, below, k = draft_steps of each bucket's first EAGLE
        arm, since vLLM's EAGLE here drafts a chain; adjacent equal k merged. Lost in the export:
        the warm-up hysteresis (vLLM switches per iteration on the batch size alone, without
        re-prefill), the tree shape (topk, verify_tokens), the bandit (one arm per bucket) and
        the history-drafter arms (the table drives vLLM's EAGLE drafter only; a policy without
        EAGLE arms raises ValueError)."""
        cfg = self.config
        if "eagle" not in cfg.drafters:
            raise ValueError(
                f"to_vllm_dynamic_table: policy {self.name!r} drafts with {', '.join(cfg.drafters)} "
                "only; vLLM's dynamic table drives its EAGLE drafter"
            )
        rows: list[list[int]] = []
        for start, end, arms in cfg.buckets():
            hi = min(end if end is not None else max_batch, cfg.threshold, max_batch)
            eagle = next(a for a in arms if a.drafter == "eagle")
            if start <= hi:
                rows.append([start, hi, eagle.draft_steps])
        if max_batch > cfg.threshold:
            rows.append([cfg.threshold + 1, max_batch, 0])
        merged: list[list[int]] = []
        for row in rows:
            if merged and merged[-1][2] == row[2]:
                merged[-1][1] = row[1]
            else:
                merged.append(row)
        return merged

    def state_dict(self) -> dict:
        """Every instance's bandit (reward windows, random stream) and SD switch, plus the
        config and seed they were learned under, which ``load_state_dict`` checks."""
        config = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self.config).items()}
        return {
            "config": config,
            "seed": self.seed,
            "bandits": [
                {"instance": i, "bandit": b.state_dict()} for i, b in self._bandits.items()
            ],
            "switches": [
                {"instance": i, "checks": sw.checks, "is_on": sw.is_on, "switch_s": sw.switch_s}
                for i, sw in self._switches.items()
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        saved = TLTConfig(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in state["config"].items()}
        )
        if saved != self.config or state["seed"] != self.seed:
            raise ValueError(
                f"TLTAdaptive.load_state_dict: the state was learned with seed {state['seed']} and {saved}, this policy has seed {self.seed} and {self.config}"
            )
        self._bandits = {}
        for entry in state["bandits"]:
            self._bandit(entry["instance"]).load_state_dict(entry["bandit"])
        self._switches = {
            e["instance"]: _InstanceSwitch(
                checks=e["checks"], is_on=e["is_on"], switch_s=e["switch_s"]
            )
            for e in state["switches"]
        }


def tltbase_settings(tlt: TLTConfig) -> dict:
    """The fields of ``tlt`` that a TLTBase beside it takes (``tltsim replay --policy all``, a
    measured run's replay): TLT's switch and bandit settings, and the history drafter's arms
    where given; its strategies and drafters stay TLTBase's own."""
    names = ("threshold", "warmup_checks", "epsilon", "explore_iters", "window")
    names += ("history_strategies",) if tlt.history_strategies else ()
    return {name: getattr(tlt, name) for name in names}


class TLTBase(TLTAdaptive):
    """The paper's ablation baseline "TLT-Base" (issue #20): the model-free history drafter only
    (``tltrun.model.history_drafter``), switched on by TLTAdaptive's threshold and warm-up, with
    one fixed chain strategy by default: 6_1_6, the strategy of ``benchmarks/bench_spec.py``'s
    best batch-1 result (with EAGLE; README), until a history-drafter benchmark picks its own.
    Any TLTConfig field may be overridden; drafters must stay ("history",). No vLLM
    dynamic-table export (that table drives EAGLE only)."""

    name = "tltbase"
    DEFAULTS = {"strategies": ("6_1_6",), "bucket_starts": (1,), "drafters": ("history",)}

    def __init__(
        self,
        seed: int = 0,
        rng: random.Random | None = None,
        config: TLTConfig | None = None,
        **settings,
    ):
        if config is None:
            defaults = dict(self.DEFAULTS)
            if "strategies" in settings and "bucket_starts" not in settings:
                # own strategies without buckets: TLTConfig's default buckets, as tlt gets
                # (the one-bucket default fits only the one default strategy)
                del defaults["bucket_starts"]
            config = TLTConfig(**{**defaults, **settings})
        elif settings:
            raise ValueError("TLTBase: pass either a TLTConfig or its fields, not both")
        if config.drafters != ("history",):
            raise ValueError(f"TLTBase: drafters must be ('history',), got {config.drafters}")
        super().__init__(seed=seed, rng=rng, config=config)
