"""benchmarks/bench_spec.py's measurement on a tiny model: greedy, where SD must reproduce NoSpec's
tokens (checked), or sampled at --temperature as GRPO's rollouts are."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from tltrun.model.drafter import EagleDrafter

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_spec.py"
_SPEC = importlib.util.spec_from_file_location("bench_spec", _PATH)
bench_spec = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_spec"] = bench_spec  # dataclasses look their module up
_SPEC.loader.exec_module(bench_spec)


def _measure(temperature: float, dtype: str = "float32") -> dict:
    torch.manual_seed(0)
    target = tiny_model(seed=0)
    drafter = EagleDrafter.for_target(target, seed=1)
    cfg = bench_spec.BenchSpecConfig(
        strategies=("2_1_2",), max_new_tokens=12, repeats=1, temperature=temperature, dtype=dtype
    )
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    return bench_spec.measure_batch(cfg, target, drafter, prompts)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_measure_batch_runs_greedy_and_sampled(temperature):
    row = _measure(temperature)
    assert row["batch"] == 2 and set(row["runs"]) == {"off", "2_1_2"}
    run = row["runs"]["2_1_2"]
    # a random drafter on a random target: some drafts are verified, accept length in [1, 3]
    assert 1.0 <= run["mean_accept_len"] <= 3.0
    assert row["runs"]["off"]["speedup"] == 1.0 and run["speedup"] > 0


def test_temperature_is_checked():
    with pytest.raises(ValueError, match="temperature"):
        bench_spec.BenchSpecConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="temperature"):
        bench_spec.BenchSpecConfig(temperature=float("nan"))


def test_a_bf16_measurement_reports_greedy_agreement_and_is_kept_apart():
    """--dtype bfloat16: verify and decode forwards round differently in bf16, so greedy SD's
    agreement with plain bf16 decoding is measured and reported, not required (float32 still
    requires it); results and config go beside the float32 ones instead of over them."""
    row = _measure(0.0, "bfloat16")
    assert set(row["runs"]) == {"off", "2_1_2"}
    assert row["runs"]["off"]["greedy_equal_fraction"] == 1.0
    assert _measure(0.0)["runs"]["2_1_2"]["greedy_equal_fraction"] == 1.0  # fp32: checked
    assert bench_spec.BenchSpecConfig().results_name == "results.json"
    bf16 = bench_spec.BenchSpecConfig(dtype="bfloat16")
    assert (bf16.results_name, bf16.config_name) == (
        "results-bfloat16.json",
        "config-bfloat16.json",
    )
    assert bench_spec.BenchSpecConfig().config_name == "config.json"
    with pytest.raises(bench_spec.UsageError, match="--dtype"):
        bench_spec.BenchSpecConfig(dtype="float16x")


def test_a_greedy_sd_difference_exits_in_fp32_and_is_reported_in_bf16(monkeypatch, capsys):
    """One of two SD outputs made to differ from plain decoding: fp32 stops with the lossless
    error, bf16 records half of the outputs equal and goes on."""
    from tltrun.rollout.engine import RolloutEngine
    from tltsim.policy import StaticSpec

    generate = RolloutEngine.generate

    def one_flipped(self, requests, policy, step=0):
        result = generate(self, requests, policy, step)
        if isinstance(policy, StaticSpec) and len(requests) == 2:
            out = result.outputs[0]
            out.output_token_ids[-1] = (out.output_token_ids[-1] + 1) % VOCAB
        return result

    monkeypatch.setattr(RolloutEngine, "generate", one_flipped)
    with pytest.raises(SystemExit, match="lossless check failed"):
        _measure(0.0)
    row = _measure(0.0, "bfloat16")
    assert row["runs"]["2_1_2"]["greedy_equal_fraction"] == 0.5
    assert "50% of greedy outputs equal plain bf16 decoding" in capsys.readouterr().out


def test_a_work_dir_is_reused_only_for_the_settings_its_models_were_built_with(
    tmp_path, monkeypatch
):
    """A rerun with another --seed skipped every stage whose files were there and measured the
    old seed's models; a killed generate (config.json, no trace.json) is resumed, not skipped."""
    built = []

    def stage(name, last_file):
        def run(cfg, where):
            out = where if name == "target" else where / name
            out.mkdir(parents=True, exist_ok=True)
            (out / last_file).write_text("{}")
            built.append(name)

        return run

    monkeypatch.setattr(bench_spec, "stage_target", stage("target", "config.json"))
    monkeypatch.setattr(bench_spec, "stage_drafter_data", stage("gen", "trace.json"))
    monkeypatch.setattr(bench_spec, "stage_drafter", stage("drafter", "config.json"))
    cfg = bench_spec.BenchSpecConfig(work_dir=str(tmp_path), seed=0)
    bench_spec.run_model_stages(cfg, tmp_path)
    assert built == ["target", "gen", "drafter"]
    (tmp_path / "gen" / "trace.json").unlink()  # a killed generate left its config.json
    (tmp_path / "gen" / "config.json").write_text("{}")
    bench_spec.run_model_stages(cfg, tmp_path)
    assert built[3:] == ["gen"]
    import dataclasses

    with pytest.raises(bench_spec.UsageError, match="seed 0 -> 1"):
        bench_spec.run_model_stages(dataclasses.replace(cfg, seed=1), tmp_path)
    assert built[4:] == []
