"""Speculative decoding on this machine: decode throughput of the torch engine with and without
SD at batch 1, 4, 16, 64 (and 128), for chain and tree strategies, with a real (briefly trained) target
and an EAGLE drafter trained by ``tltrun train-drafter`` on the target's own generations.

Stages (each cached in ``--work-dir``; delete a stage's directory to redo it):

1. ``target/``: an 8-layer, hidden-512 Llama (GQA 8/2 heads) fine-tuned for a few minutes on
   the built-in long-tail arithmetic task (tltrun.train.tasks, tltrun.train.sft's training loop), so its
   outputs are structured text, not noise;
2. ``gen/``: ``tltrun generate`` greedy rollouts of the target on task prompts;
3. ``drafter/``: ``tltrun train-drafter`` on those generations;
4. measurement on held-out prompts: for each batch size B, B requests of exactly
   ``--max-new-tokens`` tokens (``ignore_eos``: the batch stays B for the whole run), greedy
   (or sampled at ``--temperature``, as GRPO's rollouts are), NoSpec vs each SD strategy
   (StaticSpec); decode tokens/s counts decode iterations only
   (prefill and the one-off drafter prefill excluded). Speedup = SD tokens/s / NoSpec tokens/s.

Prints a table (per batch: NoSpec tokens/s, each strategy's accept length and speedup, the
best strategy) and the first batch size where no strategy pays any more; writes
``results.json`` and ``config.json`` to the work dir.

Run: ``python benchmarks/bench_spec.py`` (about 50 min on 2 shared CPU cores: target
fine-tuning ~10, drafter data ~4, drafter training ~6, measurement ~30; later runs reuse the
cached stages). Timings on a shared machine swing by 2x between runs; the interleaved
repeats and the best-of-repeats rule make the ratios, not the absolute tokens/s, the result.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tltsim.cli.args import add_dataclass_args, dataclass_from_args
from tltsim.cli.table import format_table
from tltsim.errors import UsageError
from tltsim.jsonio import write_json


@dataclass(frozen=True)
class BenchSpecConfig:
    work_dir: str = field(
        default="runs/bench_spec",
        metadata={"help": "cache and output directory of the stages", "metavar": "DIR"},
    )
    seed: int = field(default=0, metadata={"help": "seed of the model, data and sampling"})
    # issue #16: a reasoning-gym task instead of the built-in one (problems from the seed)
    task: str = field(
        default="builtin",
        metadata={"help": "builtin, or reasoning-gym:<task>[?key=value&...] (e.g. "
                  "'reasoning-gym:tower_of_hanoi?max_disks=4&max_pegs=3')"},
    )  # fmt: skip
    # Intra-op threads. 1: on a CPU shared with other jobs, OpenMP spin-waiting makes 2 threads
    # slower than 1 for these small matmuls (measured here: ~20x slower under load).
    num_threads: int = field(default=1, metadata={"help": "torch intra-op threads"})
    # Target: the suggested size; SwiGLU width 8/3 x 512 rounded up to 64.
    num_layers: int = field(default=8, metadata={"help": "target layers"})
    hidden_size: int = field(default=512, metadata={"help": "target width"})
    num_heads: int = field(default=8, metadata={"help": "target attention heads"})
    num_kv_heads: int = field(default=2, metadata={"help": "target key/value heads"})
    intermediate_size: int = field(default=1408, metadata={"help": "target SwiGLU MLP width"})
    sft_steps: int = field(default=150, metadata={"help": "target fine-tuning steps"})
    sft_batch_tokens: int = field(
        default=1024, metadata={"help": "padded tokens per fine-tuning batch"}
    )
    # tltrun.train.sft's default for small transformers
    sft_lr: float = field(default=2e-3, metadata={"help": "target fine-tuning peak learning rate"})
    # Drafter data and training
    num_train_prompts: int = field(
        default=512, metadata={"help": "task prompts the target generates drafter data from"}
    )
    train_max_new_tokens: int = field(
        default=256, metadata={"help": "token cap of those generations"}
    )
    # top-1 agreement with the target plateaus after ~150 steps here
    drafter_steps: int = field(default=400, metadata={"help": "drafter training steps"})
    # EAGLE's 3e-5 is for 7B targets and 800k steps; ours has minutes
    drafter_lr: float = field(default=1e-3, metadata={"help": "drafter learning rate"})
    drafter_batch_size: int = field(default=8, metadata={"help": "sequences per drafter step"})
    # Measurement
    # 128: past the 64, to find the end
    batch_sizes: tuple[int, ...] = field(
        default=(1, 4, 16, 64, 128), metadata={"help": "decode batch sizes measured"}
    )
    strategies: tuple[str, ...] = field(
        default=("2_1_2", "3_1_3", "4_1_4", "6_1_6", "4_2_8", "6_2_12", "8_4_32"),
        metadata={"help": "SD strategies compared with NoSpec"},
    )
    # Skip strategies verifying more tokens per iteration (batch x (verify_tokens + 1)): at
    # batch 64 a CPU is compute-bound and such runs take minutes without any chance to pay.
    max_strategy_tokens: int = field(
        default=512,
        metadata={"help": "skip strategies with more batch x (verify tokens + 1) per iteration"},
    )
    max_new_tokens: int = field(
        default=128, metadata={"help": "tokens each measured request generates"}
    )
    repeats: int = field(
        default=3,
        metadata={"help": "interleaved rounds per batch; each strategy keeps its fastest"},
    )
    # 0: greedy, where SD's output must equal NoSpec's token for token (checked). GRPO rollouts
    # sample (tltrun train --temperature 1.0): a profile that sets TLT's threshold and buckets
    # for them (bench_train.py --spec-results) is measured at their temperature, where drafts
    # are accepted less often than under greedy decoding.
    temperature: float = field(
        default=0.0,
        metadata={"help": "sampling temperature of the measured requests (0: greedy, with the "
                  "lossless check)"},
    )  # fmt: skip

    # The measured engine's weights and KV cache (the fine-tuning and drafter stages stay fp32).
    # On this CPU (AVX512-BF16) bf16 GEMMs of 8-40 rows run 2.6-3.7x faster than fp32 and one
    # row 0.7x, so SD pays more in bf16 (tltrun train --dtype bfloat16 rolls out the same way).
    # A dtype other than float32 writes results-<dtype>.json beside results.json.
    dtype: str = field(
        default="float32",
        metadata={"help": "measured engine's weights/KV dtype (float32, bfloat16)"},
    )

    @property
    def results_name(self) -> str:
        return "results.json" if self.dtype == "float32" else f"results-{self.dtype}.json"

    @property
    def config_name(self) -> str:
        return "config.json" if self.dtype == "float32" else f"config-{self.dtype}.json"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise UsageError(f"--dtype {self.dtype}: expected float32 or bfloat16")
        if (
            min(self.batch_sizes) < 1
            or min(self.max_new_tokens, self.num_threads, self.repeats) < 1
        ):
            raise ValueError("batch sizes, max_new_tokens, num_threads and repeats must be >= 1")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")


def task_prompts(num: int, seed: int, task: str = "builtin") -> list[str]:
    if task != "builtin":  # reasoning-gym problems of this seed (the questions)
        from tltrun.data.dataset import DataSpec, load_rows

        rows = load_rows(DataSpec(path=task, prompt_key="question", num_rows=num, seed=seed)).rows
        return [row.prompt for row in rows]
    from tltrun.train.tasks import TaskConfig, make_examples

    return [ex.prompt for ex in make_examples(TaskConfig(), random.Random(seed), num)]


def stage_target(cfg: BenchSpecConfig, out: Path) -> None:
    from tltrun.model.tokenizer import CharTokenizer
    from tltrun.train.sft import build_model, data_pairs, save_checkpoint, train
    from tltrun.train.sft_config import SFTConfig
    from tltrun.train.tasks import TaskConfig

    sft = SFTConfig(
        out=str(out),
        seed=cfg.seed,
        num_steps=cfg.sft_steps,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        lr=cfg.sft_lr,
        batch_tokens=cfg.sft_batch_tokens,
        warmup_steps=min(30, cfg.sft_steps // 5),
        data=None if cfg.task == "builtin" else cfg.task,
        response_key="answer",
    )
    tok, task = CharTokenizer(), TaskConfig()
    pairs = None
    max_tokens = None
    if sft.data is not None:  # the same problems tltrun train --data <task> --seed S draws
        pairs = data_pairs(sft, seed=cfg.seed, num_rows=sft.data_num_rows)
        max_tokens = 2 + max(len(p) + len(r) for p, r in pairs) + cfg.train_max_new_tokens
    model = build_model(sft, task, tok, cfg.seed, max_tokens)
    log, _ = train(sft, task, model, tok, random.Random(cfg.seed + 1), pairs=pairs)
    save_checkpoint(model, tok, out)
    write_json(out / "sft_log.json", {"sft": asdict(sft), "log": log})


def run_cli(argv: list[str]) -> None:
    from tltrun.cli.main import main

    if main(argv) != 0:
        raise SystemExit(f"tltrun {argv[0]} failed")


def stage_drafter_data(cfg: BenchSpecConfig, work: Path) -> None:
    if (work / "gen" / "generations.jsonl").is_file():  # a killed earlier run: continue it
        run_cli(["generate", "--out", str(work / "gen"), "--resume"])
        return
    prompts = task_prompts(cfg.num_train_prompts, cfg.seed + 2, cfg.task)
    path = work / "train_prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"t{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts))
    )
    run_cli(
        [
            "generate",
            "--model",
            str(work / "target"),
            "--prompts",
            str(path),
            "--out",
            str(work / "gen"),
            "--max-new-tokens",
            str(cfg.train_max_new_tokens),
            "--max-running-requests",
            "64",
            "--max-model-len",
            str(max(len(p) for p in prompts) + 1 + cfg.train_max_new_tokens),  # + BOS
            "--temperature",
            "0",
            "--seed",
            str(cfg.seed),
        ]
    )


def stage_drafter(cfg: BenchSpecConfig, work: Path) -> None:
    from tltrun.train.resumable import STATE_FILE

    if (work / "drafter" / STATE_FILE).is_file():  # a killed earlier run: continue it
        run_cli(["train-drafter", "--out", str(work / "drafter"), "--resume"])
        return
    run_cli(
        [
            "train-drafter",
            "--model",
            str(work / "target"),
            "--data",
            str(work / "gen" / "generations.jsonl"),
            "--out",
            str(work / "drafter"),
            "--train-num-steps",
            str(cfg.drafter_steps),
            "--train-lr",
            str(cfg.drafter_lr),
            "--train-batch-size",
            str(cfg.drafter_batch_size),
            "--train-seed",
            str(cfg.seed),
        ]
    )


def measure(cfg: BenchSpecConfig, work: Path) -> dict:
    from tltrun.model.drafter import load_drafter
    from tltrun.model.hf_checkpoint import load_hf
    from tltrun.model.tokenizer import CharTokenizer
    from tltrun.rollout.measured_trace import hardware_name

    target = load_hf(work / "target")
    drafter = load_drafter(work / "drafter", target)
    tok = CharTokenizer.load(work / "target")
    prompts = task_prompts(max(cfg.batch_sizes), cfg.seed + 3, cfg.task)
    held_out = [tok.encode(p, add_bos=True) for p in prompts]
    rows = [measure_batch(cfg, target, drafter, held_out[:batch]) for batch in cfg.batch_sizes]
    # a batch with no SD strategy measured (all over --max-strategy-tokens) says nothing
    stops = next(
        (r["batch"] for r in rows if r["best"] != "off" and r["runs"][r["best"]]["speedup"] < 1.0),
        None,
    )
    return {
        "hardware": hardware_name("cpu"),
        "temperature": cfg.temperature,
        "dtype": cfg.dtype,
        "rows": rows,
        "sd_stops_paying_at_batch": stops,
    }


def measure_batch(cfg: BenchSpecConfig, target, drafter, prompts: list[list[int]]) -> dict:
    """All strategies on one batch, ``repeats`` interleaved rounds; each strategy keeps its
    fastest round (the machine is shared: the minimum is the least disturbed measurement)."""
    from tltrun.rollout.engine import RolloutEngine
    from tltrun.rollout.engine_config import EngineConfig
    from tltrun.rollout.interface import Request, SamplingParams
    from tltrun.rollout.measured_trace import rollout_summary
    from tltsim.policy import NoSpec, SpecDecision, StaticSpec

    batch = len(prompts)
    reqs = [
        Request(f"b{i}", tuple(p), cfg.max_new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    max_len = max(len(p) for p in prompts) + cfg.max_new_tokens
    sampling = SamplingParams(temperature=cfg.temperature)
    engine = RolloutEngine(
        target, drafter, EngineConfig(batch, max_len, sampling, seed=cfg.seed, dtype=cfg.dtype)
    )
    engine.generate(reqs[:1], StaticSpec(2, 1, 2))  # warm-up: first-call allocations
    names = ["off"] + [
        n
        for n in cfg.strategies
        if batch * (SpecDecision.parse(n).verify_tokens + 1) <= cfg.max_strategy_tokens
    ]
    runs: dict[str, dict] = {}
    plain = None
    for _ in range(cfg.repeats):
        for name in names:
            d = SpecDecision.parse(name)
            policy = StaticSpec(d.draft_steps, d.topk, d.verify_tokens) if d.enabled else NoSpec()
            result = engine.generate(reqs, policy)
            outputs = [o.output_token_ids for o in result.outputs]
            plain = plain or outputs
            same = sum(o == p for o, p in zip(outputs, plain, strict=True)) / batch
            if cfg.temperature == 0 and same < 1:  # sampled runs draw differently
                if cfg.dtype == "float32":
                    raise SystemExit(
                        f"batch {batch} {name}: SD output differs from plain greedy (lossless check failed)"
                    )
                # bf16: a verify forward (T tokens per row) rounds differently from a decode
                # forward (one), so a near-tie of the top two logits may flip: SD is lossless
                # w.r.t. the logits it verifies with, not bit-equal to bf16 decoding (the
                # lossless tests run in fp32). Reported, not fatal.
                print(f"  batch {batch:>3} {name:>7}: {same:.0%} of greedy outputs equal plain bf16 "
                      "decoding (bf16 rounding differs between verify and decode forwards)")  # fmt: skip
            s = rollout_summary(result)
            if name not in runs or s["decode_tokens_per_s"] > runs[name]["decode_tokens_per_s"]:
                keys = ("decode_tokens_per_s", "mean_accept_len", "decode_s", "drafter_prefill_s")
                runs[name] = {k: s[k] for k in keys} | {"greedy_equal_fraction": same}
            print(
                f"  batch {batch:>3} {name:>7}: {s['decode_tokens_per_s']:8.1f} tokens/s, accept {s['mean_accept_len']:.2f}",
                flush=True,
            )
    base = runs["off"]["decode_tokens_per_s"]
    for run in runs.values():
        run["speedup"] = run["decode_tokens_per_s"] / base
    best = max((n for n in runs if n != "off"), key=lambda n: runs[n]["speedup"], default="off")
    return {"batch": batch, "runs": runs, "best": best}


# The settings the target, generations and drafter stages are built from: a work dir's models
# are reused only under the same ones (a rerun with another --seed measured the old models while
# config.json recorded the new seed).
MODEL_FIELDS = (
    "seed", "task", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
    "intermediate_size", "sft_steps", "sft_batch_tokens", "sft_lr", "num_train_prompts",
    "train_max_new_tokens", "drafter_steps", "drafter_lr", "drafter_batch_size",
)  # fmt: skip
MODEL_STAGES_FILE = "model_stages.json"


def run_model_stages(cfg: BenchSpecConfig, work: Path, label: str = "stage") -> None:
    """Build (or resume) the target, generations and drafter in ``work``; a stage whose
    finished run's last file is there is kept, if ``work`` was built with ``cfg``'s
    MODEL_FIELDS (UsageError otherwise: another --work-dir, or delete it)."""
    work.mkdir(parents=True, exist_ok=True)
    wanted = {k: getattr(cfg, k) for k in MODEL_FIELDS}
    recorded_path = work / MODEL_STAGES_FILE
    if recorded_path.is_file():
        recorded = json.loads(recorded_path.read_text())
        changed = sorted(k for k in wanted if recorded.get(k) != json.loads(json.dumps(wanted[k])))
        if changed:
            raise UsageError(
                f"--work-dir {work}: its models were built with other settings ("
                + ", ".join(f"{k} {recorded.get(k)!r} -> {wanted[k]!r}" for k in changed)
                + "); use another --work-dir, or delete it to rebuild them"
            )
    # (none recorded: a fresh work dir, or one given a target built elsewhere, as seeds.sh's
    # SFT_ARGS runs tltrun sft into it first; that target is kept)
    write_json(recorded_path, wanted)
    stages = (  # (stage, the file its finished run writes last, how to run it)
        ("target", "config.json", lambda: stage_target(cfg, work / "target")),
        ("gen", "trace.json", lambda: stage_drafter_data(cfg, work)),
        ("drafter", "config.json", lambda: stage_drafter(cfg, work)),
    )
    for name, done_file, run in stages:
        if not (work / name / done_file).is_file():
            start = time.perf_counter()
            print(f"{label} {name} ...", flush=True)
            run()
            print(f"{label} {name}: {time.perf_counter() - start:.0f} s", flush=True)


def results_table(res: dict, strategies: tuple[str, ...]) -> str:
    rows = []
    for r in res["rows"]:
        row = {
            "batch": r["batch"],
            "nospec": r["runs"]["off"]["decode_tokens_per_s"],
            "best": r["best"] if r["best"] != "off" else "not measured",
            "speedup": r["runs"][r["best"]]["speedup"] if r["best"] != "off" else None,
        }
        for s in strategies:
            run = r["runs"].get(s)
            row[s] = f"{run['mean_accept_len']:.2f}/{run['speedup']:.2f}x" if run else None
        rows.append(row)
    columns = {"batch": "batch", "nospec": "nospec tok/s", **{s: s for s in strategies}}
    columns.update(best="best", speedup="speedup")
    table = format_table(rows, columns, {"nospec": ".1f", "speedup": "{:.2f}x"})
    lines = ["per strategy: accept length / speedup", table]
    stop = res["sd_stops_paying_at_batch"]
    lines.append(
        f"SD stops paying at batch {stop}" if stop else "SD pays at every measured batch size"
    )
    unmeasured = [r["batch"] for r in res["rows"] if r["best"] == "off"]
    if unmeasured:
        lines.append(
            f"batch {', '.join(map(str, unmeasured))}: no strategy within --max-strategy-tokens"
        )
    lines.append(f"hardware: {res['hardware']}; temperature {res['temperature']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dataclass_args(parser, BenchSpecConfig)
    try:
        cfg = dataclass_from_args(BenchSpecConfig, parser.parse_args(argv))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(cfg.num_threads)
    work = Path(cfg.work_dir)
    try:
        run_model_stages(cfg, work)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # the earlier results go before the new config is written: a measurement that stops
    # (the lossless check, Ctrl-C) left them beside it, and seeds.sh reused them as this one's
    (work / cfg.results_name).unlink(missing_ok=True)
    write_json(work / cfg.config_name, asdict(cfg))
    res = measure(cfg, work)
    (work / cfg.results_name).write_text(json.dumps(res, indent=2) + "\n")
    print(results_table(res, cfg.strategies))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
