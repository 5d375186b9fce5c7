"""The rollout engine of ``tltrun train --backend vllm``: one ``VLLMBackend`` per worker, with
torch mirrors of the rollout weights, behind the surface ``tltrun.train.worker`` drives
(``generate``, ``update_weights``, ``update_drafter``, ``pop_harvest``, ``model``, ``drafter``).

vLLM returns tokens, not hidden states, so spot drafter training cannot harvest them during the
rollout as the torch engine does. ``pop_harvest`` recomputes them instead: one cache-free
forward of the torch mirror of the target over each finished response
(``tltrun.train.drafter_training.records_from_outputs``). The worker calls it after its own rollout, and
the mirror holds exactly the weights vLLM sampled with (the actor update comes after the
rollout). The recompute costs one prefill per response: on a worker that finishes early it uses
time the long tail leaves idle, but the worker that finishes last also recomputes before it
announces the end of the rollout, so it lengthens the step (``rollout_end_s`` includes it,
``drafter_train_s`` does not). The torch engine harvests the hidden states for free.

Policies run with ``control="iteration"``: the policy's ``decide()`` before every vLLM step,
exact for chain strategies (``tltrun.rollout.vllm_backend``; a tree strategy ``d_k_v`` runs as chain
``d``). The engine starts with the drafter the run starts with (exported to a temporary
directory in vLLM's EAGLE layout); later drafters arrive through ``update_drafter``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from tltrun.model.drafter import EagleDrafter, export_vllm
from tltrun.model.transformer import Transformer
from tltrun.rollout.engine_config import DTYPES
from tltrun.rollout.interface import Request, RolloutResult, SamplingParams
from tltrun.rollout.slot_state import HarvestRecord
from tltrun.rollout.vllm_backend import VLLMBackend, VLLMBackendConfig
from tltrun.train.drafter_training import records_from_outputs
from tltsim.lifetime import owned_tempdir
from tltsim.policy import SpecPolicy


class VLLMTrainRollout:
    """A worker's vLLM engine for training; ``drafter=None`` starts it without SD."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        target: Transformer,
        drafter: EagleDrafter | None,
        config: VLLMBackendConfig,
        sampling: SamplingParams,
        is_harvesting: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.model = target.eval()  # mirror of the rollout weights
        self.drafter = drafter
        self.is_harvesting = is_harvesting
        self._work = Path(owned_tempdir("tlt-vllm-train-"))  # a killed rank's: removed next time
        drafter_dir = None
        if drafter is not None:
            drafter_dir = self._work / "drafter"
            export_vllm(drafter, drafter_dir)
        self.backend = VLLMBackend(str(model_dir), drafter_dir and str(drafter_dir), config,
                                   sampling, clock)  # fmt: skip
        self._finished: list[tuple[str, list[int], int]] = []

    def generate(self, requests: list[Request], policy: SpecPolicy, step: int = 0) -> RolloutResult:
        result = self.backend.generate(requests, policy, step)
        if self.is_harvesting:
            self._finished = [
                (o.id, list(o.prompt_token_ids) + list(o.output_token_ids), len(o.prompt_token_ids))
                for o in result.outputs
            ]
        return result

    def pop_harvest(self) -> list[HarvestRecord]:
        """(token ids, target hidden states) of the last rollout's responses, recomputed by the
        torch mirror (module docstring)."""
        finished, self._finished = self._finished, []
        records = records_from_outputs(self.model, [(ids, n) for _, ids, n in finished])
        return [
            HarvestRecord(
                request_id=rid,
                token_ids=r.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                hidden=r.hidden,
            )
            for (rid, _, _), r in zip(finished, records, strict=True)
        ]

    def discard_harvest(self) -> None:
        """Forget the last rollout's responses without the recompute ``pop_harvest`` runs
        (an evaluation's: the spot trainer never sees them)."""
        self._finished = []

    @torch.no_grad()
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)
        self.backend.update_weights(state_dict)

    @torch.no_grad()
    def update_drafter(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        if self.drafter is None:
            raise ValueError("update_drafter: this engine has no drafter")
        self.drafter.load_state_dict(state_dict)
        self.backend.update_drafter(state_dict)

    def close(self) -> None:
        self.backend.close()
        shutil.rmtree(self._work, ignore_errors=True)


def worker_rollout(
    cfg,
    rank: int,
    actor_dir: str | Path,
    target: Transformer,
    drafter: EagleDrafter | None,
    shape: tuple[int, int],
    sampling: SamplingParams,
    is_harvesting: bool,
    clock: Callable[[], float],
    eos_ids: tuple[int, ...],
) -> VLLMTrainRollout:
    """Worker ``rank``'s engine of ``tltrun train --backend vllm`` (``cfg``: its TrainConfig),
    ``shape`` = (max running requests, max model length): the policy's largest k, a KV cache
    sized for the batch (``kv_cache_bytes``), the tokenizer's stop ids beside the checkpoint's."""
    from tltrun.rollout.vllm_config import kv_cache_bytes, max_draft_steps, vllm_seed

    max_running, max_model_len = shape
    # the mirror on the run's device in the rollout dtype, as the torch engine keeps its model:
    # it stayed a CPU fp32 copy, so on a GPU the harvest's recompute and the spot trainer
    # (bound to it, tltrun.model.drafter.trainable_copy) ran on the CPU
    target = target.to(device=cfg.device, dtype=DTYPES[cfg.dtype_name])
    vcfg = VLLMBackendConfig(
        control="iteration",
        max_draft_steps=max_draft_steps(cfg.policy, cfg.policy_settings()),
        max_num_seqs=max_running,
        max_model_len=max_model_len,
        kv_cache_bytes=kv_cache_bytes(
            target.config, max_running, max_model_len, drafter is not None
        ),
        dtype=cfg.dtype_name,
        seed=vllm_seed(cfg.worker_seed(rank)),
        instance=rank,
    )
    engine = VLLMTrainRollout(actor_dir, target, drafter, vcfg, sampling, is_harvesting, clock)
    # generation_config.json's stop ids too, as the torch engine (EngineConfig)
    backend = engine.backend
    backend.eos_token_ids = tuple(dict.fromkeys((*backend.eos_token_ids, *eos_ids)))
    torch.set_num_threads(cfg.num_threads)  # vLLM's start-up changes it
    return engine
