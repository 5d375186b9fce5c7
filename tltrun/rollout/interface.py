"""The rollout interface shared by the torch engine (tltrun.rollout.engine) and the vLLM backend
(tltrun.rollout.vllm_backend): requests in, per-request outputs and per-iteration records out.

Both backends return exactly these types, so GRPO, ``tltrun bench`` and the measured-trace
writer never care which backend ran. Outputs and records are keyword-only dataclasses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from tltsim.errors import TLTError
from tltsim.policy import SpecPolicy

GREEDY_BELOW_TEMPERATURE = 1e-5


class NonFiniteLogitsError(TLTError):
    """The target's logits for a prompt were NaN or inf: an activation beyond the dtype's range
    (float16's 65,504; bfloat16 has float32's range) or broken weights. Sampling from them
    gave token 0 every time, silently; checked once per request, at its prefill."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below 1e-5) means greedy. top_k None / top_p 1.0 mean no truncation."""

    temperature: float = field(
        default=1.0,
        metadata={"help": "sampling temperature; 0 (or below 1e-5, as in vLLM) = greedy"},
    )
    top_p: float = field(
        default=1.0, metadata={"help": "nucleus sampling: keep the top tokens of this mass"}
    )
    top_k: int | None = field(
        default=None, metadata={"help": "keep only the N likeliest tokens (default: all)"}
    )

    def __post_init__(self) -> None:
        # not (0 <= nan): a NaN temperature sampled token 0 every time, silently
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        # Below 1e-5 is greedy, as in vLLM (sampling_params.py: _SAMPLING_EPS), so the torch
        # engine and the vLLM backend agree; dividing the logits by a temperature near float32's
        # smallest made them infinite and every sampled token 0, silently.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class Request:
    id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    ignore_eos: bool = False  # trace replay: generate exactly max_new_tokens
    # The prompt's id in the dataset (GRPO group), kept across rollouts: the torch engine's
    # history drafter (issue #20) keeps a prompt's earlier responses under it. None: the
    # request's group is its prompt tokens, for this rollout only.
    prompt_id: str | None = None


@dataclass(kw_only=True)
class RequestOutput:
    id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: list[int]
    finish: str  # "stop" (EOS) | "length" (max_new_tokens)
    # accept_hist[i] = verify iterations in which this request had i draft tokens accepted
    accept_hist: list[int] = field(default_factory=list)
    first_token_s: float = 0.0  # seconds from rollout start to the first generated token
    finish_s: float = 0.0  # seconds from rollout start to the last generated token
    # the same, per SD strategy ({"4_1_4": [...]}): a response's own acceptance, which the
    # simulator's replay (tltsim.fidelity.measured_run) needs by strategy
    accept_hist_by_strategy: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class IterationRecord:
    start_s: float  # seconds since the rollout started
    wall_s: float  # measured wall seconds of the iteration
    num_active: int  # batch size
    num_new_tokens: int  # tokens emitted over the batch (accepted drafts + bonus/correction)
    context_tokens: int  # KV tokens attended over the batch
    is_prefill: bool
    strategy: str  # SpecDecision.strategy ("off" for plain decode)
    accept_lens: tuple[int, ...] = ()  # per request: accepted draft tokens (SD iterations only)
    # Drafter re-prefill (is_prefill too): catching the drafter up on requests it has not seen
    # since SD was last on — TLT's cost of switching SD on. Not part of any decode iteration.
    is_drafter_prefill: bool = False
    # SpecDecision.drafter of an SD iteration ("eagle" | "history"); None for plain decoding
    # and prefills (a drafter re-prefill is always EAGLE's)
    drafter: str | None = None


@dataclass(kw_only=True)
class RolloutResult:
    outputs: list[RequestOutput]
    iterations: list[IterationRecord]
    wall_s: float
    backend: str  # "torch" | "vllm"
    # requests with identical prompts shared their prefill (EngineConfig.share_prompts, vLLM's
    # prefix caching); recorded in a measured trace so the simulator replays the same
    shares_prompts: bool = False
    prefix_block_tokens: int = 1  # ... in whole blocks of this many tokens (vLLM's KV blocks)

    def accept_hist_by_drafter(self) -> dict[str, list[int]]:
        """Per drafter: hist[i] = request-verifies with i draft tokens accepted, over the SD
        iterations of this rollout (issue #20: the learned and the history drafter apart)."""
        hists: dict[str, list[int]] = {}
        for it in self.iterations:
            if it.drafter is None or it.is_prefill:
                continue
            hist = hists.setdefault(it.drafter, [])
            for n in it.accept_lens:
                if len(hist) <= n:
                    hist.extend([0] * (n + 1 - len(hist)))
                hist[n] += 1
        return hists


class RolloutBackend(Protocol):
    name: str

    def generate(
        self, requests: list[Request], policy: SpecPolicy, step: int = 0
    ) -> RolloutResult: ...
