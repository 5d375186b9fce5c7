"""Held-out evaluation of a model on the built-in task (used by ``tltrun sft``): greedy accuracy
per difficulty bucket and the response-length distribution of the model's own generations;
``evaluate_pairs`` scores a ``--data`` run's evaluation prompts with the data's own reward.

Generation uses ``transformers``' ``generate`` with a KV cache, prompts left-padded and batched
in length order (a batch runs until its longest response ends, so grouping similar lengths
keeps the long tail from holding short prompts hostage). Sampling is plain temperature-1
sampling from the model's distribution (no top-k / top-p), seeded without touching the caller's
global RNG state.

Run through ``tltrun sft`` (see tltrun/train/sft.py), or on a saved checkpoint:
``tltrun sft-eval CHECKPOINT_DIR`` (``tltrun.train.sft.evaluate_checkpoint``).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from tltrun.model.tokenizer import CharTokenizer
from tltrun.model.transformer import Transformer
from tltrun.train.sft_config import SFTConfig
from tltrun.train.tasks import LABELS, Problem, TaskConfig, length_stats, make_examples, reward

# Difficulty buckets by chain length (number of operations), doubling: the long tail spans
# 1..52 operations, so linear buckets would leave the tail in one or two near-empty bins.
DIFFICULTY_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, len(LABELS)))


@dataclass(frozen=True)
class Generation:
    text: str  # decoded response, special tokens dropped
    num_tokens: int  # generated tokens including the EOS, as a rollout engine counts them
    is_finished: bool  # ended with EOS (False: hit max_new_tokens)


def generate(
    model: Any,
    tok: CharTokenizer,
    prompts: list[str],
    max_new_tokens: list[int],
    temperature: float,
    seed: int,
    batch_size: int,
    desc: str = "generate",
    show_progress: bool = True,
) -> list[Generation]:
    """One response per prompt (greedy when ``temperature`` is 0), in the prompts' order.
    ``max_new_tokens[i]`` caps prompt i's response; a batch runs to its largest cap."""
    from transformers import GenerationConfig

    def gen_cfg(cap: int) -> GenerationConfig:  # (a cap beside the config is deprecated)
        return GenerationConfig(
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=None,
            top_p=None,
            pad_token_id=tok.pad_id,
            bos_token_id=tok.bos_id,
            eos_token_id=tok.eos_id,
            max_new_tokens=cap,
        )

    order = sorted(range(len(prompts)), key=lambda i: (max_new_tokens[i], len(prompts[i])))
    results: list[Generation | None] = [None] * len(prompts)
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for chunk in tqdm(chunks, desc=desc, unit="batch", disable=not show_progress):
            encoded = [tok.encode(prompts[i]) for i in chunk]
            width = max(map(len, encoded))
            ids = torch.tensor(
                [[tok.pad_id] * (width - len(e)) + e for e in encoded]
            )  # (B, T) left padded
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
            cap = max(max_new_tokens[i] for i in chunk)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg(cap))
            for row, i in enumerate(chunk):
                new = out[row, width:][: max_new_tokens[i]].tolist()
                is_finished = tok.eos_id in new
                num_tokens = new.index(tok.eos_id) + 1 if is_finished else len(new)
                results[i] = Generation(tok.decode(new[:num_tokens]), num_tokens, is_finished)
    return [r for r in results if r is not None]


def accuracy_by_difficulty(problems: list[Problem], rewards: list[float]) -> list[dict[str, Any]]:
    rows = []
    for lo, hi in DIFFICULTY_BUCKETS:
        picked = [r for p, r in zip(problems, rewards, strict=True) if lo <= p.num_ops <= hi]
        if picked:
            label = str(lo) if lo == hi else f"{lo}-{hi}"
            rows.append(
                {"ops": label, "num_prompts": len(picked), "accuracy": sum(picked) / len(picked)}
            )
    return rows


def evaluate(
    model: Any,
    tok: CharTokenizer,
    task: TaskConfig,
    cfg: Any,
    seed: int,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Greedy accuracy on ``cfg.num_eval_prompts`` held-out problems (per bucket) and length
    statistics of reference, greedy and sampled (``cfg.group_size`` per prompt) responses.
    ``cfg`` is an SFTConfig (its eval fields); problems and samples are drawn from ``seed``."""
    model.eval()
    rng = random.Random(seed)
    sample_seed = rng.randrange(2**31)
    held_out = make_examples(task, rng, cfg.num_eval_prompts, num_solutions=1)

    # A response longer than any well-formed solution of its problem is already wrong: cap it
    # there (+1 for EOS) rather than at the global cap, so one looping response holds its
    # batch for as few iterations as possible.
    def caps(examples: list[Any]) -> list[int]:
        return [
            min(cfg.max_new_tokens, task.max_response_chars_for(ex.problem.num_ops) + 1)
            for ex in examples
        ]

    greedy = generate(
        model,
        tok,
        [ex.prompt for ex in held_out],
        caps(held_out),
        0.0,
        sample_seed,
        cfg.eval_batch_size,
        "greedy",
        show_progress,
    )
    greedy_rewards = [reward(g.text, ex.answer) for g, ex in zip(greedy, held_out, strict=True)]
    grouped = make_examples(task, rng, cfg.num_sample_prompts, num_solutions=cfg.group_size)
    repeated = [ex for ex in grouped for _ in range(cfg.group_size)]
    sampled = generate(
        model,
        tok,
        [ex.prompt for ex in repeated],
        caps(repeated),
        1.0,
        sample_seed,
        cfg.eval_batch_size,
        "sampled",
        show_progress,
    )
    sampled_rewards = [reward(g.text, ex.answer) for g, ex in zip(sampled, repeated, strict=True)]
    # Reference lengths (+ EOS) on the same prompts as each generated set.
    reference = [len(ex.solutions[0]) + 1 for ex in held_out]
    reference_grouped = [len(s) + 1 for ex in grouped for s in ex.solutions]
    groups = [sampled[i : i + cfg.group_size] for i in range(0, len(sampled), cfg.group_size)]
    spreads = [max(g.num_tokens for g in grp) / min(g.num_tokens for g in grp) for grp in groups]
    ref_spreads = [max(map(len, ex.solutions)) / min(map(len, ex.solutions)) for ex in grouped]

    def summary(gens: list[Generation], rewards: list[float]) -> dict[str, Any]:
        return {
            "num_prompts": len(gens),
            # None, not 0.0, for no prompts: an accuracy of 0 over nothing read as a failed model
            "accuracy": sum(rewards) / len(rewards) if rewards else None,
            "num_truncated": sum(not g.is_finished for g in gens),
        }

    return {
        "greedy": {
            **summary(greedy, greedy_rewards),
            "by_difficulty": accuracy_by_difficulty(
                [ex.problem for ex in held_out], greedy_rewards
            ),
        },
        "sampled": {
            **summary(sampled, sampled_rewards),
            "group_size": cfg.group_size,
            # Per prompt: longest / shortest of its group_size samples (reference: same prompts).
            "group_max_over_min_median": statistics.median(spreads) if spreads else None,
            "group_max_over_min_max": max(spreads) if spreads else None,
            "reference_group_max_over_min_median": statistics.median(ref_spreads)
            if ref_spreads
            else None,
            "reference_group_max_over_min_max": max(ref_spreads) if ref_spreads else None,
        },
        "response_tokens": {
            "reference": length_stats(reference) if reference else None,
            "greedy": length_stats([g.num_tokens for g in greedy]) if greedy else None,
            "reference_grouped": length_stats(reference_grouped) if reference_grouped else None,
            "sampled": length_stats([g.num_tokens for g in sampled]) if sampled else None,
        },
        "examples": [
            {"prompt": ex.prompt, "response": g.text, "reward": r}
            for ex, g, r in list(zip(held_out, greedy, greedy_rewards, strict=True))[:4]
        ],
    }


def evaluate_pairs(
    model: Transformer,
    tok: CharTokenizer,
    cfg: SFTConfig,
    pairs: list[tuple[str, str]],
    is_held_out: bool,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Greedy responses to the evaluation prompts (the rollout engine, no SD), scored by the
    task's own reward: reasoning-gym's scorer, or for a file's responses an exact match of
    the final answers (the last ``\\boxed{}``, else the last line, of each).
    ``is_held_out``: training never saw these prompts (else they are training rows)."""
    from tltrun.data.rewards import RewardItem, RewardPool, parse_reward
    from tltrun.data.rows import GYM_PREFIX
    from tltrun.data.scoring import THINK_OPEN, final_answer, final_part
    from tltrun.rollout.engine import RolloutEngine
    from tltrun.rollout.engine_config import EngineConfig
    from tltrun.rollout.interface import Request, SamplingParams
    from tltsim.policy import make_policy

    if not pairs:
        return {"greedy": {"accuracy": None, "num_prompts": 0, "is_held_out": is_held_out}}
    gym = cfg.data.startswith(GYM_PREFIX)
    spec = parse_reward(
        GYM_PREFIX + cfg.data.removeprefix(GYM_PREFIX).split("?")[0] if gym else "exact",
        flag="--data",
    )
    max_new = min(cfg.max_new_tokens, 2 * max(len(r) for _, r in pairs) + 1)
    prompts = [tuple(tok.encode(p, add_bos=True)) for p, _ in pairs]
    engine = RolloutEngine(
        model,
        None,
        EngineConfig(
            max_running_requests=min(cfg.eval_batch_size, len(pairs)),
            max_model_len=max(map(len, prompts)) + max_new,
            sampling=SamplingParams(0.0),
        ),
    )
    requests = [Request(f"e{i}", ids, max_new) for i, ids in enumerate(prompts)]
    result = engine.generate(requests, make_policy("nospec"))
    outputs = {o.id: o for o in result.outputs}
    texts = [tok.decode(outputs[r.id].output_token_ids) for r in requests]
    gym_rows = []
    if gym:  # the scorer needs each entry's metadata: regenerate the eval rows
        from tltrun.data.dataset import DataSpec, load_rows

        spec_rows = DataSpec(path=cfg.data, prompt_key="question", answer_key=cfg.response_key,
                             num_rows=4 * cfg.num_eval_prompts, seed=cfg.seed + 1_000_003)  # fmt: skip
        by_prompt = {row.prompt: row for row in load_rows(spec_rows).rows}
        gym_rows = [by_prompt.get(p) for p, _ in pairs]

    def reference_part(answer: str) -> str:
        part = final_part(answer)
        return answer if part is None else part

    items = [
        RewardItem(
            sample_id=f"eval{i}",
            prompt=p,
            response=text,
            # exact compares the response's final answer (last \boxed{}, else last line) with
            # this: the reference's own final answer, not all of it (a model reproducing a
            # multi-line or boxed reference exactly scored 0), taken after its thinking as the
            # response's is (a boxed draft inside the reference's <think> was compared); a
            # reference whose thinking never closes is taken whole
            answer=answer if gym else final_answer(reference_part(answer)),
            meta=(gym_rows[i].meta if gym and gym_rows[i] is not None else {}),
            # a prompt ending in <think>: the response starts mid-thought (as tltrun train's)
            is_thinking_open=p.rstrip().endswith(THINK_OPEN),
        )
        for i, ((p, answer), text) in enumerate(zip(pairs, texts, strict=True))
    ]
    with RewardPool(spec, timeout_s=30.0) as pool:
        outcomes = pool.score(items)
    lengths = [len(outputs[r.id].output_token_ids) for r in requests]
    return {
        "greedy": {
            "accuracy": sum(o.reward for o in outcomes) / len(outcomes),
            "num_prompts": len(pairs),
            "is_held_out": is_held_out,
            "num_truncated": sum(outputs[r.id].finish == "length" for r in requests),
            "num_reward_errors": sum(o.error is not None for o in outcomes),
        },
        "response_tokens": {
            "greedy": length_stats(lengths),
            "reference": length_stats([len(r) + 1 for _, r in pairs]),
        },
        "examples": [
            {"prompt": p, "response": t} for (p, _), t in list(zip(pairs, texts, strict=True))[:3]
        ],
    }
