"""What ``tltrun train --deterministic`` costs: the same short ``--policy tlt`` run with spot
training (2 gloo workers, a tiny random model, one seed) alternately with and without the flag,
``--repeats`` times each. Per run: mean step seconds, rollout seconds, ``spot_wait_s`` (the
step's wait after the last rollout ended for spot training and the drafter sync), drafter
updates and accept length per step; per mode, the means over the runs, and whether the runs of
a mode wrote identical ``log.jsonl`` rows (timing columns aside) and final weights.

Run: ``python benchmarks/bench_deterministic.py`` (about 4 minutes on 2 otherwise idle CPU
cores; the runs are timed in wall seconds). Prints the table and writes ``results.json`` into
``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from tltrun.model.config import ModelConfig
from tltrun.model.hf_checkpoint import save_hf
from tltrun.model.tokenizer import CharTokenizer
from tltrun.model.transformer import Transformer
from tltrun.train.config import TrainConfig
from tltrun.train.launch import run_train
from tltrun.train.tasks import TaskConfig
from tltsim.cli.args import add_dataclass_args, dataclass_from_args
from tltsim.errors import UsageError
from tltsim.jsonio import write_json

TASK = TaskConfig(median_ops=2, max_ops=4)  # tests/test_train.py's
TIMING = ("rollout_s", "worker_rollout_s", "train_s", "drafter_train_s", "idle_worker_s",
          "step_s", "spot_wait_s")  # fmt: skip


@dataclass(frozen=True)
class BenchDeterministicConfig:
    out: str = field(
        default="runs/bench_deterministic",
        metadata={"help": "output directory of the runs", "metavar": "DIR"},
    )
    num_steps: int = field(default=8, metadata={"help": "RL steps per run"})
    repeats: int = field(default=2, metadata={"help": "runs per mode (alternating)"})
    # TrainConfig's default: the cap that sets the deterministic budget
    spot_max_epochs: int = field(default=10, metadata={"help": "spot passes over the buffer"})
    seed: int = field(default=0, metadata={"help": "seed of every run"})


def tiny_model_dir(out: Path) -> Path:
    """tests/tiny_models.py's random model (hidden 48, 2 layers) with the char tokenizer."""
    path = out / "model"
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            model_type="llama", vocab_size=tok.vocab_size, hidden_size=48, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
            rope_theta=10000.0, max_position_embeddings=512, eos_token_ids=(tok.eos_id,),
            bos_token_id=1,
        )
    )  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3)
    save_hf(model.eval(), path)
    tok.save(path)
    (path / "sft_config.json").write_text(json.dumps({"task": asdict(TASK)}))
    return path


def train_config(cfg: BenchDeterministicConfig, model_dir: Path, out: Path, is_det: bool):
    # tests/test_train.py's imbalanced run: worker 0 has 1 prompt, worker 1 three
    return TrainConfig(
        model_dir=str(model_dir), out=str(out), num_workers=2, num_steps=cfg.num_steps,
        prompts_per_step=4, group_size=4, max_new_tokens=32, prompt_split=(1, 3),
        max_running_requests=2, policy="tlt", tlt_threshold=2, lr=1e-2,
        checkpoint_every=cfg.num_steps, seed=cfg.seed, spot_max_epochs=cfg.spot_max_epochs,
        is_deterministic=is_det,
    )  # fmt: skip


def fingerprint(out: Path) -> tuple[list[dict], list[str]]:
    """log.jsonl rows without their timing columns, and a digest of the final weights."""
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    untimed = [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
    digests = []
    for file in sorted((out / "final").rglob("*.safetensors")):
        tensors = load_file(file)
        digests += [f"{file.parent.name}/{k}:{hash(tensors[k].numpy().tobytes())}"
                    for k in sorted(tensors)]  # fmt: skip
    return untimed, digests


def run_all(cfg: BenchDeterministicConfig) -> list[dict]:
    out = Path(cfg.out)
    model_dir = tiny_model_dir(out)
    runs = []
    for repeat in range(cfg.repeats):
        for is_det in (True, False):
            run_out = out / f"{'det' if is_det else 'nondet'}_{repeat}"
            shutil.rmtree(run_out, ignore_errors=True)  # an earlier run's checkpoints refused it
            run_train(train_config(cfg, model_dir, run_out, is_det), TASK)
            rows = [json.loads(line) for line in (run_out / "log.jsonl").read_text().splitlines()]
            runs.append(
                {
                    "mode": "deterministic" if is_det else "default",
                    "repeat": repeat,
                    "out": str(run_out),
                    **{
                        key: statistics.mean(r[key] for r in rows)
                        for key in (
                            "step_s",
                            "rollout_s",
                            "spot_wait_s",
                            "drafter_updates",
                            "accept_len",
                        )
                    },  # fmt: skip
                    "spot_wait_s_per_step": [r["spot_wait_s"] for r in rows],
                    "drafter_updates_per_step": [r["drafter_updates"] for r in rows],
                }
            )
    for mode in ("deterministic", "default"):
        prints = [fingerprint(Path(r["out"])) for r in runs if r["mode"] == mode]
        for r in runs:
            if r["mode"] == mode:  # None: one run, nothing compared
                r["identical_runs"] = (
                    all(p == prints[0] for p in prints) if len(prints) > 1 else None
                )
    return runs


def print_table(runs: list[dict]) -> None:
    print(f"{'mode':<14}{'rep':>4}{'step_s':>9}{'rollout_s':>11}{'spot_wait_s':>13}"
          f"{'updates':>9}{'accept':>8}  identical")  # fmt: skip
    for r in runs:
        print(
            f"{r['mode']:<14}{r['repeat']:>4}{r['step_s']:>9.2f}{r['rollout_s']:>11.2f}"
            f"{r['spot_wait_s']:>13.2f}{r['drafter_updates']:>9.1f}{r['accept_len']:>8.2f}"
            f"  {'n/a (one run)' if r['identical_runs'] is None else r['identical_runs']}"
        )
    for mode in ("deterministic", "default"):
        mine = [r for r in runs if r["mode"] == mode]
        print(
            f"{mode:<14} mean step_s {statistics.mean(r['step_s'] for r in mine):.2f}, "
            f"spot_wait_s {statistics.mean(r['spot_wait_s'] for r in mine):.2f} per step"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dataclass_args(parser, BenchDeterministicConfig)
    args = parser.parse_args(argv)
    try:
        cfg = dataclass_from_args(BenchDeterministicConfig, args)
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        runs = run_all(cfg)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_table(runs)
    write_json(Path(cfg.out) / "results.json", {"config": asdict(cfg), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
