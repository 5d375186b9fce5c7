"""One worker process (one torch.distributed rank) of ``tltrun train``, started by torchrun or by
``tltrun train``'s own launcher (tltrun.train.elastic, tltrun.train.launch): rollout with its
own engine, spot drafter training when idle (tltrun.train.spot), data-parallel GRPO update
(tltrun.train.grpo), logging and checkpoints on rank 0 (tltrun.train.state). Not run directly.

Actor update: DATA PARALLEL. Every worker holds the same actor and AdamW state; each computes
the GRPO loss of its own groups over the global token count, the gradients are summed with
``all_reduce`` and every worker takes the identical step (gloo's all_reduce leaves bitwise
identical sums on every rank; a test compares the workers' weights). Each worker then copies
the actor into its engine with ``update_weights``; the reference model stays the initial one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

from tltrun.data.rewards import RewardItem, RewardPool, Shaping, apply_shaping
from tltrun.data.tokenizer import load_tokenizer
from tltrun.model.drafter import EagleDrafter, export_vllm, load_drafter
from tltrun.model.transformer import load_hf, save_hf
from tltrun.rollout.engine import HarvestRecord, RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import Request, RolloutResult, SamplingParams
from tltrun.rollout.measured_trace import hardware_name, instance_prompts, measured_step
from tltrun.train import checkpoint as ckpt_io
from tltrun.train import elastic
from tltrun.train import state as ts
from tltrun.train.config import TrainConfig
from tltrun.train.drafter_training import DrafterTrainConfig, TrainRecord
from tltrun.train.grpo import GRPOConfig, Sample, group_advantages, grpo_update, make_optimizer
from tltrun.train.prompts import load_run_data, reward_spec
from tltrun.train.spot import SpotStats, SpotTrainer, SubsetGroups
from tltrun.train.tasks import TaskConfig
from tltsim.policy import SpotTrainerPolicy, make_policy
from tltsim.policy.spec import SpecDecision, SpecFeedback, SpecPolicy
from tltsim.trace.schema import Trace, trace_to_dict

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# Deterministic mode's iteration cost, in target-forward overheads (a rough CPU proxy, not
# calibrated): a drafter forward is one layer against the tiny target's few, and 32 token
# positions of a forward cost about its fixed overhead.
DRAFT_FORWARD_COST = 0.25
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
    """Wraps the run's SpecPolicy in deterministic mode: ``observe`` gets
    ``modelled_iteration_s`` instead of the measured seconds. TLTAdaptive's bandit rewards
    accepted tokens per second, so measured seconds made its strategy choices (and, through
    speculative sampling's random draws, the sampled tokens) depend on timing. Everything else
    is the wrapped policy's, state and checkpoints included."""

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
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, name: str):  # switched_on, switch_time_s, ... of the wrapped policy
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def die_with_launcher(launcher_pid: int) -> None:
    """Make this worker end when its launcher does, however the launcher ends (kill -9 too).

    Linux's PR_SET_PDEATHSIG has the kernel SIGKILL this process when its parent dies (torch's
    spawn wrapper sets SIGINT, which a worker blocked in a collective or catching
    KeyboardInterrupt can outlive); elsewhere a daemon thread polls the parent pid. Either only
    covers deaths from now on, and a worker spends its first seconds importing torch before it
    gets here: if the launcher died meanwhile, the worker has been re-parented and exits now,
    before it touches the run directory or joins the other workers."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
    if libc is None or libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        threading.Thread(target=_exit_when_orphaned, args=(launcher_pid,), daemon=True).start()
    if os.getppid() != launcher_pid:
        os._exit(1)


def _exit_when_orphaned(launcher_pid: int) -> None:
    while os.getppid() == launcher_pid:
        time.sleep(0.5)
    os._exit(1)


@record
def worker_entry(cfg: TrainConfig, task: TaskConfig, resume: str | None, launcher_pid: int):
    """What every rank of ``tltrun train``'s own launcher runs (tltrun.train.elastic.launch_local;
    rank and rendezvous from torchrun's environment). ``errors.record`` writes an exception into
    the agent's error file, from which the launcher reports it (tltrun.train.launch)."""
    die_with_launcher(launcher_pid)  # first: nothing of the run happens in an orphan
    torch.set_num_threads(cfg.num_threads)
    env = elastic.init_process_group(cfg.device)
    run_worker(env, cfg, task, resume)


def run_worker(env: elastic.RankEnv, cfg: TrainConfig, task: TaskConfig, resume: str | None):
    """One rank's run, in a process group already initialised (``elastic.init_process_group``)."""
    worker = None
    try:
        worker = Worker(env.rank, cfg, task, elastic.side_store(env), resume)
        worker.run()
    finally:
        if worker is not None and worker.tensorboard is not None:
            worker.tensorboard.close()
        if worker is not None:
            worker.rewards.close()
        if worker is not None and hasattr(worker.engine, "close"):
            worker.engine.close()  # the vLLM engine's worker process
        if dist.is_initialized():  # (vLLM's shutdown may already have torn it down)
            dist.destroy_process_group()


class Worker:
    def __init__(self, rank, cfg: TrainConfig, task: TaskConfig, store, resume: str | None):
        self.rank, self.cfg, self.task, self.clock = rank, cfg, task, time.monotonic
        # DCP's own gloo group (a collective of every rank: created first, in the same order)
        self.ckpt_group = ckpt_io.checkpoint_group()
        self.pending_checkpoint = None  # (drafter write future, tmp dir, next step)
        self.is_async_checkpoint = True  # False: the drafter write blocks (benchmarks compare)
        self.out = Path(cfg.out)
        self.tok = load_tokenizer(cfg.model_dir, is_chat_template=cfg.chat_template)
        self.data = load_run_data(cfg, task, lambda row: len(self.tok.encode_prompt(row.prompt)))
        self.rewards = RewardPool(
            reward_spec(cfg),
            num_processes=cfg.reward_processes,
            timeout_s=cfg.reward_timeout_s,
            on_error=cfg.reward_errors,
        )
        self.shaping = Shaping(
            overlong_buffer_tokens=cfg.overlong_buffer_tokens,
            overlong_penalty=cfg.overlong_penalty,
            format_penalty=cfg.format_penalty,
        )
        ckpt = Path(resume) if resume else None
        actor_dir = ckpt / "actor" if ckpt else Path(cfg.model_dir)
        # fp32 master weights and optimizer state; bf16 compute under autocast on CUDA only
        # (CPU trains in fp32: its bf16 matmuls are slower, not faster)
        self.actor = load_hf(actor_dir, device=cfg.device).train()
        self.actor.is_gradient_checkpointing = cfg.gradient_checkpointing
        if cfg.fsdp_size > 1:  # FSDP2 over every rank (TrainConfig allows 1 or the world)
            from tltrun.train.fsdp import shard_actor

            if cfg.fsdp_size != dist.get_world_size():
                raise ValueError(
                    f"fsdp_size {cfg.fsdp_size}: 1 or the world size ({dist.get_world_size()})"
                )
            shard_actor(self.actor, cfg.device)
        self.autocast_dtype = (
            torch.bfloat16 if cfg.dtype == "bfloat16" and cfg.device.startswith("cuda") else None
        )
        self.ref = None
        if cfg.kl_coef > 0:
            ref_dtype = self.autocast_dtype or torch.float32  # frozen: no master copy needed
            self.ref = load_hf(cfg.model_dir, device=cfg.device, dtype=ref_dtype).eval()
        self.gcfg = GRPOConfig(
            lr=cfg.lr,
            kl_coef=cfg.kl_coef,
            num_epochs=cfg.num_epochs,
            max_batch_tokens=cfg.max_tokens_per_microbatch,
        )
        self.optimizer = make_optimizer(self.actor, self.gcfg)
        target = load_hf(actor_dir)
        is_harvesting = cfg.is_spot_training and cfg.num_workers > 1
        drafter_src = ckpt / "drafter" if ckpt and (ckpt / "drafter").is_dir() else cfg.drafter_dir
        drafter = (
            load_drafter(drafter_src, target)
            if drafter_src
            else EagleDrafter.for_target(target, seed=cfg.seed)
        )
        start, count = cfg.shares()[rank]
        self.share = (start, count)
        max_running = cfg.max_running_requests or count * cfg.group_size
        max_prompt = task.max_prompt_chars + 1 if cfg.is_builtin_task else cfg.max_prompt_tokens
        max_model_len = max_prompt + cfg.max_new_tokens
        sampling = SamplingParams(cfg.temperature, cfg.top_p)
        engine_drafter = drafter if cfg.policy != "nospec" else None
        if cfg.backend == "vllm":
            from tltrun.rollout.vllm_backend import VLLMBackendConfig
            from tltrun.train.vllm_rollout import VLLMTrainRollout, kv_cache_bytes, max_draft_steps

            vcfg = VLLMBackendConfig(
                control="iteration",
                max_draft_steps=max_draft_steps(cfg.policy, cfg.policy_settings()),
                max_num_seqs=max_running,
                max_model_len=max_model_len,
                kv_cache_bytes=kv_cache_bytes(
                    target, max_running, max_model_len, engine_drafter is not None
                ),
                dtype=cfg.dtype,
                seed=cfg.seed * 1000 + rank,
                instance=rank,
            )
            self.engine = VLLMTrainRollout(
                actor_dir, target, engine_drafter, vcfg, sampling, is_harvesting, self.clock
            )
            # generation_config.json's stop ids too, as the torch engine (EngineConfig)
            self.engine.backend.eos_token_ids = tuple(
                dict.fromkeys((*self.engine.backend.eos_token_ids, *self.tok.eos_ids))
            )
            torch.set_num_threads(cfg.num_threads)  # vLLM's start-up changes it
        else:
            self.engine = RolloutEngine(
                target,
                engine_drafter,
                EngineConfig(
                    max_running_requests=max_running,
                    max_model_len=max_model_len,
                    sampling=sampling,
                    seed=cfg.seed * 1000 + rank,
                    device=cfg.device,
                    dtype=cfg.dtype,
                    instance=rank,
                    is_harvesting=is_harvesting,
                    eos_token_ids=self.tok.eos_ids,
                ),
                clock=self.clock,
            )
        self.spec_policy = make_policy(cfg.policy, seed=cfg.seed, **cfg.policy_settings())
        if cfg.is_deterministic:
            self.spec_policy = ModelledFeedback(self.spec_policy)
        self.spot = None
        if is_harvesting:
            groups = SubsetGroups(store, rank, elastic.COLLECTIVE_TIMEOUT_S)
            trainable = EagleDrafter(target.config)
            trainable.load_state_dict(drafter.state_dict())
            trainable.bind(self.engine.model)
            dcfg = DrafterTrainConfig(lr=cfg.drafter_lr, batch_size=cfg.drafter_batch_size)
            self.spot = SpotTrainer(
                rank,
                cfg.num_workers,
                store,
                groups,
                trainable,
                SpotTrainerPolicy(max_epochs=cfg.spot_max_epochs),
                dcfg,
                seed=cfg.seed * 1000 + 500 + rank,
                poll_s=cfg.poll_s,
                clock=self.clock,
            )
        self.start_step = 0
        if ckpt:
            self._restore(ckpt)
        self.tensorboard = None
        if cfg.tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run drops the events of steps it repeats
            self.tensorboard = SummaryWriter(
                str(self.out / "tensorboard"), purge_step=self.start_step if ckpt else None
            )

    # ---- checkpoints ------------------------------------------------------------------------

    def _restore(self, ckpt: Path) -> None:
        """The checkpoint's state. Actor, optimizer and drafter come from DCP, whatever the
        world size that wrote them; a rank the checkpoint has no files of (a resume on more
        ranks) keeps the fresh RNG streams and policy state a run starting now would have."""
        self.start_step = ts.read_next_step(ckpt)
        ckpt_io.load_actor(self.actor, self.optimizer, ckpt / ckpt_io.ACTOR_DCP, self.ckpt_group)
        if self.spot is not None and (ckpt / ckpt_io.DRAFTER_DCP).is_dir():
            meta = ckpt_io.load_drafter(
                self.spot.drafter, self.spot.optimizer, ckpt / ckpt_io.DRAFTER_DCP, self.ckpt_group
            )
            self.spot.version = int(meta["version"])
            self.spot.update_s = float(meta["update_s"])
        if not (ckpt / f"rank{self.rank}.pt").is_file():
            return
        state = torch.load(ckpt / f"rank{self.rank}.pt", weights_only=False)
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "engine_generator" in state:  # the vLLM backend's sampling seeds are stateless
            self.engine.generator.set_state(state["engine_generator"])
        ts.load_policy_state(ckpt, self.rank, self.spec_policy)
        if self.spot is not None and "spot_data_generator" in state:
            self.spot.data_gen.set_state(state["spot_data_generator"])
            self.spot.noise_gen.set_state(state["spot_noise_generator"])
            self.spot.previous = [TrainRecord(*r) for r in state["previous_harvest"]]

    def _checkpoint(self, next_step: int) -> None:
        """Write checkpoint ``next_step`` into its temporary directory: this rank's RNG and
        policy files, the actor + AdamW state (DCP, every rank), the Hugging Face actor and the
        vLLM drafter (rank 0), and start the drafter's asynchronous DCP save. The directory is
        committed by ``_finish_checkpoint`` once that save is done (after the next rollout)."""
        self._finish_checkpoint()  # the previous one first: one write in flight at most
        tmp = ts.tmp_checkpoint_dir(self.out, next_step)
        if self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if hasattr(self.engine, "generator"):  # torch engine; vLLM seeds per (step, request)
            state["engine_generator"] = self.engine.generator.get_state()
        if self.spot is not None:
            state["spot_data_generator"] = self.spot.data_gen.get_state()
            state["spot_noise_generator"] = self.spot.noise_gen.get_state()
            state["previous_harvest"] = [
                (r.token_ids, r.num_prompt_tokens, r.hidden) for r in self.spot.previous
            ]
        torch.save(state, tmp / f"rank{self.rank}.pt")
        ts.save_policy_state(tmp, self.rank, self.spec_policy)
        ckpt_io.save_actor(self.actor, self.optimizer, tmp / ckpt_io.ACTOR_DCP, self.ckpt_group)
        weights = self._actor_weights()  # a collective when sharded: every rank gathers
        if self.rank == 0:
            save_hf(self.actor, tmp / "actor", weights)
            ts.copy_tokenizer(self.cfg.model_dir, tmp / "actor")
            if self.engine.drafter is not None or self.spot is not None:
                export_vllm(self._drafter(), tmp / "drafter")
        future = None
        if self.spot is not None:
            meta = {"version": self.spot.version, "update_s": self.spot.update_s}
            future = ckpt_io.save_drafter_async(
                self.spot.drafter,
                self.spot.optimizer,
                meta,
                tmp / ckpt_io.DRAFTER_DCP,
                self.ckpt_group,
            )
        self.pending_checkpoint = (future, tmp, next_step)
        if future is None or not self.is_async_checkpoint:
            self._finish_checkpoint()

    def _finish_checkpoint(self) -> None:
        """Wait for the pending checkpoint's drafter write on every rank, then rank 0 writes
        ``state.json`` and the manifest and renames the directory into place (atomic)."""
        if self.pending_checkpoint is None:
            return
        future, tmp, next_step = self.pending_checkpoint
        self.pending_checkpoint = None
        if future is not None:
            future.result()
        dist.barrier()
        if self.rank == 0:
            ts.write_state(
                tmp,
                next_step,
                num_workers=self.cfg.num_workers,
                data_position=self.data.position(next_step, self.cfg.prompts_per_step),
            )
            ts.commit(tmp, ts.checkpoint_dir(self.out, next_step))
        dist.barrier()

    def _actor_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full weights; gathered from the shards (a collective every rank calls)
        under FSDP2 — the resharding from training to rollout that veRL and TLT do."""
        if self.cfg.fsdp_size > 1:
            from tltrun.train.fsdp import full_state_dict

            return full_state_dict(self.actor)
        return self.actor.state_dict()

    def _drafter(self) -> EagleDrafter:
        return self.spot.drafter if self.spot is not None else self.engine.drafter

    # ---- the RL loop ------------------------------------------------------------------------

    def run(self) -> None:
        cfg = self.cfg
        steps = range(self.start_step, cfg.num_steps)
        bar = tqdm(steps, desc="tltrun train", unit="step", disable=self.rank != 0)
        for step in bar:
            row = self.step(step)
            if self.rank == 0:
                bar.set_postfix(
                    reward=f"{row['reward_mean']:.3f}", rollout_s=f"{row['rollout_s']:.1f}"
                )
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.num_steps:
                self._checkpoint(step + 1)
        self._finish_checkpoint()
        weights = self._actor_weights()
        if self.rank == 0:
            final = self.out / "final"
            save_hf(self.actor, final / "actor", weights)
            ts.copy_tokenizer(cfg.model_dir, final / "actor")
            if self.engine.drafter is not None or self.spot is not None:
                export_vllm(self._drafter(), final / "drafter")
        dist.barrier()

    def step(self, step: int) -> dict:
        cfg = self.cfg
        start, count = self.share
        rows = self.data.step_rows(step, cfg.prompts_per_step)
        requests, by_group = [], {}
        names = group_names(rows)
        for row, name in zip(
            rows[start : start + count], names[start : start + count], strict=True
        ):
            ids = tuple(self.tok.encode_prompt(row.prompt))
            # prompt_id: the history drafter's key for this prompt's earlier rollouts (#20)
            for g in range(cfg.group_size):
                requests.append(
                    Request(f"{name}/{g}", ids, cfg.max_new_tokens, prompt_id=row.prompt_id)
                )
            by_group[name] = row
        dist.barrier()  # a common start: rollout times are comparable across workers
        t0 = self.clock()
        result = self.engine.generate(requests, self.spec_policy, step)
        _test_rollout_delay(self.rank)
        finish_s = self.clock() - t0
        spot = SpotStats()
        if self.spot is not None:
            records = [_record(h) for h in self.engine.pop_harvest()]
            order = self.spot.announce_done(step)
            if cfg.is_deterministic:
                spot = self.spot.run_budget(step, records)
            else:
                spot = self.spot.run_idle(step, order, records, t0)
            self.spot.sync_end_of_step(spot.num_updates, cfg.is_deterministic)
            if self.engine.drafter is not None:
                self.engine.update_drafter(self.spot.drafter.state_dict())
            if self.rank == 0:  # the drafter after preemption, for vLLM / the next run
                ts.export_drafter_atomic(self.spot.drafter, self.out / "drafter")
        else:
            dist.barrier()
        self._finish_checkpoint()  # the last checkpoint's drafter was written meanwhile
        rollout_end_s = self.clock() - t0
        t_reward = self.clock()
        by_id = {o.id: o for o in result.outputs}
        outputs = [by_id[r.id] for r in requests]
        items, scored = self._score(step, requests, outputs, by_group)
        reward_s = self.clock() - t_reward
        samples = [
            Sample(r.id.rpartition("/")[0], r.prompt_token_ids, tuple(o.output_token_ids), reward)
            for r, o, (reward, _, _) in zip(requests, outputs, scored, strict=True)
        ]
        dump = self._dump_rows(step, requests, outputs, items, scored, samples, by_group)
        t1 = self.clock()
        grpo = grpo_update(
            self.actor,
            self.ref,
            self.optimizer,
            samples,
            self.gcfg,
            cfg.temperature,
            self.tok.pad_id,
            all_reduce_sum=_all_reduce_sum,
            autocast_dtype=self.autocast_dtype,
        )
        self.engine.update_weights(self._actor_weights())
        train_s = self.clock() - t1
        t_eval = self.clock()
        evaluation = self.evaluate(step) if self.is_eval_step(step) else None
        eval_s = self.clock() - t_eval
        report = {
            "actor_sha1": _sha1(self.engine.model.state_dict()),
            "drafter_sha1": _sha1(self._drafter().state_dict()) if self._drafter() else "",
            "rollout_sha1": _sha1({o.id: torch.tensor(o.output_token_ids) for o in result.outputs}),
            "result": result,
            "rewards": [s.reward for s in samples],
            "reward_errors": [e for _, _, e in scored if e],
            "reward_s": reward_s,
            "dump": dump,
            "eval": evaluation,
            "eval_s": eval_s,
            "finish_s": finish_s,
            "rollout_end_s": rollout_end_s,
            "train_s": train_s,
            "spot": asdict(spot),
        }
        gathered = [None] * cfg.num_workers if self.rank == 0 else None
        dist.gather_object(report, gathered, dst=0)
        if self.rank != 0:
            return {}
        row = self._log(step, gathered, grpo, self.clock() - t0)
        return row

    # ---- rewards, the rollout dump and evaluation ---------------------------------------------

    def _score(
        self, step: int, requests, outputs, by_group
    ) -> tuple[list[RewardItem], list[tuple[float, float, str]]]:
        """Per response its reward input (prompt and response text) and (shaped reward, raw
        reward, error or ""); the rewards run in the pool."""
        items = []
        for r, o in zip(requests, outputs, strict=True):
            row = by_group[r.id.rpartition("/")[0]]
            items.append(
                RewardItem(
                    sample_id=f"step{step}/{r.id}",
                    prompt=row.prompt_text,  # chat messages as "role: content" lines
                    response=self.tok.decode(o.output_token_ids),
                    answer=row.answer,
                    meta=row.meta,
                )
            )
        scored = []
        for item, o, outcome in zip(items, outputs, self.rewards.score(items), strict=True):
            shaped = apply_shaping(
                outcome.reward,
                num_response_tokens=len(o.output_token_ids),
                max_response_tokens=self.cfg.max_new_tokens,
                shaping=self.shaping,
                is_format_ok=outcome.is_format_ok,
            )
            source = by_group[o.id.rpartition("/")[0]].source
            error = f"{item.sample_id} ({source}): {outcome.error}" if outcome.error else ""
            scored.append((shaped, outcome.reward, error))
        return items, scored

    def _dump_rows(self, step, requests, outputs, items, scored, samples, by_group) -> list[dict]:
        """This worker's rows of ``rollouts/step_<n>.jsonl`` (rank 0 writes them all)."""
        if not self.cfg.dump_rollouts:
            return []
        advantages = group_advantages(samples, self.gcfg.adv_eps)
        rows = []
        for r, o, item, (reward, raw, error), adv in zip(
            requests, outputs, items, scored, advantages, strict=True
        ):
            row = by_group[r.id.rpartition("/")[0]]
            strategies = {k: sum(v) for k, v in o.accept_hist_by_strategy.items() if sum(v)}
            rows.append(
                {
                    "step": step,
                    "id": r.id,
                    "prompt_id": row.prompt_id,
                    "source": row.source,
                    "prompt": self.tok.prompt_text(row.prompt),  # as the model saw it
                    "response": item.response,
                    "answer": row.answer,
                    "num_prompt_tokens": len(r.prompt_token_ids),
                    "num_response_tokens": len(o.output_token_ids),
                    "finish": o.finish,
                    "reward": reward,
                    **({"raw_reward": raw} if raw != reward else {}),
                    **({"reward_error": error} if error else {}),
                    "advantage": adv,
                    # SD verify iterations per strategy ("off": decoded without SD throughout)
                    "sd_strategies": strategies or {"off": 0},
                }
            )
        return rows

    def is_eval_step(self, step: int) -> bool:
        every = self.cfg.eval_every
        return bool(every and self.data.eval_rows) and (
            (step + 1) % every == 0 or step + 1 == self.cfg.num_steps
        )

    def evaluate(self, step: int) -> dict:
        """Greedy (``eval_num_samples`` 1) or sampled responses to this worker's share of the
        evaluation rows, scored by the run's reward. Training is left exactly as it was: the
        engine's sampling generator is restored, eval requests carry no prompt id (the history
        drafter forgets them), their harvest is discarded, and the run's SD policy is not
        consulted (plain decoding: SD is lossless, the responses are the same)."""
        cfg = self.cfg
        share = self.data.eval_rows[self.rank :: cfg.num_workers]
        num = cfg.eval_num_samples
        sampling = SamplingParams(0.0) if num == 1 else SamplingParams(cfg.temperature, cfg.top_p)
        requests, by_group = [], {}
        for i, row in enumerate(share):
            ids = tuple(self.tok.encode_prompt(row.prompt))
            requests += [Request(f"e{i}/{g}", ids, cfg.max_new_tokens) for g in range(num)]
            by_group[f"e{i}"] = row
        gen_state = getattr(self.engine, "generator", None)
        gen_state = gen_state.get_state() if gen_state is not None else None
        if hasattr(self.engine, "backend"):  # vLLM: seeds per (step, request), no generator
            saved, self.engine.backend.sampling = self.engine.backend.sampling, sampling
        else:
            saved, self.engine.config = (
                self.engine.config,
                replace(self.engine.config, sampling=sampling),
            )
        try:
            result = (
                self.engine.generate(requests, make_policy("nospec"), step) if requests else None
            )
        finally:
            if hasattr(self.engine, "backend"):
                self.engine.backend.sampling = saved
            else:
                self.engine.config = saved
            if gen_state is not None:
                self.engine.generator.set_state(gen_state)
            self.engine.pop_harvest()
        outputs = (
            [] if result is None else [{o.id: o for o in result.outputs}[r.id] for r in requests]
        )
        scored = self._score(step, requests, outputs, by_group)[1] if requests else []
        return {
            "rewards": [raw for _, raw, _ in scored],
            "lengths": [len(o.output_token_ids) for o in outputs],
            "truncated": sum(o.finish == "length" for o in outputs),
            "num_prompts": len(share),
            "errors": [e for _, _, e in scored if e],
        }

    def _log(self, step: int, gathered: list[dict], grpo: dict, step_s: float) -> dict:
        outputs = [o for g in gathered for o in g["result"].outputs]
        iterations = [it for g in gathered for it in g["result"].iterations]
        finishes = [g["finish_s"] for g in gathered]
        rollout_s = max(finishes)
        first = gathered[0]["result"]
        merged = RolloutResult(
            outputs=outputs,
            iterations=iterations,
            wall_s=rollout_s,
            backend=first.backend,
            shares_prompts=first.shares_prompts,
            prefix_block_tokens=first.prefix_block_tokens,
        )
        spots = [g["spot"] for g in gathered]
        extra = {
            "train_s": max(g["train_s"] for g in gathered),
            "drafter_train_s": max(s["train_s"] for s in spots),
            "drafter_trained_tokens": sum(s["trained_tokens"] for s in spots),
            "worker_rollout_s": finishes,
            "instance_prompts": instance_prompts([g["result"] for g in gathered]),
            "max_running_requests": self.cfg.max_running_requests,
            "is_prompt_id_stable": True,  # groups are named by dataset prompt id (group_names)
        }
        trace_step = measured_step(
            step,
            merged,
            policy_name=self.cfg.policy,
            hardware=hardware_name(self.cfg.device),
            extra=extra,
            policy_config=self.cfg.policy_settings(),
            policy_seed=self.cfg.seed,
        )
        step_dict = trace_to_dict(Trace(meta={}, steps=(trace_step,)))["steps"][0]
        ts.append_jsonl(self.out / "trace_steps.jsonl", step_dict)
        ts.write_trace(self.out, self._trace_meta())
        rewards = [r for g in gathered for r in g["rewards"]]
        lengths = np.array([len(o.output_token_ids) for o in outputs])
        summary = trace_step.measured
        decode = [it for it in iterations if not it.is_prefill]
        row = {
            "step": step,
            "reward_mean": float(np.mean(rewards)),
            "reward_std": float(np.std(rewards)),
            "response_tokens_mean": float(lengths.mean()),
            "response_tokens_median": float(np.median(lengths)),
            "response_tokens_p90": float(np.percentile(lengths, 90)),
            "response_tokens_max": int(lengths.max()),
            "num_truncated": sum(o.finish == "length" for o in outputs),
            "rollout_s": rollout_s,
            "worker_rollout_s": finishes,
            "train_s": extra["train_s"],
            "drafter_train_s": extra["drafter_train_s"],
            "drafter_updates": max(s["num_updates"] for s in spots),
            "drafter_trained_tokens": extra["drafter_trained_tokens"],
            "idle_worker_s": sum(rollout_s - f for f in finishes),
            # from the last rollout's end to the end of spot training and the drafter sync:
            # deterministic mode's wait for the spot budgets (otherwise one update at most)
            "spot_wait_s": max(g["rollout_end_s"] for g in gathered) - rollout_s,
            "accept_len": summary.mean_accept_len,
            "sd_on_fraction": sum(it.strategy != "off" for it in decode) / max(len(decode), 1),
            "step_s": step_s,
            **{k: grpo[k] for k in ("loss", "kl", "clip_frac", "grad_norm", "num_tokens")},
            "spot_decisions": [s["decisions"] for s in spots],
            # per worker, after the end-of-step syncs: equal weights <=> equal digests
            "actor_sha1": [g["actor_sha1"] for g in gathered],
            "drafter_sha1": [g["drafter_sha1"] for g in gathered],
            "rollout_sha1": [g["rollout_sha1"] for g in gathered],
        }
        errors = [e for g in gathered for e in g["reward_errors"]]
        row["reward_s"] = max(g["reward_s"] for g in gathered)
        row["reward_errors"] = len(errors)
        row["data_position"] = self.data.position(step, self.cfg.prompts_per_step)
        evals = [g["eval"] for g in gathered if g["eval"] is not None]
        if evals:
            rewards_e = [r for e in evals for r in e["rewards"]]
            lengths_e = [n for e in evals for n in e["lengths"]]
            errors += [err for e in evals for err in e["errors"]]
            row.update(
                {
                    "eval_reward_mean": float(np.mean(rewards_e)) if rewards_e else 0.0,
                    "eval_response_tokens_mean": float(np.mean(lengths_e)) if lengths_e else 0.0,
                    "eval_truncated_fraction": sum(e["truncated"] for e in evals)
                    / max(len(lengths_e), 1),
                    "eval_num_prompts": sum(e["num_prompts"] for e in evals),
                    "eval_s": max(g["eval_s"] for g in gathered),
                }
            )
        if errors:  # each one with its sample id; the log row counts them
            with (self.out / "reward_errors.log").open("a") as fh:
                fh.writelines(f"step {step}: {e}\n" for e in errors)
        if self.cfg.dump_rollouts:
            ts.write_jsonl_atomic(
                self.out / "rollouts" / f"step_{step:06d}.jsonl",
                [r for g in gathered for r in g["dump"]],
            )
        ts.append_jsonl(self.out / "log.jsonl", row)
        if self.tensorboard is not None:
            for key, value in row.items():
                if key != "step" and type(value) in (int, float):
                    group = "eval" if key.startswith("eval_") else "train"
                    self.tensorboard.add_scalar(f"{group}/{key}", value, step)
            self.tensorboard.flush()
        return row

    def _trace_meta(self) -> dict:
        return {
            "source": f"tltrun train (policy {self.cfg.policy}, {self.cfg.num_workers} workers)",
            "model": self.cfg.model_dir,
            "max_response_tokens": self.cfg.max_new_tokens,
            "group_size": self.cfg.group_size,
        }


def _test_rollout_delay(rank: int) -> None:
    """Test hook: ``TLTRUN_TEST_ROLLOUT_DELAY="RANK:SECONDS"`` makes worker RANK finish its
    rollouts that much later (tests/test_deterministic.py: a slow worker changes the spot
    updates of a run, not those of a --deterministic one). Not for use outside tests."""
    spec = os.environ.get("TLTRUN_TEST_ROLLOUT_DELAY")
    if spec:
        delayed, _, seconds = spec.partition(":")
        if int(delayed) == rank:
            time.sleep(float(seconds))


def group_names(rows) -> list[str]:
    """The name of each row's GRPO group in a step: its dataset prompt id, so that the trace's
    prompt ids name prompts across steps (``MeasuredStep.is_prompt_id_stable``: a prompt's
    earlier rollouts are the history drafter's history, issue #20); a prompt drawn twice in
    one step gets ``#1``, ``#2``, ... on its later copies (their groups stay apart)."""
    seen: dict[str, int] = {}
    names = []
    for row in rows:
        k = seen.get(row.prompt_id, 0)
        seen[row.prompt_id] = k + 1
        names.append(row.prompt_id if k == 0 else f"{row.prompt_id}#{k}")
    return names


def _record(h: HarvestRecord) -> TrainRecord:
    return TrainRecord(h.token_ids, h.num_prompt_tokens, h.hidden)


def _sha1(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha1()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t
