"""``tltsim calibrate`` on profiles that cannot price TLT, and presets that do not describe their
GPU: refused or warned where they were written and replayed without a word (a hunt with
variants of the shipped H200 profile).

Run: ``python -m pytest tests/test_calibrate_checks.py -q`` (needs scipy: the fit extra).
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from tltsim.cli.main import main

pytest.importorskip("scipy")
ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "h200_qwen2.5-1.5b_random.csv"
TRACE = ROOT / "traces" / "synth_reasoning_rl.json"
FLAGS = ["--hardware", "H200", "--model", "Qwen2.5-1.5B"]


def variant(tmp_path: Path, name: str, keep=lambda row: True, factor=lambda: 1.0) -> Path:
    """The shipped profile's rows that ``keep`` keeps, each row's times times ``factor()``; its
    sidecar."""
    rows = [r for r in csv.DictReader(PROFILE.open()) if keep(r)]
    for r in rows:
        k = factor()
        for column in ("seconds", "seconds_p10", "seconds_p90"):
            r[column] = repr(k * float(r[column]))
    path = tmp_path / f"{name}.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    path.with_suffix(".json").write_text(PROFILE.with_suffix(".json").read_text())
    return path


def test_a_profile_without_verify_rows_is_refused_and_without_drafter_rows_warned(tmp_path, capsys):
    """Decode alone fitted to 3% and mis-priced verify by up to 387%: TLT 0.98x vs 1.59x."""
    decode_only = variant(tmp_path, "decode", keep=lambda r: r["op"] not in ("verify", "drafter"))
    assert main(["calibrate", str(decode_only), *FLAGS, "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "no verify rows: SD's costs would be guessed from decode alone" in err
    assert not (tmp_path / "p.json").exists()
    no_drafter = variant(tmp_path, "nodrafter", keep=lambda r: r["op"] != "drafter")
    assert main(["calibrate", str(no_drafter), *FLAGS, "--out", str(tmp_path / "p.json")]) == 0
    assert "no drafter rows: the drafter's forwards are priced" in capsys.readouterr().err


def test_a_fit_that_misses_its_profile_is_warned_when_written_and_when_replayed(
    tmp_path, capsys, monkeypatch
):
    rng = random.Random(2)
    garbage = variant(tmp_path, "garbage", factor=lambda: 10 ** rng.uniform(-2, 2))
    preset = tmp_path / "garbage-preset.json"
    assert main(["calibrate", str(garbage), *FLAGS, "--out", str(preset)]) == 0
    assert "warning: median |error|" in capsys.readouterr().err
    assert json.loads(preset.read_text())["fit_error"]["median_abs"] > 0.25
    argv = ["replay", str(TRACE), "--preset", "h200x8-qwen7b", "--hardware-file", str(preset)]
    assert main([*argv, "--max-steps", "1", "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert err.count("its calibration missed its own profile by a median") == 1  # once
    # advise named the file relative, then absolute: once too (a copy: warned once a process)
    (tmp_path / "rel.json").write_bytes(preset.read_bytes())
    monkeypatch.chdir(tmp_path)
    argv = ["advise", str(TRACE), "--preset", "h200x8-qwen7b", "--hardware-file", "rel.json",
            "--max-steps", "1", "--num-seeds", "1", "--thresholds", "32", "--strategy-sets",
            "chains", "--out", str(tmp_path / "a")]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().err.count("missed its own profile by a median") == 1
    # the shipped profile's own fit is quiet
    good = tmp_path / "good.json"
    assert main(["calibrate", str(PROFILE), *FLAGS, "--out", str(good)]) == 0
    out, err = capsys.readouterr()
    assert "median |error|" not in err and "fitted on batches 1-64 (4 sizes)" in out
    # the ops the fit does not take, as the preset prices them (replays charge them so)
    assert "sd_switch (not fitted)" in out and "prefill (not fitted)" in out
    assert json.loads(good.read_text())["fit_domain"]["batches"] == [1, 4, 16, 64]


def test_a_fit_on_one_batch_size_or_cpu_seconds_is_warned(tmp_path, capsys):
    batch1 = variant(tmp_path, "batch1", keep=lambda r: r["batch"] == "1")
    assert main(["calibrate", str(batch1), *FLAGS, "--out", str(tmp_path / "b.json")]) == 0
    assert "fitted on 1 batch size(s) ([1]): how costs grow" in capsys.readouterr().err
    cpu = variant(tmp_path, "cpu")
    sidecar = json.loads(cpu.with_suffix(".json").read_text())
    cpu.with_suffix(".json").write_text(json.dumps({**sidecar, "clock": "cpu"}))
    assert main(["calibrate", str(cpu), *FLAGS, "--out", str(tmp_path / "c.json")]) == 0
    assert "timed on the 'cpu' clock (its sidecar): a GPU's costs are wall seconds" in (
        capsys.readouterr().err
    )


def test_a_refit_keeps_what_the_given_preset_fitted_and_replay_names_its_gpu(tmp_path, capsys):
    first = tmp_path / "first.json"
    argv = ["calibrate", str(PROFILE), *FLAGS[2:], "--out", str(first)]
    assert main([*argv, "--hardware", "H200", "--fit", "bandwidth_fraction,step_overhead_s"]) == 0
    fitted = json.loads(first.read_text())["calibration"]["step_overhead_s"]
    assert fitted != 0.001  # (not the held default)
    again = tmp_path / "again.json"
    refit = ["calibrate", str(PROFILE), *FLAGS[2:], "--hardware", str(first)]
    assert main([*refit, "--fit", "flops_fraction", "--out", str(again)]) == 0
    # a field the refit held is the given preset's, not the roofline's (it was reset)
    assert json.loads(again.read_text())["calibration"]["step_overhead_s"] == fitted
    capsys.readouterr()
    replay = ["replay", str(TRACE), "--preset", "h100x8-qwen7b", "--hardware", "H100-SXM"]
    assert main([*replay, "--hardware-file", str(again), "--max-steps", "1",
                 "--policy", "nospec", "--out", str(tmp_path / "r")]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert "--hardware H100-SXM: --hardware-file" in err and "simulated on H200" in err
    assert out.startswith("simulated: Qwen2.5-7B on 8 x H200 (TP 1)")


def test_a_hand_edited_preset_or_hardware_file_names_the_misspelt_field(tmp_path, capsys):
    """Hunt: a misspelt calibration field was Python's "CalibrationParams.__init__() got an
    unexpected keyword argument"; a misspelt section was "expected an object" with no word of
    the spelling; a hardware JSON missing a field said the same in Python's words."""
    preset = tmp_path / "h200.json"
    assert main(["calibrate", str(PROFILE), *FLAGS, "--out", str(preset)]) == 0
    doc = json.loads(preset.read_text())
    doc["calibration"]["layer_overhead_ms"] = doc["calibration"].pop("layer_overhead_s")
    (tmp_path / "field.json").write_text(json.dumps(doc))
    doc["calibraton"] = doc.pop("calibration")
    (tmp_path / "section.json").write_text(json.dumps(doc))
    (tmp_path / "hw.json").write_text(json.dumps({"name": "X", "peak_flops_per_s": 9e14}))
    (tmp_path / "extra.json").write_text(
        json.dumps({"name": "X", "peak_flops_per_s": 9e14, "hbm_bytes_per_s": 3e12,
                    "memory_bytes": 8e10, "link_bytes_per_s": 4e11, "peak_tflops": 900})
    )  # fmt: skip
    capsys.readouterr()
    expected = {
        "field.json": "field 'calibration': unknown field 'layer_overhead_ms' (did you mean "
        "'layer_overhead_s'?)",
        "section.json": "field 'calibration': expected an object of CalibrationParams fields "
        "(the file has 'calibraton')",
        "hw.json": "missing field 'hbm_bytes_per_s'",
        "extra.json": "unknown field 'peak_tflops' (did you mean 'peak_flops_per_s'?)",
    }
    for name, message in expected.items():
        path = tmp_path / name
        argv = ["replay", str(TRACE), "--preset", "h100x8-qwen7b", "--max-steps", "1"]
        argv += ["--policy", "nospec", "--hardware-file", str(path), "--out", str(tmp_path / "r")]
        if name.startswith(("hw", "extra")):
            argv = ["profile-info", str(PROFILE), "--hardware", str(path)]
        assert main(argv) == 2, name
        err = capsys.readouterr().err.strip()
        assert err == f"error: {'--hardware ' if 'profile-info' in argv else ''}{path}: {message}"


def test_a_replay_beyond_the_shapes_a_preset_was_fitted_on_says_so(tmp_path, capsys):
    """Hunt: the preset records its fit_domain (batches, contexts per sequence) and nothing
    read it: a 1-2k-context profile priced a 10k-token long tail without a word."""
    from tltsim.trace.files import save_trace
    from tltsim.trace.schema import Prompt, Response, Step, Trace

    preset = tmp_path / "h200.json"
    assert main(["calibrate", str(PROFILE), *FLAGS, "--out", str(preset)]) == 0
    short = tmp_path / "short.json"
    prompts = tuple(Prompt(f"p{i}", 100, (Response(900), Response(1500))) for i in range(4))
    save_trace(Trace({}, (Step(0, prompts),)), short)
    capsys.readouterr()
    argv = ["replay", "--preset", "h200x8-qwen7b", "--hardware-file", str(preset), "--policy",
            "nospec", "--max-steps", "1", "--out", str(tmp_path / "r")]  # fmt: skip
    assert main([*argv, str(short)]) == 0
    assert "calibration:" not in capsys.readouterr().out  # 1,600 tokens: inside 512-2,048
    assert main([*argv, str(TRACE)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("calibration:")]
    expected = (
        "calibration: this trace runs contexts up to 10,242 tokens per sequence (fitted up to "
        "2,048): h200.json's curves are extrapolated there (profile those shapes with tltrun "
        "profile and calibrate again)"
    )
    assert lines == [expected]
    # advise says it among its notes (advise.json too)
    argv = ["advise", str(TRACE), "--preset", "h200x8-qwen7b", "--hardware-file", str(preset),
            "--max-steps", "1", "--num-seeds", "1", "--thresholds", "32", "--strategy-sets",
            "chains", "--out", str(tmp_path / "a")]  # fmt: skip
    assert main(argv) == 0
    assert f"  note: {expected}" in capsys.readouterr().out.splitlines()
    assert expected in json.loads((tmp_path / "a" / "advise.json").read_text())["notes"]
    # a sweep too, once whatever its points (hunt: it said nothing), and in summary.json
    spec = tmp_path / "s.toml"
    spec.write_text(f'trace = "{TRACE}"\nseeds = [0]\nmax_steps = 1\n[fixed]\npreset = '
                    f'"h200x8-qwen7b"\nhardware = "{preset}"\n[grid]\npolicy = ["static", '
                    '"tlt"]\n')  # fmt: skip
    assert main(["sweep", str(spec), "--workers", "1", "--out", str(tmp_path / "s")]) == 0
    assert capsys.readouterr().out.splitlines().count(expected) == 1
    assert json.loads((tmp_path / "s" / "summary.json").read_text())["notes"] == [expected]


def test_a_unit_slip_in_a_hardware_file_is_refused(tmp_path, capsys):
    """A bandwidth written in TB/s (3.35) priced every byte a trillion times too slowly, and a
    replay said nothing: values beyond any CPU core or GPU are refused, naming the unit."""
    fields = {"name": "X", "peak_flops_per_s": 989e12, "hbm_bytes_per_s": 3.35e12,
              "memory_bytes": 80e9, "link_bytes_per_s": 450e9}  # fmt: skip
    for name, slip, unit in (("hbm_bytes_per_s", 3.35, "3.35e12 for 3.35 TB/s"),
                             ("memory_bytes", 80, "80e9 for 80 GB"),
                             ("peak_flops_per_s", 989, "989e12 for 989 TFLOP/s")):  # fmt: skip
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**fields, name: slip}))
        assert main(["profile-info", str(PROFILE), "--hardware", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --hardware {path}: HardwareSpec 'X': {name} {slip:g} is ")
        assert err.endswith(f"(the unit is in the name: {unit})\n")
    path.write_text(json.dumps(fields))
    assert main(["profile-info", str(PROFILE), "--hardware", str(path)]) == 0


def test_bytes_are_priced_in_the_dtype_the_profile_was_timed_in(tmp_path):
    """Hunt: the fit priced the weights in the sidecar config.json's torch_dtype (a float32
    config beside a bf16 run moved 0.69 to 0.87 of the bandwidth) and never in the dtype the
    profile ran (a float32 run, every CPU profile, was priced in bf16)."""
    from tltsim.cli.profile_info import model_of_profile
    from tltsim.cost.profile import load_profile

    def timed(name: str, model_dtype: str, run_dtype: str) -> Path:
        path = variant(tmp_path, name)
        meta = json.loads(path.with_suffix(".json").read_text())
        meta["model"]["torch_dtype"], meta["config"]["dtype"] = model_dtype, run_dtype
        path.with_suffix(".json").write_text(json.dumps(meta))
        return path

    shipped = model_of_profile(None, load_profile(PROFILE))
    assert (shipped.bytes_per_param, shipped.kv_bytes_per_elem) == (2, 2)
    config_fp32 = model_of_profile(None, load_profile(timed("a", "float32", "bfloat16")))
    assert config_fp32 == shipped
    run_fp32 = model_of_profile("Qwen2.5-1.5B", load_profile(timed("b", "bfloat16", "float32")))
    assert (run_fp32.bytes_per_param, run_fp32.kv_bytes_per_elem) == (4, 4)


def test_a_hardware_file_beside_a_profile_that_prices_every_op_is_said_unused(tmp_path, capsys):
    """Hunt: replay --profile (every op measured) --hardware-file warned of the file's fit
    error and extrapolation, yet its step times were byte-identical without the file."""
    preset = tmp_path / "h200.json"
    assert main(["calibrate", str(PROFILE), *FLAGS, "--out", str(preset)]) == 0
    capsys.readouterr()
    argv = ["replay", str(TRACE), "--preset", "h200x8-qwen7b", "--profile", str(PROFILE),
            "--policy", "nospec", "--max-steps", "1"]  # fmt: skip
    assert main([*argv, "--hardware-file", str(preset), "--out", str(tmp_path / "a")]) == 0
    said = capsys.readouterr()
    assert f"warning: --hardware-file {preset}: not used: --profile {PROFILE} measures" in said.err
    assert "calibration:" not in said.out
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    steps = [(tmp_path / run / "steps.csv").read_text() for run in "ab"]
    assert steps[0] == steps[1]


def test_an_output_file_of_another_format_is_not_written_over(tmp_path, capsys):
    """Hunt: ``calibrate --out`` a trace, or a replay's summary.json, replaced it (the next
    replay of the trace failed); ``gen`` and ``fit`` wrote over a preset the same way."""
    trace = tmp_path / "t.json"
    trace.write_bytes(TRACE.read_bytes())
    summary = tmp_path / "summary.json"
    summary.write_text('{"policies": {}}')
    preset = tmp_path / "h.json"
    for out, held in ((trace, "a tlt-trace file"), (summary, "a file of another kind")):
        before = out.read_bytes()
        assert main(["calibrate", str(PROFILE), *FLAGS, "--out", str(out)]) == 2
        assert capsys.readouterr().err == (
            f"error: --out {out}: holds {held}, not a tlt-hardware file; choose another name (or "
            "remove it)\n"
        )
        assert out.read_bytes() == before
    assert main(["calibrate", str(PROFILE), *FLAGS, "--out", str(preset)]) == 0
    assert main(["calibrate", str(PROFILE), *FLAGS, "--out", str(preset)]) == 0  # its own kind
    assert main(["gen", "--out", str(preset)]) == 2
    assert "holds a tlt-hardware file, not a tlt-trace file" in capsys.readouterr().err
    assert main(["fit", str(TRACE), "--out", str(preset)]) == 2
    assert "holds a tlt-hardware file, not a tlt-drafter-dynamics file" in capsys.readouterr().err
    assert main(["gen", "--out", str(trace), "--num-steps", "1"]) == 0  # a trace over a trace


def test_calibrate_asks_only_for_what_the_sidecar_lacks(tmp_path, capsys):
    """Hunt: a CPU profile (its sidecar names no GPU preset, but its model) asked for "--model
    and --hardware"; --hardware alone runs it."""
    cpu = variant(tmp_path, "cpu")
    meta = json.loads(cpu.with_suffix(".json").read_text())
    meta["hardware"] = "AMD EPYC, 2 CPUs, 1 torch threads"
    cpu.with_suffix(".json").write_text(json.dumps(meta))
    assert main(["calibrate", str(cpu), "--out", str(tmp_path / "h.json")]) == 2
    assert capsys.readouterr().err == (
        f"error: {cpu}: need --hardware (the sidecar names no preset for the hardware)\n"
    )


def test_a_large_json_is_told_by_its_head_or_left_unchecked(tmp_path, monkeypatch):
    """Review: a JSON over the size cap read as "another kind", so a rerun into one's own
    300 MB trace was refused; parsing it whole to read one key cost GBs."""
    from tltsim.cli import args

    monkeypatch.setattr(Path, "stat", lambda self, **kw: _Big())
    head = tmp_path / "t.json"
    head.write_text('{"format": "tlt-trace", "version": 1, "steps": []}')
    assert args.file_format_of(head) == "tlt-trace"  # (its first MiB names it)
    anonymous = tmp_path / "a.json"
    anonymous.write_text('{"calibration": {}}')
    assert args.file_format_of(anonymous) is None  # cannot tell: left unchecked


class _Big:
    st_size = 2**30
    st_mode = 0o100644
