"""The SimPy model of RL steps: rollout on ``num_gpus / tp`` engine instances, barrier, training.

    from tltsim.sim.simulator import SimConfig, simulate
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

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from tltsim.policy import IdleObs, SpecDecision
from tltsim.sim.acceptance import DrafterDynamics, HistoryModel, accept_len_pmf
from tltsim.sim.batch import AcceptDist
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

PLACEMENTS = ("round_robin", "chunked", "random")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


# Most engine instances (num_gpus / tp) one simulation may model (SimConfig.__post_init__).
MAX_NUM_INSTANCES = 4096
# Seeds reach numpy and the policies as C int64 (a larger one overflowed inside a run).
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SimConfig:
    """One simulation's cluster and model settings (one ``tltsim replay`` flag per field).

    ``model`` / ``hardware`` name the presets the CLI builds the cost model from;
    ``simulate()`` itself uses the cost model object it is handed.
    """

    model: str = field(
        default="Qwen2.5-7B", metadata=_help("target model preset (tltsim.cost.specs)")
    )
    hardware: str = field(default="H100-SXM", metadata=_help("GPU preset (tltsim.cost.specs)"))
    num_gpus: int = field(default=8, metadata=_help("GPUs in the cluster"))
    tp: int = field(default=1, metadata=_help("tensor-parallel degree of one engine instance"))
    # 1024: veRL's rollout max_num_seqs default (fastrl_trainer.yaml, actor_rollout_ref.rollout).
    max_running_requests: int = field(
        default=1024, metadata=_help("continuous-batching cap per instance")
    )
    placement: str = field(
        default="round_robin",
        metadata={"help": "how requests are spread over instances", "choices": PLACEMENTS},
    )
    # 32: TLT's threshold for the long tail (arXiv 2511.16665, adaptive SD default).
    tail_threshold: int = field(
        default=32, metadata=_help("an instance with fewer active requests is in the tail")
    )
    # Spot trainer start-up, physics only: copy the drafter's training state host->device. The
    # Qwen2.5-7B drafter has 259M trainable parameters (tltsim.cost.specs.DrafterSpec); with bf16
    # weights and grads, fp32 master weights and Adam moments that is 16 B/param = 4.1 GB, over
    # PCIe Gen5 x16 (64 GB/s per direction, ~80% achievable: 51 GB/s) = 0.08 s, rounded to 0.1 s.
    # It grows with the drafter (70B target: 15.8 GB, 0.3 s). Whatever else a real trainer does
    # at start-up is not in it: measure a run with tltrun and set this field.
    spot_startup_s: float = field(
        default=0.1, metadata=_help("seconds before an idle instance starts training the drafter")
    )
    # Checkpoint when the rollout ends: the same 4.1 GB device->host, 0.08 s, rounded to 0.1 s.
    spot_checkpoint_s: float = field(
        default=0.1,
        metadata=_help("seconds a spot trainer needs to save the drafter when the rollout ends"),
    )
    # fastrl's drafter trainer (verl/trainer/config/fastrl_trainer.yaml, speculative.train):
    # batch_size_per_gpu 2 x max_seq_len 8192 tokens per GPU per update.
    drafter_update_tokens: int = field(
        default=16384, metadata=_help("tokens one drafter update consumes per GPU")
    )
    # vLLM V1 caches prompt blocks by default (automatic prefix caching) and tltrun's torch
    # engine shares identical prompts (EngineConfig.share_prompts): the responses of one GRPO
    # group prefill their prompt once (tltsim.sim.instance explains the cost).
    share_prompts: bool = field(
        default=True,
        metadata=_help("responses of one prompt (a group) share its prefill on an instance"),
    )
    # What a sharer reuses: whole blocks of this many prompt tokens, never the last token (vLLM
    # caches full KV blocks: 16 tokens on GPUs, 128 on CPU (vllm/platforms/cpu.py); 1 is token
    # granularity, as tltrun's torch engine and SGLang's radix cache at its default page size).
    prefix_block_tokens: int = field(
        default=1, metadata=_help("granularity in tokens of a shared prompt prefix")
    )
    exact: bool = field(
        default=False, metadata=_help("one SimPy event per decode iteration (slow reference)")
    )
    is_timeline_recorded: bool = field(
        default=True, metadata=_help("keep per-instance timeline segments")
    )
    seed: int = field(
        default=0, metadata=_help("seed of accept-length sampling and random placement")
    )

    def __post_init__(self) -> None:
        for name in (
            "num_gpus",
            "tp",
            "max_running_requests",
            "tail_threshold",
            "drafter_update_tokens",
            "prefix_block_tokens",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_gpus % self.tp:
            raise ValueError(f"num_gpus={self.num_gpus} is not a multiple of tp={self.tp}")
        # The spot-trainer accounting (instance_idle) is quadratic in instances: 4096 instances
        # take about a minute per simulated step on one core, 10^8 would never finish. 4096 is
        # 64x the largest preset, beyond the rollout clusters of published RL systems.
        if self.num_instances > MAX_NUM_INSTANCES:
            raise ValueError(
                f"num_gpus / tp = {self.num_instances} instances: at most {MAX_NUM_INSTANCES} "
                "are supported (the simulation's cost grows with the square of the instances)"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        for name in ("spot_startup_s", "spot_checkpoint_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(
                    f"{name} must be a finite number >= 0, got {getattr(self, name)!r}"
                )
        if type(self.seed) is not int or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2^63 - 1], got {self.seed!r}")

    @property
    def num_instances(self) -> int:
        return self.num_gpus // self.tp


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
    (a group stays on one instance). random: uniform, seeded.
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

    def reprefill_s(self, num_active: int, context_tokens: float) -> float:
        # TLT rebuilds the drafter's KV cache by re-prefilling the running requests when SD
        # switches on (issue #3, part 4); the cost model prices it.
        return self.cost.sd_switch_s(num_active, context_tokens)

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
            buffer_tokens={
                done.index: int(done.response_tokens.sum()) + previous.get(done.index, 0)
                for done in run.done
            },
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
