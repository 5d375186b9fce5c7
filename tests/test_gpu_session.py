"""benchmarks/gpu_session.sh, the prepared device calls of a lent GPU session (issues #18, #21):
its CPU smoke mode runs every step on a tiny model and writes what a device call brings back.

Run: .venv/bin/python -m pytest tests/test_gpu_session.py -q
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_session.sh"


def run(stage: str, out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), stage, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def files_back(out: Path) -> list[Path]:
    """What a device call returns: at most 8 files, at most two folders below OUT."""
    found = [p for p in out.rglob("*") if p.is_file()]
    assert all(len(p.relative_to(out).parts) <= 3 for p in found), found
    return found


def test_engine_stage_runs_the_cuda_tests_and_the_engine_benchmark(tmp_path):
    out = tmp_path / "engine"
    result = run("engine", out, SMOKE="1")
    assert result.returncode == 0, result.stdout + result.stderr
    steps = (out / "steps.txt").read_text()
    assert "pytest_gpu: exit 0" in steps and "bench_gpu_engine: exit 0" in steps
    # the CUDA tests were collected (skipped without CUDA, each with its reason), not missed
    summary = (out / "pytest_gpu.log").read_text().strip().splitlines()[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", summary)}
    # only the gpu-marked tests ran (pytest-xdist, used where installed, omits "deselected")
    assert 0 < counts.get("skipped", 0) + counts.get("passed", 0) <= 20, summary
    assert "failed" not in summary and "error" not in summary, summary
    assert (out / "gpu_engine" / "bench_gpu_engine.json").is_file()
    assert len(files_back(out)) <= 8


def test_profile_stage_writes_a_profile_tltsim_reads(tmp_path):
    from tltsim.cost.profile import load_profile

    out = tmp_path / "profile"
    result = run("profile", out, SMOKE="1")
    assert result.returncode == 0, result.stdout + result.stderr
    table = pd.read_csv(out / "profile_tiny.csv")
    assert {"decode", "verify", "drafter", "prefill", "train"} <= set(table["op"])
    profile = load_profile(out / "profile_tiny.csv")  # its sidecar too: raises if unreadable
    assert len(profile.rows) == len(table) and profile.meta["config"]["device"] == "cpu"
    assert len(files_back(out)) <= 8


def test_stage_all_runs_every_step_in_one_call_and_packs_what_comes_back(tmp_path):
    import tarfile

    out = tmp_path / "all"
    result = run("all", out, SMOKE="1", TOTAL_S="400")
    assert result.returncode == 0, result.stdout + result.stderr
    steps = (out / "steps.txt").read_text()
    for name in ("pytest_gpu", "bench_gpu_engine", "checkpoint", "profile", "bench_kernels"):
        assert f"{name}: exit 0" in steps, steps
    assert "packed the logs" in steps
    # what a device call brings back: steps.txt, the profile and one archive of the rest
    assert sorted(p.name for p in files_back(out)) == [
        "profile_tiny.csv", "profile_tiny.json", "results.tgz", "steps.txt"
    ]  # fmt: skip
    with tarfile.open(out / "results.tgz") as tar:
        names = tar.getnames()
    assert "./gpu_engine/bench_gpu_engine.json" in names and "./pytest_gpu.log" in names
    assert "=== bench_gpu_engine" in result.stdout  # the tables, on standard output


def test_stage_targets_runs_the_target_cells_per_seed_and_takes_their_medians(tmp_path):
    import json
    import tarfile

    out = tmp_path / "targets"
    result = run("targets", out, SMOKE="1", TOTAL_S="300")
    assert result.returncode == 0, result.stdout + result.stderr
    steps = (out / "steps.txt").read_text()
    for name in ("targets_seed_0", "targets_seed_1", "targets_seed_2", "targets_summary",
                 "pytest_recipe"):  # fmt: skip
        assert f"{name}: exit 0" in steps, steps
    assert sorted(p.name for p in files_back(out)) == ["results.tgz", "steps.txt", "targets.json"]
    summary = json.loads((out / "targets.json").read_text())
    assert summary["runs"] == ["seed_0", "seed_1", "seed_2"]
    figures = {f["figure"]: f for f in summary["figures"]}
    graphs = figures["graphs over eager, batch 1"]
    assert graphs["num_runs"] == 3 and graphs["verdict"] in ("met", "NOT met")
    assert graphs["min"] <= graphs["median"] <= graphs["max"]
    # three processes, three seeds: three different timings, not one copied
    assert len(set(graphs["values"].values())) == 3
    assert figures["bucketed pool over a single strategy"]["verdict"] == "n < 3: not a result"
    with tarfile.open(out / "results.tgz") as tar:
        names = tar.getnames()
    assert "./targets/seed_2/bench_gpu_engine.json" in names
    assert "issue #18 targets over 3 runs" in result.stdout


def test_target_summary_refuses_runs_that_are_not_target_runs(tmp_path, capsys):
    import json

    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_targets

    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text(json.dumps({"is_targets_only": False}))
    (full / "bench_gpu_engine.json").write_text("{}")
    assert gpu_targets.main([str(full), str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert "not a --targets run" in err and "missing: no readable benchmark result" in err


def _target_run(seed: int, roofline: float, speedup: float, pool: float | None) -> tuple:
    config = {"is_targets_only": True, "shapes": ["small", "large"], "contexts": [1024],
              "pool_shape": "large"}  # fmt: skip
    cell = {"batch": 1, "context": 1024}
    result = {
        "decode": [  # other cells first: the summary must pick the batch-1 cell of its shape
            {"batch": 16, "context": 1024, "shape": "large", "roofline_fraction": 0.99},
            {"batch": 1, "context": 8192, "shape": "large", "roofline_fraction": 0.98},
            {**cell, "shape": "small", "graph_speedup": speedup, "roofline_fraction": 0.01},
            {**cell, "shape": "large", "graph_speedup": 9.0, "roofline_fraction": roofline},
        ],
        "pool": [{"pool": "bucketed (TLT plan, one pool)", "vs_single": pool}]
        if pool is not None
        else [{"pool": "all", "note": "skipped"}],
    }
    return f"seed_{seed}", config, result


def test_target_summary_takes_medians_of_the_right_cells_and_needs_three_runs():
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_targets

    runs = [
        _target_run(0, 0.5, 2.5, 1.2),
        _target_run(1, 0.7, 1.5, 1.6),
        _target_run(2, 0.6, 3.0, None),
    ]
    rows = {r["figure"]: r for r in gpu_targets.summarise(runs)}
    roofline = rows["decode of roofline, graphs"]  # the large shape's batch-1 cell only
    assert (roofline["median"], roofline["min"], roofline["max"]) == (0.6, 0.5, 0.7)
    assert roofline["verdict"] == "NOT met" and roofline["shape"] == "large"
    speedup = rows["graphs over eager, batch 1"]  # the small shape's
    assert speedup["median"] == 2.5 and speedup["verdict"] == "met"
    pool = rows["bucketed pool over a single strategy"]  # a ceiling, two runs of three
    assert pool["num_runs"] == 2 and pool["verdict"] == "n < 3: not a result"
    assert rows["decode of roofline, compiled layers"]["num_runs"] == 0
    runs[2] = _target_run(2, 0.6, 3.0, 1.4)
    pool = {r["figure"]: r for r in gpu_targets.summarise(runs)}[
        "bucketed pool over a single strategy"
    ]
    assert pool["median"] == 1.4 and pool["verdict"] == "met"


def test_target_summary_leaves_out_runs_that_measured_a_fallback_path():
    """A run whose flex_attention fell back to dense SDPA, or whose compiled layers ran
    eagerly, measured another engine than the figure names: its value is not a sample."""
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_targets

    runs = [_target_run(seed, 0.85, 2.5, 1.2) for seed in range(3)]
    runs[1][2]["flex_fallbacks"] = [{"shape": ["1", "2"], "reason": "inductor failed"}]
    for row in runs[2][2]["decode"]:
        row |= {"compiled_roofline_fraction": 0.5, "note": "compiled ran eagerly: boom"}
    runs[0][2]["decode"][-1]["compiled_roofline_fraction"] = 0.9
    rows = {r["figure"]: r for r in gpu_targets.summarise(runs)}
    graphs = rows["decode of roofline, graphs"]
    assert graphs["num_runs"] == 2 and graphs["verdict"] == "n < 3: not a result"
    assert graphs["values"]["seed_1"] is None and "dense SDPA" in graphs["excluded"]["seed_1"]
    assert rows["graphs over eager, batch 1"]["num_runs"] == 2
    compiled = rows["decode of roofline, compiled layers"]
    assert compiled["values"] == {"seed_0": 0.9, "seed_1": None, "seed_2": None}
    assert "ran eagerly" in compiled["excluded"]["seed_2"]
    assert rows["bucketed pool over a single strategy"]["num_runs"] == 3  # no decode path


def test_stage_all_skips_what_its_deadline_leaves_no_time_for(tmp_path):
    out = tmp_path / "late"
    result = run("all", out, SMOKE="1", TOTAL_S="20")  # 15 s stay for packing: 5 s for steps
    assert result.returncode == 1
    steps = (out / "steps.txt").read_text()
    assert "pytest_gpu: skipped, no time left" in steps
    assert "failed: pytest_gpu bench_gpu_engine checkpoint profile bench_kernels" in steps


def test_a_failing_step_is_named_and_the_others_still_run(tmp_path):
    out = tmp_path / "bad"
    # a python that cannot import the project: every step fails, each under its own name
    result = run("profile", out, SMOKE="1", PYTHON="false")
    assert result.returncode == 1
    steps = (out / "steps.txt").read_text()
    assert "failed: checkpoint profile bench_kernels" in steps


def test_usage():
    result = subprocess.run(["bash", str(SCRIPT), "everything"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr
