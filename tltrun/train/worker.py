"""One worker process (one torch.distributed rank) of ``tltrun train``, started by torchrun or by
``tltrun train``'s own launcher (tltrun.train.elastic, tltrun.train.launch): rollout with its
own engine, spot drafter training when idle (tltrun.train.spot), rewards, rollout dump and
evaluation of its responses (tltrun.train.responses), data-parallel GRPO update (train.grpo),
rank 0's log row and trace step (train.step_log), checkpoints (train.state). Not run directly.

Actor update: DATA PARALLEL. Every worker holds the same actor and AdamW state; each computes
the GRPO loss of its own groups over the global token count, the gradients are summed with
``all_reduce`` and every worker takes the identical step (gloo's all_reduce leaves bitwise
identical sums on every rank; a test compares the workers' weights). Each worker then copies
the actor into its engine with ``update_weights``; the reference model stays the initial one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

from tltrun.data.rewards import RewardPool, Shaping
from tltrun.data.tokenizer import copy_tokenizer, load_tokenizer
from tltrun.model.config import read_config
from tltrun.model.drafter import EagleDrafter, export_vllm, load_drafter, trainable_copy
from tltrun.model.hf_checkpoint import load_hf, save_hf
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import SamplingParams
from tltrun.rollout.slot_state import HarvestRecord
from tltrun.train import checkpoint as ckpt_io
from tltrun.train import elastic, step_log
from tltrun.train import state as ts
from tltrun.train.config import TrainConfig
from tltrun.train.drafter_training import DrafterTrainConfig, TrainRecord, num_trained_pairs
from tltrun.train.grpo import GRPOConfig, Sample, autocast_dtype_for, grpo_update, make_optimizer
from tltrun.train.heartbeat import Heartbeat, PeerWatch
from tltrun.train.prompts import load_run_data, max_request_tokens, reward_spec
from tltrun.train.responses import ResponseScorer
from tltrun.train.run_logs import tensorboard_writer
from tltrun.train.spot import ModelledFeedback, SpotStats, SpotTrainer
from tltrun.train.step_log import WorkerStepReport, sha1_digest, write_step_record
from tltrun.train.subset_groups import SubsetGroups
from tltrun.train.tasks import TaskConfig
from tltsim.policy import PolicyStateError, SpotTrainerPolicy, make_policy


@record
def worker_entry(cfg: TrainConfig, task: TaskConfig, resume: str | None, launcher_pid: int):
    """What every rank of ``tltrun train``'s own launcher runs (tltrun.train.elastic.launch_local;
    rank and rendezvous from torchrun's environment). ``errors.record`` writes an exception into
    the agent's error file, from which the launcher reports it (tltrun.train.launch)."""
    elastic.die_with_launcher(launcher_pid)  # first: nothing of the run happens in an orphan
    elastic.interrupt_once()
    torch.set_num_threads(cfg.num_threads)
    env = elastic.init_process_group(cfg.device)
    run_worker(env, cfg, task, resume)


def run_worker(env: elastic.RankEnv, cfg: TrainConfig, task: TaskConfig, resume: str | None):
    """One rank's run, in a process group already initialised (``elastic.init_process_group``)."""
    worker = None
    # beats from the start: a rank still loading its model is waited for by faster ones
    heartbeat = Heartbeat(elastic.side_store(env), env.rank).start()
    try:
        worker = Worker(env.rank, cfg, task, elastic.side_store(env), resume)
        worker.run()
    finally:
        heartbeat.stop()
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
        self.max_positions = read_config(cfg.model_dir).max_position_embeddings
        self.data = load_run_data(
            cfg, task, lambda row: len(self.tok.encode_prompt(row.prompt)), self.max_positions
        )
        self.rewards = RewardPool(
            reward_spec(cfg, is_module_checked=False),  # checked by the launcher
            num_processes=cfg.reward_processes,
            timeout_s=cfg.reward_timeout_s,
            on_error=cfg.reward_errors,
        )
        shaping = Shaping(
            overlong_buffer_tokens=cfg.overlong_buffer_tokens,
            overlong_penalty=cfg.overlong_penalty,
            format_penalty=cfg.format_penalty,
        )
        self.scorer = ResponseScorer(cfg, self.tok, self.rewards, shaping)
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
        self.autocast_dtype = autocast_dtype_for(cfg.dtype_name, cfg.device)
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
        is_harvesting = cfg.is_spot_harvesting
        drafter_src = ckpt / "drafter" if ckpt and (ckpt / "drafter").is_dir() else cfg.drafter_dir
        drafter = (
            load_drafter(drafter_src, target)
            if drafter_src
            else EagleDrafter.for_target(target, seed=cfg.seed)
        )
        start, count = cfg.shares()[rank]
        self.share = (start, count)
        max_running = cfg.max_running(count)
        max_model_len = max_request_tokens(cfg, task, self.max_positions)
        sampling = SamplingParams(cfg.temperature, cfg.top_p)
        # the engine casts its drafter to its dtype in place: its own copy, so that the spot
        # trainer's fp32 master weights start from the fp32 load (they were bf16-rounded)
        # a policy that drafts with none still carries the run's drafter into its checkpoints
        # (a tlt -> nospec -> tlt resume ended with a fresh, untrained one)
        self.carried_drafter = drafter if drafter_src else None
        engine_drafter = copy.deepcopy(drafter) if cfg.policy != "nospec" else None
        if cfg.backend == "vllm":
            from tltrun.train.vllm_rollout import worker_rollout

            self.engine = worker_rollout(
                cfg, rank, actor_dir, target, engine_drafter, (max_running, max_model_len),
                sampling, is_harvesting, self.clock, self.tok.eos_ids,
            )  # fmt: skip
        else:
            self.engine = RolloutEngine(
                target,
                engine_drafter,
                EngineConfig(
                    max_running_requests=max_running,
                    max_model_len=max_model_len,
                    sampling=sampling,
                    seed=cfg.worker_seed(rank),
                    device=cfg.device,
                    dtype=cfg.dtype_name,
                    instance=rank,
                    is_harvesting=is_harvesting,
                    eos_token_ids=self.tok.eos_ids,
                    **cfg.engine_settings(),
                ),
                clock=self.clock,
            )
        self.spec_policy = make_policy(cfg.policy, seed=cfg.seed, **cfg.policy_settings())
        if cfg.is_deterministic:
            self.spec_policy = ModelledFeedback(self.spec_policy)
        if cfg.eval_every and cfg.backend == "torch":  # evaluations decode with nospec: one
            # CUDA-graph pool for both (a tlt pool lacks small decode graphs, so each
            # evaluation recaptured a pool and the next rollout recaptured the first)
            self.engine.prepare_graphs([self.spec_policy, make_policy("nospec")])
        self.spot = None
        if is_harvesting:
            groups = SubsetGroups(store, rank, elastic.COLLECTIVE_TIMEOUT_S)
            # on the engine's device (a CPU copy failed against a CUDA engine's shared head)
            trainable = trainable_copy(drafter, self.engine.model)
            dcfg = DrafterTrainConfig(lr=cfg.drafter_lr, batch_size=cfg.drafter_batch_size)
            self.spot = SpotTrainer(
                rank,
                cfg.num_workers,
                store,
                groups,
                trainable,
                SpotTrainerPolicy(max_epochs=cfg.spot_max_epochs),
                dcfg,
                seed=cfg.worker_seed(rank, stream=500),
                poll_s=cfg.poll_s,
                clock=self.clock,
                wait_timeout_s=elastic.COLLECTIVE_TIMEOUT_S,
                watch=PeerWatch(store),
            )
        self.start_step = 0
        if ckpt:
            self._restore(ckpt)
        self.tensorboard = (
            tensorboard_writer(self.out, self.start_step, cfg.tensorboard) if rank == 0 else None
        )

    # ---- checkpoints ------------------------------------------------------------------------

    def _restore(self, ckpt: Path) -> None:
        """The checkpoint's state. Actor, optimizer and drafter come from DCP, whatever the
        world size that wrote them; a rank the checkpoint has no files of (a resume on more
        ranks) keeps the fresh RNG streams and policy state a run starting now would have."""
        self.start_step = ts.read_next_step(ckpt)
        ckpt_io.load_actor(self.actor, self.optimizer, ckpt / ckpt_io.ACTOR_DCP, self.ckpt_group)
        # the optimizer state carries its learning rate: a resume's --lr / --drafter-lr (an
        # --override-config) applies from the resumed step (it was recorded and ignored)
        ckpt_io.set_lr(self.optimizer, self.cfg.lr)
        if self.spot is not None and (ckpt / ckpt_io.DRAFTER_DCP).is_dir():
            meta = ckpt_io.load_drafter(
                self.spot.drafter, self.spot.optimizer, ckpt / ckpt_io.DRAFTER_DCP, self.ckpt_group
            )
            ckpt_io.set_lr(self.spot.optimizer, self.cfg.drafter_lr)
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
        if "history" in state and hasattr(self.engine, "history"):  # other settings: empty
            self.engine.history.load_state_dict(state["history"])
        # --override-config changed the SD policy or its settings (the launcher said so): what
        # the old one learned does not apply, and this one starts afresh
        if ckpt_io.is_reward_mode_kept(self.out, self.start_step, self.cfg.is_deterministic):
            with contextlib.suppress(PolicyStateError):
                ckpt_io.load_policy_state(ckpt, self.rank, self.spec_policy)
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
        if self.rank == 0:  # anything there is a killed attempt's: never commit it as ours
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        state = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if hasattr(self.engine, "generator"):  # torch engine; vLLM seeds per (step, request)
            state["engine_generator"] = self.engine.generator.get_state()
        if hasattr(self.engine, "history"):  # the torch engine's history drafter index
            state["history"] = self.engine.history.state_dict()
        if self.spot is not None:
            state["spot_data_generator"] = self.spot.data_gen.get_state()
            state["spot_noise_generator"] = self.spot.noise_gen.get_state()
            state["previous_harvest"] = [
                (r.token_ids, r.num_prompt_tokens, r.hidden) for r in self.spot.previous
            ]
        with ckpt_io.explain_write_failure(tmp):
            torch.save(state, tmp / f"rank{self.rank}.pt")
            ckpt_io.save_policy_state(tmp, self.rank, self.spec_policy)
            ckpt_io.save_actor(self.actor, self.optimizer, tmp / ckpt_io.ACTOR_DCP, self.ckpt_group)
            weights = self._actor_weights()  # a collective when sharded: every rank gathers
            if self.rank == 0:
                save_hf(self.actor, tmp / "actor", weights)
                copy_tokenizer(self.cfg.model_dir, tmp / "actor")
                if self._drafter() is not None:
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
        with ckpt_io.explain_write_failure(tmp):
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
                ts.prune_checkpoints(self.out, self.cfg.keep_checkpoints, next_step)
        dist.barrier()

    def _actor_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full weights; gathered from the shards (a collective every rank calls)
        under FSDP2 — the resharding from training to rollout that veRL and TLT do."""
        if self.cfg.fsdp_size > 1:
            from tltrun.train.fsdp import full_state_dict

            return full_state_dict(self.actor)
        return self.actor.state_dict()

    def _drafter(self) -> EagleDrafter | None:
        """The run's drafter now: the spot trainer's, else the engine's, else the one the run
        was given or resumed with (None: the run has none)."""
        if self.spot is not None:
            return self.spot.drafter
        return self.engine.drafter if self.engine.drafter is not None else self.carried_drafter

    # ---- the RL loop ------------------------------------------------------------------------

    def run(self) -> None:
        cfg = self.cfg
        steps = range(self.start_step, cfg.num_steps)
        tqdm.set_lock(threading.RLock())  # tqdm's own: a semaphore each killed worker leaked
        # a resumed run counts on from its checkpoint's step (as sft and train-drafter do)
        bar = tqdm(steps, desc="tltrun train", unit="step", disable=self.rank != 0,
                   initial=self.start_step, total=max(cfg.num_steps, self.start_step))  # fmt: skip
        is_said = False  # every reward call of a step failed: said once
        for step in bar:
            row = self.step(step)
            if self.rank == 0:
                bar.set_postfix(
                    reward=f"{row['reward_mean']:.3f}", rollout_s=f"{row['rollout_s']:.1f}"
                )
                is_said = is_said or step_log.said_reward_failed(row, cfg, self.out, step)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.num_steps:
                self._checkpoint(step + 1)
        self._finish_checkpoint()
        weights = self._actor_weights()
        if self.rank == 0:  # whole or not at all: final/ says the run finished (a resume)
            tmp = self.out / ".tmp_final"
            shutil.rmtree(tmp, ignore_errors=True)
            save_hf(self.actor, tmp / "actor", weights)
            copy_tokenizer(cfg.model_dir, tmp / "actor")
            if self._drafter() is not None:
                export_vllm(self._drafter(), tmp / "drafter")
            # the steps it holds: a resume is "finished" only where they are the checkpoint's
            # (a final/ of fewer steps stays from before a resume that ran more)
            trained = {"num_steps": max(cfg.num_steps, self.start_step)}
            (tmp / ts.FINAL_STATE).write_text(json.dumps(trained) + "\n")
            ts.commit(tmp, self.out / "final")
        dist.barrier()

    def step(self, step: int) -> dict:
        cfg = self.cfg
        rows = self.data.step_rows(step, cfg.prompts_per_step)
        requests, by_group = self.scorer.step_requests(rows, self.share)
        dist.barrier()  # a common start: rollout times are comparable across workers
        t0 = self.clock()
        result = self.engine.generate(requests, self.spec_policy, step)
        _test_rollout_delay(self.rank)
        finish_s = self.clock() - t0
        spot = SpotStats()
        if self.spot is not None:
            records = [_record(h) for h in self.engine.pop_harvest()]
            records = [r for r in records if num_trained_pairs(r) > 0]  # (nothing to train)
            order = self.spot.announce_done(step)
            if cfg.is_deterministic:
                spot = self.spot.run_budget(step, records)
            else:
                spot = self.spot.run_idle(step, order, records, t0)
            src = self.spot.sync_end_of_step(spot.num_updates, cfg.is_deterministic, step)
            if cfg.is_deterministic and src != self.rank:
                # the workers trained apart and only rank src's drafter is kept: the others'
                # tokens trained nothing that stays (the log summed them all)
                spot.trained_tokens = 0
            if self.engine.drafter is not None:
                self.engine.update_drafter(self.spot.drafter.state_dict())
            if self.rank == 0:  # the drafter after preemption, for vLLM / the next run
                ckpt_io.export_drafter_atomic(self.spot.drafter, self.out / "drafter")
        else:
            dist.barrier()
        # before the commit of the last checkpoint (its manifest hashes every file: minutes at
        # 7B), which spot_wait_s counted as waiting for spot training
        rollout_end_s = self.clock() - t0
        self._finish_checkpoint()  # the last checkpoint's drafter was written meanwhile
        t_reward = self.clock()
        by_id = {o.id: o for o in result.outputs}
        outputs = [by_id[r.id] for r in requests]
        items, scored = self.scorer.score(step, requests, outputs, by_group)
        reward_s = self.clock() - t_reward
        samples = [
            Sample(r.id.rpartition("/")[0], r.prompt_token_ids, tuple(o.output_token_ids), reward)
            for r, o, (reward, _, _) in zip(requests, outputs, scored, strict=True)
        ]
        dump = self.scorer.dump_rows(
            step, requests, outputs, items, scored, samples, by_group, self.gcfg.adv_eps
        )
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
        if cfg.device.startswith("cuda"):  # the update's last kernels end inside train_s
            torch.cuda.synchronize(cfg.device)
        train_s = self.clock() - t1
        t_eval = self.clock()
        evaluation = None
        if self.scorer.is_eval_step(step, len(self.data.eval_rows)):
            share = list(self.data.eval_rows[self.rank :: cfg.num_workers])
            evaluation = self.scorer.evaluate(self.engine, step, share)
        eval_s = self.clock() - t_eval
        drafter = self._drafter()
        report = WorkerStepReport(
            actor_sha1=sha1_digest(self.engine.model.state_dict()),
            drafter_sha1=sha1_digest(drafter.state_dict()) if drafter else "",
            rollout_sha1=sha1_digest(
                {o.id: torch.tensor(o.output_token_ids) for o in result.outputs}
            ),
            result=result,
            rewards=[s.reward for s in samples],
            raw_rewards=[raw for _, raw, _ in scored],
            reward_errors=[e for _, _, e in scored if e],
            reward_s=reward_s,
            dump=dump,
            evaluation=evaluation,
            eval_s=eval_s,
            finish_s=finish_s,
            rollout_end_s=rollout_end_s,
            train_s=train_s,
            spot=spot,
        )
        gathered = [None] * cfg.num_workers if self.rank == 0 else None
        dist.gather_object(report, gathered, dst=0)
        if self.rank != 0:
            return {}
        return write_step_record(
            step,
            gathered,
            grpo,
            self.clock() - t0,
            cfg=cfg,
            out=self.out,
            data_position=self.data.position(step, cfg.prompts_per_step),
            tensorboard=self.tensorboard,
        )


def _test_rollout_delay(rank: int) -> None:
    """Test hook: ``TLTRUN_TEST_ROLLOUT_DELAY="RANK:SECONDS"`` makes worker RANK finish its
    rollouts that much later (tests/test_deterministic.py: a slow worker changes the spot
    updates of a run, not those of a --deterministic one). Not for use outside tests."""
    spec = os.environ.get("TLTRUN_TEST_ROLLOUT_DELAY")
    if spec:
        delayed, _, seconds = spec.partition(":")
        if int(delayed) == rank:
            time.sleep(float(seconds))


def _record(h: HarvestRecord) -> TrainRecord:
    return TrainRecord(h.token_ids, h.num_prompt_tokens, h.hidden)


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t
