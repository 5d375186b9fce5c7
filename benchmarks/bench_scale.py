"""Scaling of ``tltrun train`` over torch.distributed ranks (issue #19): step and rollout seconds
of the same GRPO run (same global batch: prompts per step x group size) on 1, 2 and 4 ranks,
one thread each, and the seconds a checkpoint blocks training, drafter written synchronously
(``dcp.save``) vs asynchronously (``dcp.async_save``).

Model: a tiny random one (hidden 48, 2 layers, the built-in task's character tokenizer; the
shape of tests/tiny_models.py) unless ``--model-dir`` names one; ``--device cuda`` runs the
ranks on GPUs (NCCL). Spot training is off and the policy is NoSpec, so the ranks' only
coupling is the data-parallel all_reduce of the actor update and the step's barriers: the
numbers are the launcher's and the collectives' cost, not speculative decoding's.

Scaling efficiency of W ranks = (step s of 1 rank) / (W x step s of W ranks), over the steps
after the first (start-up and first-call costs excluded). The issue sets no CPU target beyond
"the 2-rank run is not slower than the 1-rank run for the same global batch".

The world sizes alternate in chunks of ``--chunk-steps`` steps (each chunk resumes its run;
the first step of each chunk is not timed), so every world size sees the same drift in a
shared machine's load; ``--seeds 1,2,3`` runs each seed (a fresh tiny model each) and prints
the median [min-max] over seeds of every world size's speedup over 1 rank.

Run: ``python benchmarks/bench_scale.py --seeds 1,2,3`` (20 steps x 3 world sizes per seed;
minutes per seed on a 2-core CPU, on which 4 ranks oversubscribe the cores: run nothing beside
it). Smoke test: ``python benchmarks/bench_scale.py --num-steps 4 --chunk-steps 2 --ranks 1,2``.
Prints the tables and writes ``results.json`` + ``config.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tltrun.train.config import TrainConfig
from tltrun.train.launch import run_train, task_for
from tltsim.cli.args import add_dataclass_args, dataclass_from_args
from tltsim.cli.table import format_table
from tltsim.errors import UsageError
from tltsim.jsonio import write_json


@dataclass(frozen=True)
class BenchScaleConfig:
    model_dir: str = field(
        default="",
        metadata={"help": "target checkpoint (default: a tiny random model)", "metavar": "DIR"},
    )
    out: str = field(
        default="runs/bench_scale",
        metadata={"help": "output directory of the runs", "metavar": "DIR"},
    )
    ranks: tuple[int, ...] = field(default=(1, 2, 4), metadata={"help": "world sizes to run"})
    num_steps: int = field(default=20, metadata={"help": "GRPO steps per run"})
    prompts_per_step: int = field(
        default=8, metadata={"help": "prompts per step (the global batch, split over ranks)"}
    )
    group_size: int = field(default=4, metadata={"help": "responses per prompt"})
    max_new_tokens: int = field(default=48, metadata={"help": "response cap in tokens"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    num_checkpoints: int = field(
        default=5, metadata={"help": "checkpoint writes timed per mode (sync, async)"}
    )
    seeds: tuple[int, ...] = field(
        default=(0,), metadata={"help": "seeds of the runs and the tiny model, one run each"}
    )
    # The world sizes alternate in chunks of this many steps (each chunk a --resume of its
    # run, the order rotated per chunk, as bench_train's contenders), so a change in the
    # shared machine's load reaches every world size; each ran whole, in turn, before.
    chunk_steps: int = field(
        default=5, metadata={"help": "steps per chunk; the world sizes alternate (0: whole runs)"}
    )

    def __post_init__(self) -> None:
        if not self.seeds or self.chunk_steps < 0:
            raise UsageError("--seeds needs one seed or more; --chunk-steps an integer >= 0")


def tiny_model_dir(out: Path, seed: int) -> Path:
    """tests/tiny_models.py's shape (hidden 48, 2 layers, GQA 4/2 heads) with the built-in
    task's character tokenizer, random weights of std 0.3."""
    import torch

    from tltrun.model.config import ModelConfig
    from tltrun.model.hf_checkpoint import save_hf
    from tltrun.model.tokenizer import CharTokenizer
    from tltrun.model.transformer import Transformer
    from tltrun.train.tasks import TaskConfig

    # one per seed: a rerun with another --seed reused the first seed's weights
    model_dir = out / f"tiny_model_seed{seed}"
    if (model_dir / "config.json").is_file():
        return model_dir
    tok = CharTokenizer()
    torch.manual_seed(seed)
    model = Transformer(
        ModelConfig(
            model_type="llama",
            vocab_size=tok.vocab_size,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            rope_theta=10000.0,
            max_position_embeddings=512,
            eos_token_ids=(tok.eos_id,),
            bos_token_id=1,
        )
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    save_hf(model, model_dir)
    tok.save(model_dir)
    task = TaskConfig(median_ops=2, max_ops=4)
    (model_dir / "sft_config.json").write_text(json.dumps({"task": asdict(task)}))
    return model_dir


def run_scale(cfg: BenchScaleConfig, model_dir: Path, seed: int) -> list[dict]:
    """One seed: every world size's run, alternating in chunks; means over the steps that do
    not start a chunk (each chunk's first step pays the start-up and first-call costs)."""
    import shutil

    from bench_train import chunk_ends

    task = task_for(model_dir)
    ends = chunk_ends(cfg.num_steps, cfg.chunk_steps)
    configs, wall_s = {}, dict.fromkeys(cfg.ranks, 0.0)
    for world in cfg.ranks:
        configs[world] = TrainConfig(
            model_dir=str(model_dir),
            out=str(Path(cfg.out) / f"seed{seed}" / f"ranks{world}"),
            num_workers=world,
            num_steps=cfg.num_steps,
            prompts_per_step=cfg.prompts_per_step,
            group_size=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens,
            policy="nospec",
            is_spot_training=False,
            num_threads=1,
            checkpoint_every=cfg.chunk_steps or cfg.num_steps,
            device=cfg.device,
            seed=seed,
        )
        shutil.rmtree(configs[world].out, ignore_errors=True)
    for k, end in enumerate(ends):
        order = cfg.ranks[k % len(cfg.ranks) :] + cfg.ranks[: k % len(cfg.ranks)]
        for world in order:
            t0 = time.perf_counter()
            run_train(replace(configs[world], num_steps=end), task, is_resume=k > 0)
            wall_s[world] += time.perf_counter() - t0
    starts = {0, *ends[:-1]}
    rows = []
    for world, train in configs.items():
        log = [
            json.loads(line) for line in (Path(train.out) / "log.jsonl").read_text().splitlines()
        ]
        timed = [r for r in log if r["step"] not in starts] or log
        rows.append(
            {
                "seed": seed,
                "ranks": world,
                "step_s": statistics.mean(r["step_s"] for r in timed),
                "rollout_s": statistics.mean(r["rollout_s"] for r in timed),
                "train_s": statistics.mean(r["train_s"] for r in timed),
                "wall_s": wall_s[world],
                "num_timed_steps": len(timed),
            }
        )
    base = next((r for r in rows if r["ranks"] == 1), None)
    for r in rows:
        if base is not None:
            r["step_speedup"] = base["step_s"] / r["step_s"]
            r["rollout_speedup"] = base["rollout_s"] / r["rollout_s"]
            r["efficiency"] = r["step_speedup"] / r["ranks"]
    return rows


def seed_summary(rows: list[dict]) -> list[dict]:
    """Per world size: the median [min-max] over seeds of each seed's step and rollout speedup
    (each a ratio measured within one seed's alternating runs)."""
    summary = []
    for world in dict.fromkeys(r["ranks"] for r in rows):
        mine = [r for r in rows if r["ranks"] == world and "step_speedup" in r]
        if not mine:
            continue
        row = {"ranks": world, "num_seeds": len(mine)}
        for key in ("step_speedup", "rollout_speedup", "efficiency"):
            values = sorted(r[key] for r in mine)
            row[key] = statistics.median(values)
            row[f"{key}_range"] = f"{values[0]:.2f}-{values[-1]:.2f}"
        summary.append(row)
    return summary


def checkpoint_seconds(cfg: BenchScaleConfig, model_dir: Path) -> dict:
    """Seconds one rank's training is blocked by a checkpoint of the actor (+ AdamW, always
    synchronous) and of the drafter (+ AdamW), sync vs async; medians of num_checkpoints
    writes into a 1-rank gloo group in this process."""
    import tempfile

    import torch
    import torch.distributed as dist

    from tltrun.model.drafter import EagleDrafter
    from tltrun.model.hf_checkpoint import load_hf
    from tltrun.train import checkpoint as ckpt_io
    from tltrun.train.grpo import GRPOConfig, make_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = ckpt_io.checkpoint_group()
        actor = load_hf(model_dir).train()
        actor_opt = make_optimizer(actor, GRPOConfig())
        drafter = EagleDrafter.for_target(actor, seed=cfg.seeds[0])
        drafter_opt = torch.optim.AdamW(drafter.parameters())
        times = {"actor_s": [], "drafter_sync_s": [], "drafter_async_s": [], "async_write_s": []}
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
            for i in range(cfg.num_checkpoints):
                t0 = time.perf_counter()
                ckpt_io.save_actor(actor, actor_opt, Path(tmp) / f"a{i}", group)
                times["actor_s"].append(time.perf_counter() - t0)
                meta = {"version": i, "update_s": 0.0}
                t0 = time.perf_counter()
                future = ckpt_io.save_drafter_async(
                    drafter, drafter_opt, meta, Path(tmp) / f"s{i}", group
                )
                future.result()  # synchronous: training waits for the whole write
                times["drafter_sync_s"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                future = ckpt_io.save_drafter_async(
                    drafter, drafter_opt, meta, Path(tmp) / f"d{i}", group
                )
                times["drafter_async_s"].append(time.perf_counter() - t0)  # blocked this long
                future.result()
                times["async_write_s"].append(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
    return {k: statistics.median(v) for k, v in times.items()}


SUMMARY_COLUMNS = {
    "ranks": "ranks", "num_seeds": "seeds", "step_speedup": "step x",
    "step_speedup_range": "(min-max)", "rollout_speedup": "rollout x",
    "rollout_speedup_range": "(min-max)", "efficiency": "efficiency",
}  # fmt: skip
SUMMARY_FORMATS = {"step_speedup": "{:.2f}x", "rollout_speedup": "{:.2f}x", "efficiency": ".2f"}
TABLE_COLUMNS = {
    "seed": "seed",
    "ranks": "ranks",
    "step_s": "step s",
    "rollout_s": "rollout s",
    "train_s": "train s",
    "step_speedup": "step x",
    "rollout_speedup": "rollout x",
    "efficiency": "efficiency",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dataclass_args(parser, BenchScaleConfig)
    args = parser.parse_args(argv)
    try:
        cfg = dataclass_from_args(BenchScaleConfig, args)
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "config.json", asdict(cfg))
        rows = []
        for seed in cfg.seeds:  # a fresh tiny model per seed unless --model-dir names one
            model_dir = Path(cfg.model_dir) if cfg.model_dir else tiny_model_dir(out, seed)
            rows += run_scale(cfg, model_dir, seed)
        ckpt = checkpoint_seconds(cfg, model_dir)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"{cfg.num_steps} GRPO steps, global batch {cfg.prompts_per_step} prompts x "
        f"{cfg.group_size}, one thread per rank, {cfg.device} (means over the steps that start no chunk)"
    )
    print(format_table(rows, TABLE_COLUMNS, {"efficiency": ".2f"}))
    summary = seed_summary(rows)
    if len(cfg.seeds) > 1:
        print(f"over {len(cfg.seeds)} seeds, median [min-max]:")
        print(format_table(summary, SUMMARY_COLUMNS, SUMMARY_FORMATS))
    print(
        f"checkpoint (median of {cfg.num_checkpoints}): actor + AdamW {ckpt['actor_s']:.3f} s; "
        f"drafter + AdamW sync {ckpt['drafter_sync_s']:.3f} s, async blocks "
        f"{ckpt['drafter_async_s']:.3f} s (write done after {ckpt['async_write_s']:.3f} s)"
    )
    write_json(out / "results.json", {"scale": rows, "over_seeds": summary, "checkpoint": ckpt})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
