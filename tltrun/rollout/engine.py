"""The torch rollout engine: continuous batching over a slot KV cache, with lossless speculative
decoding (EAGLE drafter, chain or tree, one target forward per verify) switched per iteration
by a ``tltsim.policy`` SpecPolicy — the same objects the simulator drives.

A rollout is ``start_rollout(requests, policy)``, then ``step()`` until ``is_rollout_done``,
then ``finish_rollout()`` (``generate`` does exactly that). One ``step()``, as nano-vllm's
``LLMEngine.step()`` glues its scheduler and model runner:

1. admit waiting requests into free slots and prefill them (batched, mixed lengths, at most
   ``max_prefill_tokens`` padded tokens per forward unless one prompt alone is longer: there is
   no chunked prefill, ``tltrun.model.batching``); the prefill samples each first token;
2. build a ``DecodeObs`` and ask the policy for a ``SpecDecision``;
3. SD off: one plain decode iteration. SD on: re-prefill the drafter for requests it has not
   seen since SD was last on (recorded as its own ``is_drafter_prefill`` IterationRecord, TLT's
   switching cost), then draft, verify the tree in ONE target forward with the tree mask,
   accept via ``tltrun.rollout.speculative.verify``, compact the accepted path in the KV cache.
   A decision with ``drafter="history"`` drafts from the model-free history drafter instead
   (``history_draft``, issue #20: no EAGLE forward, no drafter re-prefill, no drafter needed);
   its index of the rollouts' tokens is kept across rollouts under ``Request.prompt_id``;
4. ``policy.observe(SpecFeedback)`` with the measured wall seconds of the iteration and the
   tokens it emitted; finished requests (EOS unless ``ignore_eos``, or ``max_new_tokens``) leave.

On a GPU (issue #18) the defaults are bf16 weights and KV cache (sampling and acceptance in
float32: ``logits_to_probs``), attention by each sequence's own length (``attn_impl="flex"``,
``tltrun.model.kvcache``) and TLT's bucketed CUDA-graph pool (``tltrun.rollout.graphs``): the
first rollout's policy decides which decode and verify forwards are captured, and a batch runs
padded up to its bucket's graph; drafting, sampling and everything without a graph run eagerly.
``cuda_graphs=True`` on a CPU runs the same padded static forwards eagerly (the tests' path).

The pieces of a step are public too (``prefill``, ``draft``, ``reprefill_drafter``, ``sync``), so
``tltrun.profile.torch_engine`` times the engine's own code without reaching into it.

Invariant per running slot (see tltrun.model.kvcache): the target cache holds positions
``0..n-1``, ``tokens[slot, n]`` is the pending last token, ``hidden[slot, p]`` is the target's
post-norm hidden state at position p < n, and the drafter cache holds the exact pairs
``0..m-1`` with m <= n (tltrun.model.drafter explains the catch-up).

Harvest (for drafter training, issue #5): with ``is_harvesting`` every finished request leaves a
``HarvestRecord`` (all token ids, prompt length, the target hidden state at every position but
the last) in ``engine.harvest``; ``pop_harvest()`` hands them over and clears the buffer.

Run the tests: ``python -m pytest tests/test_engine.py -q``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tltrun.model.batching import padded_groups, right_pad
from tltrun.model.drafter import EagleDrafter, draft, drafter_prefill, tree_layout
from tltrun.model.history_drafter import HistoryConfig, HistoryDrafter, tree_nodes
from tltrun.model.kvcache import ATTN_IMPLS, KVCache
from tltrun.model.transformer import Transformer, check_device
from tltrun.rollout.graphs import GraphPool, StaticForward, capture_plan
from tltrun.rollout.interface import IterationRecord, Request, RolloutResult, SamplingParams
from tltrun.rollout.scheduler import Scheduler, Sequence
from tltrun.rollout.speculative import DraftTree, logits_to_probs, sample, verify
from tltsim.policy import (
    DecodeObs,
    SpecDecision,
    SpecFeedback,
    SpecPolicy,
    update_accept_len_ema,
)

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
VERIFY_IMPLS = ("ref", "triton")


def default_attn_impl(device: str) -> str:
    """``EngineConfig.attn_impl`` when none is given: flex_attention by per-sequence length on
    CUDA (no padding work), the dense SDPA reference elsewhere (eager flex is a dense reference
    too, and slower)."""
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


@dataclass(frozen=True)
class EngineConfig:
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
    is_harvesting: bool = field(
        default=False,
        metadata={"help": "keep finished requests' tokens and hidden states for drafter training"},
    )
    # Requests with identical prompts (a GRPO group) prefill the prompt once: a follower copies
    # its leader's (or a running sibling's) KV cache, hidden states and drafter cache, then
    # computes only its last prompt token (``_prefill_followers``); a drafter re-prefill feeds a
    # group's shared prompt pairs once (``_share_drafter_prompts``). vLLM's automatic prefix
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
    # generation_config.json may list stop ids config.json does not (Qwen2.5-Instruct: both
    # <|im_end|> and <|endoftext|>); tltrun.data.tokenizer gathers them
    eos_token_ids: tuple[int, ...] = field(
        default=(),
        metadata={"help": "stop token ids besides the model config's EOS"},
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
        if self.verify_impl not in VERIFY_IMPLS:
            raise ValueError(f"verify_impl {self.verify_impl!r}: expected one of {VERIFY_IMPLS}")
        sizes = self.graph_batch_sizes
        if any(not 1 <= b <= self.max_running_requests for b in sizes) or list(sizes) != sorted(
            set(sizes)
        ):
            raise ValueError(
                f"graph_batch_sizes must increase within 1..max_running_requests, got {sizes}"
            )
        if self.max_verify_tokens < 1:
            raise ValueError(f"max_verify_tokens must be >= 1, got {self.max_verify_tokens}")
        self.history_config()  # validates ngram_min, ngram_max, history_max_tokens

    @property
    def is_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    @property
    def dtype_name(self) -> str:
        """``dtype`` with its device default resolved."""
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.is_cuda else "float32"

    @property
    def attention(self) -> str:
        """``attn_impl`` with its device default resolved."""
        return default_attn_impl(self.device) if self.attn_impl is None else self.attn_impl

    @property
    def is_using_graphs(self) -> bool:
        """Whether decode and verify forwards go through the graph pool (captured on CUDA)."""
        return self.is_cuda if self.cuda_graphs is None else self.cuda_graphs

    def history_config(self) -> HistoryConfig:
        return HistoryConfig(
            ngram_min=self.ngram_min,
            ngram_max=self.ngram_max,
            max_history_tokens=self.history_max_tokens,
        )


@dataclass(frozen=True, kw_only=True)
class HarvestRecord:
    """One finished request, for drafter training: hidden[p] is the target's post-norm hidden
    state after reading token_ids[p] (so it predicts token_ids[p + 1])."""

    request_id: str
    token_ids: torch.Tensor  # (T,) long, prompt then response
    num_prompt_tokens: int
    hidden: torch.Tensor  # (T-1, C)


@dataclass
class _Rollout:
    """The rollout in progress: from ``start_rollout`` to ``finish_rollout``."""

    scheduler: Scheduler
    policy: SpecPolicy
    step: int
    t0: float  # engine clock at the start: records and finish times are relative to it
    iterations: list[IterationRecord] = field(default_factory=list)
    accept_len_ema: float = 0.0  # DecodeObs.accept_len_ema (tltsim.policy.update_accept_len_ema)
    number: int = 0  # rollouts this engine started before this one: history keys are unique
    # The history drafter's index catches up lazily (_sync_history): admission is FIFO, so
    # the admitted sequences are scheduler.sequences[:n]; the first history_cursor of them are
    # indexed, history_open those still unfinished (by Sequence.index).
    history_cursor: int = 0
    history_open: dict[int, Sequence] = field(default_factory=dict)
    history_groups: set[tuple] = field(default_factory=set)


class RolloutEngine:
    name = "torch"

    def __init__(
        self,
        model: Transformer,
        drafter: EagleDrafter | None,
        config: EngineConfig,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.config = config
        self.clock = clock
        self.device = torch.device(config.device)
        dtype = DTYPES[config.dtype_name]
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.drafter = drafter
        if drafter is not None:
            drafter.to(device=self.device, dtype=dtype).eval()
            drafter.bind(self.model)
        cfg = model.config
        slots = config.max_running_requests
        self.max_tokens = config.max_model_len + config.max_verify_tokens + 1
        self.cache = KVCache.for_model(cfg, slots, self.max_tokens, dtype, self.device)
        self.draft_cache = None
        if drafter is not None:
            self.draft_cache = KVCache.for_model(
                cfg, slots, self.max_tokens, dtype, self.device, num_layers=1
            )
        self.hidden = None  # (slots, max_tokens, C) target hidden states by position
        if drafter is not None or config.is_harvesting:
            self.hidden = torch.zeros(
                slots, self.max_tokens, cfg.hidden_size, dtype=dtype, device=self.device
            )
        self.tokens = torch.zeros(slots, self.max_tokens, dtype=torch.long, device=self.device)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.eos_ids = frozenset(cfg.eos_token_ids) | frozenset(config.eos_token_ids)
        self.harvest: list[HarvestRecord] = []
        self._rollout: _Rollout | None = None
        # Model-free drafter (issue #20), kept across rollouts. Indexed lazily: nothing is
        # indexed until a policy first asks for a history draft, then every rollout is kept.
        self.history = HistoryDrafter(config.history_config())
        self._is_history_used = False
        self._num_rollouts = 0
        # TLT's graph pool (tltrun.rollout.graphs), planned from the first rollout's policy and
        # captured then, once; replanned only for a policy whose plan differs
        self.graphs: GraphPool | None = None

    # -----------------------------------------------------------------------------------------
    # Public API
    # -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, requests: list[Request], policy: SpecPolicy, step: int = 0) -> RolloutResult:
        """One whole rollout of ``requests`` under ``policy`` (``RolloutBackend``)."""
        self.start_rollout(requests, policy, step)
        while not self.is_rollout_done:
            self.step()
        return self.finish_rollout()

    def start_rollout(self, requests: list[Request], policy: SpecPolicy, step: int = 0) -> None:
        """Queue ``requests`` as RL step ``step``'s rollout under ``policy`` (which is told
        ``start_rollout``); the clock of its records starts now. Replaces any rollout that
        was not finished."""
        self._validate(requests)
        if self._rollout is not None:
            self._close_history(self._rollout)
        sched = Scheduler(requests, self.config.max_running_requests)
        if self.config.is_using_graphs:
            self._prepare_graphs(policy)
        policy.start_rollout(step)
        self._rollout = _Rollout(
            scheduler=sched, policy=policy, step=step, t0=self.clock(), number=self._num_rollouts
        )
        self._num_rollouts += 1

    @property
    def scheduler(self) -> Scheduler:
        """The rollout's sequences: waiting, running (slots 0..n-1) and finished."""
        return self._current().scheduler

    @property
    def is_rollout_done(self) -> bool:
        return self._current().scheduler.is_done

    @torch.no_grad()
    def step(self) -> list[IterationRecord]:
        """One turn of the rollout loop: admit waiting requests and prefill them, then one
        decode iteration of the running batch as the policy decides (plain, or the drafter's
        re-prefill plus a speculative iteration), releasing finished requests after each.
        Returns the iterations it ran (also kept for ``finish_rollout``)."""
        rollout = self._current()
        sched = rollout.scheduler
        records: list[IterationRecord] = []
        admitted = sched.admit()
        if admitted:
            records += self.prefill(admitted)
            self._release(sched)
        if sched.running:
            records += self._decode_iteration(rollout)
            self._release(sched)
        rollout.iterations += records
        return records

    def finish_rollout(self) -> RolloutResult:
        """The rollout's outputs and iteration records; the engine is free for the next one."""
        rollout = self._current()
        self._rollout = None
        self._close_history(rollout)
        return RolloutResult(
            outputs=rollout.scheduler.outputs(),
            iterations=rollout.iterations,
            wall_s=self.clock() - rollout.t0,
            backend=self.name,
            shares_prompts=self.config.share_prompts,
        )

    def _prepare_graphs(self, policy: SpecPolicy) -> None:
        """The pool for ``policy``'s capture plan: kept if the plan is unchanged, else rebuilt
        (captured on CUDA). Called between rollouts only: capture writes scratch KV entries
        into free slots."""
        if self.config.attention not in ("sdpa", "flex"):  # the kernels' paths stay eager
            return
        plan = capture_plan(
            policy, self.config.max_running_requests, self.config.graph_batch_sizes or None
        )
        if self.graphs is not None and self.graphs.plan == plan:
            return
        self.graphs = None  # the old pool's memory goes back before the new one is captured
        self.graphs = GraphPool(
            self.model,
            self.cache,
            plan,
            self.config.attention,
            is_capturing=self.device.type == "cuda",
        )

    def _static_forward(self, running: list[Sequence], strategy: str) -> StaticForward | None:
        """The pool's forward for this batch (``"off"``: plain decode), or None: no pool, no
        bucket for it, or running slots not 0..n-1 (the scheduler keeps them so)."""
        if self.graphs is None:
            return None
        if any(s.slot != i for i, s in enumerate(running)):
            return None
        n = len(running)
        if strategy == "off":
            return self.graphs.decode_forward(n)
        return self.graphs.verify_forward(n, strategy)

    def sync(self) -> None:
        """Wait for the device (a no-op on CPU): what a timer must call before reading."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def pop_harvest(self) -> list[HarvestRecord]:
        out, self.harvest = self.harvest, []
        return out

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """GRPO weight sync: copy a (Hugging Face-named) state dict into the target in place.
        The drafter shares the target's embedding and LM head, so it follows automatically."""
        _load_in_place(
            self.model,
            state_dict,
            "target",
            drop={"lm_head.weight"} if self.model.config.tie_word_embeddings else set(),
        )

    @torch.no_grad()
    def update_drafter(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Spot-trainer sync: new drafter weights (tltrun.model.drafter state-dict names)."""
        if self.drafter is None:
            raise ValueError("update_drafter: this engine has no drafter")
        _load_in_place(self.drafter, state_dict, "drafter", drop=set())

    # -----------------------------------------------------------------------------------------
    # Loop pieces
    # -----------------------------------------------------------------------------------------

    def _validate(self, requests: list[Request]) -> None:
        seen: set[str] = set()
        vocab = self.model.config.vocab_size
        for r in requests:
            where = f"request {r.id!r}"
            if r.id in seen:
                raise ValueError(f"{where}: duplicate request id")
            seen.add(r.id)
            if not r.prompt_token_ids:
                raise ValueError(f"{where}: empty prompt")
            if r.max_new_tokens < 1:
                raise ValueError(f"{where}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
            total = len(r.prompt_token_ids) + r.max_new_tokens
            if total > self.config.max_model_len:
                raise ValueError(
                    f"{where}: prompt + max_new_tokens = {total} exceeds max_model_len={self.config.max_model_len}"
                )
            if min(r.prompt_token_ids) < 0 or max(r.prompt_token_ids) >= vocab:
                raise ValueError(f"{where}: prompt token ids must be in [0, {vocab})")

    def _current(self) -> _Rollout:
        if self._rollout is None:
            raise RuntimeError("no rollout in progress: call start_rollout first")
        return self._rollout

    def _slots(self, seqs: list[Sequence]) -> torch.Tensor:
        return torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)

    def _prompt_sources(
        self, admitted: list[Sequence], running: list[Sequence]
    ) -> tuple[list[Sequence], list[tuple[Sequence, Sequence]]]:
        """Split admitted sequences into leaders (prefilled) and (follower, source) pairs: a
        follower's prompt equals an earlier running sequence's (its cache rows 0..P-1 hold that
        prompt: a running sequence only appends) or an admitted leader's."""
        if not self.config.share_prompts:
            return admitted, []
        new = {id(s) for s in admitted}
        sources: dict[tuple[int, ...], Sequence] = {}
        for s in running:
            if id(s) not in new:
                sources.setdefault(s.request.prompt_token_ids, s)
        leaders, followers = [], []
        for s in admitted:
            prompt = s.request.prompt_token_ids
            if prompt in sources:
                followers.append((s, sources[prompt]))
            else:
                sources[prompt] = s
                leaders.append(s)
        return leaders, followers

    @torch.no_grad()
    def prefill(self, admitted: list[Sequence]) -> list[IterationRecord]:
        """Prefill sequences the rollout's scheduler just admitted (each samples its first
        token): leaders in padded groups of at most ``max_prefill_tokens``, followers of a
        shared prompt from their source's cache (``share_prompts``)."""
        t0 = self._current().t0
        leaders, followers = self._prompt_sources(admitted, self._current().scheduler.running)
        records = []
        lengths = [s.num_prompt_tokens for s in leaders]
        for group in padded_groups(lengths, self.config.max_prefill_tokens):
            seqs = [leaders[i] for i in group]
            start = self.clock()
            slots = self._slots(seqs)
            self.cache.reset(slots)
            if self.draft_cache is not None:
                self.draft_cache.reset(slots)
            ids, lens = right_pad([s.request.prompt_token_ids for s in seqs], 0, self.device)
            width = ids.shape[1]
            for s in seqs:
                s.is_drafter_fresh = False
            self.tokens[slots, :width] = ids
            positions = torch.arange(width, device=self.device).expand(len(seqs), -1)
            ctx = self.cache.context(slots, width, num_new=lens, impl=self.config.attention)
            logits, hidden = self.model(ids, positions, ctx, logit_index=(lens - 1)[:, None])
            if self.hidden is not None:
                self.hidden[slots, :width] = hidden
            self.cache.commit(slots, lens)
            first = sample(
                logits_to_probs(logits[:, 0], self.config.sampling), self.generator
            )  # (B,)
            self.tokens[slots, lens] = first
            self.sync()
            now = self.clock()
            for s, tok in zip(seqs, first.tolist(), strict=True):
                s.append([tok], self.eos_ids, now - t0)
            wall = self.clock() - start
            records.append(
                IterationRecord(
                    start_s=start - t0,
                    wall_s=wall,
                    num_active=len(seqs),
                    num_new_tokens=len(seqs),
                    context_tokens=int(lens.sum()),
                    is_prefill=True,
                    strategy="off",
                )
            )
        if followers:
            records.append(self._prefill_followers(followers, t0))
        return records

    def _prefill_followers(
        self, pairs: list[tuple[Sequence, Sequence]], t0: float
    ) -> IterationRecord:
        """Prefill followers from their sources' caches: copy the KV of prompt positions
        0..P-2, the hidden states there and the drafter's KV of the pairs among them it holds,
        then run the last prompt token of every follower in one decode-shaped forward, which
        samples each its own first token (vLLM's prefix cache likewise recomputes the last
        prompt token of a full hit)."""
        start = self.clock()
        seqs = [f for f, _ in pairs]
        dst = self._slots(seqs)
        src = self._slots([s for _, s in pairs])
        last = torch.tensor([f.num_prompt_tokens - 1 for f in seqs], device=self.device)  # P-1
        width = int(last.max())
        cache = self.cache
        cache.copy_positions(src, dst, width)
        cache.lens[dst] = last
        self.tokens[dst, : width + 1] = self.tokens[src, : width + 1]
        if self.hidden is not None:
            self.hidden[dst, :width] = self.hidden[src, :width]
        if self.draft_cache is not None:
            # drafter pairs p < P-1 read prompt tokens and prompt hidden states only
            held = torch.minimum(self.draft_cache.lens[src], last)
            self.draft_cache.copy_positions(src, dst, int(held.max()))
            self.draft_cache.lens[dst] = held
        ids = self.tokens[dst, last][:, None]
        ctx = cache.context(dst, 1, impl=self.config.attention)
        logits, hidden = self.model(ids, last[:, None], ctx)
        if self.hidden is not None:
            self.hidden[dst, last] = hidden[:, 0]
        cache.commit(dst, 1)
        first = sample(logits_to_probs(logits[:, 0], self.config.sampling), self.generator)
        self.tokens[dst, last + 1] = first
        self.sync()
        now = self.clock()
        for s, tok in zip(seqs, first.tolist(), strict=True):
            s.is_drafter_fresh = False
            s.append([tok], self.eos_ids, now - t0)
        wall = self.clock() - start
        return IterationRecord(
            start_s=start - t0,
            wall_s=wall,
            num_active=len(seqs),
            num_new_tokens=len(seqs),
            context_tokens=int(last.sum()) + len(seqs),
            is_prefill=True,
            strategy="off",
        )

    def _decode_iteration(self, rollout: _Rollout) -> list[IterationRecord]:
        sched, policy, step, t0 = rollout.scheduler, rollout.policy, rollout.step, rollout.t0
        running = list(sched.running)
        cfg = self.config
        obs = DecodeObs(
            now_s=self.clock() - t0,
            step=step,
            instance=cfg.instance,
            num_active=len(running),
            num_waiting=len(sched.waiting),
            mean_context_tokens=sum(s.num_tokens for s in running) / len(running),
            accept_len_ema=rollout.accept_len_ema,
        )
        decision = policy.decide(obs)
        records = []
        is_eagle = decision.enabled and decision.drafter == "eagle"
        if decision.enabled:
            if is_eagle and self.drafter is None:
                raise ValueError(
                    f"policy {policy.name!r} turned SD on ({decision.strategy}) but the engine has no drafter"
                )
            if decision.verify_tokens > cfg.max_verify_tokens:
                raise ValueError(
                    f"strategy {decision.strategy}: verify_tokens exceeds max_verify_tokens={cfg.max_verify_tokens}"
                )
        if is_eagle:
            stale = [s for s in running if not s.is_drafter_fresh]
            if stale:
                records.append(self.reprefill_drafter(stale, decision))
        slots = self._slots(running)
        context_tokens = int(self.cache.lens[slots].sum())
        start = self.clock()
        if decision.enabled:
            new_tokens, accept_lens = self._spec_step(running, slots, decision)
        else:
            new_tokens, accept_lens = self._plain_step(running, slots), ()
        self.sync()
        now = self.clock()
        num_kept = sum(
            s.append(toks, self.eos_ids, now - t0)
            for s, toks in zip(running, new_tokens, strict=True)
        )
        wall = self.clock() - start
        if decision.enabled:
            rollout.accept_len_ema = update_accept_len_ema(
                rollout.accept_len_ema, num_kept / len(running)
            )
        policy.observe(
            SpecFeedback(
                step=step,
                instance=cfg.instance,
                num_active=len(running),
                decision=decision,
                accepted_tokens=float(num_kept),
                iteration_s=wall,
            )
        )
        records.append(
            IterationRecord(
                start_s=start - t0,
                wall_s=wall,
                num_active=len(running),
                num_new_tokens=num_kept,
                context_tokens=context_tokens,
                is_prefill=False,
                strategy=decision.strategy,
                accept_lens=accept_lens,
                drafter=decision.drafter if decision.enabled else None,
            )
        )
        return records

    def _plain_step(self, running: list[Sequence], slots: torch.Tensor) -> list[list[int]]:
        lens = self.cache.lens[slots]  # (B,)
        ids = self.tokens[slots, lens][:, None]  # (B,1) the pending tokens
        static = self._static_forward(running, "off")
        if static is not None:  # padded to its bucket; a graph replay on CUDA
            logits, hidden = static(ids)
        else:
            ctx = self.cache.context(slots, 1, impl=self.config.attention)
            logits, hidden = self.model(ids, lens[:, None], ctx)
        if self.hidden is not None:
            self.hidden[slots, lens] = hidden[:, 0]
        self.cache.commit(slots, 1)
        nxt = sample(logits_to_probs(logits[:, 0], self.config.sampling), self.generator)  # (B,)
        self.tokens[slots, lens + 1] = nxt
        for s in running:
            s.is_drafter_fresh = False
        return [[t] for t in nxt.tolist()]

    def _pending_pairs(
        self, slots: torch.Tensor, num: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter input pairs (x_{p+1}, f_p) for p = drafter_len .. drafter_len + num - 1."""
        start = self.draft_cache.lens[slots]  # (B,)
        width = int(num.max())
        pos = (start[:, None] + torch.arange(width, device=self.device)[None]).clamp(
            max=self.max_tokens - 2
        )
        rows = slots[:, None]
        return self.tokens[rows, pos + 1], self.hidden[rows, pos]

    @torch.no_grad()
    def reprefill_drafter(self, stale: list[Sequence], decision: SpecDecision) -> IterationRecord:
        """Feed running sequences' pending pairs to the drafter, all but the newest (the
        drafting catch-up feeds that one and drafts from it): TLT's cost of switching SD on."""
        t0 = self._current().t0
        start = self.clock()
        fed = self._share_drafter_prompts(stale) if self.config.share_prompts else 0
        slots = self._slots(stale)
        num = self.cache.lens[slots] - self.draft_cache.lens[slots] - 1
        self._feed_drafter(slots, num)
        self.sync()
        wall = self.clock() - start
        return IterationRecord(
            start_s=start - t0,
            wall_s=wall,
            num_active=len(stale),
            num_new_tokens=0,
            context_tokens=fed + int(num.clamp(min=0).sum()),
            is_prefill=True,
            strategy=decision.strategy,
            is_drafter_prefill=True,
        )

    def _feed_drafter(self, slots: torch.Tensor, num: torch.Tensor) -> None:
        """drafter_prefill of ``num`` pending pairs per slot (none where num <= 0), in groups of
        at most max_prefill_tokens padded pairs."""
        todo = (num > 0).nonzero(as_tuple=True)[0].tolist()
        for group in padded_groups([int(num[i]) for i in todo], self.config.max_prefill_tokens):
            idx = torch.tensor([todo[i] for i in group], device=self.device)
            toks, hid = self._pending_pairs(slots[idx], num[idx])
            drafter_prefill(
                self.drafter,
                self.draft_cache,
                slots[idx],
                toks,
                hid,
                num[idx],
                self.config.attention,
            )

    def _share_drafter_prompts(self, stale: list[Sequence]) -> int:
        """Stale siblings (same prompt, empty drafter cache) get the drafter's prompt pairs
        0..P-2 from one forward over their group's first member, copied to the others. Their
        prompt hidden states are bit-identical (``_prefill_followers`` copied them), so the
        copy is what each would have computed. Returns the pairs fed."""
        empty = (self.draft_cache.lens[self._slots(stale)] == 0).tolist()
        groups: dict[tuple[int, ...], list[Sequence]] = {}
        for s, is_empty in zip(stale, empty, strict=True):
            if is_empty and s.num_prompt_tokens >= 2:
                groups.setdefault(s.request.prompt_token_ids, []).append(s)
        groups = {p: g for p, g in groups.items() if len(g) >= 2}
        if not groups:
            return 0
        leaders = [g[0] for g in groups.values()]
        num = torch.tensor([s.num_prompt_tokens - 1 for s in leaders], device=self.device)
        self._feed_drafter(self._slots(leaders), num)
        members = [(m, g[0]) for g in groups.values() for m in g[1:]]
        dst = self._slots([m for m, _ in members])
        src = self._slots([lead for _, lead in members])
        self.draft_cache.copy_positions(src, dst, int(num.max()))
        self.draft_cache.lens[dst] = self.draft_cache.lens[src]
        return int(num.sum())

    @torch.no_grad()
    def draft(self, slots: torch.Tensor, decision: SpecDecision) -> DraftTree:
        """The drafter's tree for running ``slots`` under ``decision`` (after feeding it the
        pending pairs), exactly as a speculative iteration drafts it."""
        return self._draft(slots, self.cache.lens[slots], decision)

    def _draft(self, slots: torch.Tensor, lens: torch.Tensor, decision: SpecDecision) -> DraftTree:
        cfg = self.config
        num = lens - self.draft_cache.lens[slots]  # >= 1 pending exact pairs per slot
        toks, hid = self._pending_pairs(slots, num)
        return draft(
            self.drafter,
            self.draft_cache,
            slots,
            toks,
            hid,
            num,
            decision,
            cfg.sampling,
            self.generator,
            cfg.attention,
        )

    def _spec_step(
        self, running: list[Sequence], slots: torch.Tensor, decision: SpecDecision
    ) -> tuple[list[list[int]], tuple[int, ...]]:
        cfg = self.config
        lens = self.cache.lens[slots]  # (B,) n: target cache length; tokens[n] is the root
        if decision.drafter == "history":
            tree = self.history_draft(running, slots, decision)
        else:
            tree = self._draft(slots, lens, decision)
        num_nodes = tree.tokens.shape[1]
        depth, tree_mask = tree_layout(tree.parents, decision.draft_steps)
        static = self._static_forward(running, decision.strategy)
        if static is not None:  # padded to its bucket; a graph replay on CUDA
            logits, hidden = static(tree.tokens, depth, tree_mask)  # (B,N+1,V), (B,N+1,C)
        else:
            positions = lens[:, None] + depth  # RoPE: root at n, node at n + depth
            ctx = self.cache.context(slots, num_nodes, tree_mask=tree_mask, impl=cfg.attention)
            logits, hidden = self.model(tree.tokens, positions, ctx)  # (B,N+1,V), (B,N+1,C)
        result = verify(
            tree, logits_to_probs(logits, cfg.sampling), self.generator, impl=cfg.verify_impl
        )
        path = result.accepted_nodes  # (B,D+1)
        pos = lens[:, None] + torch.arange(path.shape[1], device=self.device)[None]  # (B,D+1)
        rows = slots[:, None]
        if self.hidden is not None:
            self.hidden[rows, pos] = hidden.gather(
                1, path[..., None].expand(-1, -1, hidden.shape[-1])
            )
        self.tokens[rows, pos + 1] = result.out_tokens
        self.cache.compact(slots, path, result.num_accepted)
        accepted = result.num_accepted.tolist()
        out = result.out_tokens.tolist()
        # After a history iteration the EAGLE drafter has not seen these pairs: its next
        # iteration re-prefills it (recorded as TLT's switching cost).
        is_eagle = decision.drafter == "eagle"
        for s, n in zip(running, accepted, strict=True):
            s.is_drafter_fresh = is_eagle
            s.record_accept(n, decision.arm)
        return [row[: n + 1] for row, n in zip(out, accepted, strict=True)], tuple(accepted)

    # -----------------------------------------------------------------------------------------
    # History drafter (issue #20)
    # -----------------------------------------------------------------------------------------

    def _history_key(self, rollout: _Rollout, seq: Sequence) -> tuple:
        return (rollout.number, seq.request.id)

    @staticmethod
    def _history_group(rollout: _Rollout, seq: Sequence) -> tuple:
        """A prompt id groups across rollouts; without one, the prompt tokens group this
        rollout's siblings only."""
        r = seq.request
        if r.prompt_id is not None:
            return ("prompt_id", r.prompt_id)
        return ("rollout", rollout.number, r.prompt_token_ids)

    def _sync_history(self, rollout: _Rollout) -> None:
        """Catch the index up on the committed tokens of the rollout's admitted sequences: new
        ones are added, unfinished ones extended by what they emitted since, finished ones
        marked evictable and not visited again. Cost: O(new tokens + unfinished sequences)."""
        history = self.history
        seqs = rollout.scheduler.sequences
        while rollout.history_cursor < len(seqs) and seqs[rollout.history_cursor].slot is not None:
            seq = seqs[rollout.history_cursor]
            group = self._history_group(rollout, seq)
            history.add(self._history_key(rollout, seq), group, seq.request.prompt_token_ids)
            rollout.history_groups.add(group)
            rollout.history_open[seq.index] = seq
            rollout.history_cursor += 1
        for seq in list(rollout.history_open.values()):
            key = self._history_key(rollout, seq)
            num_indexed = len(history.tokens(key)) - seq.num_prompt_tokens
            if num_indexed < len(seq.output):
                history.extend(key, seq.output[num_indexed:])
            if seq.finish:
                history.finish(key)  # evictable from now on: never touched again
                del rollout.history_open[seq.index]

    def _close_history(self, rollout: _Rollout) -> None:
        """A rollout ends: once the history drafter has been used, keep its sequences (those
        with a prompt id) as history of later rollouts; drop its rollout-local groups."""
        if not self._is_history_used:
            return
        self._sync_history(rollout)
        for seq in rollout.history_open.values():  # unfinished: a replaced rollout
            self.history.finish(self._history_key(rollout, seq))
        for group in rollout.history_groups:
            if group[0] == "rollout":
                self.history.drop_group(group)

    @torch.no_grad()
    def history_draft(
        self, running: list[Sequence], slots: torch.Tensor, decision: SpecDecision
    ) -> DraftTree:
        """The history drafter's tree for ``running`` (in ``slots``) under ``decision``: a chain
        of verify_tokens tokens (topk 1; a chain's verify_tokens is its draft_steps), else up to topk continuations with distinct first
        tokens, verify_tokens nodes of them in (depth, branch) order. Point-mass drafts
        (``draft_probs`` None): ``verify`` accepts x with probability p(x). Where the history
        offers fewer tokens the draft is padded (a chain with its last token, a tree with
        copies of the root's first child, which are rejected once that child is): any
        deterministic draft is lossless, padding only costs verify work."""
        rollout = self._current()
        self._is_history_used = True
        self._sync_history(rollout)
        lens = self.cache.lens[slots]
        roots = self.tokens[slots, lens].tolist()  # (B,) pending last tokens
        num_drafted = decision.verify_tokens  # a chain's verify_tokens <= draft_steps
        tokens, parents = [], []
        for seq, root in zip(running, roots, strict=True):
            key = self._history_key(rollout, seq)
            if decision.is_chain:
                toks = self.history.propose(key, num_drafted)
                pad = toks[-1] if toks else root
                toks = toks + [pad] * (num_drafted - len(toks))
                pars = list(range(num_drafted))  # node i's parent is i - 1
            else:
                branches = self.history.propose_tree(key, decision.draft_steps, decision.topk)
                toks, pars = tree_nodes(branches, num_drafted)
                pad = toks[0] if toks else root
                pars += [0] * (num_drafted - len(toks))
                toks += [pad] * (num_drafted - len(toks))
            tokens.append([root] + toks)
            parents.append([0] + pars)
        device = self.device
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(parents, dtype=torch.long, device=device),
        )

    def _release(self, sched: Scheduler) -> None:
        released = sched.release_finished()
        for seq in released:
            if self.config.is_harvesting:
                n = seq.num_tokens
                ids = torch.tensor(
                    list(seq.request.prompt_token_ids) + seq.output, dtype=torch.long
                )
                hidden = self.hidden[seq.slot, : n - 1].detach().cpu().clone()
                self.harvest.append(
                    HarvestRecord(
                        request_id=seq.request.id,
                        token_ids=ids,
                        num_prompt_tokens=seq.num_prompt_tokens,
                        hidden=hidden,
                    )
                )
        if not released:  # admission fills the lowest free slots: still 0..n-1 in order
            return
        moves = sched.compact()
        if moves:
            self._move_slots(moves)

    def _move_slots(self, moves: list[tuple[int, int]]) -> None:
        """Copy running sequences' per-slot state (KV caches and lengths, tokens, hidden states)
        to their new slots (``Scheduler.compact``; sources and destinations are disjoint)."""
        src = torch.tensor([m[0] for m in moves], dtype=torch.long, device=self.device)
        dst = torch.tensor([m[1] for m in moves], dtype=torch.long, device=self.device)
        width = int(self.cache.lens[src].max()) + 1  # + the pending token / its hidden state
        for cache in (self.cache, self.draft_cache):
            if cache is not None:
                cache.copy_positions(src, dst, width)
                cache.lens[dst] = cache.lens[src]
                cache.lens[src] = 0
        self.tokens[dst] = self.tokens[src]
        if self.hidden is not None:
            w = min(width, self.hidden.shape[1])
            self.hidden[dst, :w] = self.hidden[src, :w]


def _load_in_place(
    module: torch.nn.Module, state_dict: dict[str, torch.Tensor], what: str, drop: set[str]
) -> None:
    own = module.state_dict()
    given = {k: v for k, v in state_dict.items() if k not in drop}
    unexpected = sorted(set(given) - set(own))
    missing = sorted(set(own) - set(given) - drop)
    if unexpected or missing:
        raise ValueError(f"{what} weights: unexpected {unexpected[:3]}, missing {missing[:3]}")
    for name, tensor in given.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(
                f"{what} weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}"
            )
        own[name].copy_(tensor)
