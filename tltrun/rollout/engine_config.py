"""``EngineConfig``: the torch rollout engine's settings (``tltrun.rollout.engine``), one frozen
dataclass whose fields map 1:1 onto the ``tltrun`` engine flags (``tltrun.cli.args``), with the
device-dependent defaults resolved by its properties (bf16, flex attention and CUDA graphs on
CUDA; fp32, SDPA and eager forwards elsewhere). ``DTYPES`` names the torch dtypes the engine
and its loaders accept.

Run the tests: ``python -m pytest tests/test_engine.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tltrun.model.attention import ATTN_IMPLS
from tltrun.model.config import check_device
from tltrun.model.history_drafter import HistoryConfig
from tltrun.rollout.interface import Request, SamplingParams

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
VERIFY_IMPLS = ("ref", "triton")


# The attention paths the CUDA-graph pool captures (the Triton kernels' and the reference's
# stay eager: EngineConfig.is_using_graphs is False under them).
GRAPH_ATTN_IMPLS = ("sdpa", "flex")


def default_attn_impl(device: str) -> str:
    """``EngineConfig.attn_impl`` when none is given: flex_attention by per-sequence length on
    CUDA (no padding work), the dense SDPA reference elsewhere (eager flex is a dense reference
    too, and slower)."""
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def default_dtype(device: str) -> str:
    """The engine's dtype where none is given: bfloat16 on CUDA (RL rollouts' dtype, veRL's
    default), float32 elsewhere."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


@dataclass(frozen=True)
class EngineConfig:
    """The torch rollout engine's settings; ``None`` fields take their device default."""

    # KV slots; the KV cache is preallocated for all of them
    max_running_requests: int = field(
        metadata={
            "help": "requests decoded together; KV cache is preallocated for all "
            "(tltrun default: the rollout's requests, at most 256)"
        }
    )
    # prompt + generated tokens per request
    max_model_len: int = field(
        metadata={
            "help": "prompt + generated tokens per request, the KV slot length (tltrun default: "
            "the longest request, at most the model's max_position_embeddings)"
        }
    )
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = field(default=0, metadata={"help": "seed of token sampling (and of the policy)"})
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda"})
    # None: bfloat16 on CUDA (the dtype RL rollouts run in: veRL's rollout default), float32
    # elsewhere (CPU bf16 GEMMs are slow and the lossless tests compare exact tokens)
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "weights and KV cache dtype (default: bfloat16 on CUDA, float32 on CPU)",
            "choices": tuple(DTYPES),
        },
    )
    # "sdpa" (masked torch SDPA) | "flex" (flex_attention by per-sequence length) | "ref" |
    # "triton" (kernels.tree_attention); None: flex on CUDA (no padding work), sdpa elsewhere
    attn_impl: str | None = field(
        default=None,
        metadata={
            "help": "attention implementation (default: flex on CUDA, sdpa on CPU)",
            "choices": ATTN_IMPLS,
        },
    )
    # TLT's bucketed CUDA-graph pool (tltrun.rollout.graphs); None: on for CUDA, off elsewhere.
    # On CPU, True runs the graphs' padded static forwards eagerly (what the tests compare).
    cuda_graphs: bool | None = field(
        default=None,
        metadata={"help": "capture the decode/verify CUDA-graph pool (default: on for CUDA)"},
    )
    # Issue #18 item 5: torch.compile of each decoder layer's work outside attention (norms,
    # projections, RoPE, SwiGLU, residuals; tltrun.model.transformer.compiled_pieces), what the
    # graphs then capture: fewer, fused kernels per layer. Off by default: optional, and kept
    # off until a GPU run shows it pays (benchmarks/bench_gpu_engine.py's compiled column).
    compile_layers: bool = field(
        default=False,
        metadata={
            "help": "torch.compile each layer's work around attention (fewer kernels per "
            "step; compiles at start-up; falls back to eager with a warning if it fails)"
        },
    )
    # one stacked q/k/v and one stacked gate/up projection for no-grad forwards
    # (tltrun.model.transformer.StackedProjections; vLLM's QKVParallelLinear and
    # MergedColumnParallelLinear): on an H200 the three small batch-1 q/k/v GEMVs read at a
    # third of the MLP's bandwidth (benchmarks/RESULTS.md, session 21); q/k/v stacked alone
    # gave 1.10x over graphs at 7B batch 1 (session 23, one run). Off by default until medians
    # of runs measure it (bench_gpu_engine.py's fused columns). Fusing re-points the model's
    # parameters: an engine fuses at construction, before it captures anything, and other
    # engines must not share a model that one of them fuses after they captured
    fuse_projections: bool = field(
        default=False,
        metadata={
            "help": "one GEMM for q, k and v and one for gate and up in rollout forwards "
            "(fewer, larger GEMVs)"
        },
    )
    # vLLM's --cuda-graph-sizes / SGLang's --cuda-graph-bs; () = vLLM's default capture sizes
    # up to max_running_requests (tltrun.rollout.graphs.batch_buckets)
    graph_batch_sizes: tuple[int, ...] = field(
        default=(),
        metadata={
            "help": "batch buckets of the CUDA-graph pool (default: 1, 2, 4, multiples of 8, "
            "up to --max-running-requests)"
        },
    )
    # "ref" | "triton" (kernels.spec_verify, chains)
    verify_impl: str = field(
        default="ref",
        metadata={
            "help": "SD verify implementation (triton: chains only)",
            "choices": VERIFY_IMPLS,
        },
    )
    instance: int = field(default=0, metadata={"help": "engine instance id reported to the policy"})
    # vLLM 0.32's CPU default max_num_batched_tokens for offline (LLM-class) use.
    max_prefill_tokens: int = field(
        default=4096,
        metadata={"help": "padded prompt tokens per prefill forward (a longer prompt runs alone)"},
    )
    # KV slack for a draft tree past max_model_len; TLT's largest public strategy, 8_4_48,
    # verifies 48 drafted nodes + the root (mit-han-lab/fastrl fastrl_trainer.yaml).
    max_verify_tokens: int = field(
        default=64, metadata={"help": "KV slack past --max-model-len for one verified draft tree"}
    )
    # Issue #20: after history-drafter iterations the EAGLE drafter lags a few pairs; feeding
    # them in the drafting step's first forward spares the separate re-prefill forward each
    # switch between drafters cost (the tlt-mix runs on tower_of_hanoi, README).
    catchup_pairs: int | None = field(
        default=None,
        metadata={
            "help": "pending drafter pairs per request an EAGLE drafting step feeds itself; a "
            "request further behind is re-prefilled first (default: the CUDA-graph pool's "
            "drafting bound, else max_verify_tokens; 0: always re-prefill)"
        },
    )
    is_harvesting: bool = field(
        default=False,
        metadata={"help": "keep finished requests' tokens and hidden states for drafter training"},
    )
    # Requests with identical prompts (a GRPO group) prefill the prompt once: a follower copies
    # its leader's (or a running sibling's) KV cache, hidden states and drafter cache, then
    # computes only its last prompt token; a drafter re-prefill feeds a group's shared prompt
    # pairs once (both in ``tltrun.rollout.prefill``). vLLM's automatic prefix
    # caching (on by default in V1) spares the same work, so both backends do it.
    share_prompts: bool = field(
        default=True,
        metadata={"help": "requests with identical prompts (a GRPO group) prefill it once"},
    )
    # The history drafter (issue #20, tltrun.model.history_drafter), used by SpecDecisions
    # with drafter="history"; defaults are HistoryConfig's.
    ngram_min: int = field(
        default=HistoryConfig.ngram_min,
        metadata={"help": "shortest context (tokens) a history draft may match"},
    )
    ngram_max: int = field(
        default=HistoryConfig.ngram_max,
        metadata={"help": "longest context (tokens) a history draft matches"},
    )
    history_max_tokens: int = field(
        default=HistoryConfig.max_history_tokens,
        metadata={
            "help": "tokens the history drafter's index keeps across rollouts "
            "(oldest finished responses evicted first)"
        },
    )
    is_history_cross_prompt: bool = field(
        default=HistoryConfig.is_cross_prompt,
        metadata={"help": "the history drafter also drafts from other prompts' sequences"},
    )
    history_shared_max_tokens: int = field(
        default=HistoryConfig.max_shared_tokens,
        metadata={"help": "tokens the history drafter's cross-prompt index keeps"},
    )
    # generation_config.json may list stop ids config.json does not (Qwen2.5-Instruct: both
    # <|im_end|> and <|endoftext|>); tltrun.data.tokenizer gathers them for tltrun train, and
    # tltrun.cli.args.engine_defaults for generate and bench
    eos_token_ids: tuple[int, ...] = field(
        default=(),
        metadata={
            "help": "stop token ids besides config.json's and generation_config.json's EOS "
            "(bench replays recorded lengths: it stops at none)"
        },
    )

    def __post_init__(self) -> None:
        if self.max_running_requests < 1 or self.max_model_len < 2 or self.max_prefill_tokens < 1:
            raise ValueError(
                "max_running_requests, max_prefill_tokens >= 1 and max_model_len >= 2 required"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {sorted(DTYPES)}")
        check_device(self.device)  # cuda without CUDA: one line, not torch's AssertionError
        if not 0 <= self.seed < 2**63:  # torch.manual_seed's int64 range
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")
        if self.attn_impl is not None and self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl {self.attn_impl!r}: expected one of {ATTN_IMPLS}")
        if self.cuda_graphs and self.attention not in GRAPH_ATTN_IMPLS:  # (it ran eagerly, unsaid)
            raise ValueError(
                f"cuda_graphs: the graph pool captures the {' and '.join(GRAPH_ATTN_IMPLS)} "
                f"attention paths; attn_impl {self.attention} runs eagerly (leave cuda_graphs "
                "unset, or --eager)"
            )
        if self.verify_impl not in VERIFY_IMPLS:
            raise ValueError(f"verify_impl {self.verify_impl!r}: expected one of {VERIFY_IMPLS}")
        sizes = self.graph_batch_sizes
        if any(not 1 <= b <= self.max_running_requests for b in sizes) or list(sizes) != sorted(
            set(sizes)
        ):
            raise ValueError(
                f"graph_batch_sizes must increase within 1..max_running_requests, got {sizes}"
            )
        if self.instance < 0:  # the policy's DecodeObs.instance: an index, as in the simulator
            raise ValueError(f"instance must be >= 0, got {self.instance}")
        if self.max_verify_tokens < 1:
            raise ValueError(f"max_verify_tokens must be >= 1, got {self.max_verify_tokens}")
        if self.catchup_pairs is not None and self.catchup_pairs < 0:
            raise ValueError(f"catchup_pairs must be >= 0, got {self.catchup_pairs}")
        self.history_config()  # validates the history drafter's fields

    @property
    def is_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    @property
    def dtype_name(self) -> str:
        """``dtype`` with its device default resolved."""
        return self.dtype if self.dtype is not None else default_dtype(self.device)

    @property
    def attention(self) -> str:
        """``attn_impl`` with its device default resolved."""
        return default_attn_impl(self.device) if self.attn_impl is None else self.attn_impl

    @property
    def is_using_graphs(self) -> bool:
        """Whether decode and verify forwards go through the graph pool (captured on CUDA)."""
        if self.attention not in GRAPH_ATTN_IMPLS:  # the kernels' paths stay eager
            return False
        return self.is_cuda if self.cuda_graphs is None else self.cuda_graphs

    def history_config(self) -> HistoryConfig:
        return HistoryConfig(
            ngram_min=self.ngram_min,
            ngram_max=self.ngram_max,
            max_history_tokens=self.history_max_tokens,
            is_cross_prompt=self.is_history_cross_prompt,
            max_shared_tokens=self.history_shared_max_tokens,
            max_draft_tokens=self.max_verify_tokens,  # no draft verifies more tokens
        )

    def check_requests(self, requests: list[Request], vocab_size: int) -> None:
        """``check_requests`` for an engine of this config."""
        check_requests(requests, vocab_size, self.max_model_len)


def check_requests(requests: list[Request], vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError unless ``requests`` fit an engine of ``max_model_len`` tokens and a
    target of ``vocab_size`` (the torch engine and the vLLM backend alike): unique ids,
    non-empty in-vocabulary prompts, at least one new token, prompt + max_new_tokens within
    max_model_len."""
    seen: set[str] = set()
    for r in requests:
        where = f"request {r.id!r}"
        if r.id in seen:
            raise ValueError(f"{where}: duplicate request id")
        seen.add(r.id)
        if not isinstance(r.prompt_token_ids, tuple):  # a list failed in prefill: unhashable
            raise ValueError(
                f"{where}: prompt_token_ids must be a tuple of ints, got "
                f"{type(r.prompt_token_ids).__name__}"
            )
        if not r.prompt_token_ids:
            raise ValueError(f"{where}: empty prompt")
        if r.max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
        total = len(r.prompt_token_ids) + r.max_new_tokens
        if total > max_model_len:
            raise ValueError(
                f"{where}: prompt + max_new_tokens = {total} exceeds max_model_len={max_model_len}"
            )
        if min(r.prompt_token_ids) < 0 or max(r.prompt_token_ids) >= vocab_size:
            raise ValueError(f"{where}: prompt token ids must be in [0, {vocab_size})")
