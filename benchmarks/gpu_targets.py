"""Issue #18's targets as medians of independent runs of ``bench_gpu_engine.py --targets``.

The project's standard: a figure a target rests on is the median of >= 3 independent runs,
quoted with its spread. ``benchmarks/gpu_session.sh targets OUT`` runs the benchmark's target
cells once per seed, each in a fresh process (fresh random weights, caches, allocator and
compile caches), into OUT/targets/seed_N; this script reads those runs and prints, per figure,
the median, the min-max and the number of runs, against the issue's target:

* decode at batch 1, 1k context, largest shape (7B): fraction of the HBM roofline measured in
  the same run (graphs; compiled layers; fused projections; both), target >= 80%;
* CUDA graphs over eager at batch 1, smallest shape (0.5B), target >= 2x;
* the bucketed graph pool's memory over a single strategy's graphs, target <= 1.5x.

    python benchmarks/gpu_targets.py OUT/targets/seed_* [--out OUT/targets.json]

A figure with fewer than 3 runs is printed with "n < 3" and never called met.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

MIN_RUNS = 3  # the standard's minimum for a figure a target rests on


@dataclass(frozen=True, kw_only=True)
class Figure:
    name: str
    section: str  # the benchmark JSON's section
    shape_index: int | None  # which of the run's shapes (config.json "shapes"); None: the pool
    key: str  # the row's field
    target: float | None  # None: reported beside a target, not one itself
    is_at_least: bool  # the target is a floor (else a ceiling)
    unit: str  # "%" (a fraction printed as percent), "x" or "tok/s"


ROOFLINE = 0.80  # issue #18: 7B, batch 1, 1k context >= 80% of the HBM roofline


def _decode(name: str, key: str, target: float | None, unit: str, shape_index: int = -1):
    """A figure of the decode section's batch-1 cell (``shape_index`` of the run's shapes)."""
    return Figure(name=name, section="decode", shape_index=shape_index, key=key, target=target,
                  is_at_least=True, unit=unit)  # fmt: skip


FIGURES = (
    *(
        _decode(f"decode of roofline, {label}", f"{mode}roofline_fraction", ROOFLINE, "%")
        for label, mode in (("graphs", ""), ("compiled layers", "compiled_"),
                            ("fused projections", "fused_"), ("compiled + fused", "compiled_fused_"))
    ),  # fmt: skip
    _decode("decode tok/s, graphs", "graphs_tokens_per_s", None, "tok/s"),
    _decode("decode tok/s, compiled + fused", "compiled_fused_tokens_per_s", None, "tok/s"),
    _decode("graph ms of a decode step (the graph alone)", "forward_ms", None, "ms"),
    _decode("graphs over eager, batch 1", "graph_speedup", 2.0, "x", shape_index=0),
    Figure(name="bucketed pool over a single strategy", section="pool", shape_index=None,
           key="vs_single", target=1.5, is_at_least=False, unit="x"),
)  # fmt: skip


class RunError(ValueError):
    """A run directory without a readable benchmark result."""


def load_run(run_dir: Path) -> tuple[dict, dict]:
    """(config.json, bench_gpu_engine.json) of one run."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
        result = json.loads((run_dir / "bench_gpu_engine.json").read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"{run_dir}: no readable benchmark result ({e})") from None
    if not config.get("is_targets_only"):
        raise RunError(f"{run_dir}: not a --targets run (config.json is_targets_only)")
    return config, result


def value_of(figure: Figure, config: dict, result: dict) -> tuple[float | None, str | None]:
    """(The figure's value in one run, why it has none): None where the run has no such cell
    (skipped, failed) or measured another path than the figure names: flex_attention fell back
    to dense SDPA (the run's ``flex_fallbacks``), compiled layers ran eagerly (the row's note)."""
    rows = result.get(figure.section) or []
    if figure.shape_index is None:
        rows = [r for r in rows if str(r.get("pool", "")).startswith("bucketed")]
    else:
        if result.get("flex_fallbacks"):
            return None, "flex_attention fell back to dense SDPA (flex_fallbacks)"
        shape = config["shapes"][figure.shape_index]
        context = config["contexts"][0]
        rows = [
            r for r in rows
            if r.get("shape") == shape and r.get("batch") == 1 and r.get("context") == context
        ]  # fmt: skip
    if figure.key.startswith("compiled") and any(
        str(r.get("note", "")).startswith("compiled ran eagerly") for r in rows
    ):
        return None, "compiled layers ran eagerly (the row's note)"
    values = [r[figure.key] for r in rows if isinstance(r.get(figure.key), (int, float))]
    return (float(values[0]), None) if values else (None, None)


def summarise(runs: list[tuple[str, dict, dict]]) -> list[dict]:
    rows = []
    for figure in FIGURES:
        found = {name: value_of(figure, cfg, res) for name, cfg, res in runs}
        values = {name: value for name, (value, _) in found.items()}
        excluded = {name: why for name, (_, why) in found.items() if why is not None}
        got = sorted(v for v in values.values() if v is not None)
        shape = None
        if figure.shape_index is not None and runs:
            shape = runs[0][1]["shapes"][figure.shape_index]
        row = {"figure": figure.name, "shape": shape or runs[0][1]["pool_shape"],
               "unit": figure.unit, "num_runs": len(got), "values": values,
               "excluded": excluded}  # fmt: skip
        if got:
            row |= {"median": statistics.median(got), "min": got[0], "max": got[-1]}
        if figure.target is not None:
            row["target"] = ("<= " if not figure.is_at_least else ">= ") + fmt(
                figure.target, figure.unit
            )
            if len(got) < MIN_RUNS:
                row["verdict"] = f"n < {MIN_RUNS}: not a result"
            else:
                median = row["median"]
                is_met = median >= figure.target if figure.is_at_least else median <= figure.target
                row["verdict"] = "met" if is_met else "NOT met"
        rows.append(row)
    return rows


def fmt(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value:.1%}"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "ms":
        return f"{value:.2f} ms"
    return f"{value:,.0f} {unit}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (OUT/targets/seed_N)")
    p.add_argument("--out", type=Path, default=None, help="JSON of the summary")
    a = p.parse_args(argv)
    runs, problems = [], []
    for run_dir in a.runs:
        try:
            runs.append((run_dir.name, *load_run(run_dir)))
        except RunError as e:
            problems.append(str(e))
    for problem in problems:
        print(f"skipped: {problem}", file=sys.stderr)
    if not runs:
        print("gpu_targets: no readable --targets run among the directories given", file=sys.stderr)
        return 1
    devices = sorted({res.get("device", "?") for _, _, res in runs})
    rows = summarise(runs)
    print(f"issue #18 targets over {len(runs)} runs ({', '.join(n for n, _, _ in runs)}) on "
          f"{', '.join(devices)}: median [min-max] (runs)")  # fmt: skip
    for row in rows:
        spread = "-"
        if row["num_runs"]:
            spread = (f"{fmt(row['median'], row['unit'])} [{fmt(row['min'], row['unit'])}-"
                      f"{fmt(row['max'], row['unit'])}] ({row['num_runs']})")  # fmt: skip
        target = f"  target {row['target']}: {row['verdict']}" if "target" in row else ""
        print(f"  {row['shape']:<13} {row['figure']:<44} {spread}{target}")
        for name, why in row["excluded"].items():  # measured, but not on the path named
            print(f"  {'':<13} {'':<44} {name} left out: {why}")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        summary = {"devices": devices, "runs": [n for n, _, _ in runs], "figures": rows,
                   "skipped": problems}  # fmt: skip
        a.out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
