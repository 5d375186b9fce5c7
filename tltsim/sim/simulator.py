"""The SimPy model of RL steps: rollout on ``num_gpus / tp`` engine instances, barrier, training.

    from tltsim.sim.config import SimConfig
    from tltsim.sim.simulator import simulate
    result = simulate(trace, SimConfig(num_gpus=64), cost_model, NoSpec())
    result.steps_frame()      # one row per RL step
    result.summary()          # whole-run figures

Per RL step (DESIGN.md, "Simulator model"):
1. Rollout. The step's requests (prompt x group) are placed on instances (``placement``); each
   instance is a SimPy process running continuous batching (``tltsim.sim.instance``). The
   ``SpecPolicy`` is asked before decode iterations; SD iterations advance requests by sampled
   accept lengths, never past their trace length (lossless: lengths never change, only time).
2. Spot drafter training. An instance whose share is done is idle until the slowest one
   finishes; a ``trainer_policy`` may turn it into a spot trainer (start-up cost, then training
   the drafter until the rollout ends, then a checkpoint). Trained tokens feed the drafter
   dynamics, which also drift at every RL step (the target's weights change).
3. Barrier, then the training phase: data parallel, ``cost.train_s(step_tokens / instances)``.

Decisions naming the history drafter (``SpecDecision.drafter == "history"``: ``TLTBase``, or
``TLTAdaptive`` with ``drafters=("eagle", "history")`` whose bandit picks per bucket) draw accept
lengths from a ``HistoryModel`` (``simulate(history=...)``) and cost the target verify only;
which earlier rollouts each instance has indexed is kept across the steps of one simulation.

Each call builds its own ``simpy.Environment`` and seeded ``numpy.random.Generator`` streams;
nothing is stored at module level, so simulations in one process are independent and
reproducible.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import simpy

from tltsim.policy import IdleObs, SpecDecision
from tltsim.sim.acceptance import DrafterDynamics, accept_len_pmf
from tltsim.sim.batch import AcceptDist
from tltsim.sim.config import SimConfig
from tltsim.sim.history_acceptance import HistoryModel
from tltsim.sim.instance import InstanceRollout, StepArrays, StepRun
from tltsim.sim.metrics import (
    InstanceShare,
    Segment,
    SimResult,
    StepRecord,
    ideal_bound,
    step_outputs,
)
from tltsim.sim.spot_schedule import SpotOutcome, TrainingSpan, spot_schedule
from tltsim.trace.schema import Step, Trace


def step_arrays(trace: Trace) -> list[StepArrays]:
    out = []
    for s in trace.steps:
        prompt = np.fromiter(
            (p.prompt_tokens for p in s.prompts for _ in p.responses), dtype=np.int64
        )
        resp = np.fromiter((r.tokens for p in s.prompts for r in p.responses), dtype=np.int64)
        index = np.fromiter(
            (i for i, p in enumerate(s.prompts) for _ in p.responses), dtype=np.int64
        )
        out.append(StepArrays(s.step, prompt, resp, index, tuple(p.id for p in s.prompts)))
    return out


def place(
    num_requests: int, num_instances: int, placement: str, rng: np.random.Generator
) -> list[np.ndarray]:
    """Response indices per instance, each list in admission (FIFO) order.

    round_robin: response r -> instance r mod N; a prompt's group spreads over instances.
    chunked: contiguous blocks, as veRL's ``DataProto.chunk`` splits a batch over DP ranks
    (a group stays on one instance when the blocks are whole groups, as veRL's batch sizes make
    them; otherwise ``np.array_split``'s unequal blocks can split a group over two). random:
    uniform, seeded.
    """
    idx = np.arange(num_requests)
    if placement == "round_robin":
        return [idx[i::num_instances] for i in range(num_instances)]
    if placement == "chunked":
        return list(np.array_split(idx, num_instances))
    owner = rng.integers(0, num_instances, size=num_requests)
    return [idx[owner == i] for i in range(num_instances)]


class _Simulation:
    """One simulation: its own SimPy environment, RNG, policies and drafter state."""

    def __init__(
        self,
        trace: Trace,
        config: SimConfig,
        cost: Any,
        spec_policy: Any,
        trainer_policy: Any,
        drafter: Any,
        progress: Callable[[int], None] | None,
        history: HistoryModel | None = None,
    ):
        self.config = config
        # the history drafter's model: an explicit one, else the drafter object's (a measured
        # run's fit), else the documented defaults
        self.history = history or getattr(drafter, "history", None) or HistoryModel()
        # prompt id -> instances whose history drafter indexed its rollouts in earlier steps
        self.history_seen: dict[str, set[int]] = {}
        self.current_step: Step | None = None
        self.cost = cost
        self.spec_policy = spec_policy
        self.trainer_policy = trainer_policy
        self.drafter = drafter
        self.progress = progress
        self.drafter_state = drafter.initial_state()
        self.env = simpy.Environment()
        # Two streams: placement does not depend on how many accept lengths a policy drew, so
        # every policy (and both modes) sees the same placement for a seed.
        self.rng = np.random.default_rng([config.seed, 1])  # accept lengths
        self.placement_rng = np.random.default_rng([config.seed, 0])
        self.arrays = step_arrays(trace)
        self.trace_steps = trace.steps
        self.timeline: list[Segment] | None = [] if config.is_timeline_recorded else None
        self.strategies_used: set[SpecDecision] = set()
        self.records: list[StepRecord] = []
        self.instance_rows: list[tuple] = []
        self.finish_s: list[np.ndarray] = []
        self.shares: list[list[InstanceShare]] = []
        # per instance: response tokens of its share of the previous step, which its spot
        # trainer still trains on (IdleObs.buffer_tokens: this step's and the previous one's)
        self.previous_harvest_tokens: dict[int, int] = {}

    # -- the SimPy process: RL steps one after another --------------------------------------

    def run(self):
        for arrays, step in zip(self.arrays, self.trace_steps, strict=True):
            yield from self._step(arrays, step)
            if self.progress is not None:
                self.progress(1)

    def _step(self, arrays: StepArrays, step: Step):
        env, config = self.env, self.config
        t0 = env.now
        self.spec_policy.start_rollout(arrays.step)
        self.drafter_start_step(arrays.step)
        self.current_step = step
        run = StepRun(self, arrays, t0, self.request_rates(step))
        owners = place(
            arrays.response_tokens.size, config.num_instances, config.placement, self.placement_rng
        )
        instances = [
            InstanceRollout(
                run,
                i,
                ids,
                arrays.prompt_tokens[ids],
                arrays.response_tokens[ids],
                arrays.prompt_index[ids],
            )
            for i, ids in enumerate(owners)
        ]
        run.instances = instances
        yield env.all_of([env.process(inst.process()) for inst in instances])
        # their rollouts are history of the prompts' next occurrences, where a prompt id names
        # one prompt across steps (a measured run's drafter object may say it does not:
        # ``prompt_ids_recur``, tltsim.fidelity.measured_run)
        if getattr(self.drafter, "prompt_ids_recur", True):
            for inst in instances:
                for g in np.unique(inst.groups).tolist():
                    self.history_seen.setdefault(arrays.prompt_ids[g], set()).add(inst.index)
        rollout_s = env.now - t0
        spot = self._spot_training(run, instances, rollout_s)
        self.previous_harvest_tokens = {i.index: int(i.response_tokens.sum()) for i in instances}
        step_tokens = int(arrays.prompt_tokens.sum() + arrays.response_tokens.sum())
        train_s = self.cost.train_s(
            int(round(step_tokens / config.num_instances)), run.mean_seq_tokens
        )
        checkpoint_s = config.spot_checkpoint_s if spot.tokens else 0.0
        self._close_timeline(run, instances, spot, rollout_s, checkpoint_s, train_s)
        yield env.timeout(checkpoint_s + train_s)
        record, rows, shares = step_outputs(
            run,
            arrays.prompt_tokens,
            arrays.response_tokens,
            instances,
            spot,
            rollout_s,
            checkpoint_s,
            train_s,
            config.tp,
        )
        self.records.append(record)
        self.instance_rows.extend(rows)
        self.shares.append(shares)
        self.finish_s.append(run.finish_s)

    # -- drafter and speculative decoding hooks ------------------------------------------------

    def drafter_start_step(self, step: int) -> None:
        """The target's weights changed in the previous step's update: the drafter drifts."""
        if self.records:
            self.drafter_state = self.drafter.after_rl_step(self.drafter_state)

    def drafter_acceptance(self) -> float:
        return self.drafter_state.accept_rate

    def request_rates(self, step: Step) -> np.ndarray | None:
        """Per response of ``step``, its own acceptance rate (nan: the step's), when the
        drafter object knows them (optional ``request_accept_rates(state, step)``:
        tltsim.fidelity.measured_run replays each measured response's own acceptance); else None."""
        own = getattr(self.drafter, "request_accept_rates", None)
        rates = own(self.drafter_state, step) if own is not None else None
        if rates is None or not np.isfinite(rates).any():
            return None
        return np.round(rates, 2)  # a few distinct rates: one accept distribution each

    def request_history_rates(self, arrays: StepArrays) -> np.ndarray | None:
        """Per response of the step, its own history-drafter acceptance rate (nan: the
        model's), when the drafter object knows them (optional
        ``request_history_rates(state, step)``: a measured run's per-response history arms)."""
        own = getattr(self.drafter, "request_history_rates", None)
        if own is None or self.current_step is None:
            return None
        rates = own(self.drafter_state, self.current_step)
        if rates is None or not np.isfinite(rates).any():
            return None
        return np.round(rates, 2)

    def history_indexed(self, prompt_ids: tuple[str, ...], scope: int) -> np.ndarray:
        """Per prompt: whether an earlier step's rollouts of it are in the history index of
        instance ``scope`` (-1: any instance, a cluster-wide index)."""
        seen = self.history_seen
        if scope < 0:
            return np.array([pid in seen for pid in prompt_ids], dtype=np.float64)
        return np.array([scope in seen.get(pid, ()) for pid in prompt_ids], dtype=np.float64)

    def accept_dist(self, decision: SpecDecision, acceptance: float) -> AcceptDist:
        # A drafter object may supply its own accept-length pmf for a decision (optional
        # ``accept_len_pmf(state, decision)``, None = use the model): tltsim.fidelity.measured_run
        # replays a measured run's per-step, per-strategy histograms this way.
        own = getattr(self.drafter, "accept_len_pmf", None)
        pmf = own(self.drafter_state, decision) if own is not None else None
        if pmf is None:
            pmf = accept_len_pmf(decision, acceptance, self.drafter.sibling_rate)
        return AcceptDist.of(pmf)

    def reprefill_s(self, num_seqs: float, context_tokens: float) -> float:
        # TLT rebuilds the drafter's KV cache by re-prefilling the running requests when SD
        # switches on (issue #3, part 4); the cost model prices it.
        return self.cost.sd_switch_s(num_seqs, context_tokens)

    # -- spot trainers ------------------------------------------------------------------------------

    def instance_idle(self, run: StepRun, inst: InstanceRollout) -> None:
        """Called (in simulated time) when ``inst`` runs out of rollout work: ask the trainer
        policy which idle instances should train the drafter from now on. Not when the last
        instance finishes: the rollout has ended (tltrun's last finisher asks nothing either)."""
        if self.trainer_policy is None or len(run.done) == self.config.num_instances:
            return
        previous = self.previous_harvest_tokens
        obs = IdleObs.from_buffers(
            now_s=inst.finish_s,
            step=run.step,
            # an idle instance has finished its whole share: all of it is harvested
            buffer_tokens={i: n + previous.get(i, 0) for i, n in run.done_tokens.items()},
            num_instances=self.config.num_instances,
            update_s=run.update_s,
            instance_update_tokens=self.config.drafter_update_tokens * self.config.tp,
        )
        run.train_decisions.append((inst.finish_s, self.trainer_policy.decide(obs)))

    def _spot_training(
        self, run: StepRun, instances: list[InstanceRollout], rollout_s: float
    ) -> SpotOutcome:
        """Who trained the drafter when; the drafter learns from the tokens trained."""
        config = self.config
        tokens_per_s = 0.0
        if run.train_decisions:
            ref_tokens = config.drafter_update_tokens * config.tp
            tokens_per_s = ref_tokens / self.cost.drafter_train_s(ref_tokens, run.mean_seq_tokens)
        outcome = spot_schedule(
            run.train_decisions,
            len(instances),
            rollout_s,
            config.spot_startup_s,
            tokens_per_s,
            config.drafter_update_tokens * config.tp,
        )
        if outcome.tokens:
            self.drafter_state = self.drafter.after_training(self.drafter_state, outcome.tokens)
        return outcome

    # -- records --------------------------------------------------------------------------------

    def _close_timeline(
        self,
        run: StepRun,
        instances: list[InstanceRollout],
        spot: SpotOutcome,
        rollout_s: float,
        checkpoint_s: float,
        train_s: float,
    ) -> None:
        """Idle / spot-training segments after each instance's last request, then the update."""
        if self.timeline is None:
            return
        timeline, step = self.timeline, run.step
        training: dict[int, list[TrainingSpan]] = {}
        for span in spot.segments:
            training.setdefault(span.instance, []).append(span)
        for inst in instances:
            i, t = inst.index, inst.finish_s
            for span in training.get(i, []):  # idle around the training stretches
                if span.start_s > t:
                    timeline.append(
                        Segment(step=step, instance=i, start_s=t, end_s=span.start_s, phase="idle")
                    )
                timeline.append(
                    Segment(
                        step=step,
                        instance=i,
                        start_s=span.start_s,
                        end_s=span.end_s,
                        phase="spot_train",
                    )
                )
                t = span.end_s
            if t < rollout_s:
                timeline.append(
                    Segment(step=step, instance=i, start_s=t, end_s=rollout_s, phase="idle")
                )
            end_s = rollout_s + checkpoint_s
            if checkpoint_s > 0:
                phase = "checkpoint" if spot.trained_s[i] > 0 else "idle"
                timeline.append(
                    Segment(step=step, instance=i, start_s=rollout_s, end_s=end_s, phase=phase)
                )
            timeline.append(
                Segment(step=step, instance=i, start_s=end_s, end_s=end_s + train_s, phase="train")
            )


def simulate(
    trace: Trace,
    config: SimConfig,
    cost_model: Any,
    spec_policy: Any,
    trainer_policy: Any = None,
    drafter: Any = None,
    progress: Callable[[int], None] | None = None,
    history: HistoryModel | None = None,
) -> SimResult:
    """Replay ``trace`` on the cluster of ``config`` under ``spec_policy``.

    ``cost_model`` implements ``tltsim.cost.roofline.CostModel`` (plus ``sd_iter_s`` when the
    policy speculates); ``trainer_policy`` decides which idle instances become spot drafter
    trainers (None: none do); ``drafter`` is the drafter-dynamics state whose acceptance SD
    iterations sample from (required when the policy speculates). ``progress(n)`` is called
    after each RL step (a tqdm bar's ``update``). ``history`` is the history drafter's
    acceptance model (None: the drafter object's ``history`` attribute if it has one, else
    ``HistoryModel()``'s defaults).
    """
    started = time.perf_counter()
    sim = _Simulation(
        trace,
        config,
        cost_model,
        spec_policy,
        trainer_policy,
        drafter or DrafterDynamics(),
        progress,
        history,
    )
    sim.env.process(sim.run())
    sim.env.run()
    strategies = sorted(sim.strategies_used, key=lambda d: d.strategy)
    for record, shares in zip(sim.records, sim.shares, strict=True):
        bound = ideal_bound(shares, cost_model, config.max_running_requests, strategies)
        record.ideal_rollout_s = float(bound.rollout_s)
        record.ideal_work_s = float(bound.work_s)
        record.ideal_critical_path_s = float(bound.critical_path_s)
    return SimResult(
        policy=getattr(spec_policy, "name", type(spec_policy).__name__),
        config=config,
        steps=sim.records,
        instance_rows=sim.instance_rows,
        timeline=sim.timeline if sim.timeline is not None else [],
        finish_s=sim.finish_s,
        strategies_used=set(sim.strategies_used),
        shares=sim.shares,
        wall_s=time.perf_counter() - started,
    )
