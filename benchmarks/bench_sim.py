"""Simulator speed: responses simulated per second, fast vs exact mode, per policy.

    .venv/bin/python benchmarks/bench_sim.py                       # the issue's benchmark
    .venv/bin/python benchmarks/bench_sim.py --steps 100 --exact-steps 1 --out /tmp/b.json

Replays a synthetic trace (``tltsim.trace.synth``: 1,000 steps x 64 prompts x 8 samples = 512
responses per step, 32,768-token cap, long-tail defaults) on 64 H100 GPUs, TP 1, Qwen2.5-7B,
under NoSpec, StaticSpec and TLTAdaptive (with spot drafter training). Fast mode runs the whole
trace; exact mode (one SimPy event per decode iteration) runs the first ``--exact-steps`` steps
and its time for the whole trace is extrapolated linearly (marked as such). Both wall and CPU
time (``time.process_time``, this process only) are reported: on a shared machine CPU time is
the fairer measure of one core's work. Targets (issues #2, #3): >= 1,000,000 responses per
minute in fast mode for NoSpec; TLTAdaptive at most 3x NoSpec's simulation time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

from tltsim.cli.table import format_table
from tltsim.sim.config import SimConfig
from tltsim.sim.replay import RunSettings, run_settings
from tltsim.trace.schema import Trace
from tltsim.trace.synth import GenConfig, generate

POLICIES = ("nospec", "static", "tlt")


def timed(settings: RunSettings, trace: Trace) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run_settings(settings, trace)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = trace.num_responses
    return {
        "steps": trace.num_steps,
        "responses": n,
        "wall_s": wall,
        "cpu_s": cpu,
        "responses_per_s_cpu": n / cpu,
        "responses_per_min_cpu": 60 * n / cpu,
        "responses_per_s_wall": n / wall,
        "mean_step_s_simulated": result.summary()["mean_step_s"],
    }


TABLE_COLUMNS = {
    "policy": "policy",
    "wall_s": "fast wall s",
    "cpu_s": "fast CPU s",
    "responses_per_s_cpu": "resp/s (CPU)",
    "responses_per_min_cpu": "resp/min (CPU)",
    "vs_nospec": "vs nospec",
    "exact_full_cpu_s": "exact CPU s (full, extrap.)",
    "fast_over_exact": "fast/exact",
}
TABLE_FORMATS = {
    "wall_s": ".1f",
    "cpu_s": ".1f",
    "responses_per_s_cpu": ",.0f",
    "responses_per_min_cpu": ",.0f",
    "vs_nospec": "{:.2f}x",
    "exact_full_cpu_s": ",.0f",
    "fast_over_exact": "{:.0f}x",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000, help="RL steps of the synthetic trace")
    parser.add_argument(
        "--exact-steps",
        type=int,
        default=2,
        help="steps replayed in exact mode (then extrapolated)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("results/bench_sim.json"), help="JSON output"
    )
    args = parser.parse_args()

    gen = GenConfig(
        num_steps=args.steps, prompts_per_step=64, group_size=8, max_response_tokens=32768, seed=0
    )
    started = time.perf_counter()
    trace = generate(gen)
    print(
        f"trace: {trace.num_steps} steps x {trace.steps[0].num_responses} responses, generated in {time.perf_counter() - started:.1f} s"
    )
    sliced = Trace(trace.meta, trace.steps[: args.exact_steps])
    sim = SimConfig(model="Qwen2.5-7B", hardware="H100-SXM", num_gpus=64, tp=1, seed=0)
    rows = []
    for policy in POLICIES:
        fast = timed(RunSettings(sim=sim, policy=policy), trace)
        fast_slice = timed(RunSettings(sim=sim, policy=policy), sliced)
        exact = timed(RunSettings(sim=dataclasses.replace(sim, exact=True), policy=policy), sliced)
        scale = trace.num_steps / sliced.num_steps
        rows.append(
            {
                "policy": policy,
                "fast": fast,
                "fast_on_slice": fast_slice,
                "exact_on_slice": exact,
                "exact_full_cpu_s_extrapolated": exact["cpu_s"] * scale,
                "fast_over_exact_speed": exact["cpu_s"] / fast_slice["cpu_s"],
                "exact_vs_fast_mean_step_rel_diff_on_slice": exact["mean_step_s_simulated"]
                / fast_slice["mean_step_s_simulated"]
                - 1,
            }
        )
        print(
            f"  {policy}: fast {fast['cpu_s']:.1f} s CPU, exact slice {exact['cpu_s']:.1f} s CPU",
            flush=True,
        )
    base = rows[0]["fast"]["cpu_s"]
    table = [
        {
            "policy": row["policy"],
            **row["fast"],
            "vs_nospec": row["fast"]["cpu_s"] / base,
            "exact_full_cpu_s": row["exact_full_cpu_s_extrapolated"],
            "fast_over_exact": row["fast_over_exact_speed"],
        }
        for row in rows
    ]
    print("\n" + format_table(table, TABLE_COLUMNS, TABLE_FORMATS, left=("policy",)))
    print(
        f"\nexact mode ran the first {sliced.num_steps} of {trace.num_steps} steps; its full-trace time is extrapolated x{trace.num_steps / sliced.num_steps:g}."
    )
    print(
        "fast/exact = exact CPU time / fast CPU time on that same slice; 'vs nospec' = fast CPU time / NoSpec's."
    )
    for row in rows:
        print(
            f"  {row['policy']}: exact vs fast mean step time on the slice: {100 * row['exact_vs_fast_mean_step_rel_diff_on_slice']:+.2f}%"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {
            "gen": dataclasses.asdict(gen),
            "sim": dataclasses.asdict(sim),
            "exact_steps": sliced.num_steps,
        },
        "machine": platform.platform(),
        "python": platform.python_version(),
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
