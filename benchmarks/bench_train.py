"""The same short GRPO run under NoSpec, StaticSpec (frozen drafter), TLTAdaptive with a frozen
drafter and TLTAdaptive + spot drafter training (``tltrun train``, 2 gloo workers): rollout
seconds per step, end-to-end step seconds and speedups vs NoSpec, the accept length of the
spot-trained vs the frozen drafter at the last step, and the final reward of each run. Next to
the rollout speedup (wall seconds of the slower worker, prefill included), ``decode x`` is the
engine's decode tokens per decode second vs NoSpec's (the quantity ``bench_spec.py`` measures)
and ``prefill %`` the share of the engine's seconds spent prefilling, which SD does not shorten:
together they say why a rollout gains less than the microbenchmark. Starting point: the target
and drafter of ``benchmarks/bench_spec.py`` (``--model-dir`` / ``--drafter-dir``, run that
first); every run starts from the same weights and seed, so the runs see the same prompts.

Run: ``python benchmarks/bench_train.py`` (about 20 minutes on 2 otherwise idle CPU cores; run
nothing beside it, the runs are timed in wall seconds; they alternate in chunks of
``--chunk-steps`` steps, each chunk resuming its run, so a drift in the machine's load reaches
every contender). A reasoning-gym task instead of the built-in one (issue #16): ``python
benchmarks/bench_spec.py --task T --work-dir W`` first, then ``python benchmarks/bench_train.py
--task T --model-dir W/target --drafter-dir W/drafter --spec-results W/results.json``. Prints
the table and writes ``results.json`` + ``config.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tltrun.rollout.engine_config import DTYPES
from tltrun.train.compare import (
    COLUMNS,
    FORMATS,
    compare_runs,
    drift_warnings,
    engine_totals,
    read_log,
)
from tltrun.train.config import TrainConfig
from tltrun.train.launch import check_inputs, run_train, task_for
from tltrun.train.state import read_next_step, select_checkpoint
from tltsim.cli.args import add_dataclass_args, dataclass_from_args
from tltsim.cli.table import format_table
from tltsim.errors import UsageError
from tltsim.jsonio import write_json

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
from spec_profile import crossover_batch, profile_buckets, read_spec_results  # noqa: E402

# name -> (policy, spot training, drafters TLT's bandit may pick per bucket)
RUN_SPECS = {
    "nospec": ("nospec", False, ("eagle",)),
    "static": ("static", False, ("eagle",)),
    "tlt-frozen": ("tlt", False, ("eagle",)),
    "tlt-spot": ("tlt", True, ("eagle",)),
    # issue #20: the history drafter alone (TLT-Base), and TLT's bandit choosing per bucket
    # between the spot-trained EAGLE drafter and the history drafter
    "tltbase": ("tltbase", False, ("eagle",)),
    "tlt-mix": ("tlt", True, ("eagle", "history")),
    # TLT-Base whose history drafter drafts from the prompt's own group only (no cross-prompt
    # index: HistoryConfig.is_cross_prompt), the drafter before that tier, for A/B runs
    "tltbase-group": ("tltbase", False, ("eagle",)),
}
GROUP_HISTORY_RUNS = ("tltbase-group",)
NUM_WORKERS = 2  # gloo workers of every run: one per core of the project's 2-core machine
DEFAULT_RUNS = ("nospec", "static", "tlt-frozen", "tlt-spot")


@dataclass(frozen=True)
class BenchTrainConfig:
    model_dir: str = field(
        default="runs/bench_spec/target",
        metadata={"help": "target checkpoint (bench_spec.py's)", "metavar": "DIR"},
    )
    drafter_dir: str = field(
        default="runs/bench_spec/drafter",
        metadata={"help": "drafter to start from (bench_spec.py's)", "metavar": "DIR"},
    )
    out: str = field(
        default="runs/bench_train",
        metadata={"help": "output directory of the runs", "metavar": "DIR"},
    )
    runs: tuple[str, ...] = field(
        default=DEFAULT_RUNS,
        metadata={
            "help": f"runs to compare, nospec and tlt-spot included ({', '.join(RUN_SPECS)})"
        },
    )
    # issue #16: a reasoning-gym task instead of the built-in one; the target and drafter must
    # come from bench_spec.py --task with the same task (its SFT on that task's problems)
    task: str = field(
        default="builtin",
        metadata={"help": "builtin, or reasoning-gym:<task>[?key=value&...]"},
    )
    # the example run
    num_steps: int = field(default=20, metadata={"help": "RL steps per run"})
    prompts_per_step: int = field(default=4, metadata={"help": "prompts per RL step"})
    group_size: int = field(default=4, metadata={"help": "responses per prompt"})
    max_new_tokens: int = field(default=192, metadata={"help": "token cap per response"})
    lr: float = field(default=1e-5, metadata={"help": "actor (GRPO) learning rate"})
    seed: int = field(default=0, metadata={"help": "seed of every run"})
    # TLTAdaptive on a CPU: chain strategies (TLT's GPU defaults verify 8..48-node trees per
    # request, compute-bound here — see tltrun/train/launch.py), longest chain at batch 1.
    tlt_strategies: tuple[str, ...] = field(
        default=("4_1_4", "3_1_3", "2_1_2", "1_1_1"),
        metadata={"help": "TLTAdaptive strategies, one bucket each"},
    )
    # How strategies map to batch buckets. "fastrl": tlt_strategies over TLT's bucket starts
    # (1, 2, 5, 21; fastrl mab_bs_threshold: the longer the chain, the smaller the batch it
    # serves — right for GPU trees). "spec": from bench_spec.py's profile, like the threshold —
    # each measured batch size starts a bucket served by the strategy measured fastest there
    # (``profile_buckets``). On this CPU bench_spec measures 4_1_4 fastest at batches 1, 4 and 8
    # on both tasks, where "fastrl" serves a worker's 5-8 running responses with 2_1_2.
    tlt_buckets: str = field(
        default="fastrl",
        metadata={
            "help": "fastrl (tlt_strategies, TLT's bucket starts) or spec (bench_spec.py's "
            "fastest strategy per measured batch)"
        },
    )
    # TLT's switch threshold: 0 = the batch size where SD stops paying on this machine, read
    # from benchmarks/bench_spec.py's results (``crossover_batch``) instead of the GPU default
    # 32 (fastrl bs_threshold); > 0 sets it.
    tlt_threshold: int = field(
        default=0, metadata={"help": "TLTAdaptive threshold (0: bench_spec.py's crossover batch)"}
    )
    # TLTConfig.explore_iters of the tlt runs (1: fastrl's per-iteration exploration). It
    # matters only where a bucket has several arms: tlt-mix's two drafters by default. On this
    # CPU a drafter forward costs far more than its tokens (the hanoi tlt-mix runs at b2943af:
    # an EAGLE iteration right after history ones 75 ms against 48 ms steady, a switch-on
    # re-prefill ~110 ms, ~87 SD iterations per rollout), so trying EAGLE one iteration at a time
    # pays a catch-up per try and a re-prefill in nearly every rollout; with 16, EAGLE's ~5% of
    # iterations come as about one block per four rollouts (README, issue #20 row).
    tlt_explore_iters: int = field(
        default=1, metadata={"help": "iterations a TLT bandit exploration holds its random arm"}
    )
    # TLTConfig.drafter_explore of the tlt runs ("iteration": fastrl's rule for every arm). It
    # matters only with two drafters (tlt-mix): "rollout" explores the other drafter's arms in
    # an epsilon share of rollouts, so the drafter's re-prefill and catch-up that each switch
    # costs on this CPU come in about one rollout in ten instead of nearly every one.
    tlt_drafter_explore: str = field(
        default="iteration",
        metadata={"help": "when the tlt-mix bandit explores the other drafter: iteration, rollout"},
    )
    # TLTConfig.history_strategies of the runs that draft from the history (tltbase, tlt-mix):
    # () pairs the history drafter with each bucket's tlt_strategies, as EAGLE.
    tlt_history_strategies: tuple[str, ...] = field(
        default=(),
        metadata={"help": "the history drafter's strategies in every bucket (tltbase, tlt-mix)"},
    )
    # TrainConfig.dtype of every run: the rollout engine's weights and KV cache (training stays
    # fp32 on a CPU, as veRL trains fp32 master weights beside bf16 vLLM rollouts). On this CPU
    # (AVX512-BF16) a bf16 GEMM of 8-40 rows runs 2.6-3.7x faster than fp32 and 1 row 0.7x
    # (512 -> 1408, one thread, 2026-11-27): it moves batch-8 decode from compute- toward
    # memory-bound, which is where SD pays.
    dtype: str = field(
        default="float32",
        metadata={"help": "rollout weights/KV dtype of every run (float32, bfloat16)"},
    )
    spec_results: str = field(
        default="runs/bench_spec/results.json",
        metadata={"help": "bench_spec.py's results.json", "metavar": "PATH"},
    )
    # Drafter evaluation after the runs: the spot run's final actor (the moved policy) generates
    # eval_prompts x group_size responses to prompts of steps after the run with a chain of
    # eval_strategy, once with the frozen drafter and once with the spot-trained one (same
    # target, same prompts, same seed), and the accept lengths are compared.
    eval_prompts: int = field(
        default=16, metadata={"help": "prompts of the drafter evaluation after the runs"}
    )
    eval_strategy: str = field(
        default="4_1_4", metadata={"help": "SD strategy of the drafter evaluation"}
    )
    reuse_runs: bool = field(
        default=False,
        metadata={"help": "take finished runs' log.jsonl from --out instead of rerunning"},
    )
    # The runs are timed in wall seconds on a shared machine whose load drifts: run back to
    # back, a load change lands on one contender only. So the runs alternate in chunks of this
    # many steps (each chunk a --resume of the run's last checkpoint, the contenders' order
    # rotated per chunk), and every contender sees the same drift. 0: each run whole, in turn.
    chunk_steps: int = field(
        default=5,
        metadata={"help": "steps per chunk; the runs alternate chunk by chunk (0: whole runs)"},
    )

    def __post_init__(self) -> None:
        if self.tlt_buckets not in ("fastrl", "spec"):
            raise UsageError(f"--tlt-buckets {self.tlt_buckets}: expected fastrl or spec")
        if self.chunk_steps < 0:
            raise UsageError(f"--chunk-steps {self.chunk_steps}: expected an integer >= 0")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype {self.dtype}: expected one of {', '.join(DTYPES)}")
        unknown = [name for name in self.runs if name not in RUN_SPECS]
        if unknown or not {"nospec", "tlt-spot"} <= set(self.runs):
            raise UsageError(
                f"--runs {','.join(self.runs)}: expected names from {', '.join(RUN_SPECS)}, "
                "nospec (the baseline) and tlt-spot (the drafter evaluation) included"
            )


# The runs' sampling temperature: TrainConfig's default (no run sets another)
RUN_TEMPERATURE = next(f.default for f in fields(TrainConfig) if f.name == "temperature")


def tlt_threshold(cfg: BenchTrainConfig) -> int:
    if cfg.tlt_threshold > 0:
        return cfg.tlt_threshold
    path = Path(cfg.spec_results)
    return crossover_batch(
        read_spec_results(path, "--tlt-threshold", RUN_TEMPERATURE, dtype=cfg.dtype)
    )


def tlt_buckets(cfg: BenchTrainConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(tlt_strategies, tlt_bucket_starts) of the TLT runs; () starts: the policy's default."""
    if cfg.tlt_buckets == "fastrl":
        return tuple(cfg.tlt_strategies), ()
    path = Path(cfg.spec_results)
    return profile_buckets(
        read_spec_results(path, "--tlt-buckets fastrl", RUN_TEMPERATURE, dtype=cfg.dtype)
    )


def task_fields(cfg: BenchTrainConfig) -> dict:
    """TrainConfig fields of the benchmark's task: none for the built-in task; for a
    reasoning-gym task its data path (the reward defaults to the task's own scorer) and a
    prompt cap that fits its questions."""
    if cfg.task == "builtin":
        return {}
    return {"data": cfg.task, "max_prompt_tokens": 2048}


def chunk_ends(num_steps: int, chunk_steps: int) -> list[int]:
    """The step each chunk runs up to: ``[5, 10, 15, 20]`` for 20 steps in chunks of 5."""
    if chunk_steps == 0 or chunk_steps >= num_steps:
        return [num_steps]
    return [*range(chunk_steps, num_steps, chunk_steps), num_steps]


def chunk_start(ends: list[int], k: int, done: int) -> int | None:
    """The step chunk ``k`` (up to ``ends[k]``) starts from in a run that has ``done`` steps
    checkpointed; None: skip it, its steps are done. The last chunk always runs: a resume at the
    run's end trains no step but writes ``final/``."""
    end = ends[k]
    if end <= done and k < len(ends) - 1:
        return None
    return min(max(ends[k - 1] if k else 0, done), end)


def done_steps(train: TrainConfig) -> int:
    """Steps a run in ``train.out`` has checkpointed (0: none): where a --reuse-runs resumes."""
    ckpt = select_checkpoint(Path(train.out), train.num_workers)
    return 0 if ckpt is None else read_next_step(ckpt)


def is_logged_through(train: TrainConfig) -> bool:
    """Whether ``log.jsonl`` holds steps 0 .. num_steps - 1 and ``final/`` was written after
    its last row: a finished run whose checkpoints were deleted (to free disk) afterwards."""
    out = Path(train.out)
    log, weights = out / "log.jsonl", out / "final" / "actor" / "model.safetensors"
    if not (log.is_file() and weights.is_file()):
        return False
    try:
        steps = {row["step"] for row in read_log(out)}
    except (ValueError, KeyError, TypeError):
        return False  # a torn last line: the run was killed mid-step
    return steps >= set(range(train.num_steps)) and weights.stat().st_mtime >= log.stat().st_mtime


def reused_changes(train: TrainConfig) -> str:
    """How ``train`` differs from the settings its run directory was trained with ("": no
    difference, or no config.json there). A field the saved config lacks (added to TrainConfig
    after that run) counts as its default: a finished tlt-mix run of older code must not stand
    in for one asked for with a new setting."""
    import dataclasses

    from tltrun.train import state as train_state
    from tltrun.train.config import RESUME_NEUTRAL_FIELDS

    saved = train_state.effective_config(Path(train.out))
    if saved is None or not dataclasses.is_dataclass(train):
        return ""
    old = dict(saved.get("train", {}))
    for f in dataclasses.fields(train):
        if f.name not in old and f.default is not dataclasses.MISSING:
            old[f.name] = f.default
    changed = train_state.config_diff(old, dataclasses.asdict(train))
    return "; ".join(
        f"{name}: {a!r} -> {b!r}"
        for name, (a, b) in changed.items()
        if name not in RESUME_NEUTRAL_FIELDS and name != "out"
    )


def runs_to_do(configs: dict[str, TrainConfig], reuse_runs: bool) -> tuple[list[str], dict]:
    """The runs still to train, and the steps each has checkpointed. Without ``reuse_runs``
    every run starts at step 0 (a run dir with checkpoints then stops with tltrun's "holds
    checkpoints of an earlier run" error). With it, after a kill, an unfinished run continues
    from its newest checkpoint (chunks it finished are not redone); a run is finished when it
    checkpointed all its steps and wrote ``final/``, which every chunk writes, so ``final/``
    alone does not say it (a benchmark stopped by another run's failure once left a run 5
    steps short, and a rerun reused it). A run whose log holds every step and whose
    ``final/`` is newer than that log is finished too, checkpoints or not."""
    done = {name: done_steps(train) if reuse_runs else 0 for name, train in configs.items()}
    todo = [
        name
        for name, train in configs.items()
        if not (
            reuse_runs
            and (
                (done[name] >= train.num_steps and (Path(train.out) / "final" / "actor").is_dir())
                or is_logged_through(train)
            )
        )
    ]
    for name, train in configs.items():
        changes = reuse_runs and reused_changes(train)
        if changes:
            raise SystemExit(
                f"--reuse-runs: run {name} in {train.out} was trained with other settings "
                f"({changes}); remove it or choose another --out"
            )
    return todo, {name: done[name] for name in todo}


def run_all(cfg: BenchTrainConfig) -> dict:
    threshold = tlt_threshold(cfg)
    why = (
        "--tlt-threshold"
        if cfg.tlt_threshold > 0
        else "bench_spec: SD pays on this machine up to this batch size"
    )
    print(f"TLT threshold: {threshold} ({why})")
    strategies, starts = tlt_buckets(cfg)
    if starts:
        print(
            "TLT buckets from bench_spec: "
            + ", ".join(f"batch >= {b}: {s}" for s, b in zip(strategies, starts, strict=True))
        )
    configs = {name: train_config(cfg, name, threshold, (strategies, starts)) for name in cfg.runs}
    todo, done = runs_to_do(configs, cfg.reuse_runs)
    ends = chunk_ends(cfg.num_steps, cfg.chunk_steps)
    for k, end in enumerate(ends):
        order = todo[k % len(todo) :] + todo[: k % len(todo)] if todo else []
        for name in order:
            start = chunk_start(ends, k, done[name])
            if start is None:
                continue
            chunk = f" steps {start}-{end}" if len(ends) > 1 or start else ""
            print(f"run {name}{chunk} ...", file=sys.stderr)
            train = dataclasses.replace(configs[name], num_steps=end)
            run_train(train, task_for(cfg.model_dir), is_resume=start > 0)
    results = {}
    for name, train in configs.items():
        results[name] = {
            "config": asdict(train),
            "log": read_log(train.out),
            "engine": engine_totals(train.out),
        }
    return results


def train_config(
    cfg: BenchTrainConfig,
    name: str,
    threshold: int,
    buckets: tuple[tuple[str, ...], tuple[int, ...]],
) -> TrainConfig:
    """Run ``name``'s TrainConfig (checked), all ``cfg.num_steps`` steps; ``buckets``:
    ``tlt_buckets(cfg)``'s (strategies, bucket starts)."""
    strategies, starts = buckets
    policy, is_spot, drafters = RUN_SPECS[name]
    train = TrainConfig(
        model_dir=cfg.model_dir,
        out=str(Path(cfg.out) / name),
        drafter_dir=cfg.drafter_dir,
        num_workers=NUM_WORKERS,
        num_steps=cfg.num_steps,
        prompts_per_step=cfg.prompts_per_step,
        group_size=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        policy=policy,
        tlt_strategies=strategies,
        tlt_bucket_starts=starts,
        tlt_threshold=threshold,
        is_spot_training=is_spot,
        tlt_drafters=drafters,
        tlt_history_strategies=(
            cfg.tlt_history_strategies if policy == "tltbase" or "history" in drafters else ()
        ),
        tlt_explore_iters=cfg.tlt_explore_iters,
        tlt_drafter_explore=cfg.tlt_drafter_explore if policy == "tlt" else "iteration",
        lr=cfg.lr,
        seed=cfg.seed,
        dtype=cfg.dtype,
        is_history_cross_prompt=name not in GROUP_HISTORY_RUNS,
        checkpoint_every=cfg.chunk_steps or cfg.num_steps,
        keep_checkpoints=1,  # a chunk resumes from the newest; all of them filled this disk
        **task_fields(cfg),
    )
    check_inputs(train, task_for(cfg.model_dir))
    return train


def results_config(cfg: BenchTrainConfig) -> dict:
    """The tlt-spot run's TrainConfig fields (its config.json)."""
    train = json.loads((Path(cfg.out) / "tlt-spot" / "config.json").read_text())["train"]
    return {k: tuple(v) if isinstance(v, list) else v for k, v in train.items()}


def drafter_eval(cfg: BenchTrainConfig) -> dict[str, float]:
    """Mean accept length (tokens per verify, bonus included) of the frozen and of the
    spot-trained drafter on the same moved target (the spot run's final actor)."""
    import torch

    from tltrun.data.tokenizer import load_tokenizer
    from tltrun.model.drafter import load_drafter
    from tltrun.model.hf_checkpoint import load_hf
    from tltrun.rollout.engine import RolloutEngine
    from tltrun.rollout.engine_config import EngineConfig
    from tltrun.rollout.interface import Request, SamplingParams
    from tltrun.rollout.measured_trace import rollout_summary
    from tltrun.train.prompts import load_run_data
    from tltsim.policy import make_policy

    torch.set_num_threads(1)
    spot_dir = Path(cfg.out) / "tlt-spot" / "final"
    target = load_hf(spot_dir / "actor")
    tok = load_tokenizer(spot_dir / "actor")
    train = TrainConfig(**{**results_config(cfg), "eval_every": 0})
    task = task_for(cfg.model_dir)
    positions = target.config.max_position_embeddings
    data = load_run_data(train, task, lambda row: len(tok.encode_prompt(row.prompt)), positions)
    rows = data.step_rows(cfg.num_steps, cfg.eval_prompts)  # prompts of a step after the runs
    prompts = [tuple(tok.encode_prompt(row.prompt)) for row in rows]
    requests = [
        Request(f"e{i}/{g}", ids, cfg.max_new_tokens)
        for i, ids in enumerate(prompts)
        for g in range(cfg.group_size)
    ]
    engine_cfg = EngineConfig(
        max_running_requests=len(requests),
        max_model_len=max(map(len, prompts)) + cfg.max_new_tokens,
        sampling=SamplingParams(1.0),
        seed=cfg.seed,
        eos_token_ids=tok.eos_ids,
    )
    accept = {}
    for name, drafter_dir in (("frozen", cfg.drafter_dir), ("spot", spot_dir / "drafter")):
        engine = RolloutEngine(target, load_drafter(drafter_dir, target), engine_cfg)
        result = engine.generate(requests, make_policy("static", strategy=cfg.eval_strategy))
        accept[name] = rollout_summary(result)["mean_accept_len"]
    return accept


def print_table(table: list[dict]) -> None:
    print(format_table(table, COLUMNS, FORMATS, left=("run",)))
    print("accept length per step:")
    for t in table:  # None: no SD iteration in that step (the batch never reached the threshold)
        accept = " ".join("-" if a is None else f"{a:.2f}" for a in t["accept_len_per_step"])
        print(f"  {t['run']:<12}{accept}")
    for line in drift_warnings(table):
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dataclass_args(parser, BenchTrainConfig)
    args = parser.parse_args(argv)
    try:
        cfg = dataclass_from_args(BenchTrainConfig, args)
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "config.json", asdict(cfg))
        results = run_all(cfg)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    table = compare_runs(results)
    print_table(table)
    accept = drafter_eval(cfg)
    print(
        f"drafters on the moved policy (tlt-spot's final actor, {cfg.eval_prompts} new prompts "
        f"x {cfg.group_size}, chain {cfg.eval_strategy}): accept length frozen "
        f"{accept['frozen']:.2f}, spot-trained {accept['spot']:.2f}"
    )
    write_json(
        out / "results.json",
        {"config": asdict(cfg), "table": table, "drafter_eval": accept, "runs": results},
    )
    from analysis.train_plots import report

    for path in report([str(out / name) for name in cfg.runs], str(out)):
        print(f"figure: {path}")  # reward.png: the runs' reward curves side by side
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
