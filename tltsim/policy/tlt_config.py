"""``TLTConfig``: the settings of TLT's adaptive rollout engine (threshold, warm-up checks,
strategies per batch-size bucket, drafters, the bandit's exploration), defaults from TLT's public
configuration; read by ``TLTAdaptive`` (``tltsim.policy.tlt``) and its bandit
(``tltsim.policy.bandit``). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tltsim.policy.spec import DRAFTERS, SpecDecision

# TLTConfig.drafter_explore: explore other-drafter arms per iteration (fastrl) or per rollout
DRAFTER_EXPLORE = ("iteration", "rollout")


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
        for name in ("threshold", "warmup_checks", "window"):  # the one that is wrong, named
            # alone (the three together named fields tltrun train has no flags for)
            if getattr(self, name) < 1:
                raise ValueError(f"TLTConfig: {name} must be >= 1, got {getattr(self, name)}")
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
                f"TLTConfig: {len(starts)} buckets (bucket_starts {tuple(starts)}) need as many "
                f"distinct verify_tokens values among the strategies, got {self.strategies}: "
                "give bucket_starts one start per verify_tokens value, or more strategies"
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
