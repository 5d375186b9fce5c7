"""GRPO maths on hand-checked numbers (advantages, clipped surrogate, k3 KL, token-level
aggregation) and a tiny GRPO run that makes a rewarded token more likely.

Run: ``python -m pytest tests/test_grpo.py -q``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import tiny_model

from tltrun.model.batching import padded_groups
from tltrun.model.transformer import CausalContext
from tltrun.train.grpo import (
    GRPOConfig,
    Sample,
    group_advantages,
    grpo_update,
    make_optimizer,
    pack,
    surrogate_loss,
    token_logprobs,
)
from tltsim.errors import DivergedError


def test_group_advantages_hand_checked():
    samples = [Sample("a", (1,), (5,), r) for r in (1.0, 0.0, 0.0, 1.0)]
    samples += [
        Sample("b", (1,), (5,), 3.0),
        Sample("c", (1,), (5,), 2.0),
        Sample("c", (1,), (5,), 2.0),
    ]
    adv = group_advantages(samples, eps=0.0 + 1e-12)
    # group a: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    assert adv[:4] == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    assert adv[4] == 0.0  # a group of one: no signal
    assert adv[5:] == [0.0, 0.0]  # equal rewards: no signal


def test_surrogate_clip_and_k3_kl_hand_checked():
    cfg = GRPOConfig(clip_eps=0.2, kl_coef=0.0)
    old = torch.zeros(2, 1)
    logp = torch.full((2, 1), math.log(1.5), requires_grad=True)  # ratio 1.5 for both
    mask = torch.ones(2, 1)
    loss, _ = surrogate_loss(logp, old, None, torch.tensor([1.0, -1.0]), mask, cfg, num_tokens=2)
    # A=+1: min(1.5, 1.2) = 1.2 -> -1.2 ; A=-1: min(-1.5, -1.2) = -1.5 -> +1.5 ; mean over 2
    assert loss.item() == pytest.approx((-1.2 + 1.5) / 2, abs=1e-6)
    loss.backward()
    # the clipped branch has no gradient; the unclipped one: d(1.5 * -(-1))/dlogp / 2 = 0.75
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, 0.75], abs=1e-6)
    cfg_kl = GRPOConfig(kl_coef=0.5)
    ref = torch.tensor([[0.5]])
    loss_kl, stats = surrogate_loss(
        torch.zeros(1, 1), torch.zeros(1, 1), ref, torch.zeros(1), torch.ones(1, 1), cfg_kl, 1
    )
    k3 = math.exp(0.5) - 0.5 - 1  # 0.148721
    assert stats["kl_sum"] == pytest.approx(k3, abs=1e-6)
    assert loss_kl.item() == pytest.approx(0.5 * k3, abs=1e-6)


def test_clip_fraction_counts_the_tokens_whose_gradient_the_clip_removes():
    """veRL's pg_clipfrac: a ratio outside [1 - eps, 1 + eps] counts only where the clipped
    term wins the min. Tokens: ratio 1.5 with A > 0 (clipped), 0.5 with A > 0 (not: the
    unclipped term is smaller and keeps its gradient), 0.5 with A < 0 (clipped), 1.5 with
    A < 0 (not), 1.0 (inside)."""
    ratio = torch.tensor([[1.5, 0.5], [0.5, 1.5], [1.0, 1.0]])
    logp, old = ratio.log(), torch.zeros(3, 2)
    advantages = torch.tensor([1.0, -1.0, 1.0])
    _, stats = surrogate_loss(logp, old, None, advantages, torch.ones(3, 2), GRPOConfig(), 6)
    assert stats["clipped_sum"] == 2


def test_token_level_aggregation_and_mask():
    samples = [Sample("a", (1, 7), (5, 6, 2), 1.0), Sample("a", (1,), (9,), 0.0)]
    ids, mask = pack(samples, pad_id=0)
    assert ids.tolist() == [[1, 7, 5, 6, 2], [1, 9, 0, 0, 0]]
    # response tokens are predicted at t = len(prompt) - 1 .. len(seq) - 2
    assert mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    logp = torch.zeros(2, 4)
    loss, _ = surrogate_loss(logp, logp, None, torch.tensor([1.0, -1.0]), mask, GRPOConfig(), 4)
    assert loss.item() == pytest.approx((-3 + 1) / 4)  # every token weighs 1/N, N = 4


def test_a_masked_position_s_log_ratio_cannot_overflow_the_loss():
    """Review: k3 = exp(ref - logp) - (ref - logp) - 1 and exp(logp - old) were evaluated at
    prompt and padding positions too, then masked: a gap of > 88 nats there overflowed to inf,
    and inf * 0 made the loss and gradient NaN (reported as divergence)."""
    logp = torch.tensor([[-120.0, -1.0, -2.0]], requires_grad=True)  # position 0: the prompt
    ref = torch.tensor([[-20.0, -1.1, -1.9]])
    old = torch.tensor([[-300.0, -1.0, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    cfg = GRPOConfig(kl_coef=0.04)
    loss, stats = surrogate_loss(logp, old, ref, torch.tensor([0.5]), mask, cfg, 2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 0] == 0
    # the response positions' terms are what they were
    kl = [math.exp(d) - d - 1 for d in (-0.1, 0.1)]
    assert loss.item() == pytest.approx((-0.5 - 0.5 + cfg.kl_coef * sum(kl)) / 2)
    assert stats["kl_sum"] == pytest.approx(sum(kl))


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 100))
def test_padded_groups_cover_in_order_within_the_cap(lengths, cap):
    """The packing GRPO's micro-batches and the engine's prefill share: consecutive groups,
    every index once, each within the cap unless one item alone is longer, greedy (the next
    item would not have fit)."""
    groups = padded_groups(lengths, cap)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    for g, nxt in zip(groups, groups[1:] + [None], strict=True):
        padded = len(g) * max(lengths[i] for i in g)
        assert padded <= cap or len(g) == 1
        if nxt is not None:
            assert (len(g) + 1) * max(lengths[i] for i in g + nxt[:1]) > cap


def test_tiny_grpo_run_makes_rewarded_token_likelier():
    """Prompt [1], one sampled token; reward 1 iff it is token 7. GRPO must raise p(7)."""
    model = tiny_model(seed=3).train()
    cfg = GRPOConfig(lr=3e-3, kl_coef=0.0)
    opt = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.tensor([[1, 4]])

    def p7() -> float:
        with torch.no_grad():
            return float(token_logprobs(model, torch.tensor([[1, 4, 7]]), 1.0)[0, -1].exp())

    before = p7()
    for it in range(15):
        with torch.no_grad():
            logits, _ = model(prompt, torch.arange(2)[None], CausalContext())
            probs = torch.softmax(logits[0, -1], -1)
        # half the group forced to the rewarded token so every group has signal
        toks = torch.multinomial(probs, 8, replacement=True, generator=gen).tolist()
        toks[:2] = [7, 7]
        samples = [Sample(f"g{it}", (1, 4), (t,), float(t == 7)) for t in toks]
        grpo_update(model, None, opt, samples, cfg, temperature=1.0, pad_id=0)
    after = p7()
    assert after > 2 * before, (before, after)


def test_multi_epoch_ratio_moves_and_clip_engages():
    model = tiny_model(seed=4).train()
    cfg = GRPOConfig(lr=5e-2, kl_coef=0.0, num_epochs=4, clip_eps=0.1)
    opt = make_optimizer(model, cfg)
    samples = [Sample("g", (1, 4), (7, 8), 1.0), Sample("g", (1, 4), (9, 10), 0.0)]
    stats = grpo_update(model, None, opt, samples, cfg, temperature=1.0, pad_id=0)
    # after several large steps on the same batch the ratio leaves [0.9, 1.1] for some tokens
    assert stats["clip_frac"] > 0


def _long_tail_samples() -> list[Sample]:
    """Two groups whose responses range from 2 to 40 tokens (a long tail), rewards spread."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for g, lengths in enumerate(((2, 40, 5, 3), (7, 4, 30, 2))):
        for i, n in enumerate(lengths):
            ids = tuple(torch.randint(4, 90, (n,), generator=gen).tolist())
            samples.append(Sample(f"g{g}", (1, 5 + g), ids, float(i % 2)))
    return samples


def _update(max_batch_tokens: int, **kwargs) -> tuple[dict, dict]:
    actor, ref = tiny_model(seed=0).train(), tiny_model(seed=0)
    actor.is_gradient_checkpointing = kwargs.pop("checkpointing", False)
    cfg = GRPOConfig(lr=1e-2, max_batch_tokens=max_batch_tokens)
    stats = grpo_update(
        actor, ref, make_optimizer(actor, cfg), _long_tail_samples(), cfg, 1.0, 0, **kwargs
    )
    return stats, {k: v.detach().clone() for k, v in actor.state_dict().items()}


@pytest.mark.parametrize("max_batch_tokens", [8192, 48])  # one microbatch, and several
def test_the_update_is_a_mean_over_every_response_token(max_batch_tokens):
    """Token-level aggregation in grpo_update itself (surrogate_loss was checked with a count
    the test passed in; a per-sequence mean passed every test): one epoch without KL has ratio
    1, so its loss is -sum_i A_i len_i / sum_i len_i over responses of 2 to 40 tokens."""
    samples = _long_tail_samples()
    actor = tiny_model(seed=0).train()
    cfg = GRPOConfig(lr=1e-2, kl_coef=0.0, num_epochs=1, max_batch_tokens=max_batch_tokens)
    stats = grpo_update(actor, None, make_optimizer(actor, cfg), samples, cfg, 1.0, 0)
    lengths = [len(s.response_ids) for s in samples]
    assert stats["num_tokens"] == sum(lengths) == 93
    advantages = group_advantages(samples, cfg.adv_eps)
    expected = -sum(a * n for a, n in zip(advantages, lengths, strict=True)) / sum(lengths)
    # a mean of per-sequence means (0: advantages sum to 0 in a group) or a division by the
    # number of responses (-0.54) would not match it
    assert abs(expected) > 0.01
    assert stats["loss"] == pytest.approx(expected, abs=1e-5)
    assert stats["clip_frac"] == 0.0 and stats["kl"] == 0.0


def test_token_budget_microbatches_sort_by_length_and_keep_the_step():
    from tltrun.train.grpo import microbatches

    samples = _long_tail_samples()
    groups = microbatches(samples, max_tokens=84)
    assert sorted(i for g in groups for i in g) == list(range(len(samples)))
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    for g in groups:  # within the budget (a longer sequence alone), lengths sorted across groups
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 84
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)
    # the padded tokens: sorted micro-batches pad far less than the rollout's order would
    sorted_pad = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    in_order = padded_groups(lengths, 84)
    order_pad = sum(len(g) * max(lengths[i] for i in g) for g in in_order)
    assert sorted_pad < order_pad  # 138 vs 184 padded tokens
    # the same optimiser step whatever the budget (float summation order aside)
    small, w_small = _update(48)
    large, w_large = _update(10_000)
    assert small["loss"] == pytest.approx(large["loss"], rel=1e-4, abs=1e-6)
    # the gradient's scale too: AdamW's first step is about lr * sign(g), so the weights alone
    # would not see a micro-batch count in the normaliser (review)
    assert small["grad_norm"] == pytest.approx(large["grad_norm"], rel=1e-4)
    for name in w_small:  # atol: 1% of an AdamW step (lr 1e-2) on near-zero gradients
        torch.testing.assert_close(w_small[name], w_large[name], rtol=1e-4, atol=1e-4)


def test_a_greedy_rollouts_update_uses_temperature_1_below_the_greedy_threshold():
    """--temperature 1e-6 decodes greedily (below GREEDY_BELOW_TEMPERATURE, as vLLM), but the
    update divided the logits by 1e-6: NaN with a KL term, a ~1e6x gradient without."""
    steps = []
    for temperature in (0.0, 1e-6, 1.0):
        actor, ref = tiny_model(seed=0).train(), tiny_model(seed=0)
        cfg = GRPOConfig(lr=1e-2, max_batch_tokens=10_000)
        steps.append(
            grpo_update(
                actor, ref, make_optimizer(actor, cfg), _long_tail_samples(), cfg, temperature, 0
            )
        )
    assert steps[0]["grad_norm"] == steps[1]["grad_norm"] == steps[2]["grad_norm"]


def test_gradient_checkpointing_gives_the_same_step():
    plain, w_plain = _update(10_000)
    recomputed, w_rec = _update(10_000, checkpointing=True)
    assert recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    for name in w_plain:
        torch.testing.assert_close(w_rec[name], w_plain[name], rtol=1e-5, atol=1e-6)


def test_bf16_autocast_keeps_fp32_master_weights_and_tracks_fp32():
    """--dtype bfloat16 trains under bf16 autocast (on CUDA; the CPU autocast path tests it):
    parameters and optimiser state stay fp32, the step is close to the fp32 one."""
    plain, w_plain = _update(10_000)
    mixed, w_mixed = _update(10_000, autocast_dtype=torch.bfloat16)
    assert all(v.dtype == torch.float32 for v in w_mixed.values())
    assert math.isfinite(mixed["loss"]) and mixed["grad_norm"] > 0
    assert mixed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=0.1)
    diffs = torch.cat([(w_mixed[k] - w_plain[k]).abs().flatten() for k in w_plain])
    assert diffs.max() > 0  # bf16 compute really differs from fp32 ...
    # ... yet AdamW's first step (about lr x sign(grad) per weight) agrees on almost every
    # weight: only weights with near-zero gradients may step the other way
    assert float((diffs > 2e-3).float().mean()) < 0.05


def test_a_non_finite_gradient_stops_the_update_before_it_is_applied():
    """A NaN in the actor (an fp16 overflow, too high a learning rate) made every later
    update NaN, silently: the update now stops with one DivergedError, weights untouched."""
    actor = tiny_model(seed=0).train()
    with torch.no_grad():
        actor.model.norm.weight[0] = math.nan  # every logit NaN, every gradient NaN
    before = {k: v.detach().clone() for k, v in actor.state_dict().items()}
    cfg = GRPOConfig(lr=1e-2, kl_coef=0.0)
    with pytest.raises(DivergedError, match="GRPO update: gradient norm is nan"):
        grpo_update(actor, None, make_optimizer(actor, cfg), _long_tail_samples(), cfg, 1.0, 0)
    after = actor.state_dict()
    assert all(torch.allclose(before[k], after[k], rtol=0, atol=0, equal_nan=True) for k in before)
