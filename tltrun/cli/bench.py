"""``tltrun bench``: replay a tlt-trace under several SD policies (and backends), side by side.

    tltrun bench --trace traces/x.json --policy nospec,static,tlt --model M --drafter D \\
        --out runs/bench --temperature 0

What a replay runs and writes: ``tltrun.rollout.bench``'s docstring. Flags map 1:1 onto
``BenchConfig``, ``EngineConfig`` and ``SamplingParams``; ``--max-running-requests`` and
``--max-model-len`` default to what the replayed steps need (``tltrun.cli.args.engine_defaults``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tltrun.cli.args import (
    add_engine_args,
    check_kv_cache_fits,
    config_dict,
    engine_config_from_args,
    engine_defaults,
)
from tltrun.rollout.bench import BenchConfig, load_bench_trace, run_bench, select_steps
from tltsim.cli.args import add_dataclass_args, check_out_dir, dataclass_from_args
from tltsim.cli.table import format_table
from tltsim.jsonio import write_json

COLUMNS = {
    "name": "backend/policy",
    "rollout_s": "wall s",
    "total_tokens": "tokens",
    "tokens_per_s": "tokens/s",
    "mean_accept_len": "accept len",
    "sd_iteration_share": "SD iters",
    "drafter_prefill_s": "re-prefill s",
    "speedup": "speedup",
}
FORMATS = {
    "rollout_s": ".2f",
    "tokens_per_s": ".1f",
    "mean_accept_len": lambda v: f"{v:.2f}" if v else "-",  # 0: no SD iteration ran
    "sd_iteration_share": ".0%",
    "drafter_prefill_s": ".2f",
    "speedup": "{:.2f}x",
}


def format_results(results: dict[str, Any]) -> str:
    """One row per backend/policy of ``run_bench``'s results."""
    rows = [{"name": name, **r} for name, r in results.items()]
    return format_table(rows, COLUMNS, FORMATS, left=("name",))


def cmd_bench(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(BenchConfig, args)
    check_out_dir(cfg.out)
    trace = load_bench_trace(cfg)
    steps = select_steps(trace, cfg, max_model_len=None)
    # Defaults sized to the replay: the most responses of one step, the longest scaled request.
    widest = max(sum(len(p.responses) for p in s.prompts) for s in steps)
    longest = max(p.prompt_tokens + r.tokens for s in steps for p in s.prompts for r in p.responses)
    engine_cfg = engine_config_from_args(args, defaults=engine_defaults(cfg.model, widest, longest))
    check_kv_cache_fits(cfg.model, engine_cfg)
    results = run_bench(cfg, engine_cfg, trace)
    out = Path(cfg.out)
    write_json(out / "config.json", config_dict(bench=cfg, engine=engine_cfg))
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(format_results(results))
    print(f"results.json, trace_*.json and config.json written to {out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tltrun bench``."""
    b = subparsers.add_parser(
        "bench", help="replay a trace under several policies; side-by-side table"
    )
    add_dataclass_args(b, BenchConfig)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
