"""The ``where`` section of ``benchmarks/bench_gpu_engine.py`` (issue #18): the batch-1 decode
step of the roofline target's cell under ``torch.profiler``, graphs, compiled layers and eager:
the device's busy time against the step's wall time (the rest is the device waiting for the
host), busy time by kernel kind (GEMM, attention, other), the GEMMs' weight read rate against
the measured copy bandwidth, and the costliest kernels by name. It says why a step misses the
HBM roofline: launch-bound (host waits), GEMMs below bandwidth, or attention.

Not run directly; tests: ``python -m pytest tests/test_graphs.py -k gpu_benchmark -q``.
"""

from __future__ import annotations

import re
import time

import gpu_engine_timing as timing
from gpu_engine_models import build_model, weight_bytes_per_token

from tltrun.rollout.engine import RolloutEngine

# device kernel names by what they compute, attention first (fused attention kernels may carry
# "cutlass" or "gemm" in their names): flex, flash or Triton attention; cuBLAS / CUTLASS GEMMs and
# GEMVs (cuBLAS's Hopper kernels are named nvjet_*, seen on an H200 with torch 2.11+cu130;
# aten::linear / mm on a CPU); everything else (norms, rotary, activations, sampling,
# copies) is "other". An unrecognised name lands in "other": the costliest are listed by name.
KERNEL_KINDS = (
    ("attention", re.compile(r"flex|attention|attn|fmha|flash|sdpa", re.I)),
    (
        "gemm",
        re.compile(
            r"gemm|gemv|cutlass|xmma|cublas|nvjet|matmul|splitk|linear|addmm|aten::b?mm$"
            r"|_mm(_|$)",
            re.I,
        ),
    ),
)


TOP_KERNELS = 12  # the costliest kernels a where row lists by name
# the batch of the extra graphs row: a decode batch above TLT's default SD threshold (32), where
# the rollout spends its first, busiest iterations; batch 1 alone hides attention's batch costs
# (session 23: 7B at batch 256 took 56 ms a step, 8x batch 1's, ~2.3x weights and KV read once)
LARGE_BATCH = 64


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def profile_steps(engine: RolloutEngine, steps: int, device) -> dict:
    """``steps`` engine steps under ``torch.profiler``: per step the wall time (inflated by the
    profiler a little), the device's busy time (the kernels' durations summed: one stream, so
    they do not overlap), and each kernel name's time and count. On CUDA the kernels are the
    device's (a graph replay's kernels are traced one by one); on a CPU, the top-level aten ops
    stand in for them (a check of the script). The gap between wall and busy is the time the
    device waited for the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    is_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        engine.sync()
        wall_s = (time.perf_counter() - start) / steps
    if is_cuda:
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
    busy_ms = sum(map(sum, by_name.values())) / steps
    kernels = sorted(
        ({"name": n, "kind": kernel_kind(n), "ms_per_step": sum(t) / steps,
          "per_step": len(t) / steps} for n, t in by_name.items()),
        key=lambda k: -k["ms_per_step"],
    )  # fmt: skip
    return {"step_ms": 1e3 * wall_s, "busy_ms": busy_ms, "kernels": kernels,
            "kernels_per_step": len(events) / steps}  # fmt: skip


def bench_where(
    cfg: timing.BenchConfig,
    device,
    dtype,
    bandwidth: float,
    budget: timing.Budget,
    rows: list[dict],
) -> list[dict]:
    """Where the batch-1 decode step's time goes (the roofline target's cell: the largest
    shape, the first context), eager, graphs, compiled layers, and compiled layers with fused
    projections, then graphs at the largest decode batch up to ``LARGE_BATCH``: device busy vs
    waiting for the host, and the busy time by kernel kind (GEMM, attention, other) with the
    costliest kernels. ``rows`` gets each row as it is measured (an interrupted run keeps
    them)."""
    shape, context = cfg.shapes[-1], cfg.contexts[0]
    large = max(b for b in (1, *cfg.batches) if b <= LARGE_BATCH)
    if budget.is_over:
        return [{"shape": shape, "note": timing.SKIPPED}]
    model = build_model(shape, device, dtype, cfg.seed)
    weight_bytes = weight_bytes_per_token(model)
    try:
        modes = [(m, 1) for m in (timing.MODES[1], timing.COMPILED, timing.COMPILED_FUSED)]
        modes += [(timing.MODES[0], 1)] + ([(timing.MODES[1], large)] if large > 1 else [])
        for (mode, is_graphs, is_compiled, is_fused), batch in modes:
            row = {"shape": shape, "context": context, "batch": batch, "mode": mode}
            if budget.is_over:
                rows.append({**row, "note": timing.SKIPPED})
                continue
            try:
                engine, probe = timing.make_engine(
                    model,
                    None,
                    batch,
                    context,
                    is_graphs,
                    cfg,
                    compile_layers=is_compiled,
                    fuse_projections=is_fused,
                )
                timing.warm_up(engine, probe, None, cfg)
                prof = profile_steps(engine, cfg.timed_iters, device)
            except Exception as e:  # noqa: BLE001 -- one mode's failure is its row's note
                rows.append({**row, "note": timing.failure(e)})
                continue
            finally:
                engine = probe = None
                timing.release(device)
            kinds = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
            for k in prof["kernels"]:
                kinds[k["kind"]] += k["ms_per_step"]
            row |= {
                "step_ms": prof["step_ms"],
                "busy_ms": prof["busy_ms"],
                "host_wait_ms": max(0.0, prof["step_ms"] - prof["busy_ms"]),
                "kernels_per_step": prof["kernels_per_step"],
                **{f"{kind}_ms": ms for kind, ms in kinds.items()},
                "top_kernels": prof["kernels"][:TOP_KERNELS],
            }
            if prof["kernels_per_step"] == 0:  # CUPTI off, or graph replays not traced
                row["note"] = "the profiler recorded no device kernels"
            if device.type == "cuda" and kinds["gemm"] > 0:  # the weights' read rate
                row["gemm_gb_per_s"] = weight_bytes / (kinds["gemm"] / 1e3) / 1e9
                row["gemm_of_bandwidth"] = row["gemm_gb_per_s"] * 1e9 / bandwidth
            rows.append(row)
    finally:
        del model
        timing.release(device)
    print("costliest kernels per decode step (ms, launches, kind, name):")
    for row in rows:
        for k in row.get("top_kernels", ()):
            label = f"{row['mode']} b{row['batch']}"
            print(f"  {label:>18}  {k['ms_per_step']:8.3f} ms  x{k['per_step']:<5.0f} "
                  f"{k['kind']:<9}  {k['name'][:90]}")  # fmt: skip
    return rows
