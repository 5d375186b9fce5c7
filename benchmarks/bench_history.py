"""History drafter benchmark (issue #20), two sections.

Proposal cost: proposal microseconds per sequence vs history size, which must not grow with the
history (the suffix automaton walks at most ngram_max + draft_steps tokens per proposal).

    .venv/bin/python benchmarks/bench_history.py                        # 1k, 100k, 1M tokens
    .venv/bin/python benchmarks/bench_history.py --sizes 1000,20000 --out /tmp/h.json

GRPO (``--grpo``): ``benchmarks/bench_train.py``'s runs (2 workers, same prompts and seed per
run) for NoSpec, the history drafter alone (``tltbase``), the frozen and the spot-trained EAGLE
drafter (``tlt-frozen``, ``tlt-spot``) and TLT's bandit choosing between the spot-trained EAGLE
and the history drafter per batch bucket (``tlt-mix``): accept length per step and rollout
speedup vs NoSpec of each, once per bench_spec work directory (one per seed: each holds its own
SFT target and offline drafter, ``bench_spec.py --seed S --work-dir W``), then the median and
range over seeds and the issue's two checks (history accept length >= 2 from step 0; the mix's
rollout speedup >= the better of tltbase and tlt-spot, paired by seed, within noise), and #16's
reward check (each run's mean reward per step against NoSpec's, paired by step, within noise;
``reward_checks``). Per seed also what a history draft could reach on tltbase's step-0
rollouts (``history_bounds``): the ceiling of any point-mass draft, and one drafted token's
acceptance sampled from the history's continuation counts vs the most frequent continuation.
On the built-in task also what no better SFT model could raise (``--reference`` alone prints
just this, in a second): the history drafter replayed, and that ceiling, on the task's own
reference solutions (a model that has learned the task exactly, at temperature 1).

    .venv/bin/python benchmarks/bench_history.py --grpo --work-dirs runs/s0/spec,runs/s1/spec \
        --seeds 0,1 --out runs/bench_history_grpo [--task reasoning-gym:...]

Synthetic RL-like history, all in ONE prompt group (the worst case: one automaton holds every
token): a reference answer of ``--answer-tokens`` random token ids (vocabulary 32,000), and
responses that copy spans of it (mean 24 tokens) with a fresh token between spans, so responses
share long spans and the automaton branches where they differ. Each size indexes responses of
1,000 tokens until the history holds that many tokens, then times, for 64 running responses of
the same group (grown to 300 tokens and indexed incrementally): ``propose`` (a chain of
``--draft-steps``), ``propose_tree`` (``--topk`` continuations of ``--draft-steps``) and the
incremental index update (``extend`` of one token), each as the median over ``--repeats`` rounds
of the mean per sequence. Also printed: indexing rate of the build and automaton states per
token. Then two more tables (``benchmarks/history_cost.py``): one response looping on a cycle
of 1 or 3 tokens, indexed token by token with the counted contexts bounded (the default) and
not (``--loop-sizes``); and a long run at the 1M-token cap, 32 new prompts x 8 x 2,000 tokens
per step, evicting just under the cap or down to ``evict_to_fraction`` of it
(``--steady-steps``). Prints the tables and writes JSON (``--out``). Pure Python, one core.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

from grpo_checks import history_accept_check, mix_check, reward_checks, table_row
from history_bounds import reference_bounds, step0_bounds
from history_cost import cost_tables

from tltrun.model.history_drafter import HistoryConfig
from tltrun.train.compare import compare_runs, drift_warnings
from tltsim.cli.table import format_table

GRPO_RUNS = ("nospec", "tltbase", "tltbase-group", "tlt-frozen", "tlt-spot", "tlt-mix")


def _bench_train():
    """benchmarks/bench_train.py as a module (benchmarks/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_train", Path(__file__).with_name("bench_train.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


def _accept(value: float | None) -> str:
    """An accept length for a sentence; None: the step ran no SD iteration."""
    return "- (no SD iteration)" if value is None else f"{value:.2f}"


def print_reference(group_size: int, worker_prompts: int = 2) -> list[dict]:
    """``reference_bounds`` for groups of ``group_size``, printed as a table; the cross-prompt
    columns for ``worker_prompts`` (a worker's share of the GRPO runs' prompts) and 64 groups
    running at once."""
    concurrent = (worker_prompts, 64)
    rows = reference_bounds(group_size=group_size, concurrent_groups=concurrent)
    for row in rows:  # fixed keys for the table: the worker's share and 64
        row["cross_prompt_worker"] = row[f"cross_prompt_{worker_prompts}"]
    print(
        f"built-in task, reference solutions (a model that has learned the task exactly, at "
        f"temperature 1; 64 prompts x {group_size}): accept length per verify of the history "
        "drafter replayed in lockstep one prompt's group at a time, as a chain and as a tree "
        "of 16 continuations; the ceiling of any point-mass draft from the prompt's group; "
        f"the chain with the cross-prompt index, {worker_prompts} and 64 prompts' groups "
        "running at once"
    )
    print(
        format_table(
            rows,
            {
                "draft_tokens": "draft tokens",
                "replay_branches_1": "chain",
                "replay_branches_16": "tree 16",
                "ceiling": "group ceiling",
                "cross_prompt_worker": f"cross {worker_prompts}",
                "cross_prompt_64": "cross 64",
            },
            dict.fromkeys(
                ("replay_branches_1", "replay_branches_16", "ceiling")
                + ("cross_prompt_worker", "cross_prompt_64"),
                ".2f",
            ),
        )
    )
    return rows


def grpo(args: argparse.Namespace) -> dict:
    """The GRPO section over every (work dir, seed); returns the JSON written to --out."""
    bt = _bench_train()
    work_dirs = args.work_dirs.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    if len(seeds) != len(work_dirs):
        raise SystemExit("error: --seeds needs one seed per --work-dirs entry")
    runs = tuple(args.runs.split(","))
    unknown = sorted(set(runs) - set(GRPO_RUNS))
    if unknown or not {"nospec", "tlt-spot"} <= set(runs):
        raise SystemExit(
            f"error: --runs {args.runs}: expected names from {', '.join(GRPO_RUNS)}, "
            "nospec and tlt-spot included"
        )
    out = Path(args.out)
    per_seed = []
    for work, seed in zip(work_dirs, seeds, strict=True):
        cfg = bt.BenchTrainConfig(
            model_dir=f"{work}/target",
            drafter_dir=f"{work}/drafter",
            spec_results=f"{work}/results.json",
            out=str(out / f"seed{seed}"),
            seed=seed,
            task=args.task,
            num_steps=args.num_steps,
            prompts_per_step=args.prompts_per_step,
            group_size=args.group_size,
            max_new_tokens=args.max_new_tokens,
            runs=runs,
            reuse_runs=args.reuse_runs,
            tlt_buckets=args.tlt_buckets,
            tlt_threshold=args.tlt_threshold,
            tlt_explore_iters=args.tlt_explore_iters,
            tlt_drafter_explore=args.tlt_drafter_explore,
            tlt_history_strategies=tuple(s for s in args.tlt_history_strategies.split(",") if s),
            dtype=args.dtype,
        )
        table = compare_runs(bt.run_all(cfg))
        print(f"seed {seed} ({work}):")
        bt.print_table(table)
        entry = {
            "seed": seed,
            "work_dir": work,
            "table": table,
            "drift_warnings": drift_warnings(table),  # print_table printed them
        }
        if "tltbase" in runs:  # what a draft from the prompt's group could reach
            bounds = step0_bounds(out / f"seed{seed}" / "tltbase", Path(work) / "target")
            entry["history_ceiling_step0"] = bounds["ceiling"]
            entry["history_one_token_accept_step0"] = {
                "point_mass": bounds["point_mass"],
                "sampled": bounds["sampled"],
            }
            print(
                f"history drafter at step 0: accept {_accept(table_row(table, 'tltbase'))}; "
                f"ceiling of any point-mass draft from the prompt's group on these rollouts "
                f"{bounds['ceiling']:.2f}; one drafted token accepted with probability "
                f"{bounds['point_mass']:.3f} as the most frequent continuation, "
                f"{bounds['sampled']:.3f} sampled from the continuations' counts"
            )
        per_seed.append(entry)
    summary = []
    for name in runs:
        rows = [next(t for t in s["table"] if t["run"] == name) for s in per_seed]
        speedups = [r["rollout_speedup"] for r in rows]
        steps = [r["step_speedup"] for r in rows]
        # a step without SD iterations has accept length None: left out, counted
        first = [a for r in rows if (a := r["accept_len_per_step"][0]) is not None]
        means = [
            statistics.fmean(sd)
            for r in rows
            if (sd := [a for a in r["accept_len_per_step"] if a is not None])
        ]
        decodes = [r["decode_speedup"] for r in rows if r.get("decode_speedup") is not None]
        prefills = [r["prefill_share"] for r in rows if r.get("prefill_share") is not None]
        summary.append(
            {
                "run": name,
                "rollout_speedup_median": statistics.median(speedups),
                "rollout_speedup_range": f"{min(speedups):.2f}-{max(speedups):.2f}",
                "step_speedup_median": statistics.median(steps),
                "step_speedup_range": f"{min(steps):.2f}-{max(steps):.2f}",
                "decode_speedup_median": statistics.median(decodes) if decodes else None,
                "decode_speedup_range": (
                    f"{min(decodes):.2f}-{max(decodes):.2f}" if decodes else None
                ),
                "prefill_share_median": statistics.median(prefills) if prefills else None,
                "accept_len_step0_median": statistics.median(first) if first else None,
                "accept_len_step0_num_seeds": len(first),  # seeds whose step 0 ran SD
                "accept_len_mean_median": statistics.median(means) if means else None,
                "steps_without_sd": (
                    sum(a is None for r in rows for a in r["accept_len_per_step"])
                    if name != "nospec"
                    else None
                ),
                "reward_mean_median": statistics.median(r["reward_mean_all"] for r in rows),
                "reward_first_last_median": "{:.3f} -> {:.3f}".format(
                    statistics.median(r["reward_per_step"][0] for r in rows),
                    statistics.median(r["reward_per_step"][-1] for r in rows),
                ),
            }
        )
    print(f"over {len(per_seed)} seed(s): median (range) per run")
    print(
        format_table(
            summary,
            {
                "run": "run",
                "rollout_speedup_median": "rollout x",
                "rollout_speedup_range": "range",
                "step_speedup_median": "step x",
                "step_speedup_range": "range",
                "decode_speedup_median": "decode x",
                "decode_speedup_range": "range",
                "prefill_share_median": "prefill %",
                "accept_len_step0_median": "accept step0",
                "accept_len_mean_median": "accept mean",
                "steps_without_sd": "steps w/o SD",
                "reward_mean_median": "reward",
                "reward_first_last_median": "reward step 0 -> last",
            },
            {
                "rollout_speedup_median": ".2f",
                "step_speedup_median": ".2f",
                "decode_speedup_median": ".2f",
                "prefill_share_median": "{:.0%}",
                "reward_mean_median": ".3f",
            },
            left=(
                "run",
                "rollout_speedup_range",
                "step_speedup_range",
                "decode_speedup_range",
                "reward_first_last_median",
            ),
        )
    )
    checks = history_accept_check(summary, per_seed) if "tltbase" in runs else {}
    if {"tltbase", "tlt-mix"} <= set(runs):
        checks.update(mix_check(per_seed))
    reference = (
        # a worker's share of a step's prompts, as bench_train.py's runs split them
        print_reference(cfg.group_size, max(1, cfg.prompts_per_step // bt.NUM_WORKERS))
        if args.task == "builtin"
        else None
    )
    checks["reward_vs_nospec"] = reward_checks(runs, per_seed)
    drifted = [f"seed {s['seed']}" for s in per_seed if s["drift_warnings"]]
    if drifted:
        print(
            f"warning: the machine's speed moved between runs of {', '.join(drifted)} (the "
            "warnings above): those seeds' speedups, and the checks that use them, are not "
            "comparable"
        )
    result = {
        "config": vars(args),
        "per_seed": per_seed,
        "summary": summary,
        "checks": checks,
        "reference_bounds": reference,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out / 'results.json'}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpo", action="store_true", help="run the GRPO section instead")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="print only the history bounds on the built-in task's reference solutions",
    )
    parser.add_argument(
        "--group-size", type=int, default=4, help="samples per prompt (--grpo: per RL step)"
    )
    parser.add_argument(
        "--tlt-threshold",
        type=int,
        default=0,
        help="--grpo: TLT's threshold, as bench_train.py's (0: each seed's bench_spec crossover)",
    )
    parser.add_argument(
        "--prompts-per-step",
        type=int,
        default=4,
        help="--grpo: prompts per RL step, as bench_train.py's (2 workers share them)",
    )
    parser.add_argument(
        "--work-dirs", default="runs/bench_spec", help="--grpo: bench_spec work dirs, one per seed"
    )
    parser.add_argument("--seeds", default="0", help="--grpo: the seed of each work dir")
    parser.add_argument("--task", default="builtin", help="--grpo: builtin or reasoning-gym:<task>")
    parser.add_argument("--num-steps", type=int, default=20, help="--grpo: RL steps per run")
    parser.add_argument(
        "--max-new-tokens", type=int, default=192, help="--grpo: token cap per response"
    )
    parser.add_argument(
        "--reuse-runs", action="store_true", help="--grpo: reuse finished runs in --out"
    )
    parser.add_argument(
        "--tlt-buckets",
        choices=("fastrl", "spec"),
        default="fastrl",
        help="--grpo: TLT's strategy per batch bucket, as bench_train.py --tlt-buckets",
    )
    parser.add_argument(
        "--tlt-explore-iters",
        type=int,
        default=1,
        help="--grpo: iterations a TLT bandit exploration holds its arm, as bench_train.py's",
    )
    parser.add_argument(
        "--tlt-drafter-explore",
        choices=("iteration", "rollout"),
        default="iteration",
        help="--grpo: when tlt-mix explores the other drafter, as bench_train.py's",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="--grpo: rollout weights/KV dtype of every run, as bench_train.py's",
    )
    parser.add_argument(
        "--tlt-history-strategies",
        default="",
        help="--grpo: the history drafter's strategies in every bucket, as bench_train.py's",
    )
    parser.add_argument(
        "--runs",
        default=",".join(GRPO_RUNS),
        help="--grpo: the contenders (nospec and tlt-spot included); the history targets are "
        "checked when tltbase and tlt-mix are among them",
    )
    parser.add_argument("--sizes", default="1000,100000,1000000", help="history sizes (tokens)")
    parser.add_argument(
        "--loop-sizes",
        default="1000,4000,16000",
        help="lengths (tokens) of the looping responses timed ('' : none)",
    )
    parser.add_argument(
        "--steady-steps", type=int, default=6, help="steps of the run at the cap (0: none)"
    )
    parser.add_argument(
        "--steady-prompts", type=int, default=32, help="new prompts per step of that run"
    )
    parser.add_argument(
        "--repeats-steady", type=int, default=1, help="runs at the cap per eviction rule"
    )
    parser.add_argument("--draft-steps", type=int, default=6, help="tokens per drafted chain")
    parser.add_argument("--topk", type=int, default=4, help="continuations per drafted tree")
    parser.add_argument("--ngram-min", type=int, default=HistoryConfig.ngram_min)
    parser.add_argument("--ngram-max", type=int, default=HistoryConfig.ngram_max)
    parser.add_argument("--answer-tokens", type=int, default=2_000, help="reference answer length")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds per measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_history.json", help="JSON output path")
    parser.add_argument(
        "--parse-only",
        action="store_true",
        help="check the flags and stop (seeds.sh does, before hours of runs whose summary "
        "this script would then refuse)",
    )
    args = parser.parse_args()
    if args.parse_only:
        return
    if args.reference:
        rows = print_reference(args.group_size)
        if args.out == "results/bench_history.json":
            args.out = "results/bench_history_reference.json"
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"config": vars(args), "reference_bounds": rows}, indent=2) + "\n"
        )
        print(f"wrote {out}")
        return
    if args.grpo:
        if args.out == "results/bench_history.json":
            args.out = "runs/bench_history_grpo"
        grpo(args)
        return
    tables = cost_tables(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(vars(args))
    meta["python"] = platform.python_version()
    meta["machine"] = platform.machine()
    out.write_text(
        json.dumps(
            {"config": meta, **tables},
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
