"""Spot drafter training over torch.distributed: rollout workers that finished their share of a
rollout train the EAGLE drafter, data parallel, until the last worker finishes (TLT, arXiv
2511.16665, "spot trainer"). Used by every worker process of ``tltrun train``.

Protocol (one RL step, W workers, a shared c10d store and gloo/NCCL process groups)
-----------------------------------------------------------------------------------
* Finishing: a worker whose rollout ends does ``k = store.add("s{step}/num_done", 1)`` and
  sets ``"s{step}/order/{k}" = rank``: k is its finish order. The idle workers after the k-th
  finish are exactly the first k finishers, a PREFIX of the finish order, known to everyone.
* Phase j (1 <= j < W) is the time during which exactly the first j finishers are idle. Its
  members (the first j finishers) communicate only in the process group of that rank set,
  created by its members when they first need it (``SubsetGroups``: no group per subset up
  front, so W has no 2^W cap). The j-th finisher enters phase j directly; members of phase
  j - 1 enter phase j after leaving phase j - 1. Nobody skips a phase, so every member of
  phase j arrives.
* Phase entry: one ``all_gather`` in the phase group of (finishes seen, buffer tokens,
  seconds per update, drafter version). From that table every member builds the SAME
  ``IdleObs`` and so gets the same ``SpotTrainerPolicy`` decision (policies are deterministic
  functions of the observation). If the decision trains and the members' drafters differ, the
  freshest one (highest version, lowest rank) is broadcast in the phase group, with its AdamW
  state: all trainers then start from identical parameters and optimiser state.
* Rounds: each round starts with an ``all_reduce(MAX)`` of the finishes each member has seen in
  the store; if it exceeds j, every member leaves the phase together (same value everywhere).
  Otherwise each trainer runs one drafter update whose gradients are averaged (all_reduce SUM /
  number of trainers) in the trainers' subset group; a member with nothing to do sleeps
  ``poll_s`` before the next round, leaving the CPU to the workers still rolling out.
* Preemption: the last finisher (order W) enters no phase; when its finish is seen, phase W - 1
  ends and every worker proceeds to the end-of-step collectives on the default group. Training
  stops at most one drafter update after the rollout ended.
* End of step: an ``all_gather`` of drafter versions on the default group; if they differ the
  freshest drafter (and optimiser state) is broadcast to all workers, so every engine drafts
  with the same weights in the next rollout.

Why it cannot deadlock: a collective of group G is only issued by members of G, and each member
issues the same sequence on G (phase entry, then rounds whose number every member learns from
the same all_reduce result). A member of phase j waits only for other members of phase j,
which all arrive (the j-th finisher finishes its finite rollout; earlier ones leave phase j - 1
once that finish is seen). Phases end because every worker eventually finishes its rollout (a
worker lost with its whole node never does: the wait raises once its heartbeats stop,
tltrun.train.heartbeat, or at the latest after ``wait_timeout_s``).
Different groups have separate communicators (``tltrun.train.subset_groups``), so interleaving
across groups is harmless.

Deterministic mode (``TrainConfig.is_deterministic``, ``tltrun train --deterministic``)
-------------------------------------------------------------------------------------------
The protocol above is timing-dependent: the finish order decides the phases and trainer sets,
and the rollout's end decides how many updates run, so the same seed gives a different drafter
(hence different speculative rollouts and actor) from about the third step on. ``run_budget``
replaces it: each worker, once its rollout ends, asks the policy for its budget from its OWN
buffer alone (an ``IdleObs`` in which only it is idle, ``update_s`` fixed at 1 and no
``available_s``, so only the data cap ``max_epochs x buffer_tokens / tokens_per_update``
counts) and runs exactly that many updates on its own copy, with no collective (no trainer set
or all-reduce depends on timing), and is never preempted: the step waits for the slowest
budget. ``sync_end_of_step`` then broadcasts the drafter that ran the most updates (ties: the
lowest rank), whose state depends only on the step's harvest and the seeded per-worker RNG
streams; the other workers' updates are discarded (the price of training without talking).
The rollout's SD policy is timing-dependent too (TLT's bandit rewards accepted tokens per
measured second): ``ModelledFeedback`` (end of this module) feeds it ``modelled_iteration_s``.

Data: each trainer samples its batches from its own buffer: the (token, hidden) pairs harvested
from its responses of this step and of the previous step (``HarvestRecord``s of the engine).
The ``IdleObs`` counts that buffer as ``tltsim.policy.IdleObs`` defines it, as the simulator does:
each member's response tokens (``instance_buffer_tokens``), and per update one batch of
``batch_size`` records of its buffer's mean response length (``instance_update_tokens``), so
the policy's cap of ``max_epochs`` passes holds for each trainer's own buffer.
Per-worker clipping: ``drafter_train_step`` clips gradients by value before the optimiser step;
we average after that clip (an elementwise clip of each part, the average stays in bounds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from tltrun.model.drafter import EagleDrafter
from tltrun.train.drafter_training import (
    DrafterTrainConfig,
    TrainRecord,
    drafter_train_step,
    make_batch,
)
from tltrun.train.heartbeat import PeerWatch
from tltrun.train.subset_groups import AveragedOptimizer, SubsetGroup, SubsetGroups
from tltsim.policy import DrafterTrainingPolicy, IdleObs
from tltsim.policy.spec import SpecDecision, SpecFeedback, SpecPolicy


def buffer_tokens(records: list[TrainRecord]) -> int:
    """Response tokens of ``records``: the positions a drafter update trains on
    (``make_batch``'s loss mask), i.e. ``tltsim.policy.IdleObs.buffer_tokens``."""
    return sum(len(r.token_ids) - r.num_prompt_tokens for r in records)


def phase_row(
    num_done: int, buffer: list[TrainRecord], update_s: float, version: int, elapsed_s: float
) -> torch.Tensor:
    """One member's row of a phase table (``idle_obs`` reads the gathered rows)."""
    return torch.tensor(
        [
            float(num_done),
            float(buffer_tokens(buffer)),
            update_s,
            float(version),
            float(len(buffer)),
            elapsed_s,
        ],
        dtype=torch.float64,
    )


def idle_obs(
    step: int, members: list[int], table: torch.Tensor, world_size: int, batch_size: int
) -> IdleObs:
    """The ``IdleObs`` of a phase from its gathered table (rows of the ``members`` in sorted
    rank order: finishes seen, buffer tokens, seconds per update, drafter version, buffered
    records, seconds since the rollout began); the same on every member."""
    ranks = sorted(members)
    tokens = [int(t) for t in table[:, 1].tolist()]
    records = [int(r) for r in table[:, 4].tolist()]
    return IdleObs.from_buffers(
        now_s=float(table[:, 5].max()),  # agreed by all members, like every field
        step=step,
        buffer_tokens=dict(zip(ranks, tokens, strict=True)),
        num_instances=world_size,
        update_s=float(table[:, 2].max()),
        # a trainer's update is one batch of batch_size records from its own buffer: of its
        # own mean response length
        instance_update_tokens={
            rank: batch_size * max(t // max(r, 1), 1)
            for rank, t, r in zip(ranks, tokens, records, strict=True)
        },
    )


@dataclass(kw_only=True)
class SpotStats:
    """What one worker did in one step's idle time."""

    num_updates: int = 0
    trained_tokens: int = 0
    train_s: float = 0.0
    idle_s: float = 0.0  # from its rollout's end to the last worker's
    num_phases: int = 0
    decisions: list[dict] = field(default_factory=list)


class SpotTrainer:
    """Per-worker state of spot drafter training: the trainable drafter, its optimiser, the
    harvested-data buffer, and the protocol above."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store,
        groups: SubsetGroups | None,
        drafter: EagleDrafter,
        policy: DrafterTrainingPolicy,
        cfg: DrafterTrainConfig,
        seed: int,
        poll_s: float,
        clock: Callable[[], float] = time.monotonic,
        wait_timeout_s: float = 3600.0,
        watch: PeerWatch | None = None,
    ):
        self.rank, self.world_size, self.store, self.groups = rank, world_size, store, groups
        # how long a worker waits for the others' rollouts (tltrun.train.elastic's
        # COLLECTIVE_TIMEOUT_S): a node lost whole is seen by no agent here, and the wait polled
        # the store, which lives on, forever (hunt: two torchrun nodes, one SIGKILLed)
        self.wait_timeout_s = wait_timeout_s
        # ... and the heartbeats that find a lost rank much sooner (tltrun.train.heartbeat)
        self.watch = watch
        self.drafter, self.policy, self.cfg, self.poll_s, self.clock = (
            drafter,
            policy,
            cfg,
            poll_s,
            clock,
        )
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2)
        )
        # batches go to the drafter's device, and the feature noise is drawn there (a CPU
        # generator cannot draw on a GPU); window starts are drawn on the host
        self.device = next(drafter.parameters()).device
        self.data_gen = torch.Generator().manual_seed(seed)
        self.noise_gen = torch.Generator(self.device).manual_seed(seed + 1)
        self.version = 0  # drafter updates applied to this copy since the run began
        self.update_s = 1.0  # EMA of seconds per update; only a time cap would use it
        self.previous: list[TrainRecord] = []  # last step's harvest

    def announce_done(self, step: int) -> int:
        order = self.store.add(f"s{step}/num_done", 1)
        self.store.set(f"s{step}/order/{order}", str(self.rank))
        return order

    def _num_done(self, step: int) -> int:
        return self.store.add(f"s{step}/num_done", 0)

    def _first_finishers(self, step: int, n: int) -> list[int]:
        return [int(self.store.get(f"s{step}/order/{i}")) for i in range(1, n + 1)]

    def _check_wait(self, step: int, since: float) -> None:
        """Raise once a worker whose rollout of ``step`` this one waits for stopped sending
        heartbeats (``watch``), or once this one has waited ``wait_timeout_s`` (real seconds),
        naming the workers that never finished."""
        waited_s = time.monotonic() - since
        if waited_s > self.wait_timeout_s:
            raise TimeoutError(
                f"rank {self.rank} waited {waited_s:.0f} s for the rollouts of rank(s) "
                f"{', '.join(map(str, self._missing(step)))} in step {step}: lost (a node "
                "that died whole is seen by no launcher here)?"
            )
        if self.watch is not None and self.watch.is_due():
            silent = self.watch.lost(self._missing(step))
            if silent:
                raise TimeoutError(
                    f"rank {self.rank} waited for the rollouts of rank(s) "
                    f"{', '.join(map(str, silent))} in step {step}, which sent no heartbeat for "
                    f"{max(silent.values()):.0f} s: lost (a node that died whole is seen by no "
                    "launcher here)?"
                )

    def _missing(self, step: int) -> list[int]:
        """The ranks whose rollout of ``step`` has not finished."""
        done = set(self._first_finishers(step, self._num_done(step)))
        return sorted(set(range(self.world_size)) - done)

    # ---- the protocol ----------------------------------------------------------------------

    def run_idle(
        self, step: int, order: int, current: list[TrainRecord], rollout_t0: float
    ) -> SpotStats:
        """Called by a worker right after ``announce_done`` returned ``order``; returns when
        the rollout has ended on every worker."""
        stats = SpotStats()
        buffer = current + self.previous
        start, since = self.clock(), time.monotonic()
        step_version = self.version
        j = order
        while j < self.world_size:
            members = self._first_finishers(step, j)
            group = self.groups[members]
            table = self._gather_table(step, buffer, group, rollout_t0)
            if int(table[:, 0].max()) > j:  # the phase already ended
                j += 1
                continue
            stats.num_phases += 1
            trainers, max_updates = self._decide(step, members, table, stats)
            remaining = max_updates - (int(table[:, 3].max()) - step_version)
            if trainers and remaining > 0:
                self._sync_from_freshest(members, table[:, 3], group)
            opt = None
            if self.rank in trainers:
                opt = AveragedOptimizer(self.optimizer, self.groups[trainers], len(trainers))
            done_here = 0
            while True:
                flag = torch.tensor([float(self._num_done(step))])
                group.all_reduce(flag, dist.ReduceOp.MAX)
                if int(flag[0]) > j:
                    break
                self._check_wait(step, since)  # (its agent then ends the job)
                if opt is not None and done_here < remaining and buffer:
                    self._train_one(buffer, opt, stats)
                    done_here += 1
                else:
                    time.sleep(self.poll_s)
            j += 1
        stats.idle_s = self.clock() - start
        self.previous = current
        return stats

    def run_budget(self, step: int, current: list[TrainRecord]) -> SpotStats:
        """Deterministic mode (module docstring): called right after ``announce_done``; trains
        this worker's own budget, then returns once the rollout has ended on every worker."""
        stats = SpotStats()
        buffer = current + self.previous
        start = self.clock()
        obs = self.budget_obs(step, buffer)
        decision = self.policy.decide(obs)
        budget = decision.max_updates if decision.is_training and buffer else 0
        stats.num_phases = 1
        stats.decisions.append(
            {"idle": [self.rank], "trainers": [self.rank] if budget else [], "max_updates": budget}
        )
        since = time.monotonic()
        for _ in range(budget):
            self._train_one(buffer, self.optimizer, stats)
        while self._num_done(step) < self.world_size:  # sleep, leaving the CPU to the rollout
            self._check_wait(step, since)
            time.sleep(self.poll_s)
        stats.idle_s = self.clock() - start
        self.previous = current
        return stats

    def budget_obs(self, step: int, buffer: list[TrainRecord]) -> IdleObs:
        """This worker alone idle, with no clock in it: the same on every run of a seed."""
        tokens = buffer_tokens(buffer)
        return IdleObs.from_buffers(
            now_s=0.0,
            step=step,
            buffer_tokens={self.rank: tokens},
            num_instances=self.world_size,
            update_s=1.0,  # unused without available_s; a measured value would be timing
            instance_update_tokens=self.cfg.batch_size * max(tokens // max(len(buffer), 1), 1),
        )

    def _gather_table(self, step, buffer, group: SubsetGroup, rollout_t0: float) -> torch.Tensor:
        elapsed_s = self.clock() - rollout_t0
        mine = phase_row(self._num_done(step), buffer, self.update_s, self.version, elapsed_s)
        return torch.stack(group.all_gather(mine))  # (members, 6), rows in sorted-rank order

    def _decide(self, step, members, table, stats) -> tuple[tuple[int, ...], int]:
        obs = idle_obs(step, members, table, self.world_size, self.cfg.batch_size)
        decision = self.policy.decide(obs)
        trainers = tuple(sorted(set(decision.workers) & set(members)))
        stats.decisions.append(
            {
                "idle": list(obs.idle_instances),
                "trainers": list(trainers),
                "max_updates": decision.max_updates,
            }
        )
        return (trainers, decision.max_updates) if decision.is_training else ((), 0)

    def _sync_from_freshest(self, members, versions: torch.Tensor, group) -> None:
        if int(versions.max()) == int(versions.min()):
            return
        ranks = sorted(members)  # group ranks follow sorted global ranks
        best = max(range(len(ranks)), key=lambda i: (int(versions[i]), -ranks[i]))
        self.broadcast_state(ranks[best], group)

    def broadcast_state(self, src: int, group=None) -> None:
        """Drafter weights, AdamW state and version from global rank ``src`` to the group."""
        payload = [None]
        if self.rank == src:
            # on the CPU: a pickled CUDA tensor unpickles onto the sender's device index, i.e.
            # onto another rank's GPU (load_state_dict then copies onto each rank's own device)
            state = {"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict()}
            state = tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), state)
            payload = [{**state, "version": self.version}]
        if group is None:  # the default group: every worker
            dist.broadcast_object_list(payload, src=src)
        else:
            payload = [group.broadcast_object(payload[0], src)]
        if self.rank != src:
            self.load_state(payload[0])

    def load_state(self, state: dict) -> None:
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]

    def _train_one(self, buffer, opt, stats: SpotStats) -> None:
        t0 = self.clock()
        idx = torch.randint(len(buffer), (self.cfg.batch_size,), generator=self.data_gen)
        records = [buffer[i] for i in idx.tolist()]
        batch = make_batch(records, self.cfg.max_seq_len, self.device, self.data_gen)
        drafter_train_step(self.drafter, batch, opt, self.cfg, self.noise_gen)
        self.version += 1
        seconds = self.clock() - t0
        stats.num_updates += 1
        stats.trained_tokens += int(batch.loss_mask.sum())
        stats.train_s += seconds
        self.update_s = seconds if stats.num_updates == 1 else 0.8 * self.update_s + 0.2 * seconds

    def sync_end_of_step(
        self, num_updates: int = 0, is_deterministic: bool = False, step: int | None = None
    ) -> int:
        """All workers: make every drafter the freshest one (most updates; ties: lowest rank);
        returns its rank. ``num_updates``: this worker's updates of the step (in deterministic
        mode copies trained apart can have equal versions and differ: any training broadcasts).
        Rank 0 then deletes ``step``'s store keys (kept, they grew the launcher's store)."""
        mine = torch.tensor([self.version, num_updates], dtype=torch.long)
        rows = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine)
        for k in range(self.world_size + 1) if self.rank == 0 and step is not None else ():
            self.store.delete_key(f"s{step}/order/{k}" if k else f"s{step}/num_done")
        versions = [int(r[0]) for r in rows]
        src = versions.index(max(versions))
        trained = max(int(r[1]) for r in rows) > 0
        if min(versions) != max(versions) or (is_deterministic and trained):
            self.broadcast_state(src)
        return src


# Deterministic mode's iteration cost, in target-forward overheads (a rough CPU proxy, not
# calibrated): a drafter forward is one layer against the tiny target's few, and 32 token
# positions of a forward cost about its fixed overhead.
DRAFT_FORWARD_COST = 0.25
MODELLED_STATE = "modelled_reward_state"  # ModelledFeedback.state_dict's one key
TOKEN_COST = 1 / 32


def modelled_iteration_s(num_active: int, decision: SpecDecision) -> float:
    """A clock-free iteration cost: one target forward over (verify_tokens + 1) positions per
    request, plus draft_steps drafter forwards over topk positions per request."""
    if not decision.enabled:
        return 1 + TOKEN_COST * num_active
    drafts = decision.draft_steps * DRAFT_FORWARD_COST
    positions = decision.verify_tokens + 1 + drafts * decision.topk
    return 1 + drafts + TOKEN_COST * num_active * positions


class ModelledFeedback(SpecPolicy):
    """Wraps the run's SpecPolicy in deterministic mode: ``observe`` gets ``modelled_iteration_s``
    instead of the measured seconds (TLTAdaptive's bandit rewards accepted tokens per second, so
    its choices and, through speculative sampling's draws, the tokens depended on timing).
    Everything else is the wrapped policy's; its state is checkpointed under MODELLED_STATE."""

    def __init__(self, inner: SpecPolicy):
        self.inner = inner
        self.name = inner.name

    def start_rollout(self, step: int) -> None:
        self.inner.start_rollout(step)

    def decide(self, obs):
        return self.inner.decide(obs)

    def observe(self, feedback: SpecFeedback) -> None:
        modelled = modelled_iteration_s(feedback.num_active, feedback.decision)
        self.inner.observe(replace(feedback, iteration_s=modelled))

    def max_hold_iters(self, obs, decision):
        return self.inner.max_hold_iters(obs, decision)

    def vllm_dynamic_table(self, max_batch: int) -> list[list[int]]:
        return self.inner.vllm_dynamic_table(max_batch)

    def state_dict(self) -> dict:
        """The wrapped policy's state under a key of its own: its rewards are modelled costs, not
        seconds (a clock-mode policy cannot load it; the worker loads a state only where the mode
        is kept, tltrun.train.checkpoint.is_reward_mode_kept). One of the inner policy's own form
        is a deterministic checkpoint written before 2026-11-29."""
        return {MODELLED_STATE: self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        is_wrapped = set(state) == {MODELLED_STATE}
        self.inner.load_state_dict(state[MODELLED_STATE] if is_wrapped else state)

    def __getattr__(self, name: str):  # switched_on, switch_time_s, ... of the wrapped policy
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
