"""Step-time models: roofline from model + hardware specs, or measured profile tables.

Every cost the simulator charges goes through a ``CostModel``; a measured profile CSV
(``tltrun profile``) slots in behind the same interface (issue #7). ``RooflineCost`` is the
physics default: one forward pass takes

    max(FLOPs / achievable FLOP/s, bytes moved / achievable bandwidth) + fixed overhead + TP all-reduce

per GPU, where bytes = weights once + KV context read + KV written + logits, and
FLOPs = 2 x params x new tokens + attention over the context.

    from tltsim.cost.roofline import RooflineCost
    from tltsim.cost.specs import get_hardware, get_model
    cost = RooflineCost(get_model("Qwen2.5-7B"), get_hardware("H100-SXM"))
    cost.decode_iter_s(batch=32, context_tokens=32 * 4000)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, runtime_checkable

from tltsim.cost.specs import DrafterSpec, HardwareSpec, ModelSpec
from tltsim.policy import SpecDecision


@runtime_checkable
class CostModel(Protocol):
    """Seconds for the work of ONE engine instance (a TP group of ``tp`` GPUs).

    ``context_tokens`` is what the engine's attention reads, summed over the batch. For a
    paged engine (vLLM) that is each sequence's own context; an engine whose batched attention
    is dense and padded (older engines; tltrun's torch engine with dense attention) reads the
    longest sequence's context for every sequence, and its prefill pads prompts to the longest. A cost model of such an engine says
    so with an attribute ``is_context_padded = True`` (optional; absent means False, see
    ``is_context_padded``) and the simulator then passes batch x the longest context instead."""

    def decode_iter_s(self, batch: int, context_tokens: float, tokens_per_seq: int = 1) -> float:
        """One target forward over ``batch`` sequences, each feeding ``tokens_per_seq`` new
        tokens, attending to ``context_tokens`` KV tokens in total over the batch."""
        ...

    def decode_span_s(self, batch: int, context_tokens: float, num_iters: int) -> float:
        """Sum of ``decode_iter_s(batch, context_tokens + i * batch, 1)`` for i in 0..num_iters-1:
        plain decoding of a fixed batch whose context grows by one token per sequence per
        iteration. Lets the simulator advance analytically between batch-composition changes."""
        ...

    def prefill_s(self, num_tokens: int, context_tokens: float = 0.0, num_seqs: float = 1) -> float:
        """Prefill ``num_tokens`` new tokens (summed over ``num_seqs`` requests, split evenly)
        on top of ``context_tokens`` cached tokens (summed likewise). ``num_seqs`` may be
        fractional: the simulator prices prompts of unequal lengths as N^2 / sum(n_i^2) equal
        ones, which attend over the same pairs (``tltsim.sim.prefill.attention_seqs``)."""
        ...

    def drafter_iter_s(self, batch: int, context_tokens: float, tokens_per_seq: int = 1) -> float:
        """One drafter forward (one draft step) over the batch."""
        ...

    def sd_iter_s(self, batch: int, context_tokens: float, decision: SpecDecision) -> float:
        """One engine iteration under ``decision`` (plain decode when SD is off). Default:
        ``default_sd_iter_s``; a measured profile may time whole SD iterations instead."""
        ...

    def sd_span_s(
        self,
        batch: int,
        context_tokens: float,
        decision: SpecDecision,
        num_iters: int,
        tokens_per_iter: float,
    ) -> float:
        """Sum of ``sd_iter_s`` over ``num_iters`` iterations of a fixed batch whose context grows
        by ``tokens_per_iter`` (batch total) per iteration — the simulator's fast-mode hot path,
        in closed form (``RooflineCost``, ``ProfileCost``)."""
        ...

    def sd_switch_s(self, batch: float, context_tokens: float) -> float:
        """Turning SD on mid-rollout: re-prefill of the running requests (target + drafter), as
        TLT requeues them to rebuild the drafter's KV cache. ``batch`` sequences of equal
        length (a float: the simulator prices uneven contexts as
        ``tltsim.sim.prefill.attention_seqs`` equal ones, as a prefill). Default:
        ``default_sd_switch_s``."""
        ...

    def train_s(self, num_tokens: int, mean_seq_tokens: float = 0.0) -> float:
        """Actor update (forward + backward + optimizer, with recompute) over ``num_tokens``
        (prompt + response) tokens on this instance's ``tp`` GPUs. The simulator's training
        phase is data parallel: ``train_s(total_tokens / num_instances)``. ``mean_seq_tokens``
        (0: ignore) adds causal attention FLOPs for sequences of that mean length."""
        ...

    def drafter_train_s(self, num_tokens: int, mean_seq_tokens: float = 0.0) -> float:
        """Drafter training over ``num_tokens`` harvested tokens on one instance."""
        ...


def is_context_padded(cost: CostModel) -> bool:
    """Whether ``cost`` models an engine whose attention pads the batch to its longest
    sequence (the ``CostModel`` docstring)."""
    return bool(getattr(cost, "is_context_padded", False))


def default_sd_iter_s(
    cost: CostModel, batch: int, context_tokens: float, decision: SpecDecision
) -> float:
    """``draft_steps`` drafter forwards, each over the batch x ``topk`` frontier tokens (EAGLE-2
    expands the top-k nodes of the current layer, arXiv 2406.16858 Sec. 4), then one target
    verify over ``verify_tokens + 1`` tokens per request: the tree nodes plus the root (the last
    accepted token, whose target KV is not yet written; SGLang's num_draft_tokens counts it)."""
    if not decision.enabled:
        return cost.decode_iter_s(batch, context_tokens, 1)
    draft_s = decision.draft_steps * cost.drafter_iter_s(batch, context_tokens, decision.topk)
    return draft_s + cost.decode_iter_s(batch, context_tokens, decision.verify_tokens + 1)


def default_sd_switch_s(cost: CostModel, batch: float, context_tokens: float) -> float:
    """Re-prefill every running request: the target recomputes the hidden states the drafter
    needs (an upper bound: a prefix cache could spare part of it) and the drafter rebuilds its
    one-layer KV cache over the same tokens."""
    if batch < 1 or context_tokens <= 0:
        return 0.0
    tokens = int(round(context_tokens))
    seqs = max(1, round(batch))  # a drafter forward of whole sequences
    per_seq = max(1, tokens // seqs)
    return cost.prefill_s(tokens, 0.0, batch) + cost.drafter_iter_s(seqs, 0.0, per_seq)


def crossover_batch(
    cost: CostModel,
    decision: SpecDecision,
    accept_len: float,
    context_per_seq: float,
    max_batch: int = 4096,
) -> int | None:
    """Smallest batch at which SD's tokens/s falls below plain decoding's, or None if SD still
    wins at ``max_batch``. SD emits ``accept_len`` tokens per request per iteration (incl. the
    bonus token), plain decoding one: SD is slower iff accept_len x t_plain < t_sd."""
    if not decision.enabled:
        raise ValueError("crossover_batch: decision must have SD enabled")
    for batch in range(1, max_batch + 1):
        context = batch * context_per_seq
        if accept_len * cost.decode_iter_s(batch, context, 1) < cost.sd_iter_s(
            batch, context, decision
        ):
            return batch
    return None


def sum_max_linear(a0: float, a1: float, b0: float, b1: float, n: int) -> float:
    """``sum(max(a0 + a1*i, b0 + b1*i) for i in range(n))`` in closed form: two lines cross at
    most once, so the sum splits into two arithmetic series at the crossover index."""
    if n <= 0:
        return 0.0

    def series(c: float, s: float, first: int, last: int) -> float:
        count = last - first + 1
        return count * c + s * (first + last) * count / 2.0 if count > 0 else 0.0

    g0, g1 = a0 - b0, a1 - b1  # a - b = g0 + g1*i
    if g1 == 0:
        return series(a0, a1, 0, n - 1) if g0 >= 0 else series(b0, b1, 0, n - 1)
    root = min(max(-g0 / g1, -1.0), n + 1.0)  # clamped: a tiny slope gives a huge root
    if g1 > 0:  # a dominates from index k on
        k = min(max(math.ceil(root), 0), n)
        return series(b0, b1, 0, k - 1) + series(a0, a1, k, n - 1)
    k = min(max(math.floor(root) + 1, 0), n)  # a dominates on indices 0..k-1
    return series(a0, a1, 0, k - 1) + series(b0, b1, k, n - 1)


@dataclass(frozen=True)
class _Pass:
    """Per-GPU coefficients of one kind of forward pass (target or drafter) under TP."""

    matmul_params: float  # per GPU
    weight_bytes: float  # per GPU
    kv_bytes_per_token: float  # per GPU
    attn_flops_per_pair: float  # per GPU
    logits_bytes_per_token: float  # per GPU (vocab-parallel LM head)
    num_layers: int  # all-reduces: two per layer under TP
    overhead_s: float
    # of matmul_params, the LM head's (per GPU): a prefill computes logits of each sequence's
    # last token only (vLLM and SGLang gather those positions before the head)
    head_params: float = 0.0


@dataclass(frozen=True)
class RooflineCost:
    """Roofline ``CostModel`` for one engine instance of ``tp`` GPUs serving ``model``."""

    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    drafter: DrafterSpec | None = None  # None: the EAGLE-1 drafter of ``model``
    # Full activation recompute runs the forward twice: (2 + 4 + 2) / 6 = 8/6 of the 6N FLOPs per
    # token of forward + backward (the extra forward pass of full recomputation discussed by
    # Korthikanti et al. 2022, arXiv 2205.05198). fastrl's config enables gradient checkpointing
    # (actor_rollout_ref.model.enable_gradient_checkpointing: true).
    recompute_factor: float = 8.0 / 6.0
    # Extra forward passes over the batch in the training phase: veRL recomputes old-policy
    # log-probs (1); add one more when a reference model is used for a KL term.
    num_logprob_passes: int = 1
    # fastrl's default (collect_hidden_states_from_sgl: false) makes the drafter trainer run the
    # target forward to get the hidden states it trains on.
    is_drafter_target_forward: bool = True
    logit_bytes: int = 4  # logits are upcast to fp32 before sampling / verification
    act_bytes: int = 2  # bf16 activations in the TP all-reduce
    # Prefill is chunked; 8192 is max_num_batched_tokens in fastrl's rollout config.
    max_prefill_chunk_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"RooflineCost: tp must be >= 1, got {self.tp}")
        if self.model.num_attention_heads % self.tp:
            raise ValueError(
                f"RooflineCost: {self.model.name} has {self.model.num_attention_heads} attention heads, not divisible by tp={self.tp}"
            )
        if (
            self.recompute_factor < 1
            or self.num_logprob_passes < 0
            or self.max_prefill_chunk_tokens < 1
        ):
            raise ValueError(
                "RooflineCost: need recompute_factor >= 1, num_logprob_passes >= 0, max_prefill_chunk_tokens >= 1"
            )
        if self.drafter is not None and self.drafter.target != self.model:
            raise ValueError("RooflineCost: the drafter must be built on the same target model")

    # --- coefficients -------------------------------------------------------------------------

    @property
    def drafter_spec(self) -> DrafterSpec:
        return self.drafter or DrafterSpec(self.model)

    def _kv_shard(self) -> float:
        """Fraction of a token's KV held per GPU; KV heads are replicated when tp > num_kv_heads."""
        heads = self.model.num_kv_heads
        return math.ceil(heads / self.tp) / heads

    def _pass(self, spec, overhead_s: float) -> _Pass:
        """Per-GPU costs of one forward of ``spec`` (target ModelSpec or DrafterSpec) at ``tp``."""
        tp = self.tp
        return _Pass(
            spec.matmul_params / tp,
            spec.weight_bytes / tp,
            spec.kv_bytes_per_token * self._kv_shard(),
            spec.attn_flops_per_pair / tp,
            spec.vocab_size * self.logit_bytes / tp,
            spec.num_layers,
            overhead_s,
            spec.lm_head_params / tp,
        )

    @cached_property
    def _target(self) -> _Pass:
        return self._pass(self.model, self.hardware.iter_overhead_s)

    @cached_property
    def _draft(self) -> _Pass:
        return self._pass(self.drafter_spec, self.hardware.draft_step_overhead_s)

    @cached_property
    def _body(self) -> _Pass:
        """The target's layers alone: no LM head, no logits, no per-iteration overhead. What a
        GPU timer around the model forward measures (vLLM's StepTimingCollector.forward_ms)."""
        m, tp = self.model, self.tp
        return dataclasses.replace(
            self._target,
            matmul_params=(m.matmul_params - m.lm_head_params) / tp,
            weight_bytes=(m.weight_bytes - m.bytes_per_param * m.lm_head_params) / tp,
            logits_bytes_per_token=0.0,
            overhead_s=0.0,
            head_params=0.0,
        )

    def forward_body_s(self, batch: int, context_tokens: float, tokens_per_seq: int = 1) -> float:
        """GPU seconds of one target forward without the LM head, sampling and the engine's
        per-iteration host overhead (``_body``); the published model-forward timings
        (``tltsim.cost.published.vllm_h100_forward_points``) are this quantity."""
        return self._iter_s(self._body, batch, context_tokens, tokens_per_seq)

    def _allreduce_s(self, p: _Pass, num_tokens: float, num_calls: int = 1) -> float:
        """Two ring all-reduces per layer (after attention, after the MLP), each moving
        2 (tp-1)/tp x the activations over the link; zero without TP."""
        if self.tp == 1:
            return 0.0
        hw = self.hardware
        message = num_tokens * self.model.hidden_size * self.act_bytes
        per_layer = (
            2 * num_calls * hw.allreduce_latency_s
            + 2 * 2 * (self.tp - 1) / self.tp * message / hw.link_bytes_per_s
        )
        return p.num_layers * per_layer

    def _lines(
        self, p: _Pass, batch: int, tokens_per_seq: int
    ) -> tuple[float, float, float, float, float]:
        """Iteration time = max((f0 + f1*C) / F, (m0 + m1*C) / BW) + fixed, C = context tokens."""
        new = batch * tokens_per_seq
        # New tokens attend causally to each other within the iteration (t(t+1)/2 pairs per seq).
        f0 = (
            2.0 * p.matmul_params * new
            + p.attn_flops_per_pair * batch * tokens_per_seq * (tokens_per_seq + 1) / 2
        )
        f1 = p.attn_flops_per_pair * tokens_per_seq
        m0 = p.weight_bytes + p.kv_bytes_per_token * new + p.logits_bytes_per_token * new
        m1 = p.kv_bytes_per_token  # the whole context is read once per iteration
        return f0, f1, m0, m1, p.overhead_s + self._allreduce_s(p, new)

    def _iter_s(self, p: _Pass, batch: int, context_tokens: float, tokens_per_seq: int) -> float:
        if batch < 1 or tokens_per_seq < 1:
            raise ValueError(
                f"need batch >= 1 and tokens_per_seq >= 1, got {batch}, {tokens_per_seq}"
            )
        f0, f1, m0, m1, fixed = self._lines(p, batch, tokens_per_seq)
        hw = self.hardware
        return (
            max(
                (f0 + f1 * context_tokens) / hw.achievable_flops_per_s,
                (m0 + m1 * context_tokens) / hw.achievable_bytes_per_s,
            )
            + fixed
        )

    def _span_s(
        self,
        p: _Pass,
        batch: int,
        tokens_per_seq: int,
        context_tokens: float,
        growth: float,
        num_iters: int,
    ) -> float:
        """Closed-form sum of ``_iter_s`` over contexts C_i = context_tokens + i * growth."""
        if num_iters <= 0:  # no iterations cost nothing (it was negative, CalibratedCost's 0)
            return 0.0
        f0, f1, m0, m1, fixed = self._lines(p, batch, tokens_per_seq)
        flops_s, bytes_s = (
            self.hardware.achievable_flops_per_s,
            self.hardware.achievable_bytes_per_s,
        )
        a0, a1 = (f0 + f1 * context_tokens) / flops_s, f1 * growth / flops_s
        b0, b1 = (m0 + m1 * context_tokens) / bytes_s, m1 * growth / bytes_s
        return sum_max_linear(a0, a1, b0, b1, num_iters) + num_iters * fixed

    def _prefill_pass_s(
        self, p: _Pass, num_tokens: int, context_tokens: float, num_seqs: float
    ) -> float:
        if num_tokens <= 0:
            return 0.0
        seqs = max(1, num_seqs)
        chunks = math.ceil(num_tokens / self.max_prefill_chunk_tokens)
        # Pairs per request (n new over c cached tokens, split evenly): n*c + n(n+1)/2.
        pairs = num_tokens * context_tokens / seqs + num_tokens * (num_tokens / seqs + 1) / 2
        # the LM head over the last token of each sequence only (it was charged on every
        # prompt token: +8% on a 7B prefill, x3 on the drafter's re-prefill, whose head is
        # most of its FLOPs)
        flops = (
            2.0 * (p.matmul_params - p.head_params) * num_tokens
            + 2.0 * p.head_params * min(seqs, num_tokens)
            + p.attn_flops_per_pair * pairs
        )
        # Weights stream once per chunk; cached KV read, new KV written; logits of last tokens only.
        moved = (
            chunks * p.weight_bytes
            + p.kv_bytes_per_token * (num_tokens + context_tokens)
            + p.logits_bytes_per_token * seqs
        )
        hw = self.hardware
        compute = max(flops / hw.achievable_flops_per_s, moved / hw.achievable_bytes_per_s)
        return compute + chunks * p.overhead_s + self._allreduce_s(p, num_tokens, chunks)

    # --- CostModel ------------------------------------------------------------------------------

    def decode_iter_s(self, batch: int, context_tokens: float, tokens_per_seq: int = 1) -> float:
        return self._iter_s(self._target, batch, context_tokens, tokens_per_seq)

    def decode_span_s(self, batch: int, context_tokens: float, num_iters: int) -> float:
        return self._span_s(self._target, batch, 1, context_tokens, float(batch), num_iters)

    def prefill_s(self, num_tokens: int, context_tokens: float = 0.0, num_seqs: float = 1) -> float:
        return self._prefill_pass_s(self._target, num_tokens, context_tokens, num_seqs)

    def drafter_iter_s(self, batch: int, context_tokens: float, tokens_per_seq: int = 1) -> float:
        return self._iter_s(self._draft, batch, context_tokens, tokens_per_seq)

    def sd_iter_s(self, batch: int, context_tokens: float, decision: SpecDecision) -> float:
        return default_sd_iter_s(self, batch, context_tokens, decision)

    def sd_switch_s(self, batch: float, context_tokens: float) -> float:
        if batch < 1 or context_tokens <= 0:
            return 0.0
        tokens = int(round(context_tokens))
        return self.prefill_s(tokens, 0.0, batch) + self._prefill_pass_s(
            self._draft, tokens, 0.0, batch
        )

    def sd_span_s(
        self,
        batch: int,
        context_tokens: float,
        decision: SpecDecision,
        num_iters: int,
        tokens_per_iter: float,
    ) -> float:
        """Closed-form sum of ``sd_iter_s`` over ``num_iters`` iterations whose context grows by
        ``tokens_per_iter`` (batch total, e.g. batch x expected accept length) per iteration."""
        if not decision.enabled:
            return self._span_s(self._target, batch, 1, context_tokens, tokens_per_iter, num_iters)
        draft = self._span_s(
            self._draft, batch, decision.topk, context_tokens, tokens_per_iter, num_iters
        )
        verify = self._span_s(
            self._target,
            batch,
            decision.verify_tokens + 1,
            context_tokens,
            tokens_per_iter,
            num_iters,
        )
        return decision.draft_steps * draft + verify

    def crossover_batch(
        self,
        decision: SpecDecision,
        accept_len: float,
        context_per_seq: float,
        max_batch: int = 4096,
    ) -> int | None:
        return crossover_batch(self, decision, accept_len, context_per_seq, max_batch)

    def _train_flops_per_s(self) -> float:
        hw = self.hardware
        return self.tp * hw.peak_flops_per_s * hw.train_flops_fraction

    def train_s(self, num_tokens: int, mean_seq_tokens: float = 0.0) -> float:
        """(recompute x 6 + logprob passes x 2) x params x tokens, plus causal attention (mean
        s/2 keys per token; backward = 2x forward), over the instance's achievable train FLOP/s.
        The optimizer step (memory-bound, sharded by FSDP) is left out."""
        m = self.model
        fwd_per_token = 2.0 * m.matmul_params + m.attn_flops_per_pair * mean_seq_tokens / 2
        flops = (3 * self.recompute_factor + self.num_logprob_passes) * fwd_per_token * num_tokens
        return flops / self._train_flops_per_s()

    def drafter_train_s(self, num_tokens: int, mean_seq_tokens: float = 0.0) -> float:
        """6 x trainable drafter params per token; the frozen LM head still costs its forward and
        the backward to its input (4 x vocab x hidden); plus the target forward that produces
        the hidden states when they are not harvested during rollout."""
        d, m = self.drafter_spec, self.model
        flops = (
            6.0 * d.trainable_params
            + 4.0 * d.lm_head_params
            + 3 * d.attn_flops_per_pair * mean_seq_tokens / 2
        ) * num_tokens
        if self.is_drafter_target_forward:
            flops += m.forward_flops_per_token(mean_seq_tokens / 2) * num_tokens
        return flops / self._train_flops_per_s()

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """KV tokens that fit on the instance next to the target and drafter weights (target +
        drafter KV per token). 0.9 is vLLM's default gpu_memory_utilization."""
        d = self.drafter_spec
        free = self.tp * self.hardware.memory_bytes * gpu_memory_utilization
        free -= (
            self.model.num_params * self.model.bytes_per_param
            + d.trainable_params * self.model.bytes_per_param
        )
        # per token over the instance: KV heads replicated where tp > num_kv_heads (_kv_shard)
        per_token = (
            self.tp * self._kv_shard() * (self.model.kv_bytes_per_token + d.kv_bytes_per_token)
        )
        return max(0, int(free // per_token))


__all__ = [
    "CostModel",
    "DrafterSpec",
    "HardwareSpec",
    "ModelSpec",
    "RooflineCost",
    "crossover_batch",
    "default_sd_iter_s",
    "default_sd_switch_s",
    "sum_max_linear",
]
