"""The benchmark scripts' own logic on CPU, without their long runs: cached models keyed by
seed (bench_scale), a batch with no SD strategy measured (bench_spec's table, spec_profile's
crossover), the history cost's tail of a short response, the temperature a profile was measured
at (bench_train's warning), and bench_deterministic's single-run comparison.

Run: ``python -m pytest tests/test_bench_scripts.py -q``.
"""

from __future__ import annotations

import importlib
import os
import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _module(name: str):
    return importlib.import_module(name)


def test_bench_scale_builds_one_model_per_seed(tmp_path):
    """A rerun with another --seed reused the first seed's weights (config.json said the new
    seed)."""
    bench_scale = _module("bench_scale")
    first, again = bench_scale.tiny_model_dir(tmp_path, 0), bench_scale.tiny_model_dir(tmp_path, 0)
    other = bench_scale.tiny_model_dir(tmp_path, 1)
    weights = [(d / "model.safetensors").read_bytes() for d in (first, again, other)]
    assert first == again and weights[0] == weights[1]
    assert other != first and weights[2] != weights[0]


SD_AT_1_ONLY = {
    "rows": [
        {"batch": 1, "best": "2_1_2", "runs": {
            "off": {"decode_tokens_per_s": 10.0, "speedup": 1.0},
            "2_1_2": {"mean_accept_len": 2.0, "speedup": 1.4}}},
        {"batch": 256, "best": "off", "runs": {"off": {"decode_tokens_per_s": 90.0, "speedup": 1.0}}},
    ],
    "sd_stops_paying_at_batch": None,
    "hardware": "cpu",
    "temperature": 1.0,
}  # fmt: skip


def test_a_batch_without_an_sd_strategy_is_shown_as_not_measured():
    """Every strategy over --max-strategy-tokens at batch 256: its row said best 'off' at 1.00x
    (as if SD had been measured not to pay) and spec_profile's crossover crashed on it."""
    bench_spec, spec_profile = _module("bench_spec"), _module("spec_profile")
    table = bench_spec.results_table(SD_AT_1_ONLY, ("2_1_2",))
    assert "not measured" in table and "batch 256: no strategy within" in table
    assert spec_profile.crossover_batch(SD_AT_1_ONLY) == 1
    with pytest.raises(spec_profile.UsageError, match="no SD strategy was measured"):
        spec_profile.crossover_batch({"rows": SD_AT_1_ONLY["rows"][1:]})


def test_the_history_cost_of_a_short_loop_has_a_tail():
    """Fewer than 10 tokens: the tail's start was never set (UnboundLocalError)."""
    history_cost = _module("history_cost")
    args = Namespace(ngram_min=1, ngram_max=3, seed=0)
    row = history_cost.bench_loop(5, cycle=3, max_draft_tokens=4, args=args)
    assert row["loop_tokens"] == 5 and row["extend_tail_us"] > 0


def test_a_profile_of_another_temperature_is_warned_about(tmp_path, capsys):
    spec_profile = _module("spec_profile")
    path = tmp_path / "results.json"
    path.write_text('{"temperature": 0.0, "rows": []}')
    spec_profile.read_spec_results(path, "--tlt-threshold", temperature=1.0)
    assert "measured at temperature 0.0, the runs sample at 1.0" in capsys.readouterr().err
    spec_profile.read_spec_results(path, "--tlt-threshold", temperature=0.0)
    assert capsys.readouterr().err == ""


def test_a_profile_of_another_dtype_is_warned_about(tmp_path, capsys):
    """seeds.sh set bf16 runs' threshold and buckets from an fp32 profile without a word."""
    spec_profile = _module("spec_profile")
    path = tmp_path / "results.json"
    path.write_text('{"temperature": 1.0, "rows": []}')  # written before dtype was recorded
    spec_profile.read_spec_results(path, "--tlt-threshold", temperature=1.0, dtype="bfloat16")
    assert "measured in float32, the runs roll out in bfloat16" in capsys.readouterr().err
    path.write_text('{"temperature": 1.0, "dtype": "bfloat16", "rows": []}')
    spec_profile.read_spec_results(path, "--tlt-threshold", temperature=1.0, dtype="bfloat16")
    assert capsys.readouterr().err == ""


def test_seeds_sh_checks_bench_historys_flags_and_profiles_in_the_runs_dtype(tmp_path):
    """TRAIN_ARGS bench_history does not take failed only after every seed's runs; a bf16
    run's bench_spec profile was measured in fp32."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    script = root / "benchmarks" / "seeds.sh"
    fake = tmp_path / "py"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "TRAIN_ARGS": "--lr 1e-4", "PYTHONPATH": str(root)}
    done = subprocess.run(["bash", str(script), str(tmp_path / "o"), "1"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "unrecognized arguments: --lr 1e-4" in done.stderr
    assert (tmp_path / "calls").read_text().count("\n") == 1  # nothing ran after the check
    # a python that only records: the scripts seeds.sh would run, with which flags
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls2\n')
    env["TRAIN_ARGS"] = "--max-new-tokens 192 --dtype bfloat16"
    done = subprocess.run(["bash", str(script), str(tmp_path / "o"), "1"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls2").read_text().splitlines()
    spec = next(c for c in calls if "bench_spec.py" in c)
    train = next(c for c in calls if "bench_train.py" in c)
    assert "--temperature 1.0 --dtype bfloat16" in spec
    assert f"--spec-results {tmp_path}/o/spec-seed1/results-bfloat16.json" in train


def test_bench_scale_alternates_world_sizes_in_chunks_and_summarises_seeds(tmp_path, monkeypatch):
    """Each world size ran whole, in turn (a load change hit one only), and the README's median
    over seeds was worked out by hand."""
    import json

    bench_scale = _module("bench_scale")
    calls = []

    def fake_run_train(train, task, is_resume=False):
        calls.append((train.num_workers, train.num_steps, is_resume))
        log = Path(train.out) / "log.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)
        done = len(log.read_text().splitlines()) if log.is_file() else 0
        with log.open("a") as f:
            for step in range(done, train.num_steps):
                first = step in (0, 2)  # a chunk's first step: start-up costs, not timed
                step_s = 100.0 if first else 1.0 / train.num_workers
                row = {"step": step, "step_s": step_s, "rollout_s": step_s, "train_s": 0.0}
                f.write(json.dumps(row) + "\n")

    monkeypatch.setattr(bench_scale, "run_train", fake_run_train)
    monkeypatch.setattr(bench_scale, "task_for", lambda model_dir: None)
    cfg = bench_scale.BenchScaleConfig(out=str(tmp_path), ranks=(1, 2), num_steps=4, chunk_steps=2)
    rows = bench_scale.run_scale(cfg, tmp_path, seed=7)
    assert calls == [(1, 2, False), (2, 2, False), (2, 4, True), (1, 4, True)]
    assert [r["num_timed_steps"] for r in rows] == [2, 2]  # steps 1 and 3
    assert rows[1]["step_speedup"] == 2.0
    summary = bench_scale.seed_summary([*rows, {**rows[1], "seed": 8, "step_speedup": 1.5}])
    two = next(r for r in summary if r["ranks"] == 2)
    assert two["num_seeds"] == 2 and two["step_speedup"] == 1.75
    assert two["step_speedup_range"] == "1.50-2.00"


def test_bench_fidelity_keeps_the_other_backends_results(tmp_path):
    """README's recipe runs torch, then vLLM: the second call overwrote the torch results."""
    bench_fidelity = _module("bench_fidelity")
    path = tmp_path / "results.json"
    assert bench_fidelity.earlier_backends(path) == {}
    path.write_text('{"backends": {"torch": {"summary": 1}}}')
    assert bench_fidelity.earlier_backends(path) == {"torch": {"summary": 1}}
    path.write_text("[1, 2")  # torn
    assert bench_fidelity.earlier_backends(path) == {}


def test_bench_spec_drops_earlier_results_before_a_new_measurement(tmp_path, monkeypatch):
    """A measurement that stopped left the earlier results.json beside the new config.json."""
    bench_spec = _module("bench_spec")
    (tmp_path / "results.json").write_text("{}")
    monkeypatch.setattr(bench_spec, "run_model_stages", lambda cfg, work: None)

    def stopped(cfg, work):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_spec, "measure", stopped)
    with pytest.raises(KeyboardInterrupt):
        bench_spec.main(["--work-dir", str(tmp_path)])
    assert (tmp_path / "config.json").is_file() and not (tmp_path / "results.json").exists()
