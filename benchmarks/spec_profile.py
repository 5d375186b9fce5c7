"""What ``benchmarks/bench_spec.py``'s measurements tell ``benchmarks/bench_train.py``: TLT's
threshold (the batch size where SD stops paying, ``crossover_batch``) and, with
``--tlt-buckets spec``, the SD strategy of each batch bucket (``profile_buckets``), both read
from bench_spec's ``results.json`` (per measured batch size, each strategy's decode speedup
over NoSpec). TLT sets both from the engine's own profile in the same way (arXiv 2511.16665,
the adaptive rollout engine), so a run's policy follows what this machine measured.

Not run directly; tests: ``python -m pytest tests/test_bench_train_threshold.py -q``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tltsim.errors import UsageError


def crossover_batch(spec_results: dict) -> int:
    """The largest batch size at which SD still pays, from bench_spec's rows (per batch size,
    the speedup of each strategy): between the last measured batch whose best speedup is >= 1
    and the next one, where it is < 1, the speedup is interpolated linearly in log2(batch) and
    the crossing rounded down. E.g. 1.58x at batch 4 and 0.91x at 16 cross at batch 13."""
    points = []
    for row in sorted(spec_results["rows"], key=lambda r: r["batch"]):
        sd = [v["speedup"] for k, v in row["runs"].items() if k != "off"]
        if sd:  # a batch where no strategy fit --max-strategy-tokens measured no SD (crashed)
            points.append((row["batch"], max(sd)))
    if not points:
        raise UsageError("bench_spec results: no SD strategy was measured")
    for (b0, s0), (b1, s1) in zip(points, points[1:], strict=False):
        if s0 >= 1 > s1:
            x0, x1 = math.log2(b0), math.log2(b1)
            return int(2 ** (x0 + (s0 - 1) / (s0 - s1) * (x1 - x0)))
    return points[-1][0] if points[-1][1] >= 1 else 1


def profile_buckets(spec_results: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(strategies, bucket starts) from bench_spec's rows: each measured batch size, in order,
    is served by the SD strategy measured fastest at it, from that batch size on (the first
    from batch 1); neighbours with the same strategy merge. E.g. 4_1_4 fastest at 1 and 4 and
    2_1_2 at 8 give (4_1_4, 2_1_2) with starts (1, 8). TLT's buckets need one verify-token
    count each, so a strategy that is fastest again after another one is a UsageError."""
    strategies: list[str] = []
    starts: list[int] = []
    for row in sorted(spec_results["rows"], key=lambda r: r["batch"]):
        runs = {k: v["speedup"] for k, v in row["runs"].items() if k != "off"}
        if not runs:
            continue
        best = max(runs, key=runs.__getitem__)
        if strategies and best == strategies[-1]:
            continue
        if best in strategies:
            raise UsageError(
                f"bench_spec results: {best} is fastest at batch {row['batch']} after "
                f"{strategies[-1]} was fastest at a smaller batch; --tlt-buckets spec needs one "
                "strategy per batch range (use --tlt-buckets fastrl)"
            )
        strategies.append(best)
        starts.append(1 if not starts else row["batch"])
    if not strategies:
        raise UsageError("bench_spec results: no SD strategy was measured")
    return tuple(strategies), tuple(starts)


def read_spec_results(
    path: Path, instead: str, temperature: float | None = None, dtype: str | None = None
) -> dict:
    """bench_spec's results.json; a UsageError naming the file and the flag to pass instead.
    With the runs' sampling ``temperature``: a warning on stderr where the results were
    measured at another one (greedy drafts are accepted more often than sampled ones, so a
    greedy profile overstates where SD pays for sampled rollouts). With the runs' rollout
    ``dtype``: the same where the profile ran in another (on this CPU a batch-8 verify is
    compute-bound in fp32 and not in bf16: the crossover and the fastest strategies move)."""
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UsageError(
            f"{path}: cannot read bench_spec results ({err}); run benchmarks/bench_spec.py or "
            f"pass {instead}"
        ) from None
    measured = results.get("temperature") if isinstance(results, dict) else None
    if temperature is not None and measured != temperature:
        print(
            f"warning: {path} was measured at temperature {measured}, the runs sample at "
            f"{temperature}: its crossover and buckets describe other acceptance "
            "(bench_spec.py --temperature)",
            file=sys.stderr,
        )
    measured_dtype = results.get("dtype", "float32") if isinstance(results, dict) else None
    if dtype is not None and measured_dtype != dtype:
        print(
            f"warning: {path} was measured in {measured_dtype}, the runs roll out in {dtype}: "
            "its crossover and buckets describe another engine (bench_spec.py --dtype)",
            file=sys.stderr,
        )
    return results
