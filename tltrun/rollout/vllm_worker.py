"""Code vLLM calls back into for ``tltrun.rollout.vllm_backend``: the worker extension that reloads
target and drafter weights in a running engine (runs in vLLM's worker process), and the stat
logger that hands each engine step's scheduler statistics, spec-decode counts included, to the
backend (runs where the engine's front end runs).

Weight sync: the target goes through vLLM's in-place ``reload_weights`` (the model runner's),
the drafter through the same layer-wise reload (``initialize_layerwise_reload`` ->
``load_weights`` -> ``finalize_layerwise_reload``): vLLM's CPU linears repack their weights
after loading, so a plain ``copy_`` into the parameters would not reach the kernels. vLLM logs
"RotaryEmbedding / ParallelLMHead / VocabParallelEmbedding: Failed to load weights" on a drafter
reload: those layers (shared with the target) get no tensors and keep their values, as intended.

vLLM imports ``TLTWorkerExtension`` by name (``worker_extension_cls``) in its worker process and
mixes it into its worker class; the backend calls its methods through ``collective_rpc``. vLLM
is imported lazily, so importing this module needs only torch.
Tested through ``tests/test_vllm_backend.py`` (``pytest -m vllm``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _weights(source: list[tuple[str, torch.Tensor]] | str) -> list[tuple[str, torch.Tensor]]:
    """Tensors handed over directly, or a safetensors file path (the engine-core process's
    msgpack channel turns tensors inside an RPC's arguments into lists, so the multiprocess
    engine gets a file)."""
    if isinstance(source, str):
        from safetensors.torch import load_file

        return list(load_file(source).items())
    return source


class TLTWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called by name through
    ``collective_rpc``, so it works with the in-process and the multiprocess executor alike."""

    def tlt_load_target(self, source: list[tuple[str, torch.Tensor]] | str) -> int:
        weights = _weights(source)
        self.model_runner.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
        return len(weights)

    def tlt_load_drafter(self, source: list[tuple[str, torch.Tensor]] | str) -> int:
        weights = _weights(source)
        # The same layer-wise path vLLM's reload_weights takes for the target: CPU (and
        # quantized) linears repack their weights after loading, so a plain copy_ would not do.
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_draft_model()  # type: ignore[attr-defined]
        if model is None:
            raise RuntimeError("tlt_load_drafter: this engine has no drafter")
        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        with set_current_vllm_config(vllm_config):
            initialize_layerwise_reload(model)
            model.load_weights(iter(weights))
            finalize_layerwise_reload(model, vllm_config.speculative_config.draft_model_config)
        return len(weights)


def stat_logger_factory(sink: list[Any]) -> Callable[..., Any]:
    """A per-engine vLLM stat logger that appends each step's SchedulerStats to ``sink``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _StepStats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                sink.append(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _StepStats
