"""The history drafter's costs (issue #20), measured by ``benchmarks/bench_history.py``: proposal
microseconds per sequence and index updates per token against the history's size (synthetic
RL-like responses that copy spans of a reference answer, all in one prompt group: the worst
case, one automaton holds every token); one response looping on a short cycle of tokens (RL's
degenerate long-tail responses), indexed with and without the bound on the counted contexts;
and a long run at the index's cap, where every step evicts old prompt groups, under both
eviction rules. Pure Python, one core.

Not run directly: ``python benchmarks/bench_history.py [--sizes ...] [--loop-sizes ...]``.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from tltrun.model.history_drafter import HistoryConfig, HistoryDrafter
from tltsim.cli.table import format_table

VOCAB = 32_000
RESPONSE_TOKENS = 1_000
NUM_RUNNING = 64
RUNNING_TOKENS = 300


def synthetic_response(rng: random.Random, answer: list[int], num_tokens: int) -> list[int]:
    """Spans of the reference answer (geometric lengths, mean 24) with a fresh token between."""
    out: list[int] = []
    while len(out) < num_tokens:
        start = rng.randrange(len(answer))
        span = min(int(rng.expovariate(1 / 24)) + 1, len(answer) - start)
        out += answer[start : start + span]
        out.append(rng.randrange(VOCAB))
    return out[:num_tokens]


def bench_size(num_tokens: int, is_cross_prompt: bool, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    answer = [rng.randrange(VOCAB) for _ in range(args.answer_tokens)]
    prompt = [rng.randrange(VOCAB) for _ in range(64)]
    cfg = HistoryConfig(
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        max_history_tokens=num_tokens * 2,
        is_cross_prompt=is_cross_prompt,
    )
    history = HistoryDrafter(cfg)
    start = time.perf_counter()
    num_done = 0
    while history.num_tokens < num_tokens:
        size = min(RESPONSE_TOKENS, num_tokens - history.num_tokens)
        response = synthetic_response(rng, answer, max(size - len(prompt), 1))
        history.add(("old", num_done), "group", prompt + response)
        history.finish(("old", num_done))
        num_done += 1
    build_s = time.perf_counter() - start
    running = [synthetic_response(rng, answer, RUNNING_TOKENS) for _ in range(NUM_RUNNING)]
    for i, response in enumerate(running):
        history.add(("run", i), "group", prompt + response[: RUNNING_TOKENS // 2])
        history.extend(("run", i), response[RUNNING_TOKENS // 2 :])

    def per_seq_us(fn) -> float:
        rounds = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for i in range(NUM_RUNNING):
                fn(("run", i))
            rounds.append((time.perf_counter() - t) / NUM_RUNNING * 1e6)
        return statistics.median(rounds)

    chain_us = per_seq_us(lambda key: history.propose(key, args.draft_steps))
    tree_us = per_seq_us(lambda key: history.propose_tree(key, args.draft_steps, args.topk))
    drafted = [len(history.propose(("run", i), args.draft_steps)) for i in range(NUM_RUNNING)]
    # last: it appends (a span of the answer, token by token, as decoding would)
    extend_us = per_seq_us(lambda key: history.extend(key, [answer[rng.randrange(len(answer))]]))
    sam = history.automata["group"]
    return {
        "history_tokens": num_tokens,
        "is_cross_prompt": is_cross_prompt,
        "indexed_tokens": history.num_tokens,
        "build_s": build_s,
        "index_tokens_per_s": num_tokens / build_s,
        "states_per_token": sam.num_states / max(sam.num_tokens, 1),
        "propose_chain_us": chain_us,
        "propose_tree_us": tree_us,
        "extend_one_token_us": extend_us,
        "mean_drafted_tokens": sum(drafted) / len(drafted),  # before the extend rounds
    }


def bench_loop(num_tokens: int, cycle: int, max_draft_tokens: int, args) -> dict:
    """A response that loops on a cycle of ``cycle`` tokens (RL's degenerate long-tail
    responses), indexed token by token as decoding commits it, by a drafter whose statistics
    reach ``max_draft_tokens`` past the match: microseconds per indexed token over the whole
    response and over its last tenth (a cost that grows with the response shows there)."""
    rng = random.Random(args.seed)
    prompt = [rng.randrange(VOCAB) for _ in range(64)]
    loop = [rng.randrange(VOCAB) for _ in range(cycle)]
    history = HistoryDrafter(
        HistoryConfig(
            ngram_min=args.ngram_min, ngram_max=args.ngram_max, max_draft_tokens=max_draft_tokens
        )
    )
    history.add("loop", "group", prompt)
    tail_from = num_tokens - max(1, num_tokens // 10)  # the last tenth, at least one token
    start = time.perf_counter()
    for i in range(num_tokens):
        if i == tail_from:
            tail_start = time.perf_counter()
        history.extend("loop", [loop[i % cycle]])
    end = time.perf_counter()
    return {
        "loop_tokens": num_tokens,
        "cycle_tokens": cycle,
        "max_draft_tokens": max_draft_tokens,
        "extend_us": (end - start) / num_tokens * 1e6,
        "extend_tail_us": (end - tail_start) / (num_tokens - tail_from) * 1e6,
    }


def bench_steady(evict_to_fraction: float, args) -> dict:
    """A long RL run at the index's cap: each step ``--steady-prompts`` new prompts x 8 samples
    of 2,000 tokens (spans of the prompt's own reference answer, as ``synthetic_response``),
    indexed as they decode (``add`` the prompt, ``extend`` the response), then finished. Once
    the default cap (1M tokens) is reached, every step evicts a step's worth of old groups.
    Seconds per step of all history work (indexing, eviction and rebuilds), median over the
    steps at the cap."""
    rng = random.Random(args.seed)
    history = HistoryDrafter(HistoryConfig(evict_to_fraction=evict_to_fraction))
    per_step = []
    for step in range(args.steady_steps):
        start = time.perf_counter()
        for p in range(args.steady_prompts):
            group = (step, p)
            answer = [rng.randrange(VOCAB) for _ in range(400)]
            prompt = [rng.randrange(VOCAB) for _ in range(64)]
            for g in range(8):
                response = synthetic_response(rng, answer, 2_000)
                history.add((group, g), group, prompt)
                history.extend((group, g), response)
            for g in range(8):
                history.finish((group, g))
        per_step.append((time.perf_counter() - start, history.num_tokens))
    at_cap = [t for t, n in per_step[1:] if n >= 0.5 * history.config.max_history_tokens]
    return {
        "evict_to_fraction": evict_to_fraction,
        "steps_at_cap": len(at_cap),
        "step_s": statistics.median(at_cap) if at_cap else math.nan,
        "first_step_s": per_step[0][0],
    }


STEADY_COLUMNS = {
    "evict_to_fraction": "evict to",
    "first_step_s": "first step s",
    "step_s": "step s at the cap",
    "steps_at_cap": "steps",
}

LOOP_COLUMNS = {
    "loop_tokens": "loop tokens",
    "cycle_tokens": "cycle",
    "max_draft_tokens": "max draft tokens",
    "extend_us": "extend us/token",
    "extend_tail_us": "last tenth us/token",
}
# statistics unbounded: what the drafter did before max_draft_tokens bounded them
UNBOUNDED = 10**9

COLUMNS = {
    "history_tokens": "history tokens",
    "is_cross_prompt": "cross-prompt",
    "propose_chain_us": "chain us/seq",
    "propose_tree_us": "tree us/seq",
    "extend_one_token_us": "extend us/token",
    "mean_drafted_tokens": "drafted",
    "index_tokens_per_s": "index tok/s",
    "states_per_token": "states/token",
}


def cost_tables(args: argparse.Namespace) -> dict[str, list[dict]]:
    """The three cost tables of ``bench_history.py`` (``--sizes``, ``--loop-sizes``,
    ``--steady-steps``), printed; returned by name for the JSON."""
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for size in sizes:  # the index with and without its cross-prompt tier, one after the other
        for is_cross_prompt in (False, True):
            row = bench_size(size, is_cross_prompt, args)
            rows.append(row)
            print(f"{size} tokens, cross-prompt {is_cross_prompt}: built in {row['build_s']:.1f} s")
    print(format_table(rows, COLUMNS, {"index_tokens_per_s": ",.0f", "history_tokens": ",d"}))
    loops = []
    for size in [int(s) for s in args.loop_sizes.split(",") if s]:
        for cycle in (1, 3):
            for depth in (HistoryConfig.max_draft_tokens, UNBOUNDED):
                loops.append(bench_loop(size, cycle, depth, args))
    if loops:
        print("one response looping on a cycle of 1 or 3 tokens, indexed token by token:")
        print(
            format_table(
                loops,
                LOOP_COLUMNS,
                {"extend_us": ".1f", "extend_tail_us": ".1f", "loop_tokens": ",d"},
            ).replace(str(UNBOUNDED), "unbounded".rjust(len(str(UNBOUNDED))))
        )
    steady = []
    if args.steady_steps:
        for _ in range(args.repeats_steady):  # the two rules alternating
            for fraction in (1.0, HistoryConfig.evict_to_fraction):
                steady.append(bench_steady(fraction, args))
        print(
            f"a run at the 1M-token cap, {args.steady_prompts} prompts x 8 x 2,000 tokens per "
            "step: seconds of history work per step, evicting just under the cap (1.0) or "
            "down to a share of it:"
        )
        print(format_table(steady, STEADY_COLUMNS, {"step_s": ".2f", "first_step_s": ".2f"}))
    return {"proposal_cost": rows, "loop_cost": loops, "steady_state": steady}
