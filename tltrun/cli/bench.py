"""``tltrun bench``: replay a tlt-trace under several SD policies (and backends), side by side.

    tltrun bench --trace traces/x.json --policy nospec,static,tlt --model M --drafter D \\
        --out runs/bench --temperature 0
    tltrun bench --out runs/bench --resume      # a killed bench: its finished rows are kept

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
    check_same_weights,
    check_torch_only_flags,
    engine_config_from_args,
    engine_defaults,
    recorded_engine_run,
    run_config_dict,
    stop_says_how_to_resume,
    weights_digests,
)
from tltrun.rollout.bench import (
    BACKENDS,
    BenchConfig,
    finished_rows,
    load_bench_trace,
    row_trace_name,
    run_bench,
    select_steps,
)
from tltrun.train.config_checks import absolute_paths
from tltsim.cli.args import add_dataclass_args, check_out_dir, dataclass_from_args
from tltsim.cli.table import format_table
from tltsim.errors import UsageError
from tltsim.jsonio import write_json
from tltsim.policy import POLICY_NAMES

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
    from tltrun.train.resumable import refuse_other_results
    from tltrun.train.state import RunLock, write_atomic

    if args.resume:
        configs = recorded_engine_run(
            args, command="tltrun bench", section="bench", cls=BenchConfig,
            finished_file="results.json",
        )  # fmt: skip
        if configs is None:
            print(
                f"{args.out}: the bench already finished (results.json is written); nothing to resume"
            )
            return 0
        cfg, engine_cfg = configs
        out = Path(args.out)  # where the run is now (its config names where it started)
        check_same_weights(out, cfg.model, cfg.drafter)
        trace = load_bench_trace(cfg)
    else:
        cfg = absolute_paths(dataclass_from_args(BenchConfig, args))  # resumable from anywhere
        # (it was ignored; a run recorded before strategy became optional resumes as it was)
        if cfg.strategy is not None and "static" not in cfg.policy:
            raise UsageError(
                f"--strategy {cfg.strategy}: only --policy static takes a strategy; "
                f"--policy {','.join(cfg.policy)} choose their own"
            )
        out = check_out_dir(cfg.out)
        refuse_other_results(out, "tltrun bench")
        trace = load_bench_trace(cfg)
        steps = select_steps(trace, cfg, max_model_len=None)
        # Defaults sized to the replay: the most responses of one step, the longest scaled request.
        widest = max(sum(len(p.responses) for p in s.prompts) for s in steps)
        longest = max(
            p.prompt_tokens + r.tokens for s in steps for p in s.prompts for r in p.responses
        )
        check_torch_only_flags(args, cfg.backend)
        engine_cfg = engine_config_from_args(
            args, defaults=engine_defaults(cfg.model, widest, longest)
        )
    check_kv_cache_fits(cfg.model, engine_cfg)
    if "vllm" in cfg.backend:  # before any row runs (vLLM's own refusal came after the torch rows)
        from tltrun.rollout.vllm_config import VLLM_DTYPES

        if engine_cfg.dtype_name not in VLLM_DTYPES:
            raise UsageError(
                f"--dtype {engine_cfg.dtype_name}: --backend vllm takes {', '.join(VLLM_DTYPES)}"
            )
    with (
        RunLock(out, "tltrun bench"),
        stop_says_how_to_resume(out, "tltrun bench", is_resumable_anytime=True),
    ):
        if args.resume:
            done, notes = finished_rows(cfg, select_steps(trace, cfg, None), out)
            for note in notes:
                print(f"note: {note}")
        else:
            _start_fresh(cfg, out)
            write_json(
                out / "config.json",
                {
                    **run_config_dict(bench=cfg, engine=engine_cfg),
                    **weights_digests(cfg.model, cfg.drafter),
                },
            )
            done = {}
        results = run_bench(cfg, engine_cfg, trace, out, done)
        write_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    print(format_results(results))
    if done:
        print(
            f"resumed: {', '.join(done)} timed by the killed run (another process: their speedups "
            "compare runs of two processes)"
        )
    print(f"results.json, trace_*.json and config.json written to {out}")
    return 0


def _start_fresh(cfg: BenchConfig, out: Path) -> None:
    """A fresh bench in ``out``: refused over an unfinished one (its finished rows would be
    overwritten; ``--resume`` keeps them); an earlier finished run's results.json and row
    traces go, so that this run, if killed, is neither taken for finished nor resumed with
    the earlier run's rows."""
    rows = [row_trace_name(f"{b}/{p}") for b in cfg.backend for p in cfg.policy]
    if not (out / "results.json").is_file() and (out / "config.json").is_file():
        written = sorted(p.name for p in out.glob("trace_*.json"))
        if written:
            raise UsageError(
                f"{out}: holds the finished rows of an unfinished bench ({', '.join(written)}; "
                "no results.json); pass --resume to continue it, or choose another --out"
            )
    (out / "results.json").unlink(missing_ok=True)
    # an earlier bench's rows of other policies or backends go too (hunt: its static and tlt
    # row traces stayed beside a nospec-only results.json): the names a row has, never the
    # bench's own --trace (review)
    earlier = [row_trace_name(f"{b}/{p}") for b in BACKENDS for p in POLICY_NAMES]
    for name in {*rows, *earlier}:
        if (out / name).resolve() != Path(cfg.trace).resolve():
            (out / name).unlink(missing_ok=True)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tltrun bench``."""
    b = subparsers.add_parser(
        "bench", help="replay a trace under several policies; side-by-side table"
    )
    b.add_argument(
        "--resume",
        action="store_true",
        help="continue the killed bench in --out with its config.json: its finished rows "
        "(trace files) are kept, the others run",
    )
    add_dataclass_args(b, BenchConfig)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
