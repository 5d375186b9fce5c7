"""``TLTAdaptive``: SD only in the long tail of a rollout, with the strategy per batch-size
bucket chosen by the BEG-MAB bandit (TLT, arXiv 2511.16665); its arms may pair strategies with
the learned or the history drafter (``TLTConfig.drafters``, issue #20). ``TLTBase``: the same
switch with the history drafter only. Standard library only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tltsim.policy.bandit import BegMab, bucket_arms
from tltsim.policy.spec import (
    OFF,
    DecodeObs,
    PolicyStateError,
    SpecDecision,
    SpecFeedback,
    SpecPolicy,
)
from tltsim.policy.tlt_config import TLTConfig


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
        until the bandit's next exploration block starts or the one under way ends, or until
        a greedy arm's own rewards could demote it (``BegMab.hold_iters``; ``observe``
        advances the schedule likewise); otherwise it stands until the batch changes."""
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
            # A span of num_iters OFF iterations is num_iters checks; decide() counted the first
            # (unless the span continues an earlier feedback's: SpecFeedback.is_continued).
            sw.checks += feedback.num_iters - (0 if feedback.is_continued else 1)
        if feedback.decision.enabled and feedback.instance in self._bandits:
            # likewise a span of num_iters SD iterations advances the exploration schedule
            uncounted = feedback.num_iters - (0 if feedback.is_continued else 1)
            self._bandits[feedback.instance].advance(uncounted)
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
        if "config" not in state:  # another policy's (NoSpec, static: none)
            raise PolicyStateError(
                f"TLTAdaptive.load_state_dict: not a TLT policy's state (fields {sorted(state)})"
            )
        saved = TLTConfig(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in state["config"].items()}
        )
        if saved != self.config or state["seed"] != self.seed:
            raise PolicyStateError(
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


# The TLTConfig fields a TLTBase beside a TLTAdaptive takes from it (tltbase_settings); the
# last only where given. A sweep keys tltbase points on these (tltsim.sim.sweep.effective).
TLTBASE_FIELDS = (
    "threshold", "warmup_checks", "epsilon", "explore_iters", "window", "history_strategies"
)  # fmt: skip


def tltbase_settings(tlt: TLTConfig) -> dict:
    """The fields of ``tlt`` that a TLTBase beside it takes (``tltsim replay --policy all``, a
    measured run's replay): TLT's switch and bandit settings, and the history drafter's arms
    where given; its strategies and drafters stay TLTBase's own."""
    names = TLTBASE_FIELDS[:-1] + (TLTBASE_FIELDS[-1:] if tlt.history_strategies else ())
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

    @classmethod
    def config_of(cls, settings: dict) -> TLTConfig:
        """The TLTConfig of TLT-Base with ``settings`` (TLTConfig fields) over its DEFAULTS
        (a measured run's replay rebuilds it so: it kept the one-bucket default beside a run's
        own strategies, which the run had dropped)."""
        defaults = dict(cls.DEFAULTS)
        if "strategies" in settings and "bucket_starts" not in settings:
            # own strategies without buckets: TLTConfig's default buckets, as tlt gets
            # (the one-bucket default fits only the one default strategy)
            del defaults["bucket_starts"]
        return TLTConfig(**{**defaults, **settings})

    def __init__(
        self,
        seed: int = 0,
        rng: random.Random | None = None,
        config: TLTConfig | None = None,
        **settings,
    ):
        if config is None:
            config = self.config_of(settings)
        elif settings:
            raise ValueError("TLTBase: pass either a TLTConfig or its fields, not both")
        if config.drafters != ("history",):
            raise ValueError(f"TLTBase: drafters must be ('history',), got {config.drafters}")
        super().__init__(seed=seed, rng=rng, config=config)
