"""The training ops of ``tltrun profile`` (the same torch trainer behind either rollout backend):
``train``, one GRPO actor update and weight sync as ``tltrun train`` runs them, and
``drafter_train``, one spot trainer's drafter update, each on a copy of the model, over the grid's batches and tokens per
sequence (``cfg``: a ``tltrun.profile.measure.ProfileRunConfig``).
``tltrun.profile.measure.run_profile`` times them after the rollout ops.
"""

from __future__ import annotations

import copy

import torch

from tltrun.profile.timing import Series


def train_series(cfg, target, drafter, gen) -> list[Series]:
    """``train``: one GRPO actor update (tltrun.train.grpo, as ``tltrun train`` runs it: the KL
    reference model's forward when ``cfg.kl_coef`` > 0, ``cfg.num_epochs`` passes) of ``batch``
    sequences, on a copy of the target. ``drafter_train``: ``make_batch`` +
    ``drafter_train_step`` (a spot trainer's update), on a copy of the drafter. Keys: (op,
    batch, tokens per sequence)."""
    from tltrun.rollout.slot_state import load_in_place
    from tltrun.train.grpo import GRPOConfig, Sample, autocast_dtype_for, grpo_update
    from tltrun.train.grpo import make_optimizer as actor_optimizer

    # as tltrun.train.worker builds them: fp32 master weights and AdamW state, bf16 compute
    # under autocast on CUDA only (a bf16 actor timed 2.5x the fp32 update tltrun train runs
    # on a CPU), the frozen KL reference in the compute dtype
    autocast = autocast_dtype_for(cfg.dtype_name, cfg.device)
    actor = copy.deepcopy(target).float().train()
    # as tltrun.train.worker: a reference model only with a KL term
    ref = copy.deepcopy(target).to(autocast or torch.float32).eval() if cfg.kl_coef > 0 else None
    gcfg = GRPOConfig(kl_coef=cfg.kl_coef, num_epochs=cfg.num_epochs)
    optimizer = actor_optimizer(actor, gcfg)
    vocab = target.config.vocab_size
    series = []
    for seq in cfg.train_tokens_per_seq:
        for batch in cfg.train_batches:
            ids = torch.randint(vocab, (batch, seq), generator=gen)
            rewards = torch.rand(batch, generator=gen).tolist()
            prompt = max(1, seq // 4)  # the split only moves the loss mask, not the work
            samples = [
                Sample("g0", tuple(ids[b, :prompt].tolist()), tuple(ids[b, prompt:].tolist()), r)
                for b, r in enumerate(rewards)
            ]

            def update(s=samples) -> None:
                temperature = cfg.temperature or 1.0
                grpo_update(
                    actor, ref, optimizer, s, gcfg, temperature, pad_id=0, autocast_dtype=autocast
                )
                # and the weight sync into the rollout model that tltrun train's train_s holds
                load_in_place(target, actor.state_dict(), "target", drop=target.config.tied_names)

            series.append(Series(("train", batch, seq), update, is_warmed_each_round=False))
    if drafter is not None:
        series += _drafter_train_series(cfg, target, drafter, gen)
    return series


def _drafter_train_series(cfg, target, drafter, gen) -> list[Series]:
    from tltrun.model.drafter import trainable_copy
    from tltrun.train.drafter_training import (
        DrafterTrainConfig,
        TrainRecord,
        drafter_train_step,
        make_batch,
        make_optimizer,
    )

    device = drafter.fc.weight.device
    # as tltrun train's spot trainer: fp32 master weights (a copy in the engine's dtype timed
    # another update, 28% off in bf16 on a CPU, and went NaN in fp16)
    trainee = trainable_copy(drafter, target)
    dcfg = DrafterTrainConfig()
    optimizer = make_optimizer(trainee, dcfg)
    vocab, dim = drafter.config.vocab_size, drafter.config.hidden_size
    noise = torch.Generator(device).manual_seed(cfg.seed)
    series = []
    for seq in cfg.train_tokens_per_seq:
        for batch in cfg.train_batches:
            records = [
                TrainRecord(
                    torch.randint(vocab, (seq,), generator=gen),
                    max(1, seq // 4),
                    torch.randn(seq - 1, dim, generator=gen),
                )
                for _ in range(batch)
            ]

            def update(r=records) -> None:
                step_batch = make_batch(r, dcfg.max_seq_len, device)
                drafter_train_step(trainee, step_batch, optimizer, dcfg, noise)

            key = ("drafter_train", batch, seq)
            series.append(Series(key, update, is_warmed_each_round=False))
    return series


__all__ = ["train_series"]
