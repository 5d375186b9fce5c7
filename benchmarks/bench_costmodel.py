"""Calibrated GPU cost model vs published step latencies: fit error, held-out error, SD vs batch.

    .venv/bin/python benchmarks/bench_costmodel.py [--out results/bench_costmodel.json]

For each calibrated GPU (``tltsim.cost.calibrated.CALIBRATIONS``) the calibration is refitted
to the published points marked ``fit`` (``tltsim.cost.published``: where every number comes
from) and compared, point by point, with (1) the points it was fitted on (fit error) and (2)
the points held out before fitting (held-out error: SpecDecode-Bench's batches 8 and 32 and
7-token verifies, and two SGLang batch-1 measurements, Llama-2-7B and Llama-3.1-8B: another
engine and source). The roofline's
error on the same points is shown beside. The issue's target: held-out iteration-time error
<= 10% median, <= 25% max. Then SD speedup vs batch 1..128 (expected accept length x plain
decode seconds / SD iteration seconds at DEFAULT_ACCEPT_RATE, 2,048 tokens of context per
sequence) for chain 4 and trees 8_4_{16,32,48,64}, under the roofline and the calibrated model,
and the batch where SD stops paying (``crossover_batch``). Needs scipy (the ``fit`` extra).

Caveat printed with the table: SpecDecode-Bench's points are their published linear fit
evaluated, not raw measurements, so the in-source held-out error measures how well our
physics form reproduces their fitted form; only the two SGLang points are independent.
The only published SD-vs-batch numbers found (EAGLE-3 in SGLang, Llama-3.1-8B on H100: 2.36x at
batch 1, 1.38x at batch 64) come without the strategy and accept length used at batch 64, so
only their ratio is compared with each simulated strategy's; no published batch where SD stops
paying was found.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from tltsim.cli.table import format_table
from tltsim.cost.calibrate import errors_on, fit_published
from tltsim.cost.calibrated import CALIBRATIONS, CalibratedCost
from tltsim.cost.published import SD_SPEEDUPS, as_profile_rows, published_points
from tltsim.cost.roofline import RooflineCost
from tltsim.cost.specs import get_hardware, get_model
from tltsim.policy import SpecDecision
from tltsim.sim.acceptance import DEFAULT_ACCEPT_RATE, expected_accept_len

STRATEGIES = ("4_1_4", "8_4_16", "8_4_32", "8_4_48", "8_4_64")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXT_PER_SEQ = 2048
SD_MODELS = ("Llama-3.1-8B", "Qwen2.5-7B")
TARGET_MEDIAN, TARGET_MAX = 0.10, 0.25


def point_rows(hardware_name: str, params) -> tuple[list[dict], dict]:
    """Per published point: published, roofline and calibrated ms, and the errors."""
    hardware = get_hardware(hardware_name)
    rows, errs = [], {"fit": [], "held_out": [], "roofline_fit": [], "roofline_held_out": []}
    for p in published_points():
        if p.hardware != hardware_name:
            continue
        cal = CalibratedCost(p.model, hardware, params=params)
        roof = RooflineCost(p.model, hardware)
        t = p.tokens_per_seq
        cal_s = cal.decode_iter_s(p.batch, p.context_tokens, t)
        roof_s = roof.decode_iter_s(p.batch, p.context_tokens, t)
        err = float(errors_on(as_profile_rows([p]), p.model, hardware, 1, params)[0])
        errs[p.use].append(err)
        errs[f"roofline_{p.use}"].append(roof_s / p.seconds - 1)
        rows.append(
            {
                "use": p.use,
                "engine": p.engine,
                "model": p.model.name,
                "batch": p.batch,
                "context_per_seq": p.context_tokens // p.batch,
                "tokens_per_seq": t,
                "published_ms": 1e3 * p.seconds,
                "roofline_ms": 1e3 * roof_s,
                "calibrated_ms": 1e3 * cal_s,
                "roofline_err": f"{100 * (roof_s / p.seconds - 1):+.1f}%",
                "calibrated_err": f"{100 * (cal_s / p.seconds - 1):+.2f}%",
            }
        )
    return rows, errs


def summary_of(errs: dict) -> list[dict]:
    out = []
    for key in ("fit", "held_out", "roofline_fit", "roofline_held_out"):
        e = np.abs(np.array(errs[key]))
        if len(e):
            out.append(
                {
                    "set": key,
                    "num_points": len(e),
                    "median_abs_error": float(np.median(e)),
                    "max_abs_error": float(np.max(e)),
                }
            )
    return out


def sd_rows(hardware_name: str, params) -> tuple[list[dict], list[dict]]:
    """SD speedup vs batch per strategy and model, and the batch where SD stops paying."""
    hardware = get_hardware(hardware_name)
    rows, stops = [], []
    for model_name in SD_MODELS:
        model = get_model(model_name)
        costs = {
            "roofline": RooflineCost(model, hardware),
            "calibrated": CalibratedCost(model, hardware, params=params),
        }
        for strategy in STRATEGIES:
            decision = SpecDecision.parse(strategy)
            accept = expected_accept_len(decision, DEFAULT_ACCEPT_RATE)
            for name, cost in costs.items():
                row = {"model": model_name, "strategy": strategy, "cost": name, "accept": accept}
                for b in BATCHES:
                    c = b * CONTEXT_PER_SEQ
                    row[f"b{b}"] = (
                        accept * cost.decode_iter_s(b, c, 1) / cost.sd_iter_s(b, c, decision)
                    )
                rows.append(row)
                stop = cost.crossover_batch(decision, accept, CONTEXT_PER_SEQ, max_batch=4096)
                stops.append(
                    {
                        "model": model_name,
                        "strategy": strategy,
                        "cost": name,
                        "stops_paying_at": stop,
                    }
                )
    return rows, stops


def sd_validation(sd: list[dict]) -> list[dict]:
    """Published EAGLE-3-in-SGLang speedups at batch 1 and 64 (Llama-3.1-8B, H100) as a ratio,
    beside the same ratio of each simulated strategy (Llama-3.1-8B rows of ``sd``)."""
    published = {p.batch: p.speedup for p in SD_SPEEDUPS if p.model == "Llama-3.1-8B"}
    rows = [
        {
            "what": "published EAGLE-3, SGLang (b1 2.36x, b64 1.38x)",
            "ratio_64_over_1": published[64] / published[1],
        }
    ]
    for row in sd:
        if row["model"] == "Llama-3.1-8B":
            rows.append(
                {
                    "what": f"{row['cost']} {row['strategy']}",
                    "ratio_64_over_1": row["b64"] / row["b1"],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("results/bench_costmodel.json"), help="JSON output"
    )
    args = parser.parse_args(argv)
    report = {"presets": {}}
    for hardware_name in CALIBRATIONS:
        fit = fit_published()
        params = fit.params
        print(f"== {hardware_name}: refitted to {len(fit.rows)} published points ({params.source})")
        print(
            "fitted: "
            + ", ".join(f"{f}={getattr(params, f):.4g}" for f in fit.fitted)
            + f"; held: step_overhead_s={params.step_overhead_s:.4g}, gemm_half_tokens={params.gemm_half_tokens:g}"
        )
        rows, errs = point_rows(hardware_name, params)
        print(
            format_table(
                rows,
                list(rows[0]),
                {"published_ms": ".3f", "roofline_ms": ".3f", "calibrated_ms": ".3f"},
                left=("use", "engine", "model"),
            )
        )
        summary = summary_of(errs)
        print(
            format_table(
                summary,
                list(summary[0]),
                {"median_abs_error": ".2%", "max_abs_error": ".2%"},
                left=("set",),
            )
        )
        held = next(s for s in summary if s["set"] == "held_out")
        meets = held["median_abs_error"] <= TARGET_MEDIAN and held["max_abs_error"] <= TARGET_MAX
        print(
            f"held-out target (median <= {TARGET_MEDIAN:.0%}, max <= {TARGET_MAX:.0%}): "
            f"{'met' if meets else 'NOT met'}. Caveat: the SpecDecode-Bench points are their "
            "published linear fit evaluated, not raw measurements; only the two SGLang points are independent measurements."
        )
        sd, stops = sd_rows(hardware_name, params)
        print(
            f"SD speedup vs batch (accept rate {DEFAULT_ACCEPT_RATE}, {CONTEXT_PER_SEQ} context tokens per sequence):"
        )
        print(format_table(sd, list(sd[0]), {"accept": ".2f"}, left=("model", "strategy", "cost")))
        print("batch where SD stops paying (None: pays up to 4096):")
        print(format_table(stops, list(stops[0]), left=("model", "strategy", "cost")))
        validation = sd_validation(sd)
        print(
            "published SD speedups (validation only; strategy and accept length at batch 64 not "
            "published, so compare the shape: speedup at 64 / speedup at 1):"
        )
        print(
            format_table(
                validation, list(validation[0]), {"ratio_64_over_1": ".3f"}, left=("what",)
            )
        )
        report["presets"][hardware_name] = {
            "params": {f: getattr(params, f) for f in params.__dataclass_fields__},
            "shipped_params": {
                f: getattr(CALIBRATIONS[hardware_name], f) for f in params.__dataclass_fields__
            },
            "points": rows,
            "errors": summary,
            "meets_target": meets,
            "sd_speedup": sd,
            "sd_stops_paying": stops,
            "sd_validation": validation,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
