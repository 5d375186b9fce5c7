"""``tltrun sft``: supervised fine-tuning of a small Llama-style model on the built-in task's
worked solutions, or on ``--data``'s prompt/response rows (a file, a directory of shards, or
reasoning-gym problems with their answers) — the starting policy for GRPO (issues #5, #16).

The model is the project's own Llama-shaped ``tltrun.model.transformer.Transformer`` (RMSNorm,
RoPE, SwiGLU, GQA) — the implementation ``tltrun train`` trains with GRPO — initialised as
Hugging Face initialises Llama, trained with next-token cross-entropy on the response tokens
(prompt tokens are masked), and saved in the Hugging Face layout: ``config.json``
(``LlamaForCausalLM``, model_type llama) + ``model.safetensors`` + ``generation_config.json`` +
the character tokenizer's files. That directory loads in ``tltrun.model.hf_checkpoint.load_hf``,
``transformers.AutoModelForCausalLM`` (which the held-out evaluation generates with) and vLLM.

Next to the checkpoint: ``sft_config.json`` (the resolved SFT and task configs), ``metrics.json``
(loss curve, held-out accuracy per difficulty bucket, response-length statistics of the model's
own greedy and sampled generations). ``config.json`` in the same directory is the model's
Hugging Face config, which vLLM and the loaders need under that name.

Data: with the built-in task every step draws fresh problems from the task generator (no
epochs, no overfitting); ``--data`` rows are read once and reshuffled every epoch
(``pair_stream``).
Examples are sorted by length and cut into batches of at most ``batch_tokens`` padded tokens,
so the long tail costs compute in proportion to its tokens, not to the longest sequence.

Run: ``tltrun sft --out runs/sft`` (defaults: ~500 CPU-seconds of training, measured on one
core of a shared 2-core machine; greedy accuracy on 256 held-out prompts 67% median over
seeds 0-2, range 24-94%: whether the label lookup forms within the budget is seed luck), or ``tltrun sft --out DIR
--num-steps 50`` for a quick look. Re-run only the evaluation of a checkpoint with
``tltrun sft-eval DIR`` (``evaluate_checkpoint``). Every run is reproducible from ``--seed`` (at
a fixed ``--num-threads``: float reductions depend on the thread count). The command line is
``tltrun.cli.sft``.

Kills: every ``--checkpoint-every`` steps (and after the last) ``OUT/resume_state.pt`` holds the
weights, AdamW state and log so far; ``tltrun sft --out DIR --resume`` continues a killed run
with its recorded settings (sft_config.json) and ends bitwise as the uninterrupted run. The data
position is the step: the batch stream is made again from the seed and the trained batches are
skipped. The state is deleted once metrics.json is written (tltrun.train.resumable says why).
"""

from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tltrun.model.config import ModelConfig
from tltrun.model.hf_checkpoint import save_hf
from tltrun.model.tokenizer import CharTokenizer, warn_unknown_chars
from tltrun.model.transformer import CausalContext, Transformer
from tltrun.train import resumable
from tltrun.train.resumable import Checkpointing
from tltrun.train.sft_config import SFTConfig
from tltrun.train.sft_eval import evaluate, evaluate_pairs
from tltrun.train.tasks import Example, TaskConfig, make_examples
from tltsim.errors import InputWarning, UsageError, check_finite
from tltsim.jsonio import read_json, write_json

# sft_config.json's sections
CONFIG_SECTIONS = {"sft": SFTConfig, "task": TaskConfig}
IGNORE_INDEX = -100  # torch cross_entropy's ignore_index: prompt and padding positions
# LlamaConfig.initializer_range's default (transformers), used by its _init_weights
INIT_STD = 0.02


def build_model(
    cfg: SFTConfig, task: TaskConfig, tok: CharTokenizer, seed: int, max_tokens: int | None = None
) -> Transformer:
    """A freshly initialised Llama-shaped ``tltrun.model.transformer.Transformer`` — the model
    ``tltrun train`` trains with GRPO, so SFT and RL train one implementation (issue #16).
    Weights drawn from ``seed`` without touching the caller's global torch RNG state.
    ``max_tokens``: the longest sequence it must position (default: the built-in task's)."""
    # Positions needed: BOS + longest prompt + longest reference solution + EOS, rounded up to
    # a power of two (RoPE has no learned positions; vLLM sizes its KV cache from this).
    if max_tokens is None:
        max_tokens = 2 + task.max_prompt_chars + task.max_response_chars
    config = ModelConfig(
        model_type="llama",
        vocab_size=tok.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=1 << (max_tokens - 1).bit_length(),
        bos_token_id=tok.bos_id,
        eos_token_ids=(tok.eos_id,),
        tie_word_embeddings=False,
    )
    model = Transformer(config)
    init_weights(model, torch.Generator().manual_seed(seed))
    return model


def init_weights(model: Transformer, generator: torch.Generator, std: float = INIT_STD) -> None:
    """Hugging Face Llama's initialisation (``LlamaPreTrainedModel._init_weights``): every
    matrix and embedding ~ N(0, std), RMSNorm gains 1, biases 0; drawn in parameter-name
    order from ``generator``."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim >= 2:
                p.copy_(torch.empty(p.shape, dtype=p.dtype).normal_(0, std, generator=generator))
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()


def save_checkpoint(model: Transformer, tok: CharTokenizer, out: Path) -> None:
    """config.json + model.safetensors (``save_hf``), generation_config.json and the tokenizer:
    a directory ``tltrun train``, transformers and vLLM all load."""
    save_hf(model, out)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id},
    )
    tok.save(out, model_max_length=model.config.max_position_embeddings)


def example_tokens(ex: Example, solution: str, tok: CharTokenizer) -> tuple[list[int], list[int]]:
    """(input ids, labels): BOS prompt response EOS, with the prompt's labels ignored."""
    prompt_ids = tok.encode(ex.prompt, add_bos=True)
    response_ids = tok.encode(solution, add_bos=False, add_eos=True)
    return prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids


def length_batches(seqs: list[tuple[list[int], list[int]]], batch_tokens: int, rng: random.Random):
    """Sort by length, cut into batches whose padded size fits ``batch_tokens`` (a sequence
    longer than that is a batch of its own), and return them in random order."""
    seqs = sorted(seqs, key=lambda s: len(s[0]))
    batches, current = [], []
    for seq in seqs:
        if current and len(seq[0]) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(seq)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # (B, T), right padded
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (x, y) in enumerate(batch):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def batch_stream(task: TaskConfig, tok: CharTokenizer, batch_tokens: int, rng: random.Random):
    """Endless batches of fresh examples; a pool of problems is drawn, length-batched, used."""
    # ~4 batches' worth of typical sequences (~90 tokens): enough to sort into batches of
    # similar length (little padding), small enough to draw fresh data often.
    pool_size = max(64, 4 * batch_tokens // 90)
    while True:
        examples = make_examples(task, rng, pool_size, num_solutions=1)
        seqs = [example_tokens(ex, ex.solutions[0], tok) for ex in examples]
        yield from length_batches(seqs, batch_tokens, rng)


def data_pairs(cfg: SFTConfig, *, seed: int, num_rows: int) -> list[tuple[str, str]]:
    """(prompt, response) pairs of ``cfg.data``: reasoning-gym problems generated from ``seed``,
    or the file's rows (``seed`` and ``num_rows`` then unused: a file holds what it holds)."""
    from tltrun.data.dataset import DataError, DataSpec, SkippedRowsWarning, load_rows
    from tltrun.data.rows import GYM_PREFIX

    assert cfg.data is not None
    spec = DataSpec(
        path=cfg.data,
        prompt_key="question" if cfg.data.startswith(GYM_PREFIX) else cfg.prompt_key,
        answer_key=cfg.response_key,
        answer_flag="--response-key",
        num_rows=num_rows if cfg.data.startswith(GYM_PREFIX) else None,
        seed=seed,
        is_skip_bad_rows=cfg.skip_bad_rows,
    )
    loaded = load_rows(spec)
    pairs, skipped, num_skipped = [], list(loaded.skipped), loaded.num_skipped
    for row in loaded.rows:
        if not isinstance(row.prompt, str) or row.answer is None:
            why = (
                f"{row.source}: tltrun sft trains the character tokenizer on plain-text prompts "
                "with a response (no chat messages, no missing response)"
            )
            if not cfg.skip_bad_rows:
                raise DataError(f"{why}; --skip-bad-rows skips such rows")
            skipped.append(why)  # a bad row for sft, as the loader's are (it ran into them)
            num_skipped += 1
            continue
        pairs.append((row.prompt, row.answer))
    if num_skipped:
        warnings.warn(
            f"--skip-bad-rows: skipped {num_skipped} bad rows of {cfg.data}, first: {skipped[0]}",
            SkippedRowsWarning,
            stacklevel=2,
        )
    if not pairs:
        raise DataError(f"--data {cfg.data}: no row left to train on")
    warn_unknown_chars(f"--data {cfg.data}", [p + r for p, r in pairs])
    return pairs


def pair_tokens(prompt: str, response: str, tok: CharTokenizer) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a data pair, as ``example_tokens``: BOS prompt response EOS."""
    prompt_ids = tok.encode(prompt, add_bos=True)
    response_ids = tok.encode(response, add_bos=False, add_eos=True)
    return prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids


def pair_stream(
    pairs: list[tuple[str, str]], tok: CharTokenizer, batch_tokens: int, rng: random.Random
):
    """Endless length-sorted batches over the pairs, reshuffled every epoch: the rows first,
    so that rows of one length meet others each epoch (the sort is stable: without it the same
    rows, in file order, made the same batches every epoch), then the batches."""
    seqs = [pair_tokens(p, r, tok) for p, r in pairs]
    while True:
        order = seqs[:]
        rng.shuffle(order)
        yield from length_batches(order, batch_tokens, rng)


def lr_at(step: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def response_loss(model: Transformer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the response tokens of the batch. Right padding
    needs no attention mask: causal attention never lets a real token see a later pad."""
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    logits, _ = model(ids, positions, CausalContext())  # (B, T, V)
    targets = batch["labels"][:, 1:]  # token t+1 is predicted at position t
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


def train(
    cfg: SFTConfig,
    task: TaskConfig,
    model: Transformer,
    tok: CharTokenizer,
    rng: random.Random,
    show_progress: bool = True,
    pairs: list[tuple[str, str]] | None = None,
    checkpointing: Checkpointing | None = None,
) -> tuple[list[dict[str, float]], float]:
    """Run ``cfg.num_steps`` optimiser steps (on ``pairs`` when given, else on fresh built-in
    task examples), writing and resuming from the state ``checkpointing`` names; returns the
    per-step log and the seconds spent training, those before a resume included."""
    decay = [p for p in model.parameters() if p.ndim >= 2]  # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # RMSNorm gains: no decay
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    stream = (
        pair_stream(pairs, tok, cfg.batch_tokens, rng)
        if pairs is not None
        else batch_stream(task, tok, cfg.batch_tokens, rng)
    )
    log = []
    earlier_s = 0.0  # training seconds of the processes before a resume
    data_sha256 = None
    if pairs is not None and checkpointing is not None:
        data_sha256 = _data_sha256(pairs)
    if checkpointing is not None and checkpointing.is_resume:
        state = checkpointing.load(model, optimizer, data_sha256)
        log, earlier_s = state["log"], state["train_s"]
        for _ in range(state["next_step"]):  # the data position: one batch per step done
            next(stream)
    start_s = time.perf_counter()
    bar = tqdm(range(len(log), cfg.num_steps), desc="sft", unit="step",
               disable=not show_progress, initial=len(log), total=cfg.num_steps)  # fmt: skip
    for step in bar:
        batch = collate(next(stream), tok.pad_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = response_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        loss_value = loss.item()
        check_finite(loss_value + float(grad_norm), f"sft step {step}: loss + gradient norm")
        optimizer.step()
        num_tokens = int((batch["labels"] != IGNORE_INDEX).sum())
        log.append(
            {
                "step": step,
                "loss": loss_value,
                "grad_norm": float(grad_norm),
                "lr": lr_at(step, cfg),
                "num_seqs": len(batch["input_ids"]),
                "num_response_tokens": num_tokens,
            }
        )
        bar.set_postfix(loss=f"{loss_value:.3f}")
        if checkpointing is not None and checkpointing.is_due(step + 1, cfg.num_steps):
            train_s = earlier_s + time.perf_counter() - start_s
            checkpointing.save(step + 1, model, optimizer, log, data_sha256, train_s=train_s)
    model.eval()
    return log, earlier_s + time.perf_counter() - start_s


def run_sft(
    cfg: SFTConfig, task: TaskConfig, show_progress: bool = True, is_resume: bool = False
) -> dict[str, Any]:
    """Train, save the checkpoint and evaluate; returns the metrics written to metrics.json.
    ``is_resume``: continue the run in ``cfg.out`` from its state (``cfg`` and ``task`` are
    its recorded ones: tltrun.cli.sft checks them)."""
    previous_threads = torch.get_num_threads()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    try:
        return _run_sft(cfg, task, show_progress, is_resume)
    finally:
        torch.set_num_threads(previous_threads)


def _run_sft(
    cfg: SFTConfig, task: TaskConfig, show_progress: bool, is_resume: bool
) -> dict[str, Any]:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    # the data first, so a bad row is refused before the run directory is touched; the run's
    # --seed generates reasoning-gym problems, as tltrun train --data does
    pairs = None
    if cfg.data is not None:
        pairs = data_pairs(cfg, seed=cfg.seed, num_rows=cfg.data_num_rows)
    if not is_resume:  # a resume keeps the recorded config: it is the run's
        resumable.start_fresh(out, "tltrun sft", config_file="sft_config.json")
        write_json(out / "sft_config.json", {"sft": asdict(cfg), "task": asdict(task)})
    tok = CharTokenizer()
    init_seed, data_seed, eval_seed = stream_seeds(cfg.seed)
    eval_pairs = None
    max_tokens = None
    if pairs is not None:
        eval_pairs, is_held_out = _held_out_pairs(cfg, pairs)
        # positions for the examples, and for --max-new-tokens of response after the longest
        # prompt (sized to the examples alone, a model of 60-token rows refused a later
        # generate or train of longer responses; RoPE has no learned positions to add)
        longest_prompt = max(len(p) for p, _ in pairs + eval_pairs)
        max_tokens = max(
            2 + max(len(p) + len(r) for p, r in pairs + eval_pairs),
            1 + longest_prompt + cfg.max_new_tokens,
        )
    model = build_model(cfg, task, tok, init_seed, max_tokens)
    num_params = sum(p.numel() for p in model.parameters())
    checkpoints = Checkpointing(
        out=out, command="tltrun sft", every=cfg.checkpoint_every, is_resume=is_resume
    )
    log, train_s = train(
        cfg, task, model, tok, random.Random(data_seed), show_progress, pairs, checkpoints
    )
    save_checkpoint(model, tok, out)
    eval_start_s = time.perf_counter()
    if eval_pairs is not None:
        evaluation = evaluate_pairs(model, tok, cfg, eval_pairs, is_held_out, show_progress)
    else:
        # Evaluation generates with transformers from the saved files: it checks the
        # checkpoint the way every other consumer will load it.
        from transformers import AutoModelForCausalLM

        evaluation = evaluate(
            AutoModelForCausalLM.from_pretrained(out), tok, task, cfg, eval_seed, show_progress
        )
    metrics = {
        "num_params": num_params,
        "train_s": train_s,
        "eval_s": time.perf_counter() - eval_start_s,
        "first_loss": log[0]["loss"] if log else None,
        "final_loss": sum(r["loss"] for r in log[-20:]) / len(log[-20:]) if log else None,
        **evaluation,
        # (sft-eval warns when the data it reads differs: its numbers then differ from these)
        "data_sha256": None if pairs is None else _data_sha256(pairs),
        "train_log": log,
    }
    write_json(out / "metrics.json", metrics)
    resumable.finish(out)
    return metrics


def _data_sha256(pairs: list[tuple[str, str]]) -> str:
    return resumable.fingerprint(s.encode() for pair in pairs for s in pair)


def _warn_if_data_changed(checkpoint_dir: Path, pairs: list[tuple[str, str]]) -> None:
    """sft-eval of a run whose --data changed since (metrics.json keeps its fingerprint): the
    evaluation prompts and references are not the run's, so neither are the numbers."""
    path = checkpoint_dir / "metrics.json"
    recorded = read_json(path, "sft metrics").get("data_sha256") if path.is_file() else None
    if recorded is not None and recorded != _data_sha256(pairs):
        warnings.warn(
            f"{checkpoint_dir}: its --data changed since the run (fingerprint in metrics.json "
            "differs): these numbers are not the run's",
            InputWarning,
            stacklevel=2,
        )


def _held_out_pairs(
    cfg: SFTConfig, pairs: list[tuple[str, str]]
) -> tuple[list[tuple[str, str]], bool]:
    """Evaluation pairs, and whether training never saw their prompts: reasoning-gym problems
    of a seed training never uses, minus any that also occur in training (small tasks repeat
    problems; one with fewer distinct problems than the training rows may have none left, and
    then its evaluation reads training problems, said so); a file's rows are not held out (it
    is the user's training set), so its evaluation reads the training rows."""
    from tltrun.data.rows import GYM_PREFIX

    if not cfg.data.startswith(GYM_PREFIX) or not cfg.num_eval_prompts:
        return pairs[: cfg.num_eval_prompts], False
    seen = {p for p, _ in pairs}
    fresh = data_pairs(cfg, seed=cfg.seed + 1_000_003, num_rows=4 * cfg.num_eval_prompts)
    unseen = [pair for pair in fresh if pair[0] not in seen]
    return (unseen or fresh)[: cfg.num_eval_prompts], bool(unseen)


def stream_seeds(seed: int) -> tuple[int, int, int]:
    """Independent seeds for model init, training data and held-out evaluation."""
    seeds = random.Random(seed)
    return seeds.randrange(2**31), seeds.randrange(2**31), seeds.randrange(2**31)


def evaluate_checkpoint(checkpoint_dir: str | Path, show_progress: bool = True) -> dict[str, Any]:
    """Re-run the held-out evaluation of a checkpoint written by ``tltrun sft`` (same task, eval
    settings and seed as in its sft_config.json, so the numbers match its metrics.json)."""
    from transformers import AutoModelForCausalLM

    config_path = Path(checkpoint_dir) / "sft_config.json"
    if not config_path.is_file():
        raise UsageError(f"{checkpoint_dir}: no sft_config.json (not a checkpoint of tltrun sft)")
    recorded = resumable.recorded_configs(config_path, CONFIG_SECTIONS)
    cfg, task = recorded["sft"], recorded["task"]
    # killed: its model is missing, or an earlier run's (sft-eval loaded it as this run's, or
    # failed as an internal error). Weights elsewhere with the sft_config.json copied beside
    # them (tltrun train's final/actor) are evaluated: they were refused as an unfinished run
    is_run_dir = Path(cfg.out).resolve() == Path(checkpoint_dir).resolve()
    has_weights = (Path(checkpoint_dir) / "config.json").is_file()
    if not (Path(checkpoint_dir) / "metrics.json").is_file() and (is_run_dir or not has_weights):
        then = (
            f"continue it with tltrun sft --out {checkpoint_dir} --resume"
            if (Path(checkpoint_dir) / resumable.STATE_FILE).is_file()
            else "start it again"
        )
        raise UsageError(
            f"{checkpoint_dir}: the tltrun sft run did not finish (no metrics.json); {then}"
        )
    if cfg.data is not None:
        from tltrun.model.hf_checkpoint import load_hf

        pairs = data_pairs(cfg, seed=cfg.seed, num_rows=cfg.data_num_rows)
        _warn_if_data_changed(Path(checkpoint_dir), pairs)
        tok = CharTokenizer.load(checkpoint_dir)
        return evaluate_pairs(
            load_hf(checkpoint_dir), tok, cfg, *_held_out_pairs(cfg, pairs), show_progress
        )
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir)
    tok = CharTokenizer.load(checkpoint_dir)
    return evaluate(model, tok, task, cfg, stream_seeds(cfg.seed)[2], show_progress)
