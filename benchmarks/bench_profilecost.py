"""ProfileCost against the roofline it was generated from: interpolation error and call speed.

    .venv/bin/python benchmarks/bench_profilecost.py [--out results/bench_profilecost.json]

For each model x GPU preset, a noiseless profile is generated from ``RooflineCost`` on the
default ``ProfileGrid`` (``tltsim.cost.measured.profile_from_cost``) and ``ProfileCost`` is asked
for random off-grid points: "interior" ones (every coordinate away from an axis' first and last
grid segment, where the scheme rebuilds memory/compute kinks) and "anywhere" ones (the whole
measured range, where a kink in an edge segment is bridged by a chord). It prints the max and
median relative error per op, then microseconds per call of ``decode_span_s`` (1,000
iterations) and ``decode_iter_s`` for both cost models, and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
import warnings
from pathlib import Path

import numpy as np

from tltsim.cli.table import format_table
from tltsim.cost.measured import ProfileCost, profile_from_cost
from tltsim.cost.profile import Profile, ProfileGrid, grid_points
from tltsim.cost.roofline import RooflineCost
from tltsim.cost.specs import get_hardware, get_model
from tltsim.policy import SpecDecision

PRESETS = [
    ("Qwen2.5-7B", "H100-SXM", 1),
    ("Qwen2.5-0.5B", "A100-80GB", 1),
    ("Qwen2.5-32B", "H200", 2),
    ("Llama-3.1-70B", "H100-SXM", 4),
    ("Qwen2.5-7B", "L40S", 1),
]
NUM_POINTS = 400
# Batch sizes of the speed loop (fixed, so that both cost models see the same calls).
BATCHES = [int(x) for x in np.random.default_rng(2).integers(1, 257, 64)]


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))


def _contexts(grid: ProfileGrid, batch: int, batches: tuple[int, ...]) -> list[int]:
    """Context-per-sequence knots measured at both batches bracketing ``batch``."""
    hi = batches[min(bisect.bisect_left(batches, batch), len(batches) - 1)]
    return [c for c in grid.context_per_seq if c * hi <= grid.max_context_tokens]


def errors(
    rc: RooflineCost, cost: ProfileCost, grid: ProfileGrid, is_interior: bool, seed: int
) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    edge = 1 if is_interior else 0
    out: dict[str, list[float]] = {
        "decode/verify": [],
        "drafter": [],
        "sd_iter": [],
        "prefill": [],
        "sd_switch": [],
    }

    def add(name: str, got: float, want: float) -> None:
        out[name].append(abs(got / want - 1))

    decisions = [SpecDecision.parse(s) for s in ("4_1_4", "8_4_16", "8_4_48")]
    for _ in range(NUM_POINTS):
        b = int(round(_log_uniform(rng, grid.batches[edge], grid.batches[-1 - edge])))
        ctx = _contexts(grid, b, grid.batches)
        c = b * _log_uniform(rng, ctx[edge], ctx[-1 - edge])
        for t in (1, 2, 4, 9, 13, 33, 49):
            add("decode/verify", cost.decode_iter_s(b, c, t), rc.decode_iter_s(b, c, t))
        for k in (1, 3, 4, 8):
            add("drafter", cost.drafter_iter_s(b, c, k), rc.drafter_iter_s(b, c, k))
        d = decisions[int(rng.integers(len(decisions)))]
        add("sd_iter", cost.sd_iter_s(b, c, d), rc.sd_iter_s(b, c, d))
        bp = int(
            round(_log_uniform(rng, grid.prefill_batches[edge], grid.prefill_batches[-1 - edge]))
        )
        tp = int(
            round(
                _log_uniform(
                    rng, grid.prefill_tokens_per_seq[edge], grid.prefill_tokens_per_seq[-1 - edge]
                )
            )
        )
        add("prefill", cost.prefill_s(bp * tp, 0.0, bp), rc.prefill_s(bp * tp, 0.0, bp))
        ctx = _contexts(grid, bp, grid.prefill_batches)
        cs = bp * _log_uniform(rng, ctx[edge], ctx[-1 - edge])
        add("sd_switch", cost.sd_switch_s(bp, cs), rc.sd_switch_s(bp, cs))
    return out


def per_call_us(fn, num_calls: int = 2000) -> float:
    start = time.perf_counter()
    for i in range(num_calls):
        fn(i)
    return (time.perf_counter() - start) / num_calls * 1e6


ERROR_COLUMNS = {
    "preset": "preset",
    "op": "op",
    "interior_max_pct": "interior max",
    "interior_median_pct": "median",
    "anywhere_max_pct": "anywhere max",
    "anywhere_median_pct": "median",
}
SPEED_COLUMNS = {
    "preset": "preset",
    "roofline_decode_span_us": "decode_span roofline",
    "profile_decode_span_us": "profile",
    "roofline_decode_iter_us": "decode_iter roofline",
    "profile_decode_iter_us": "profile",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench_profilecost.json"))
    args = parser.parse_args()
    grid = ProfileGrid()
    results = []
    error_rows, speed_rows = [], []
    for model, hw, tp in PRESETS:
        rc = RooflineCost(get_model(model), get_hardware(hw), tp=tp)
        cost = ProfileCost(
            Profile(tuple(profile_from_cost(grid_points(grid), rc)), {}, "roofline"),
            is_warned=False,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inner, anywhere = errors(rc, cost, grid, True, 0), errors(rc, cost, grid, False, 1)
        name = f"{model} {hw} tp{tp}"
        row = {"preset": name, "ops": {}}
        for op in inner:
            stats = [
                100 * max(inner[op]),
                100 * float(np.median(inner[op])),
                100 * max(anywhere[op]),
                100 * float(np.median(anywhere[op])),
            ]
            row["ops"][op] = dict(
                zip(
                    (
                        "interior_max_pct",
                        "interior_median_pct",
                        "anywhere_max_pct",
                        "anywhere_median_pct",
                    ),
                    stats,
                    strict=True,
                )
            )
            error_rows.append({"preset": name, "op": op, **row["ops"][op]})
        speed = {}
        for label, model_cost in (("roofline", rc), ("profile", cost)):
            speed[f"{label}_decode_span_us"] = per_call_us(
                lambda i, m=model_cost: m.decode_span_s(
                    BATCHES[i % 64], BATCHES[i % 64] * 900.0, 1000
                )
            )
            speed[f"{label}_decode_iter_us"] = per_call_us(
                lambda i, m=model_cost: m.decode_iter_s(
                    BATCHES[i % 64], BATCHES[i % 64] * 900.0 + i
                )
            )
        row["speed"] = speed
        speed_rows.append({"preset": name, **speed})
        results.append(row)
    print("profile interpolation error vs the roofline it was built from (%):")
    print(format_table(error_rows, ERROR_COLUMNS, left=("preset", "op")))
    print("\nspeed (microseconds per call):")
    print(format_table(speed_rows, SPEED_COLUMNS, left=("preset",), float_format=".1f"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "config": {"grid": grid.__dict__, "num_points": NUM_POINTS, "presets": PRESETS},
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
