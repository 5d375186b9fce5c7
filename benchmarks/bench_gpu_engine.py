"""GPU benchmark of the torch rollout engine (issue #18): bf16, flex attention by sequence length
and TLT's bucketed CUDA-graph pool, on random-weight models of Qwen2.5-0.5B / 1.5B / 7B shape
(``tltsim.cost.specs.MODEL_PRESETS``, built here: no download).

What it measures, each in the same run:

* ``copy``: device-to-device copy bandwidth (bytes read + written / time): the HBM roofline's
  bandwidth, measured rather than taken from a datasheet.
Each eager-vs-graphs figure is the median of ``--repeats`` (3) timings with the two engines
alternating, the ratio's min-max printed beside it.

* ``decode``: tokens/s of the engine's own decode iteration (``RolloutEngine.step`` with SD off:
  policy call, forward, sampling, bookkeeping) at each batch and context, eager vs graphs; at
  batch 1 also the fraction of the HBM roofline, (weight bytes + KV bytes read per token) /
  copy bandwidth. Issue targets: 7B, batch 1, 1k context >= 80% of the roofline; graphs >= 2x
  eager at batch 1 for the 0.5B shape.
* ``where``: the batch-1 decode step of the roofline target's cell (largest shape, first
  context) under ``torch.profiler``, graphs and eager (and graphs at batch 64, above TLT's SD
  threshold, where attention's batch costs show): the device's busy time vs the step's wall
  time (the rest: the device waiting for the host), busy time by kernel kind (GEMM, attention,
  other), the GEMMs' weight read rate, and the costliest kernels by name.
* ``sd``: one SD iteration (``StaticSpec``: chain 4_1_4, tree 8_4_32) per batch bucket up to
  TLT's threshold, eager vs graphs (graphs: the EAGLE drafting step and the verify forward,
  ``tltrun.rollout.draft_graphs`` and ``tltrun.rollout.graphs``).
* ``pool``: CUDA memory of the graphs TLTAdaptive's default plan captures into one pool, vs one
  pool per strategy with every strategy at every SD bucket (the naive way), vs a single
  strategy's graphs. Issue target: bucketed <= 1.5x a single strategy.
* ``hf``: the same weights through ``transformers``' ``generate()`` at batch 1 and 16 (greedy,
  decode tokens/s = tokens past the first / time past the first): the reference a user has.

Run (H100/H200, one call of under 10 minutes with ``--quick``):
    python benchmarks/bench_gpu_engine.py --quick [--out_dir results/bench_gpu_engine]
Without CUDA it says so and exits 0; ``--device cpu --smoke`` runs every section on a tiny
model on the CPU (graphs run eagerly there, no pool memory): a check of the script, not numbers.
Writes OUT_DIR/config.json and OUT_DIR/bench_gpu_engine.json and prints the tables.

Beside it in benchmarks/: ``gpu_engine_models.py`` (the models, the roofline's byte counts, copy
bandwidth), ``gpu_engine_timing.py`` (settings, engines per cell, alternating timings, the time
budget), ``gpu_engine_where.py`` (the profiled ``where`` section).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from tltrun.model import attention, transformer
from tltrun.model.drafter import EagleDrafter
from tltrun.rollout.draft_graphs import draft_sources
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.graphs import CapturePlan, GraphPool, batch_buckets, capture_plan
from tltrun.rollout.static_decode import decode_sources
from tltsim.cli.table import format_table
from tltsim.policy import SpecDecision, StaticSpec, TLTAdaptive

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
from gpu_engine_models import (  # noqa: E402
    bench_hf,
    build_model,
    copy_bandwidth,
    fits,
    kv_bytes_per_token,
    sync,
    weight_bytes_per_token,
)
from gpu_engine_timing import (  # noqa: E402
    MODES,
    SKIPPED,
    TARGET_MODES,
    BenchConfig,
    Budget,
    failure,
    make_engine,
    ratio_spread,
    release,
    time_cell,
    time_forward,
)
from gpu_engine_where import bench_where  # noqa: E402


def parse_config(argv: list[str] | None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --smoke)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="0.5B and 7B shapes, batches 1/16/256, fewer iterations: one 10-minute call",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model, tiny sizes: checks the script")
    p.add_argument(
        "--targets",
        action="store_true",
        help="only the cells the issue's targets rest on (batch 1, 1k context; the pool "
        "without its naive row), sections decode,pool unless --sections: one run of several "
        "(benchmarks/gpu_targets.py takes their medians)",
    )
    p.add_argument("--out_dir", default=BenchConfig.out_dir, help="where the JSON goes")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, caches and sampling")
    p.add_argument("--repeats", type=int, default=None,
                   help="timings per engine, eager and graphs alternating (default 3; 1 with "
                   "--smoke)")  # fmt: skip
    p.add_argument(
        "--attn-impl",
        default=None,
        # ref and triton attention have no graph capture (EngineConfig refuses cuda_graphs
        # with them): every graphs cell would fail
        choices=("sdpa", "flex"),
        help="engine attention (default: the engine's, flex on CUDA)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=BenchConfig.budget_s,
        help="skip what remains after this many seconds (the JSON is still written)",
    )
    p.add_argument(
        "--sections",
        default=None,
        help="comma-separated sections to run, in this order, of "
        + ", ".join(BenchConfig.sections)
        + " (default: all; decode,pool with --targets)",
    )
    a = p.parse_args(argv)  # fmt: skip
    if a.sections is None:
        a.sections = "decode,pool" if a.targets else ",".join(BenchConfig.sections)
    sections = tuple(x.strip() for x in a.sections.split(",") if x.strip())
    unknown = sorted(set(sections) - set(BenchConfig.sections))
    if unknown or not sections or len(set(sections)) < len(sections):
        p.error(f"--sections: unknown {unknown or 'name, repeated or empty list'}; known: "
                f"{', '.join(BenchConfig.sections)}")  # fmt: skip
    if a.repeats is not None and a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    repeats = a.repeats if a.repeats is not None else 1 if a.smoke else BenchConfig.repeats
    base = dict(device=a.device, seed=a.seed, out_dir=a.out_dir, attn_impl=a.attn_impl,
                budget_s=a.budget_s, repeats=repeats, sections=sections,
                is_targets_only=a.targets)  # fmt: skip
    if a.smoke:
        return BenchConfig(**base, shapes=("tiny",), batches=(1,) if a.targets else (1, 4),
                           contexts=(32,),
                           sd_shapes=("tiny",), sd_strategies=("2_1_2", "3_2_4"), sd_context=32,
                           pool_shape="tiny", hf_batches=(1, 2), hf_context=16, hf_new_tokens=4,
                           warmup_iters=1, timed_iters=2, is_smoke=True)  # fmt: skip
    if a.targets:
        return BenchConfig(**base, shapes=("Qwen2.5-0.5B", "Qwen2.5-7B"), batches=(1,),
                           contexts=(1024,), warmup_iters=3, timed_iters=10)  # fmt: skip
    if a.quick:
        return BenchConfig(**base, shapes=("Qwen2.5-0.5B", "Qwen2.5-7B"), batches=(1, 16, 256),
                           sd_shapes=("Qwen2.5-0.5B",), warmup_iters=3, timed_iters=10,
                           hf_new_tokens=32)  # fmt: skip
    return BenchConfig(**base)


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


# each section's part of the budget (of what is left when it starts): decode holds the issue's
# roofline and graph targets, so it gets the most; the pool section captures one model's graphs
SECTION_SHARES = {"decode": 0.42, "where": 0.06, "sd": 0.24, "pool": 0.11, "hf": 0.17}


def bench_decode(
    cfg: BenchConfig, device, dtype, bandwidth: float, budget: Budget, rows: list[dict]
) -> list[dict]:
    """Decode cells in priority order: every shape at the first context and batch before any
    larger one, so a run cut short by its budget has measured what the targets rest on (batch 1
    at 1k context) rather than one shape's whole grid. The shapes' models stay resident.
    ``rows`` gets each cell as it is measured (an interrupted run keeps them)."""
    models = {shape: build_model(shape, device, dtype, cfg.seed) for shape in cfg.shapes}
    for context in cfg.contexts:
        for batch in cfg.batches:
            for shape, model in models.items():
                row = {"shape": shape, "context": context, "batch": batch}
                if budget.is_over:
                    rows.append({**row, "note": SKIPPED})
                    continue
                logits_bytes = 4 * batch * model.config.vocab_size * 4
                # the eager and the graphs engine are alive together: two KV caches
                if not fits(model, batch, 2 * (context + 64), 2 * logits_bytes, device):
                    rows.append({**row, "note": "KV cache does not fit"})
                    continue
                is_target = batch == 1 and context == cfg.contexts[0]
                if cfg.is_targets_only:  # the roofline target's shape alone
                    is_target = is_target and shape == cfg.shapes[-1]
                try:
                    seconds, forward_s = time_cell(
                        partial(make_engine, model, None, batch, context, cfg=cfg), None, cfg,
                        device, partial(time_forward, batch=batch, cfg=cfg),
                        MODES + TARGET_MODES if is_target else MODES,
                    )  # fmt: skip
                except Exception as e:  # noqa: BLE001 -- one cell's failure is its row's note
                    rows.append({**row, "note": failure(e)})
                    continue
                for mode, samples in seconds.items():
                    row[f"{mode}_tokens_per_s"] = batch / statistics.median(samples)
                row["step_ms"] = 1e3 * statistics.median(seconds["graphs"])
                if forward_s is not None:
                    row["forward_ms"] = 1e3 * forward_s
                row["graph_speedup"], row["graph_speedup_range"] = ratio_spread(
                    seconds["eager"], seconds["graphs"]
                )
                for mode, *_ in TARGET_MODES:
                    if mode in seconds:
                        row[f"{mode}_speedup"], row[f"{mode}_speedup_range"] = ratio_spread(
                            seconds["graphs"], seconds[mode]
                        )
                if "compiled" in seconds and transformer.compile_failure is not None:
                    row["note"] = f"compiled ran eagerly: {transformer.compile_failure}"
                if batch == 1:
                    weight_bytes = weight_bytes_per_token(model)
                    kv_token = kv_bytes_per_token(model.config, dtype)
                    roofline = bandwidth / (weight_bytes + context * kv_token)
                    row["roofline_tokens_per_s"] = roofline
                    row["roofline_fraction"] = row["graphs_tokens_per_s"] / roofline
                    for mode, *_ in TARGET_MODES:
                        if f"{mode}_tokens_per_s" in row:
                            row[f"{mode}_roofline_fraction"] = (
                                row[f"{mode}_tokens_per_s"] / roofline
                            )
                    if "forward_ms" in row:  # the graph alone: the engine step's host work out
                        row["forward_roofline_fraction"] = 1e3 / row["forward_ms"] / roofline
                rows.append(row)
    rows.sort(key=lambda r: (cfg.shapes.index(r["shape"]), r["context"], r["batch"]))
    del models
    release(device)
    return rows


def bench_sd(cfg: BenchConfig, device, dtype, budget: Budget, rows: list[dict]) -> list[dict]:
    threshold = TLTAdaptive().config.threshold
    for shape in cfg.sd_shapes:
        model = build_model(shape, device, dtype, cfg.seed)
        drafter = EagleDrafter.for_target(model, seed=cfg.seed)
        buckets = [b for b in batch_buckets(threshold) if not (cfg.is_smoke and b > 2)]
        # the ends of the range first, then the middle: a run cut short by its budget still
        # spans it; every strategy at a batch before the next batch
        order = sorted(buckets, key=lambda b: (b not in (buckets[0], buckets[-1]), b))
        for batch in order:
            for strategy in cfg.sd_strategies:
                decision = SpecDecision.parse(strategy)
                row = {"shape": shape, "strategy": strategy, "batch": batch}
                if budget.is_over:
                    rows.append({**row, "note": SKIPPED})
                    continue
                policy = StaticSpec(strategy=strategy)
                try:
                    make = partial(make_engine, model, drafter, batch, cfg.sd_context, cfg=cfg,
                                   max_verify_tokens=decision.verify_tokens, policy=policy)  # fmt: skip
                    seconds, _ = time_cell(make, policy, cfg, device)
                except Exception as e:  # noqa: BLE001 -- one cell's failure is its row's note
                    rows.append({**row, "note": failure(e)})
                    continue
                for mode, samples in seconds.items():
                    row[f"{mode}_ms"] = 1e3 * statistics.median(samples)
                row["graph_speedup"], row["graph_speedup_range"] = ratio_spread(
                    seconds["eager"], seconds["graphs"]
                )
                rows.append(row)
        del model, drafter
        release(device)
    rows.sort(key=lambda r: (r["shape"], cfg.sd_strategies.index(r["strategy"]), r["batch"]))
    return rows


def bench_pool(cfg: BenchConfig, device, dtype, budget: Budget, rows: list[dict]) -> list[dict]:
    """Pool memory of TLTAdaptive's default plan at 256 requests (bucketed, one pool) vs one
    pool per strategy, each at every SD bucket (naive), vs one strategy's graphs."""
    if device.type != "cuda":
        return [{"pool": "all", "note": "needs CUDA (nothing is captured on CPU)"}]
    if budget.is_over:
        return [{"pool": "all", "note": SKIPPED}]
    policy = TLTAdaptive()
    model = build_model(cfg.pool_shape, device, dtype, cfg.seed)
    max_batch = 256
    plan = capture_plan(policy, max_batch, is_drafting=True)  # SD graphs: drafting + verify
    sd_buckets = sorted({b for b, _ in plan.spec_graphs})
    strategies = policy.config.strategies

    def every_bucket(strategy: str) -> CapturePlan:
        graphs = tuple((b, strategy) for b in sd_buckets)
        return CapturePlan(spec_graphs=graphs, draft_graphs=graphs)

    drafter = EagleDrafter.for_target(model, seed=cfg.seed)
    cache_engine = RolloutEngine(model, drafter, EngineConfig(
        max_running_requests=max_batch, max_model_len=cfg.sd_context, device=cfg.device,
        attn_impl=cfg.attn_impl, cuda_graphs=False, max_verify_tokens=64))  # fmt: skip
    cache = cache_engine.cache
    impl = cache_engine.config.attention
    drafting = draft_sources(cache_engine)
    decoding = decode_sources(cache_engine)  # the engine's pools: whole decode and verify steps

    def measure(plans: list[CapturePlan]) -> tuple[int, int]:
        release(device)
        before = torch.cuda.memory_reserved(device)
        pools = [
            GraphPool(model, cache, p, impl, True, drafting=drafting, decoding=decoding)
            for p in plans
        ]
        sync(device)
        used = torch.cuda.memory_reserved(device) - before
        num = sum(p.plan.num_graphs for p in pools)
        del pools
        return used, num

    decode = CapturePlan(decode_buckets=plan.decode_buckets)
    single_name = f"single strategy ({strategies[0]})"
    # the target (bucketed vs single) first, measured as a pair once begun: a budget
    # cut spares it (a 60 s H200 call of session 21 ended inside the pair, nothing printed)
    pools = (
        ("bucketed (TLT plan, one pool)", [plan]),
        (single_name, [dataclasses.replace(
            every_bucket(strategies[0]), decode_buckets=plan.decode_buckets)]),
        ("naive (a pool per strategy, every bucket)", [decode] + [every_bucket(s) for s in strategies]),
    )  # fmt: skip
    for name, plans in pools[:2] if cfg.is_targets_only else pools:
        is_pair_begun = name == single_name and "memory_gib" in rows[0]
        if budget.is_over and not is_pair_begun:
            rows.append({"pool": name, "note": SKIPPED})
            continue
        used, num = measure(plans)
        rows.append({"pool": name, "num_graphs": num, "memory_gib": used / 2**30})
    single = next(r for r in rows if r["pool"] == single_name).get("memory_gib")
    for row in rows:
        if single and "memory_gib" in row:
            row["vs_single"] = row["memory_gib"] / single
    return rows


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def target_mode_columns() -> dict[str, str]:
    """The decode table's columns of each mode timed beside graphs (``TARGET_MODES``)."""
    columns = {}
    for mode, *_ in TARGET_MODES:
        label = mode.replace("_", "+")
        columns |= {f"{mode}_tokens_per_s": f"{label} tok/s", f"{mode}_speedup": f"{label}/graphs",
                    f"{mode}_speedup_range": "range",
                    f"{mode}_roofline_fraction": f"{label} of roofline"}  # fmt: skip
    return columns


def target_mode_formats() -> dict[str, str]:
    formats = {}
    for mode, *_ in TARGET_MODES:
        formats |= {f"{mode}_tokens_per_s": ",.0f", f"{mode}_speedup": "{:.2f}x",
                    f"{mode}_roofline_fraction": ".0%"}  # fmt: skip
    return formats


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_engine needs a CUDA GPU (bf16 engine, CUDA graphs); none is available "
              "here, so nothing was measured (--device cpu --smoke checks the script).")  # fmt: skip
        return 0
    if device.type != "cuda" and not cfg.is_smoke:
        print("bench_gpu_engine: on a CPU only --smoke runs (a check of the script, not numbers)")
        return 0
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_properties(device).name if device.type == "cuda" else "cpu"
    started = time.perf_counter()
    budget = Budget(cfg.budget_s)
    bandwidth = copy_bandwidth(device, (1 << 31) if device.type == "cuda" else (1 << 24))
    print(f"device: {name}; copy bandwidth {bandwidth / 1e9:,.0f} GB/s (read + write)")
    result = {"device": name, "copy_bytes_per_s": bandwidth, "dtype": str(dtype)}
    sections = (
        ("decode", lambda b, rows: bench_decode(cfg, device, dtype, bandwidth, b, rows),
         {"shape": "shape", "context": "context", "batch": "batch", "eager_tokens_per_s": "eager tok/s",
          "graphs_tokens_per_s": "graphs tok/s", "graph_speedup": "graphs/eager",
          "graph_speedup_range": "range", "roofline_fraction": "of roofline", "step_ms": "step ms", "forward_ms": "graph ms",
          "forward_roofline_fraction": "graph of roofline", **target_mode_columns(),
          "note": "note"},
         {"eager_tokens_per_s": ",.0f", "graphs_tokens_per_s": ",.0f", "graph_speedup": "{:.2f}x",
          "roofline_fraction": ".0%", "step_ms": ".2f", "forward_ms": ".2f",
          "forward_roofline_fraction": ".0%", **target_mode_formats()}),
        ("where", lambda b, rows: bench_where(cfg, device, dtype, bandwidth, b, rows),
         {"shape": "shape", "context": "context", "batch": "batch", "mode": "mode",
          "step_ms": "step ms", "busy_ms": "device busy ms", "host_wait_ms": "waits for host ms",
          "kernels_per_step": "kernels", "gemm_ms": "GEMM ms", "attention_ms": "attention ms",
          "other_ms": "other ms", "gemm_gb_per_s": "GEMM weights GB/s",
          "gemm_of_bandwidth": "of copy bw", "note": "note"},
         {"step_ms": ".2f", "busy_ms": ".2f", "host_wait_ms": ".2f", "kernels_per_step": ".0f",
          "gemm_ms": ".2f", "attention_ms": ".2f", "other_ms": ".2f",
          "gemm_gb_per_s": ",.0f", "gemm_of_bandwidth": ".0%"}),
        ("sd", lambda b, rows: bench_sd(cfg, device, dtype, b, rows),
         {"shape": "shape", "strategy": "strategy", "batch": "batch", "eager_ms": "eager ms",
          "graphs_ms": "graphs ms", "graph_speedup": "graphs/eager",
          "graph_speedup_range": "range", "note": "note"},
         {"eager_ms": ".2f", "graphs_ms": ".2f", "graph_speedup": "{:.2f}x"}),
        ("pool", lambda b, rows: bench_pool(cfg, device, dtype, b, rows),
         {"pool": "pool", "num_graphs": "graphs", "memory_gib": "GiB", "vs_single": "vs single",
          "note": "note"},
         {"memory_gib": ".3f", "vs_single": "{:.2f}x"}),
        ("hf", lambda b, rows: bench_hf(cfg, device, dtype, b, rows),
         {"shape": "shape", "batch": "batch", "context": "context",
          "tokens_per_s": "transformers generate tok/s", "note": "note"},
         {"tokens_per_s": ",.0f"}),
    )  # fmt: skip
    # in the order asked: a budget cut spares the first
    by_key = {x[0]: x for x in sections}
    sections = tuple(by_key[key] for key in cfg.sections)
    shares_left = sum(SECTION_SHARES[x[0]] for x in sections)
    is_interrupted = False
    for key, run, columns, formats in sections:
        t0 = time.perf_counter()
        rows: list[dict] = []  # filled as cells finish: an interrupted section keeps them
        if is_interrupted:
            rows = [{"note": "skipped: interrupted"}]
        else:
            try:
                rows = run(budget.share(SECTION_SHARES[key] / shares_left), rows)
            except Exception as e:  # noqa: BLE001 -- the sections after it still run
                rows = [*rows, {"note": failure(e)}]
                release(device)
            except KeyboardInterrupt:  # gpu_session.sh's time limit (SIGINT, then SIGKILL
                # 15 s later): what was measured is written, the rest marked, exit 1
                rows = [*rows, {"note": "error: interrupted (the step's time limit)"}]
                is_interrupted = True
        shares_left -= SECTION_SHARES[key]
        result[key] = rows
        print(f"\n{key} ({time.perf_counter() - t0:.0f} s)")
        print(format_table(rows, columns, formats, left=("shape", "pool", "strategy", "note")))
    # shapes whose compiled flex_attention failed and ran the dense masked SDPA instead
    result["flex_fallbacks"] = [
        {"shape": list(map(str, k)), "reason": why} for k, why in attention.flex_fallbacks.items()
    ]
    if result["flex_fallbacks"]:
        print(f"\nflex_attention fell back to dense SDPA for {len(result['flex_fallbacks'])} "
              "shapes (listed in the JSON)")  # fmt: skip
    result["wall_s"] = time.perf_counter() - started
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    (out_dir / "bench_gpu_engine.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out_dir / 'bench_gpu_engine.json'} ({result['wall_s']:.0f} s in all)")
    # a run whose cells failed is not a good run (gpu_session.sh judges a step by its exit
    # code: session 13's SD and pool sections all failed at capture, and it said "ended well")
    failed = [
        row for rows in result.values() if isinstance(rows, list)
        for row in rows if isinstance(row, dict) and str(row.get("note", "")).startswith("error: ")
    ]  # fmt: skip
    if failed:
        print(f"failed cells: {len(failed)} (their notes above and in the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
