"""Calibrated GPU cost model, ``tltsim calibrate``, ``profile-info``'s three-way table and
``tltsim advise`` (issue #21).

Run: ``python -m pytest tests/test_calibrated.py -q``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from tltsim.cli.main import main
from tltsim.cost.calibrate import fit_calibration, predict_s
from tltsim.cost.calibrated import (
    CALIBRATIONS,
    CalibratedCost,
    CalibrationError,
    CalibrationParams,
    load_hardware_preset,
    preset_cost,
    save_hardware_preset,
)
from tltsim.cost.profile import ProfileRow, write_profile
from tltsim.cost.roofline import CostModel, RooflineCost
from tltsim.cost.specs import get_hardware, get_model
from tltsim.errors import InputWarning
from tltsim.policy import SpecDecision

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "synth_reasoning_rl.json"
TRUE = CalibrationParams(
    bandwidth_fraction=0.8,
    kv_bandwidth_fraction=0.9,
    flops_fraction=0.6,
    gemm_half_tokens=200.0,
    overlap_exponent=2.0,
    step_overhead_s=1e-3,
)


def _cost(params: CalibrationParams = TRUE, model: str = "Qwen2.5-7B", tp: int = 1):
    return CalibratedCost(get_model(model), get_hardware("H100-SXM"), params=params, tp=tp)


def _profile_rows(cost: CalibratedCost, noise: float, seed: int = 0) -> list[ProfileRow]:
    """decode and verify rows of ``cost`` over batch 1..1024, times lognormal noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for b in (1, 4, 16, 64, 256, 1024):
        for t in (1, 3, 9, 33):
            for per_seq in (256, 4096):
                op = "decode" if t == 1 else "verify"
                exact = predict_s(cost, ProfileRow(op, b, b * per_seq, t, 1, 1, 1, 1))
                s = exact * float(np.exp(rng.normal(0.0, noise)))
                rows.append(ProfileRow(op, b, b * per_seq, t, s, s, s, 5))
    return rows


def test_implements_the_cost_model_protocol():
    assert isinstance(_cost(), CostModel)
    assert isinstance(preset_cost("Qwen2.5-7B", "H100-SXM"), CalibratedCost)
    assert isinstance(preset_cost("Qwen2.5-7B", "H200"), RooflineCost)  # not calibrated


@pytest.mark.parametrize("params", [TRUE, CALIBRATIONS["H100-SXM"]])
def test_monotone_in_batch_and_tokens(params):
    cost = _cost(params)
    for per_seq in (0, 512, 8192):
        for t in (1, 5, 33):
            times = [cost.decode_iter_s(b, b * per_seq, t) for b in range(1, 513)]
            assert all(b >= a for a, b in zip(times, times[1:], strict=False)), (per_seq, t)
        by_tokens = [cost.decode_iter_s(16, 16 * per_seq, t) for t in range(1, 65)]
        assert all(b >= a for a, b in zip(by_tokens, by_tokens[1:], strict=False))


@pytest.mark.parametrize("model,tp", [("Qwen2.5-7B", 1), ("Llama-3.1-70B", 4)])
def test_reduces_to_the_roofline_in_its_limit(model, tp):
    hw = get_hardware("H100-SXM")
    roof = RooflineCost(get_model(model), hw, tp=tp)
    cal = CalibratedCost(get_model(model), hw, params=CalibrationParams.roofline_limit(hw), tp=tp)
    tree = SpecDecision.parse("8_4_32")
    for b, c in ((1, 100.0), (7, 7 * 3000.0), (64, 64 * 2048.0), (900, 900 * 500.0)):
        for t in (1, 9, 33):
            assert cal.decode_iter_s(b, c, t) == pytest.approx(
                roof.decode_iter_s(b, c, t), rel=1e-12
            )
            assert cal.drafter_iter_s(b, c, t) == pytest.approx(
                roof.drafter_iter_s(b, c, t), rel=1e-12
            )
        assert cal.decode_span_s(b, c, 777) == pytest.approx(
            roof.decode_span_s(b, c, 777), rel=1e-12
        )
        assert cal.sd_span_s(b, c, tree, 300, 3.0 * b) == pytest.approx(
            roof.sd_span_s(b, c, tree, 300, 3.0 * b), rel=1e-12
        )
        assert cal.prefill_s(int(c), 0.0, b) == pytest.approx(
            roof.prefill_s(int(c), 0.0, b), rel=1e-12
        )
        assert cal.sd_switch_s(b, c) == pytest.approx(roof.sd_switch_s(b, c), rel=1e-12)
    assert cal.train_s(10_000, 2048) == roof.train_s(10_000, 2048)


@pytest.mark.parametrize("q", [None, 1.0, 1.3, 2.0, 8.0, 16.0])
def test_span_is_the_sum_of_its_iterations(q):
    """Up to q = 16 (calibrate's largest); a long span crossing from memory- to compute-bound
    (batch 474 of Llama-3.1-8B on an H100) missed by 2.5e-5 at q = 10, 6.3e-5 at 16 with one
    Simpson rule of 32 panels."""
    cost = _cost(dataclasses.replace(TRUE, overlap_exponent=q))
    h100 = CalibratedCost(
        get_model("Llama-3.1-8B"),
        get_hardware("H100-SXM"),
        params=dataclasses.replace(CALIBRATIONS["H100-SXM"], overlap_exponent=q),
    )
    want = sum(h100.decode_iter_s(474, 57701.8 + i * 474, 1) for i in range(5000))
    assert h100.decode_span_s(474, 57701.8, 5000) == pytest.approx(want, rel=1e-6)
    for b, n in ((1, 5000), (48, 1000), (300, 65), (8, 10)):
        c0 = b * 700.0
        want = sum(cost.decode_iter_s(b, c0 + i * b, 1) for i in range(n))
        assert cost.decode_span_s(b, c0, n) == pytest.approx(want, rel=1e-6)


def test_calibrate_round_trip_recovers_known_parameters():
    pytest.importorskip("scipy")
    hw = get_hardware("H100-SXM")
    rows = _profile_rows(_cost(), noise=0.01)
    base = dataclasses.replace(CalibrationParams.roofline_limit(hw), step_overhead_s=1e-3)
    fit = fit_calibration(rows, get_model("Qwen2.5-7B"), hw, 1, base)
    for name in ("bandwidth_fraction", "kv_bandwidth_fraction", "flops_fraction"):
        assert getattr(fit.params, name) == pytest.approx(getattr(TRUE, name), rel=0.06), name
    assert fit.params.gemm_half_tokens == pytest.approx(200.0, rel=0.25)
    assert fit.params.overlap_exponent == pytest.approx(2.0, rel=0.15)
    assert fit.median_abs_error < 0.015 and fit.max_abs_error < 0.05
    # The roofline limit is what the fit starts from: it must have moved away from it.
    assert fit.params.gemm_half_tokens > 50


def test_shipped_h100_calibration_is_the_fit_to_the_published_points():
    pytest.importorskip("scipy")
    from tltsim.cost.calibrate import errors_on, fit_published
    from tltsim.cost.published import as_profile_rows, published_points

    fit = fit_published()
    shipped = CALIBRATIONS["H100-SXM"]
    for name in fit.fitted:
        assert getattr(fit.params, name) == pytest.approx(getattr(shipped, name), rel=0.01), name
    # The target on points held out before the fit (bench_costmodel.py prints them).
    hw = get_hardware("H100-SXM")
    held = [p for p in published_points() if p.use == "held_out"]
    errors = np.abs([errors_on(as_profile_rows([p]), p.model, hw, 1, shipped)[0] for p in held])
    assert np.median(errors) <= 0.10 and errors.max() <= 0.25


def test_the_drafting_points_fit_the_drafter_overhead_alone():
    """SpecDecode-Bench's drafting-time points move only ``draft_step_overhead_s``: the target's
    parameters are those of a fit without them, and the drafter's overhead is no longer
    HardwareSpec's assumption."""
    pytest.importorskip("scipy")
    from tltsim.cost.calibrate import PUBLISHED_FIT_FIELDS, fit_published

    full = fit_published()
    body_only = fit_published(
        tuple(f for f in PUBLISHED_FIT_FIELDS if f != "draft_step_overhead_s")
    )
    assert "draft_step_overhead_s" in full.fitted
    assert "draft_step_overhead_s" not in body_only.fitted
    for name in body_only.fitted:
        assert getattr(full.params, name) == getattr(body_only.params, name), name
    assumed = get_hardware("H100-SXM").draft_step_overhead_s
    assert body_only.params.draft_step_overhead_s == assumed
    assert abs(full.params.draft_step_overhead_s / assumed - 1) > 0.05
    drafter = [i for i, r in enumerate(full.rows) if r.op == "drafter"]
    assert len(drafter) == 6  # batches 1, 16, 64 at two contexts; 8 and 32 held out
    # one parameter for six points: its errors straddle zero
    errors = full.rel_errors[drafter]
    assert errors.min() < 0 < errors.max()


def test_every_published_point_has_a_source_and_positive_numbers():
    from tltsim.cost.published import independent_points, published_points

    # SD_BATCH_SERIES: tests/test_sd_batch_validation.py
    points = [*published_points(), *independent_points()]
    assert len(independent_points()) >= 20
    for p in points:
        assert isinstance(p.source, str) and len(p.source) > 20, p
        get_hardware(p.hardware)  # a known preset
        numbers = {
            f.name: getattr(p, f.name)
            for f in dataclasses.fields(p)
            if type(getattr(p, f.name)) in (int, float)
        }
        # context 0: the Qwen3-1.7B grid's first row (no KV cache yet); everything else > 0
        assert numbers and all(
            (v >= 0 if k == "context_tokens" else v > 0) and math.isfinite(v)
            for k, v in numbers.items()
        ), p


def test_a_static_batch_point_rejects_a_non_positive_number():
    from tltsim.cost.published import LLAMA2_7B, StaticBatchPoint

    with pytest.raises(ValueError, match="output_tokens_per_s"):
        StaticBatchPoint(
            source="x",
            engine="e",
            hardware="A100-80GB",
            model=LLAMA2_7B,
            batch=1,
            input_tokens=1,
            output_tokens=1,
            output_tokens_per_s=0.0,
        )


def test_the_independent_points_are_not_in_the_fit():
    pytest.importorskip("scipy")
    from tltsim.cost.calibrate import fit_published
    from tltsim.cost.published import (
        SPECDECODE_BENCH,
        VLLM_H100_QWEN3_1_7B,
        as_profile_rows,
        independent_points,
        published_points,
    )

    fit_points = [p for p in published_points() if p.use == "fit"]
    # The fit sees exactly the points marked "fit": SpecDecode-Bench's model and 12 cells of the
    # Qwen3-1.7B forward grid (two models: what separates per-layer from per-byte costs).
    assert list(fit_published().rows) == as_profile_rows(fit_points)
    assert {p.source for p in fit_points} == {SPECDECODE_BENCH, VLLM_H100_QWEN3_1_7B}
    assert len({p.model for p in fit_points}) == 2
    grid = [p for p in published_points() if p.op == "forward"]
    assert sum(p.use == "fit" for p in grid) == 12 and sum(p.use == "held_out" for p in grid) == 71
    # Independent data: the other measured points held out, and static-batch points from other
    # sources, engines and GPUs than any fit point.
    measured = [p for p in published_points() if p.kind == "measured" and p.op != "forward"]
    assert measured and all(p.use == "held_out" for p in measured)
    fit_sources = {p.source for p in fit_points}
    fit_engines = {p.engine for p in fit_points}
    for p in [*measured, *independent_points()]:
        assert p.source not in fit_sources and p.engine not in fit_engines, p
    assert {p.hardware for p in independent_points()}.isdisjoint({p.hardware for p in fit_points})


def test_forward_body_is_the_layers_without_head_sampling_or_host_overhead():
    model, hw = get_model("Qwen3-1.7B"), get_hardware("H100-SXM")
    params = dataclasses.replace(
        CALIBRATIONS["H100-SXM"], sample_s_per_token=1e-5, overlap_exponent=None
    )
    cal = CalibratedCost(model, hw, params=params)
    # Memory-bound at batch 1 (max blend): the body streams the layers' weights, the KV cache
    # and pays the per-layer cost; the full iteration adds the LM head's weights and logits, the
    # step overhead and the sampling, and nothing else.
    body = cal.forward_body_s(1, 1000.0)
    head_s = (model.bytes_per_param * model.lm_head_params) / (
        hw.hbm_bytes_per_s * params.bandwidth_fraction
    ) + model.vocab_size * 4 / (hw.hbm_bytes_per_s * params.kv_bandwidth_fraction)
    full = cal.decode_iter_s(1, 1000.0)
    assert full - body == pytest.approx(head_s + params.step_overhead_s + 1e-5, rel=1e-9)
    # layers' weights (+ the final norm) at the weight fraction, the 1,001 KV tokens read and
    # written at the KV fraction, and the per-layer cost
    weights = model.num_layers * model.layer_params * model.bytes_per_param + model.hidden_size * 2
    kv = model.kv_bytes_per_token * 1001
    weights_s = weights / (hw.hbm_bytes_per_s * params.bandwidth_fraction)
    kv_s = kv / (hw.hbm_bytes_per_s * params.kv_bandwidth_fraction)
    assert body == pytest.approx(weights_s + kv_s + model.num_layers * params.layer_overhead_s)
    # The roofline prices the same scope (its max of memory and compute, no overhead).
    roof = RooflineCost(model, hw)
    assert roof.forward_body_s(1, 1000.0) < roof.decode_iter_s(1, 1000.0)


def test_a_missing_scipy_is_one_usage_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    hw = get_hardware("H100-SXM")
    with pytest.raises(CalibrationError, match="needs scipy"):
        fit_calibration(_profile_rows(_cost(), 0.0), get_model("Qwen2.5-7B"), hw, 1, TRUE)


def _write_profile(path: Path, rows: list[ProfileRow]) -> Path:
    meta = {
        "hardware": "H100-SXM",
        "backend": "vllm",
        "tp": 1,
        "model": "Qwen2.5-7B",
        "software": {"python": "3.11"},
        "date": "2026-11-24",
    }
    write_profile(rows, path, meta)
    return path


def test_calibrate_refuses_to_overwrite_a_profiles_sidecar(tmp_path, capsys):
    """``calibrate h100.csv --out h100.json`` replaced the profile's own sidecar with the
    preset: the profile could not be read again. Refused before any fit (so without scipy)."""
    profile = _write_profile(tmp_path / "h100.csv", _profile_rows(_cost(), noise=0.005))
    sidecar = profile.with_suffix(".json")
    before = sidecar.read_bytes()
    other = tmp_path / "other.json"
    other.write_bytes(before)  # another profile's sidecar (its CSV is elsewhere)
    for out in (sidecar, other):
        assert main(["calibrate", str(profile), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "sidecar of profile" in err and "\n" not in err
    assert sidecar.read_bytes() == before == other.read_bytes()


def test_calibrate_cli_writes_a_preset_that_replay_uses(tmp_path, capsys):
    pytest.importorskip("scipy")
    profile = _write_profile(tmp_path / "h100.csv", _profile_rows(_cost(), noise=0.005))
    preset = tmp_path / "h100-preset.json"
    assert main(["calibrate", str(profile), "--out", str(preset)]) == 0
    out = capsys.readouterr().out
    assert "fit error" in out and str(preset) in out
    doc = json.loads(preset.read_text())
    assert doc["format"] == "tlt-hardware" and doc["fit_error"]["max_abs"] < 0.05
    cost = preset_cost("Qwen2.5-7B", str(preset))
    assert isinstance(cost, CalibratedCost)
    assert cost.params.flops_fraction == pytest.approx(0.6, rel=0.06)
    # profile-info: roofline vs calibrated vs measured, per op
    assert main(["profile-info", str(profile), "--hardware", str(preset)]) == 0
    out = capsys.readouterr().out
    assert "roofline vs calibrated vs measured" in out and "measured/calibrated" in out
    # replay with the preset file
    run = tmp_path / "replay"
    argv = ["replay", str(TRACE), "--preset", "h100x8-qwen7b", "--max-steps", "1"]
    assert main([*argv, "--hardware-file", str(preset), "--out", str(run)]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["sim"]["hardware"] == str(preset)
    # config.json says which calibration ran: the file's digest and its fitted numbers (it
    # held the roofline fractions the calibration replaces, and a relative path only)
    cost = config["cost_model"]
    assert cost["hardware_file"]["sha256"] == hashlib.sha256(preset.read_bytes()).hexdigest()
    assert cost["hardware_file"]["path"] == str(preset.resolve())
    fitted = preset_cost("Qwen2.5-7B", str(preset)).params.flops_fraction
    assert cost["calibration"]["flops_fraction"] == fitted


def test_calibrate_says_when_the_profile_is_incomplete(tmp_path, capsys):
    """A killed or interrupted ``tltrun profile`` leaves a valid profile of fewer repeats, whose
    sidecar says so: the fit runs and names it."""
    pytest.importorskip("scipy")
    profile = _write_profile(tmp_path / "h100.csv", _profile_rows(_cost(), noise=0.005))
    assert main(["calibrate", str(profile), "--out", str(tmp_path / "a.json")]) == 0
    assert "incomplete" not in capsys.readouterr().out
    side = profile.with_suffix(".json")
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({**meta, "partial": "the run did not finish; measured: 1 of 3"}))
    assert main(["calibrate", str(profile), "--out", str(tmp_path / "b.json")]) == 0
    assert "note: an incomplete profile (partial: the run did not" in capsys.readouterr().out


def test_a_held_overlap_exponent_stays_as_the_base_has_it(tmp_path, capsys):
    """H200 has no shipped calibration: its base is the roofline limit, a plain max of compute
    and memory time (overlap_exponent None). Fitting only the bandwidth must keep it so; it
    used to write the optimiser's start (2), a soft max, as 'held'. A --hardware the sidecar's
    device name does not match gets a note."""
    pytest.importorskip("scipy")
    shipped = Path(__file__).resolve().parents[1] / "profiles" / "h200_qwen2.5-1.5b_random.csv"
    preset = tmp_path / "bw.json"
    argv = ["calibrate", str(shipped), "--hardware", "H200", "--out", str(preset)]
    assert main([*argv, "--fit", "bandwidth_fraction"]) == 0
    assert "note:" not in capsys.readouterr().out
    # one fitted fraction over the roofline's max misses the profile by a median 26%: said
    with pytest.warns(InputWarning, match="missed its own profile by a median 26%"):
        cost = preset_cost("Qwen2.5-1.5B", str(preset))
    assert cost.params.overlap_exponent is None and cost.params.bandwidth_fraction < 1
    argv = ["calibrate", str(shipped), "--hardware", "H100-SXM", "--out", str(tmp_path / "x.json")]
    assert main(argv) == 0
    assert "note: --hardware H100-SXM, but the profile was measured on 'NVIDIA H200'" in (
        capsys.readouterr().out
    )


def test_profile_info_shows_the_shipped_calibration(tmp_path, capsys):
    profile = _write_profile(tmp_path / "p.csv", _profile_rows(_cost(), noise=0.0))
    assert main(["profile-info", str(profile)]) == 0
    assert "roofline vs calibrated vs measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "columns",
        "bad_fit_field",
        "hardware_file_missing",
        "hardware_file_not_json",
        "no_drafter_rows",
        "other_model",
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    pytest.importorskip("scipy")
    good = _write_profile(tmp_path / "good.csv", _profile_rows(_cost(), noise=0.0))
    if case == "missing":
        argv = ["calibrate", str(tmp_path / "nope.csv")]
    elif case == "columns":
        bad = tmp_path / "bad.csv"
        bad.write_text("op,batch,seconds\ndecode,1,0.01\n")
        (tmp_path / "bad.json").write_text((tmp_path / "good.json").read_text())
        argv = ["calibrate", str(bad)]
    elif case == "bad_fit_field":
        argv = ["calibrate", str(good), "--fit", "bandwidth_fraction,warp_speed"]
    elif case == "no_drafter_rows":  # it fitted nothing and exited 0
        rows = [r for r in _profile_rows(_cost(), noise=0.0) if r.op != "drafter"]
        plain = _write_profile(tmp_path / "plain.csv", rows)
        argv = ["calibrate", str(plain), "--fit", "draft_step_overhead_s"]
    elif case == "other_model":  # the sidecar says Qwen2.5-7B
        argv = ["calibrate", str(good), "--model", "Qwen2.5-0.5B"]
    elif case == "hardware_file_missing":
        argv = ["replay", str(TRACE), "--hardware-file", str(tmp_path / "nope.json")]
    else:
        junk = tmp_path / "junk.json"
        junk.write_text('{"format": "something else"}')
        argv = ["replay", str(TRACE), "--hardware-file", str(junk)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err


def test_a_saved_preset_round_trips(tmp_path):
    hw = get_hardware("H100-SXM")
    path = tmp_path / "hw.json"
    save_hardware_preset(path, hw, TRUE, {"note": "x"})
    cost = preset_cost("Qwen2.5-7B", str(path), tp=1)
    assert cost.params == TRUE and cost.hardware == hw
    assert cost.decode_iter_s(8, 8000.0) == _cost().decode_iter_s(8, 8000.0)
    # a field of the wrong type is one line naming the file and field (a string failed with
    # "'>=' not supported ...", true was read as 1.0)
    doc = json.loads(path.read_text())
    for section, name, value in (("calibration", "step_overhead_s", "0.001"),
                                 ("calibration", "bandwidth_fraction", True),
                                 ("hardware", "hbm_bytes_per_s", "4.8e12")):  # fmt: skip
        path.write_text(json.dumps({**doc, section: {**doc[section], name: value}}))
        with pytest.raises(CalibrationError) as err:
            preset_cost("Qwen2.5-7B", str(path), tp=1)
        message = str(err.value)
        assert f"hw.json: field '{section}': {name}: expected a number" in message, message


def test_sweep_says_whether_the_best_is_distinguishable():
    from tltsim.cli.sweep import distinguishable_line

    summary = {
        "runner_up": {"policy": "tlt", "tlt.threshold": 32, "speedup_vs_nospec": 1.5},
        "speedup_interval_over_seeds": {"best": [1.6, 1.7], "runner_up": [1.4, 1.55]},
        "is_best_distinguishable": True,
    }
    assert "distinguishable: the speedup intervals" in distinguishable_line(summary)
    overlap = summary | {"is_best_distinguishable": False}
    assert "NOT distinguishable" in distinguishable_line(overlap)
    assert "no runner-up" in distinguishable_line({"runner_up": {}})
    # both as the sweep ranks them (hunt: advise's single-replay figure above a runner-up's
    # mean over seeds made a tie look like a worse pick)
    ranked = summary | {"best": {"policy": "tlt", "speedup_vs_nospec": 1.65}}
    assert "(best 1.650x vs 1.500x, means over seeds)" in distinguishable_line(ranked)


def test_a_preset_of_another_version_and_a_boolean_hardware_field_are_one_line(tmp_path, capsys):
    """A version 99 preset loaded as version 1; calibrate --hardware FILE took true for a number
    and wrote a preset that replay then refused."""
    from tltsim.cli.main import main

    path = tmp_path / "hw.json"
    save_hardware_preset(path, get_hardware("H100-SXM"), TRUE, {"note": "x"})
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "version": 99}))
    with pytest.raises(CalibrationError, match="field 'version': expected 1, got 99"):
        load_hardware_preset(path)
    spec = {**doc["hardware"], "flops_fraction": True}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    good = _write_profile(tmp_path / "good.csv", _profile_rows(_cost(), noise=0.0))
    argv = ["calibrate", str(good), "--hardware", str(tmp_path / "spec.json"),
            "--out", str(tmp_path / "out.json")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "flops_fraction: expected a number, got true" in err and "\n" not in err, err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("field", ["sample_s_per_token", "step_overhead_s", "gemm_half_tokens"])
def test_absurd_calibration_values_are_refused(field):
    """sample_s_per_token = 1e308 ran to NaN step times and 0.00x speedups, exit 0."""
    with pytest.raises(ValueError, match=f"{field} must be at most"):
        dataclasses.replace(TRUE, **{field: 1e308})
