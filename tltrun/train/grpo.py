"""GRPO (Group Relative Policy Optimisation, Shao et al. 2024, "DeepSeekMath", Sec. 4.1): the
actor update of ``tltrun train``.

Per prompt the rollout draws G responses; each gets a scalar reward r_i (outcome supervision).
The advantage of every token of response i is the group-normalised reward

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)                         (DeepSeekMath eq. 4.1.2)

and the loss over the response tokens t of all responses is the clipped surrogate with a KL
penalty to a frozen reference policy (k3 estimator, Schulman 2020 "Approximating KL"):

    ratio_t = exp(logp_t - logp_old_t)
    L = -1/N sum_t [ min(ratio_t A, clip(ratio_t, 1 - eps_clip, 1 + eps_clip) A) - beta KL_t ]
    KL_t = exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1                   (>= 0)

Departures from the paper, each on purpose:

* token-level aggregation: one mean over ALL response tokens of the batch (N above), not a mean
  per response then over responses (DAPO, Yu et al. 2025, Sec. 3.3; Dr. GRPO, Liu et al. 2025):
  a long response's tokens weigh as much as a short one's — the long tail is what we study;
* std is the unbiased sample std of the group (veRL's ``compute_grpo_outcome_advantage``); the
  paper does not say which. A group whose rewards are all equal gets A = 0 (no signal);
* log-probabilities use logits / temperature, the distribution the rollout sampled from when
  ``top_p`` is 1 (veRL does the same); greedy rollouts use temperature 1. With ``top_p < 1`` the
  rollout samples the truncated, renormalised distribution while the loss differentiates the
  untruncated one (as veRL), so the gradient omits the truncation's normaliser: keep top_p 1 for
  on-policy GRPO;
* the reference model stays the initial (SFT) model for the whole run; the paper's iterative
  GRPO resets it to the current policy every so often;
* ``num_epochs`` optimiser steps per rollout on the whole batch (the paper's mu inner
  iterations) without mini-batches; with the default of 1 the ratio is exactly 1 and the clip
  is inactive, but it is computed as written so that more epochs are correct;
* gradients are clipped to a global norm (``max_grad_norm``), not in the paper but standard in
  veRL / TRL.

Distributed use (tltrun.train.spot): each worker computes the loss of its own groups divided by the
GLOBAL token count, the gradients are all-reduced (summed) before the optimiser step, which
makes every worker take exactly the step a single process would take on the whole batch.

Run the tests: ``python -m pytest tests/test_grpo.py -q``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tltrun.model.batching import padded_groups, right_pad
from tltrun.model.transformer import CausalContext, Transformer, reduce_grads
from tltrun.rollout.interface import GREEDY_BELOW_TEMPERATURE
from tltsim.errors import check_finite


@dataclass(frozen=True)
class GRPOConfig:
    # DeepSeekMath Sec. 4.1 trains its 7B policy at 1e-6; tiny models need far more (set it).
    lr: float = 1e-6
    kl_coef: float = 0.04  # beta, DeepSeekMath Sec. 4.1
    clip_eps: float = 0.2  # PPO's epsilon (Schulman et al. 2017, Sec. 6)
    adv_eps: float = 1e-6  # veRL compute_grpo_outcome_advantage epsilon
    max_grad_norm: float = 1.0  # veRL actor.grad_clip default
    num_epochs: int = 1  # DeepSeekMath's GRPO iterations mu = 1
    # Padded tokens per forward/backward micro-batch (memory cap only; results do not depend
    # on it beyond float summation order).
    max_batch_tokens: int = 8192

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.kl_coef < 0 or not 0 < self.clip_eps < 1:
            raise ValueError("GRPOConfig: lr > 0, kl_coef >= 0 and 0 < clip_eps < 1 required")
        if not self.adv_eps > 0 or not self.max_grad_norm > 0:
            raise ValueError("GRPOConfig: adv_eps > 0 and max_grad_norm > 0 required")
        if self.num_epochs < 1 or self.max_batch_tokens < 1:
            raise ValueError("GRPOConfig: num_epochs >= 1 and max_batch_tokens >= 1 required")


@dataclass(frozen=True)
class Sample:
    """One response of a group: prompt and response token ids, reward, group key."""

    group: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    reward: float


def group_advantages(samples: list[Sample], eps: float) -> list[float]:
    """(r - mean) / (std + eps) within each group (unbiased std; a group of one gets 0)."""
    by_group: dict[str, list[float]] = {}
    for s in samples:
        by_group.setdefault(s.group, []).append(s.reward)
    stats = {}
    for g, rewards in by_group.items():
        r = torch.tensor(rewards, dtype=torch.float64)
        std = float(r.std()) if len(rewards) > 1 else 0.0
        stats[g] = (float(r.mean()), std)
    return [(s.reward - stats[s.group][0]) / (stats[s.group][1] + eps) for s in samples]


def token_logprobs(model: Transformer, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for t = 0..T-2 under logits / temperature. (B, T-1)"""
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).expand(b, -1)
    logits, _ = model(ids, positions, CausalContext())  # (B,T,V)
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # (B,T-1,V)
    return logp.gather(-1, ids[:, 1:, None])[..., 0]  # (B,T-1)


def surrogate_loss(
    logp: torch.Tensor,  # (B,T) current policy
    old_logp: torch.Tensor,  # (B,T) policy that sampled the rollout
    ref_logp: torch.Tensor | None,  # (B,T) frozen reference, None without KL
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B,T) float: 1 on response tokens
    cfg: GRPOConfig,
    num_tokens: int,  # normaliser N (global over all workers)
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over masked tokens of the clipped-surrogate + KL loss, divided by ``num_tokens``."""
    # log-ratios are zeroed off the mask before exp: a prompt or padding position whose ratio
    # overflowed to inf made inf * 0 = NaN in the loss and gradient (review), which the run
    # then reported as divergence
    is_on = mask.bool()
    ratio = torch.exp(torch.where(is_on, logp - old_logp, 0.0))
    adv = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # (B,T)
    kl = torch.zeros_like(logp)
    if ref_logp is not None and cfg.kl_coef > 0:
        delta = torch.where(is_on, ref_logp - logp, 0.0)
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        per_token = per_token + cfg.kl_coef * kl
    loss = (per_token * mask).sum() / num_tokens
    with torch.no_grad():
        # veRL's pg_clipfrac: the tokens where the clipped term won the min (their surrogate
        # gradient is zero), not every ratio outside the range (baselines' clipfrac: a ratio
        # outside it on the side the advantage pulls away from still gets its gradient)
        is_clipped = (clipped * adv < ratio * adv).float()
        stats = {
            "kl_sum": float((kl * mask).sum()),
            "clipped_sum": float((is_clipped * mask).sum()),
        }
    return loss, stats


def pack(samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B,T) and the response mask (B,T-1) aligned with token_logprobs."""
    ids, lens = right_pad([s.prompt_ids + s.response_ids for s in samples], pad_id)
    mask = torch.zeros(len(samples), ids.shape[1] - 1)
    for b, (s, n) in enumerate(zip(samples, lens.tolist(), strict=True)):
        # token at position p (p >= len(prompt)) is predicted at t = p - 1
        mask[b, len(s.prompt_ids) - 1 : n - 1] = 1.0
    return ids, mask


def grpo_update(
    actor: Transformer,
    ref: Transformer | None,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    cfg: GRPOConfig,
    temperature: float,
    pad_id: int,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """``cfg.num_epochs`` optimiser steps on ``samples``. ``all_reduce_sum`` sums a tensor over
    the data-parallel workers in place (identity for one process): used for the token count,
    the gradients and the logged statistics, so all workers take identical steps.

    ``autocast_dtype`` (e.g. bfloat16 on CUDA): forwards and backwards run under
    ``torch.autocast`` in that dtype while the parameters, their gradients and the optimiser
    state stay in the actor's own dtype (fp32 master weights: mixed precision as in
    Micikevicius et al. 2018, which bf16's fp32-sized exponent lets run without loss scaling).
    Log-probabilities and the loss are computed in fp32 (``token_logprobs`` upcasts)."""
    # the rollout's own rule: below GREEDY_BELOW_TEMPERATURE it decoded greedily, and a
    # division by such a temperature gave NaN or ~1e6x gradients
    temp = 1.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature
    device = next(actor.parameters()).device
    advantages = torch.tensor(
        group_advantages(samples, cfg.adv_eps), dtype=torch.float32, device=device
    )
    local_tokens = sum(len(s.response_ids) for s in samples)
    num_tokens = int(all_reduce_sum(torch.tensor([float(local_tokens)]))[0])
    batches = microbatches(samples, cfg.max_batch_tokens)
    sharded = _is_sharded(actor)
    scale = 1.0
    if sharded:  # FSDP2 (tltrun.train.fsdp): every rank gathers each layer equally often
        from tltrun.train.fsdp import gradient_scale, max_over_ranks

        batches += [[] for _ in range(max_over_ranks(len(batches)) - len(batches))]
        scale = gradient_scale(actor)
    params = [p for p in actor.parameters() if p.requires_grad]
    old: list[torch.Tensor] = []
    refs: list[torch.Tensor | None] = []
    totals = torch.zeros(4)  # loss, kl_sum, clipped_sum, grad_norm (last epoch)
    actor.train()
    for epoch in range(cfg.num_epochs):
        optimizer.zero_grad(set_to_none=False)
        totals.zero_()
        for k, idx in enumerate(batches):
            if not idx:  # a sharded rank's filler: the layers' collectives, zero gradient
                filler = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
                with _autocast(device, autocast_dtype):
                    (token_logprobs(actor, filler, temp).sum() * 0.0).backward()
                if epoch == 0:
                    old.append(None)
                    refs.append(None)
                continue
            ids, mask = pack([samples[i] for i in idx], pad_id)
            ids, mask = ids.to(device), mask.to(device)
            with _autocast(device, autocast_dtype):
                logp = token_logprobs(actor, ids, temp)
            if epoch == 0:  # the rollout's policy: current weights before any step
                old.append(logp.detach())
                with torch.no_grad(), _autocast(device, autocast_dtype):
                    refs.append(token_logprobs(ref, ids, temp) if ref is not None else None)
            loss, stats = surrogate_loss(
                logp, old[k], refs[k], advantages[idx], mask, cfg, max(num_tokens, 1)
            )
            (loss * scale if sharded else loss).backward()
            totals += torch.tensor([loss.item(), stats["kl_sum"], stats["clipped_sum"], 0.0])
        if not sharded:  # (FSDP2's reduce-scatter of the scaled loss's gradients summed them)
            reduce_grads(params, all_reduce_sum)  # sum of per-worker (loss / global N) gradients
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        totals[3] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        # every rank holds the same summed gradients: all stop here, or none
        check_finite(totals[3], "GRPO update: gradient norm")
        optimizer.step()
    actor.eval()
    summed = all_reduce_sum(totals[:3].clone())
    return {
        "loss": float(summed[0]),
        "kl": float(summed[1]) / max(num_tokens, 1),
        "clip_frac": float(summed[2]) / max(num_tokens, 1),
        "grad_norm": float(totals[3]),
        "num_tokens": num_tokens,
    }


def _is_sharded(actor) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(actor, FSDPModule)


def microbatches(samples: list[Sample], max_tokens: int) -> list[list[int]]:
    """Index groups of ``samples`` for one forward/backward each: sorted by length, then cut
    so that members x longest member stays within ``max_tokens`` padded tokens. Sorting first
    puts sequences of similar length together, so a micro-batch pads to its own longest
    member rather than the rollout's (a long-tail batch otherwise pays for its longest
    response in every micro-batch); gradients accumulate over the micro-batches, so the step
    is the same up to float summation order."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: lengths[i])
    groups = padded_groups([lengths[i] for i in order], max_tokens)
    return [[order[j] for j in group] for group in groups]


def autocast_dtype_for(dtype: str, device: str) -> torch.dtype | None:
    """``tltrun train``'s compute dtype under autocast: bf16 on CUDA when asked, else None
    (fp32 master weights and AdamW state either way; a CPU's bf16 matmuls are slower)."""
    return torch.bfloat16 if dtype == "bfloat16" and device.startswith("cuda") else None


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_optimizer(actor: Transformer, cfg: GRPOConfig) -> torch.optim.Optimizer:
    # AdamW with DeepSeekMath's pre-training betas and weight decay (Sec. 2.2.1); its RL
    # section (4.1) gives only the learning rate.
    return torch.optim.AdamW(actor.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
