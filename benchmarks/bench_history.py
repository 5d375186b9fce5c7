"""History drafter benchmark (issue #20). This script holds the proposal-cost section: proposal
microseconds per sequence vs history size, which must not grow with the history (the suffix
automaton walks at most ngram_max + draft_steps tokens per proposal).

    .venv/bin/python benchmarks/bench_history.py                        # 1k, 100k, 1M tokens
    .venv/bin/python benchmarks/bench_history.py --sizes 1000,20000 --out /tmp/h.json

Synthetic RL-like history, all in ONE prompt group (the worst case: one automaton holds every
token): a reference answer of ``--answer-tokens`` random token ids (vocabulary 32,000), and
responses that copy spans of it (mean 24 tokens) with a fresh token between spans, so responses
share long spans and the automaton branches where they differ. Each size indexes responses of
1,000 tokens until the history holds that many tokens, then times, for 64 running responses of
the same group (grown to 300 tokens and indexed incrementally): ``propose`` (a chain of
``--draft-steps``), ``propose_tree`` (``--topk`` continuations of ``--draft-steps``) and the
incremental index update (``extend`` of one token), each as the median over ``--repeats`` rounds
of the mean per sequence. Also printed: indexing rate of the build and automaton states per
token. Prints a table and writes JSON (``--out``). Pure Python, one core.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

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


def bench_size(num_tokens: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    answer = [rng.randrange(VOCAB) for _ in range(args.answer_tokens)]
    prompt = [rng.randrange(VOCAB) for _ in range(64)]
    cfg = HistoryConfig(
        ngram_min=args.ngram_min, ngram_max=args.ngram_max, max_history_tokens=num_tokens * 2
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
        "indexed_tokens": history.num_tokens,
        "build_s": build_s,
        "index_tokens_per_s": num_tokens / build_s,
        "states_per_token": sam.num_states / max(sam.num_tokens, 1),
        "propose_chain_us": chain_us,
        "propose_tree_us": tree_us,
        "extend_one_token_us": extend_us,
        "mean_drafted_tokens": sum(drafted) / len(drafted),  # before the extend rounds
    }


COLUMNS = {
    "history_tokens": "history tokens",
    "propose_chain_us": "chain us/seq",
    "propose_tree_us": "tree us/seq",
    "extend_one_token_us": "extend us/token",
    "mean_drafted_tokens": "drafted",
    "index_tokens_per_s": "index tok/s",
    "states_per_token": "states/token",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,100000,1000000", help="history sizes (tokens)")
    parser.add_argument("--draft-steps", type=int, default=6, help="tokens per drafted chain")
    parser.add_argument("--topk", type=int, default=4, help="continuations per drafted tree")
    parser.add_argument("--ngram-min", type=int, default=HistoryConfig.ngram_min)
    parser.add_argument("--ngram-max", type=int, default=HistoryConfig.ngram_max)
    parser.add_argument("--answer-tokens", type=int, default=2_000, help="reference answer length")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds per measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_history.json", help="JSON output path")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for size in sizes:
        row = bench_size(size, args)
        rows.append(row)
        print(f"{size} tokens: built in {row['build_s']:.1f} s", flush=True)
    print(format_table(rows, COLUMNS, {"index_tokens_per_s": ",.0f", "history_tokens": ",d"}))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(vars(args))
    meta["python"] = platform.python_version()
    meta["machine"] = platform.machine()
    out.write_text(json.dumps({"config": meta, "proposal_cost": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
