"""Offline EAGLE drafter training on the target's own generations (what a user runs before RL
starts; the spot trainers of issue #5 call ``drafter_train_step`` on harvested data).

Loss (EAGLE-1, Li et al. 2024, Sec. 3.2): for each input pair (f_p, x_{p+1}) the drafter
predicts g_{p+1} ~ f_{p+1};

    L = regression_weight * SmoothL1(g_{p+1}, f_{p+1})
      + classification_weight * CE(softmax(lm_head(f_{p+1})), log_softmax(lm_head(g_{p+1})))

i.e. cross-entropy against the target's full next-token distribution, not just the sampled
token. Inputs f_p get uniform noise of width ``feature_noise`` (EAGLE's data augmentation
against error accumulation; EAGLE scales it by 512 / sequence length, we do not). Only
positions whose predicted token is a response token contribute (EAGLE's loss mask on the
assistant part), because the drafter only ever drafts responses.

Data: ``TrainRecord``s (token ids, prompt length, target hidden states); the engine's
``HarvestRecord`` has the same fields, and ``records_from_outputs`` recomputes hidden states
for plain generations (e.g. the JSONL written by ``tltrun generate``).

Run: ``tltrun train-drafter --model DIR --data generations.jsonl --out DIR`` (see tltrun.cli.train_drafter).
Every ``--checkpoint-every`` steps (and after the last) ``OUT/resume_state.pt`` holds the drafter,
AdamW state, history so far and the states of the batch (``gen``) and noise (``noise_gen``)
generators; ``--resume`` continues a killed run from it and ends bitwise as the uninterrupted run
(tltrun.train.resumable).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tltrun.model.drafter import EagleDrafter
from tltrun.model.transformer import CausalContext, Transformer
from tltrun.train.resumable import Checkpointing, fingerprint
from tltsim.errors import MAX_LR, UsageError, check_finite


@dataclass(frozen=True)
class DrafterTrainConfig:
    # Defaults are EAGLE-1's published training configuration (SafeAILab/EAGLE
    # eagle/train/main.py train_config) unless said otherwise.
    num_steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=4, metadata={"help": "sequences per step"})  # "bs"
    # "lr" (tuned there for 7B targets; small targets want far more)
    lr: float = field(default=3e-5, metadata={"help": "AdamW learning rate"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})  # "b1"
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})  # "b2"
    # "grad_clip" (clip by value)
    grad_clip: float = field(default=0.5, metadata={"help": "clip each gradient value to +-X"})
    # "v_w"
    regression_weight: float = field(
        default=1.0, metadata={"help": "loss weight of the hidden-feature regression"}
    )
    # "p_w"
    classification_weight: float = field(
        default=0.1, metadata={"help": "loss weight of the next-token cross-entropy"}
    )
    # "std" of the uniform noise
    feature_noise: float = field(
        default=0.2, metadata={"help": "width of the uniform noise added to input features"}
    )
    # "max_len"
    max_seq_len: int = field(
        default=2048, metadata={"help": "token pairs per sequence at most (longer ones cropped)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of batch sampling and feature noise"})

    def __post_init__(self) -> None:
        if self.num_steps < 0 or self.batch_size < 1 or self.max_seq_len < 2:
            raise ValueError("num_steps >= 0, batch_size >= 1, max_seq_len >= 2 required")
        # int32 bounds: larger values overflowed inside torch/tqdm instead of being refused
        if (
            max(self.num_steps, self.batch_size, self.max_seq_len) >= 2**31
            or not 0 <= self.seed < 2**63
        ):
            raise ValueError(
                "num_steps, batch_size, max_seq_len < 2^31 and seed in [0, 2^63) required"
            )
        # written as not (...) so that NaN fails too (an AdamW lr of NaN was a torch traceback)
        finite = (self.lr, self.beta1, self.beta2, self.grad_clip, self.feature_noise)
        if not all(math.isfinite(v) for v in finite) or not (
            0 < self.lr <= MAX_LR and self.grad_clip > 0 and self.feature_noise >= 0
        ):
            raise ValueError(
                f"lr in (0, {MAX_LR}], finite grad_clip > 0, feature_noise >= 0 required"
            )
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if not (
            0 <= self.regression_weight < math.inf and 0 <= self.classification_weight < math.inf
        ):
            raise ValueError("loss weights must be finite and >= 0")
        if self.regression_weight == 0 and self.classification_weight == 0:
            raise ValueError(
                "regression_weight and classification_weight are both 0: the loss would be 0 "
                "and nothing would train; give one of them a weight > 0"
            )


@dataclass(frozen=True)
class TrainRecord:
    token_ids: torch.Tensor  # (T,) long
    num_prompt_tokens: int
    hidden: torch.Tensor  # (T-1, C): hidden[p] is the target's state after token p


@dataclass(frozen=True)
class DrafterBatch:
    tokens: torch.Tensor  # (B,T) x_{p+1}
    hidden: torch.Tensor  # (B,T,C) f_p
    target: torch.Tensor  # (B,T,C) f_{p+1}
    loss_mask: torch.Tensor  # (B,T) bool


@torch.no_grad()
def records_from_outputs(
    model: Transformer, sequences: Iterable[tuple[list[int], int]], batch_size: int = 8
) -> list[TrainRecord]:
    """(token ids, prompt length) pairs -> TrainRecords, hidden states from one cache-free
    forward of the target per batch."""
    seqs = list(sequences)
    device = model.lm_head.weight.device
    out = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
        for b, (toks, _) in enumerate(chunk):
            ids[b, : len(toks)] = torch.tensor(toks)
        # logits of one position only: the hidden states are what is kept, and full logits
        # are B x T x vocab (9.5 GB in bf16 for 8 x 4k tokens of Qwen2.5's 151,936-token vocab)
        one = torch.zeros(len(chunk), 1, dtype=torch.long, device=device)
        positions = torch.arange(width, device=device).expand(len(chunk), -1)
        _, hidden = model(ids, positions, CausalContext(), logit_index=one)
        for b, (toks, num_prompt) in enumerate(chunk):
            out.append(
                TrainRecord(
                    ids[b, : len(toks)].cpu(), num_prompt, hidden[b, : len(toks) - 1].float().cpu()
                )
            )
    return out


def num_trained_pairs(record: TrainRecord) -> int:
    """Positions ``make_batch`` trains in the whole record: p in [max(P - 2, 0), T - 3]. Zero
    for a record without a response token to predict (T < 3, or no response): an update
    on a batch of only such records would train nothing, yet AdamW's decay moves the weights."""
    return max(0, len(record.token_ids) - 2 - max(record.num_prompt_tokens - 2, 0))


def window_start(record: TrainRecord, max_seq_len: int, generator: torch.Generator | None) -> int:
    """The first pair of ``record``'s window of ``max_seq_len`` pairs: 0 when it fits, or
    without a generator (the head, as EAGLE's offline training truncates); else uniform over the
    windows that start at the first trained pair or later, so a long response is trained where
    SD drafts it, deep into the response (TLT speculates in the long tail; fastrl's spot
    trainer crops to the response's end), not only in its first ``max_seq_len`` pairs."""
    num_pairs = len(record.token_ids) - 1
    if num_pairs <= max_seq_len or generator is None:
        return 0
    last = num_pairs - max_seq_len  # the window ends at the last pair
    first = min(max(record.num_prompt_tokens - 2, 0), last)  # the first trained pair
    return first + int(torch.randint(last - first + 1, (1,), generator=generator))


def make_batch(
    records: list[TrainRecord],
    max_seq_len: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> DrafterBatch:
    """Pairs p = o..o+n-1 of each record (n = min(T - 1, max_seq_len); o its
    ``window_start``, 0 unless it is longer and ``generator`` is given), right-padded.

    Position p is trained iff f_{p+1} exists (p <= T-3) and the token f_{p+1} predicts,
    x_{p+2}, is a response token (p >= num_prompt_tokens - 2). Positions within a window
    count from 0: the drafter's attention (RoPE) sees only relative offsets."""
    num_pairs = [min(len(r.token_ids) - 1, max_seq_len) for r in records]
    width = max(num_pairs, default=0)
    if width < 1:  # (torch's "cannot reshape tensor of 0 elements" otherwise)
        raise ValueError("make_batch: no record has two tokens (a token pair to train on)")
    dim = records[0].hidden.shape[-1]
    tokens = torch.zeros(len(records), width, dtype=torch.long)
    hidden = torch.zeros(len(records), width, dim)
    target = torch.zeros(len(records), width, dim)
    mask = torch.zeros(len(records), width, dtype=torch.bool)
    for b, (r, n) in enumerate(zip(records, num_pairs, strict=True)):
        o = window_start(r, max_seq_len, generator)
        tokens[b, :n] = r.token_ids[o + 1 : o + n + 1]
        hidden[b, :n] = r.hidden[o : o + n]
        # targets f_{p+1} where they exist: all n pairs of a cropped window but the record's
        # last (its last pair lost its target, and its training, in every cropped window)
        m = min(n, len(r.hidden) - 1 - o)
        target[b, :m] = r.hidden[o + 1 : o + 1 + m]
        lo = max(r.num_prompt_tokens - 2 - o, 0)
        mask[b, lo : min(m, len(r.token_ids) - 2 - o)] = True
    return DrafterBatch(tokens.to(device), hidden.to(device), target.to(device), mask.to(device))


def drafter_train_step(
    drafter: EagleDrafter,
    batch: DrafterBatch,
    optimizer: torch.optim.Optimizer,
    cfg: DrafterTrainConfig,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """One optimizer step of the EAGLE loss; returns loss, regression, classification, top1
    (agreement of the drafter's argmax with the target's at trained positions)."""
    drafter.train()
    dtype = drafter.fc.weight.dtype
    hidden = batch.hidden.to(dtype)
    target = batch.target.to(dtype)
    if cfg.feature_noise > 0:
        noise = torch.rand(hidden.shape, generator=generator, device=hidden.device, dtype=dtype)
        hidden = hidden + (noise - 0.5) * cfg.feature_noise
    b, t = batch.tokens.shape
    positions = torch.arange(t, device=hidden.device).expand(b, -1)
    logits, pred = drafter(batch.tokens, hidden, positions, CausalContext())  # (B,T,V), (B,T,C)
    with torch.no_grad():
        target_logits = drafter.lm_logits(target)
        target_p = torch.softmax(target_logits.float(), dim=-1)
    mask = batch.loss_mask.float()
    denom = mask.sum().clamp(min=1.0)
    ce = -(target_p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # (B,T)
    reg = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)  # (B,T)
    classification = (ce * mask).sum() / denom
    regression = (reg * mask).sum() / denom
    loss = cfg.regression_weight * regression + cfg.classification_weight * classification
    loss_value = loss.item()  # the one device sync of the step, read before the update
    check_finite(loss_value, "drafter training: loss")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_value_(drafter.parameters(), cfg.grad_clip)
    optimizer.step()
    drafter.eval()
    with torch.no_grad():
        agree = (logits.argmax(-1) == target_logits.argmax(-1)).float()
        top1 = float((agree * mask).sum() / denom)
    return {
        "loss": loss_value,
        "regression": regression.item(),
        "classification": classification.item(),
        "top1": top1,
    }


def make_optimizer(drafter: EagleDrafter, cfg: DrafterTrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def train_drafter(
    drafter: EagleDrafter,
    records: list[TrainRecord],
    cfg: DrafterTrainConfig,
    is_progress_shown: bool = True,
    checkpointing: Checkpointing | None = None,
    target_sha256: str | None = None,
) -> list[dict[str, float]]:
    """``cfg.num_steps`` steps on batches drawn (seeded) from ``records``, writing and resuming
    from the state ``checkpointing`` names; returns the history. ``target_sha256``
    (``hf_checkpoint.checkpoint_digest`` of the target the records' hidden states came from) is
    recorded, and a resume on another target refused."""
    if not records:
        raise ValueError("train_drafter: no training records")
    device = drafter.fc.weight.device
    gen = torch.Generator().manual_seed(cfg.seed)
    noise_gen = torch.Generator(device).manual_seed(cfg.seed + 1)
    optimizer = make_optimizer(drafter, cfg)
    history = []
    data_sha256 = None
    if checkpointing is not None:  # the records' tokens (their hidden states follow from them)
        data_sha256 = fingerprint(
            chunk
            for r in records
            for chunk in (
                r.token_ids.cpu().numpy().tobytes(),
                r.num_prompt_tokens.to_bytes(8, "little"),
            )
        )
    if checkpointing is not None and checkpointing.is_resume:
        state = checkpointing.load(drafter, optimizer, data_sha256)
        # a state of an older tltrun records none: resumed as before
        if state.get("target_sha256", target_sha256) != target_sha256:
            raise UsageError(
                f"{checkpointing.out}: --resume with another target checkpoint than the run "
                "started on (the hidden states it trains on would change); restore the target, "
                "or start a new run in another --out"
            )
        history = state["log"]
        gen.set_state(state["gen"])
        noise_gen.set_state(state["noise_gen"])
    bar = tqdm(range(len(history), cfg.num_steps), desc="train-drafter", initial=len(history),
               total=cfg.num_steps, disable=not is_progress_shown)  # fmt: skip
    for step in bar:
        idx = torch.randint(len(records), (cfg.batch_size,), generator=gen).tolist()
        batch = make_batch([records[i] for i in idx], cfg.max_seq_len, device, gen)
        stats = drafter_train_step(drafter, batch, optimizer, cfg, noise_gen)
        history.append(stats)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", top1=f"{stats['top1']:.2f}")
        if checkpointing is not None and checkpointing.is_due(step + 1, cfg.num_steps):
            checkpointing.save(step + 1, drafter, optimizer, history, data_sha256,
                               gen=gen.get_state(), noise_gen=noise_gen.get_state(),
                               target_sha256=target_sha256)  # fmt: skip
    return history
