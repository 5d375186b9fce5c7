"""Rank 0's record of one RL step of ``tltrun train`` (tltrun.train.worker): every worker's
``WorkerStepReport`` (gathered with ``gather_object``) becomes the step's measured trace step
(``trace_steps.jsonl`` and ``trace.json``, tltrun.rollout.measured_trace), its ``log.jsonl`` row,
the step's ``rollouts/step_<n>.jsonl`` dump, ``reward_errors.log`` lines and TensorBoard
scalars. Not run directly.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tltrun.rollout.interface import RolloutResult
from tltrun.rollout.measured_trace import hardware_name, instance_prompts, measured_step
from tltrun.train import run_logs
from tltrun.train import state as ts
from tltrun.train.config import TrainConfig
from tltrun.train.responses import EvalSummary
from tltrun.train.spot import SpotStats
from tltsim.trace.schema import Trace, trace_to_dict


def sha1_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of named tensors (names sorted): equal digests <=> equal weights or tokens.
    Their raw bytes, any dtype (numpy has no bfloat16: a bf16 engine's weights are hashed as
    bytes too). A GPU tensor is summed where it lives (``device_checksum``): copying a 7B
    model's 15 GB to the host and hashing them at ~1 GB/s took every worker ~15 s a step
    (so a CUDA run's digests are not a CPU run's, and equal ones are equal weights but for
    a checksum collision, not a SHA-1 one)."""
    digest = hashlib.sha1()
    for name in sorted(tensors):
        digest.update(name.encode())
        tensor = tensors[name].detach()
        if tensor.device.type == "cuda":
            digest.update(device_checksum(tensor))
            continue
        raw = tensor.cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().tobytes())
    return digest.hexdigest()


CHECKSUM_CHUNK = 1 << 20  # 16-bit words per position-weighted sum (no int64 sum can overflow)
CHECKSUM_CHUNKS_AT_ONCE = 64  # 64 x 2^20 words widened to int64 at a time: 512 MiB


def device_checksum(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes as 16-bit words in chunks of ``CHECKSUM_CHUNK``, and per chunk
    two exact int64 sums computed on the tensor's device: of the words, and of each word times
    its place in the chunk (|word| < 2^15, place < 2^20, so a sum stays under 2^55; integer
    sums do not depend on the reduction order). Any changed word changes its chunk's sums
    (a swap of two words the weighted one), so equal weights give equal bytes and moved ones
    differ but for a collision (a linear checksum has them: +1, -1, -1, +1 on four words
    placed just so) no training update is built to find. Shape and dtype lead."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 2 or raw.storage_offset() % 2:  # (an int16 view needs an even offset)
        raw = torch.cat([raw, raw.new_zeros(raw.numel() % 2)])
    words = raw.view(torch.int16)
    pad = -words.numel() % CHECKSUM_CHUNK
    place = torch.arange(1, CHECKSUM_CHUNK + 1, device=words.device, dtype=torch.int64)
    sums = []
    for start in range(0, words.numel(), CHECKSUM_CHUNK * CHECKSUM_CHUNKS_AT_ONCE):
        part = words[start : start + CHECKSUM_CHUNK * CHECKSUM_CHUNKS_AT_ONCE]
        if start + part.numel() == words.numel() and pad:
            part = torch.cat([part, part.new_zeros(pad)])
        wide = part.view(-1, CHECKSUM_CHUNK).to(torch.int64)  # (chunks, CHUNK)
        plain = wide.sum(1)
        sums.append(torch.stack([plain, wide.mul_(place).sum(1)], dim=1))  # (in place: 512 MiB)
    head = f"{tuple(tensor.shape)}:{tensor.dtype}:".encode()
    return head + (torch.cat(sums).cpu().numpy().tobytes() if sums else b"")


@dataclass(frozen=True, kw_only=True)
class WorkerStepReport:
    """What one worker sends rank 0 at the end of a step (seconds from its clock)."""

    actor_sha1: str  # the engine's weights after the end-of-step syncs
    drafter_sha1: str  # "" without a drafter
    rollout_sha1: str  # the response tokens by request id
    result: RolloutResult
    rewards: list[float]  # shaped, one per response
    raw_rewards: list[float]  # the reward function's own scores (what evaluation reports)
    reward_errors: list[str]
    reward_s: float
    dump: list[dict]  # rollout dump rows (empty without --dump-rollouts)
    evaluation: EvalSummary | None  # None: not an eval step
    eval_s: float
    finish_s: float  # its rollout's end, from the common start
    rollout_end_s: float  # after spot training and the drafter sync
    train_s: float
    spot: SpotStats


def trace_meta(cfg: TrainConfig) -> dict:
    """The measured trace's ``meta`` block of a run."""
    return {
        "source": f"tltrun train (policy {cfg.policy}, {cfg.num_workers} workers)",
        "model": cfg.model_dir,
        "max_response_tokens": cfg.max_new_tokens,
        "group_size": cfg.group_size,
    }


def write_step_record(
    step: int,
    gathered: list[WorkerStepReport],
    grpo: dict,
    step_s: float,
    *,
    cfg: TrainConfig,
    out: Path,
    data_position: dict,
    tensorboard=None,
) -> dict:
    """Write step ``step``'s trace step, log row, dump and reward errors under ``out`` (and
    its TensorBoard scalars, if a writer is given); returns the log row."""
    outputs = [o for g in gathered for o in g.result.outputs]
    iterations = [it for g in gathered for it in g.result.iterations]
    finishes = [g.finish_s for g in gathered]
    rollout_s = max(finishes)
    first = gathered[0].result
    merged = RolloutResult(
        outputs=outputs,
        iterations=iterations,
        wall_s=rollout_s,
        backend=first.backend,
        shares_prompts=first.shares_prompts,
        prefix_block_tokens=first.prefix_block_tokens,
    )
    spots = [g.spot for g in gathered]
    extra = {
        "train_s": max(g.train_s for g in gathered),
        "drafter_train_s": max(s.train_s for s in spots),
        "drafter_trained_tokens": sum(s.trained_tokens for s in spots),
        "worker_rollout_s": finishes,
        "instance_prompts": instance_prompts([g.result for g in gathered]),
        "max_running_requests": cfg.max_running_requests,
        "is_prompt_id_stable": True,  # groups are named by dataset prompt id (group_names)
        "num_epochs": cfg.num_epochs,  # (what the update ran: compare checks a profile's)
        "kl_coef": cfg.kl_coef,
    }
    trace_step = measured_step(
        step,
        merged,
        policy_name=cfg.policy,
        hardware=hardware_name(cfg.device),
        extra=extra,
        policy_config=cfg.policy_settings(),
        policy_seed=cfg.seed,
    )
    step_dict = trace_to_dict(Trace(meta={}, steps=(trace_step,)))["steps"][0]
    ts.append_jsonl(out / "trace_steps.jsonl", step_dict)
    run_logs.append_trace(out, trace_meta(cfg), step_dict)
    rewards = [r for g in gathered for r in g.rewards]
    lengths = np.array([len(o.output_token_ids) for o in outputs])
    summary = trace_step.measured
    decode = [it for it in iterations if not it.is_prefill]
    row = {
        "step": step,
        "reward_mean": float(np.mean(rewards)),
        "reward_std": float(np.std(rewards)),
        # unshaped (before --overlong-*/--format-penalty): the quantity eval_reward_mean holds
        "reward_raw_mean": float(np.mean([r for g in gathered for r in g.raw_rewards])),
        "response_tokens_mean": float(lengths.mean()),
        "response_tokens_median": float(np.median(lengths)),
        "response_tokens_p90": float(np.percentile(lengths, 90)),
        "response_tokens_max": int(lengths.max()),
        "num_truncated": sum(o.finish == "length" for o in outputs),
        "rollout_s": rollout_s,
        "worker_rollout_s": finishes,
        "train_s": extra["train_s"],
        "drafter_train_s": extra["drafter_train_s"],
        "drafter_updates": max(s.num_updates for s in spots),
        "drafter_trained_tokens": extra["drafter_trained_tokens"],
        "idle_worker_s": sum(rollout_s - f for f in finishes),
        # from the last rollout's end to the end of spot training and the drafter sync (its
        # broadcast of the drafter and optimizer state included): deterministic mode's wait
        # for the spot budgets, otherwise the preempted update and that broadcast
        "spot_wait_s": max(g.rollout_end_s for g in gathered) - rollout_s,
        "accept_len": summary.mean_accept_len,
        "sd_on_fraction": sum(it.strategy != "off" for it in decode) / max(len(decode), 1),
        "step_s": step_s,
        **{k: grpo[k] for k in ("loss", "kl", "clip_frac", "grad_norm", "num_tokens")},
        "spot_decisions": [s.decisions for s in spots],
        # per worker, after the end-of-step syncs: equal weights <=> equal digests
        "actor_sha1": [g.actor_sha1 for g in gathered],
        "drafter_sha1": [g.drafter_sha1 for g in gathered],
        "rollout_sha1": [g.rollout_sha1 for g in gathered],
    }
    errors = [e for g in gathered for e in g.reward_errors]
    row["reward_s"] = max(g.reward_s for g in gathered)
    row["reward_errors"] = len(errors)
    row["data_position"] = data_position
    evals = [g.evaluation for g in gathered if g.evaluation is not None]
    if evals:
        row.update(eval_columns(evals, max(g.eval_s for g in gathered)))
        errors += [err for e in evals for err in e.errors]
    if errors:  # each one with its sample id; the log row counts them
        with (out / "reward_errors.log").open("a") as fh:
            fh.writelines(f"step {step}: {e}\n" for e in errors)
    if cfg.dump_rollouts:
        ts.write_jsonl_atomic(
            out / "rollouts" / f"step_{step:06d}.jsonl", [r for g in gathered for r in g.dump]
        )
    ts.append_jsonl(out / "log.jsonl", row)
    if tensorboard is not None:
        for key, value in row.items():
            if key != "step" and type(value) in (int, float):
                group = "eval" if key.startswith("eval_") else "train"
                tensorboard.add_scalar(f"{group}/{key}", value, step)
        tensorboard.flush()
    return row


def said_reward_failed(row: dict, cfg: TrainConfig, out: Path, step: int) -> bool:
    """Whether every reward call of the step failed (each scored 0 under ``--reward-errors
    zero``), said then in one line (hunt: a reward that always failed trained on zeros, counted
    in log.jsonl and reward_errors.log only); the worker says it once a run."""
    if row["reward_errors"] < cfg.prompts_per_step * cfg.group_size:
        return False
    tqdm.write(  # (above the progress bar)
        f"warning: step {step}: every reward call failed and scored 0, so the run trains on no "
        f"signal: see {out / 'reward_errors.log'}; --reward-errors raise stops at the first",
        file=sys.stderr,
    )
    return True


def eval_columns(evals: list[EvalSummary], eval_s: float) -> dict:
    """The ``eval_*`` columns of a log row from the workers' evaluations of the step."""
    rewards = [r for e in evals for r in e.rewards]
    lengths = [n for e in evals for n in e.lengths]
    return {
        "eval_reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "eval_response_tokens_mean": float(np.mean(lengths)) if lengths else 0.0,
        "eval_truncated_fraction": sum(e.num_truncated for e in evals) / max(len(lengths), 1),
        "eval_num_prompts": sum(e.num_prompts for e in evals),
        # scored 0 like any failed reward: counted apart, or a failing eval reward read as
        # a model that scores 0 (they were in reward_errors.log only)
        "eval_reward_errors": sum(len(e.errors) for e in evals),
        "eval_s": eval_s,
    }
