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

Run: ``python benchmarks/bench_scale.py`` (20 steps x 3 world sizes; minutes on a 2-core CPU,
on which 4 ranks oversubscribe the cores: run nothing beside it). Smoke test:
``python benchmarks/bench_scale.py --num-steps 2 --ranks 1,2``. Prints the tables and writes
``results.json`` + ``config.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
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
    seed: int = field(default=0, metadata={"help": "seed of the runs and the tiny model"})


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


def run_scale(cfg: BenchScaleConfig, model_dir: Path) -> list[dict]:
    rows = []
    task = task_for(model_dir)
    for world in cfg.ranks:
        out = Path(cfg.out) / f"ranks{world}"
        train = TrainConfig(
            model_dir=str(model_dir),
            out=str(out),
            num_workers=world,
            num_steps=cfg.num_steps,
            prompts_per_step=cfg.prompts_per_step,
            group_size=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens,
            policy="nospec",
            is_spot_training=False,
            num_threads=1,
            checkpoint_every=cfg.num_steps,
            device=cfg.device,
            seed=cfg.seed,
        )
        if out.exists():
            import shutil

            shutil.rmtree(out)
        t0 = time.perf_counter()
        run_train(train, task)
        wall_s = time.perf_counter() - t0
        log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        timed = log[1:] or log  # the first step pays start-up and first-call costs
        rows.append(
            {
                "ranks": world,
                "step_s": statistics.mean(r["step_s"] for r in timed),
                "rollout_s": statistics.mean(r["rollout_s"] for r in timed),
                "train_s": statistics.mean(r["train_s"] for r in timed),
                "wall_s": wall_s,
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
        drafter = EagleDrafter.for_target(actor, seed=cfg.seed)
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


TABLE_COLUMNS = {
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
        model_dir = Path(cfg.model_dir) if cfg.model_dir else tiny_model_dir(out, cfg.seed)
        rows = run_scale(cfg, model_dir)
        ckpt = checkpoint_seconds(cfg, model_dir)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"{cfg.num_steps} GRPO steps, global batch {cfg.prompts_per_step} prompts x "
        f"{cfg.group_size}, one thread per rank, {cfg.device} (means over steps 1..)"
    )
    print(format_table(rows, TABLE_COLUMNS, {"efficiency": ".2f"}))
    print(
        f"checkpoint (median of {cfg.num_checkpoints}): actor + AdamW {ckpt['actor_s']:.3f} s; "
        f"drafter + AdamW sync {ckpt['drafter_sync_s']:.3f} s, async blocks "
        f"{ckpt['drafter_async_s']:.3f} s (write done after {ckpt['async_write_s']:.3f} s)"
    )
    write_json(out / "results.json", {"scale": rows, "checkpoint": ckpt})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
