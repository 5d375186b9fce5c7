"""What a profile lacks is said where it is used: replay/compare warn once about a profile of a
run that did not end or without some op (the fallback prices those with another machine's and
model's physics) and config.json records it; calibrate refuses a --tp other than the profile's,
warns when the fit ends on a bound, and finds the preset of a sidecar's device name.

Run: .venv/bin/python -m pytest tests/test_profile_gaps.py -q
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from test_calibrated import TRUE, _cost, _profile_rows, _write_profile

from tltsim.cli.main import main
from tltsim.cost.hardware import preset_of_device
from tltsim.cost.measured import ProfileGapWarning, with_profile
from tltsim.cost.profile import ProfileRow, load_profile
from tltsim.cost.roofline import RooflineCost
from tltsim.cost.specs import get_hardware, get_model

SHIPPED = Path(__file__).resolve().parents[1] / "profiles" / "h200_qwen2.5-1.5b_random.csv"


def _shipped_copy(tmp_path: Path, keep_ops: tuple[str, ...] | None = None, **marks) -> Path:
    lines = SHIPPED.read_text().splitlines(keepends=True)
    kept = [lines[0]] + [ln for ln in lines[1:] if keep_ops is None or ln.split(",")[0] in keep_ops]
    path = tmp_path / "p.csv"
    path.write_text("".join(kept))
    meta = json.loads(SHIPPED.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**meta, **marks}))
    return path


def test_a_complete_profile_warns_nothing_and_a_gap_is_said_once(tmp_path: Path) -> None:
    roofline = RooflineCost(get_model("Qwen2.5-1.5B"), get_hardware("H200"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileGapWarning)
        with_profile(SHIPPED, roofline)
    rollout = ("decode", "verify", "drafter", "prefill", "sd_switch")
    cut = _shipped_copy(tmp_path, rollout, partial="measured: 2 of 5 rounds; no training ops")
    with pytest.warns(ProfileGapWarning) as caught:
        with_profile(cut, roofline)
    (message,) = [str(w.message) for w in caught]
    assert "did not end (partial: measured: 2 of 5 rounds" in message
    assert "no rows for train, drafter_train: RooflineCost (H200, Qwen2.5-1.5B) prices" in message


def test_replay_says_and_records_what_the_profile_lacks(tmp_path: Path, capsys) -> None:
    """A profile made without --drafter gave a TLT speedup of CPU decode against the fallback's
    H100 verify and drafter, said only in the last line of the output."""
    path = _shipped_copy(tmp_path, ("decode", "prefill", "train"))
    trace = Path(__file__).resolve().parents[1] / "traces" / "synth_reasoning_rl.json"
    argv = ["replay", str(trace), "--profile", str(path), "--preset", "h100x64-qwen7b"]
    argv += ["--model", "Qwen2.5-1.5B", "--hardware", "H200", "--policy", "nospec"]
    argv += ["--max-steps", "1", "--cost-error", "0", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: profile" in err and "no rows for verify, drafter, drafter_train" in err
    record = json.loads((tmp_path / "r" / "config.json").read_text())["cost_model"]["profile"]
    assert record["ops_not_measured"] == ["verify", "drafter", "drafter_train"]
    assert record["incomplete"] == {}


def test_calibrate_refuses_another_tp_and_finds_the_device_preset(tmp_path: Path, capsys) -> None:
    pytest.importorskip("scipy")
    out = tmp_path / "h.json"
    assert main(["calibrate", str(SHIPPED), "--tp", "2", "--out", str(out)]) == 2
    assert "--tp 2: " in capsys.readouterr().err and not out.exists()
    # the sidecar says "NVIDIA H200", the device's name, not the preset's
    assert load_profile(SHIPPED).meta["hardware"] == "NVIDIA H200"
    assert main(["calibrate", str(SHIPPED), "--out", str(out)]) == 0
    assert "on H200, tp=1" in capsys.readouterr().out
    assert (
        preset_of_device("NVIDIA  H200") == "H200" and preset_of_device("NVIDIA H200 NVL") is None
    )
    assert preset_of_device("NVIDIA H100 PCIe") is None


def test_calibrate_warns_when_the_fit_ends_on_a_bound(tmp_path: Path, capsys) -> None:
    """A CPU profile fitted as an H100 put every fraction on its floor, said only as a note on
    the device name; the preset then charged 96 s for a 126-token rollout."""
    pytest.importorskip("scipy")
    rows = _profile_rows(_cost(), noise=0.005)
    slow = [ProfileRow(r.op, r.batch, r.context_tokens, r.tokens_per_seq, *(
        500 * x for x in (r.seconds, r.seconds_p10, r.seconds_p90)), r.num_repeats) for r in rows]  # fmt: skip
    assert main(["calibrate", str(_write_profile(tmp_path / "slow.csv", slow))]) == 0
    err = capsys.readouterr().err
    assert "warning: fitted parameters at a bound: bandwidth_fraction = 0.05 (lower)" in err
    assert main(["calibrate", str(_write_profile(tmp_path / "ok.csv", rows))]) == 0
    assert "at a bound" not in capsys.readouterr().err
    assert TRUE.bandwidth_fraction > 0.05  # the fit of the honest profile is not on the floor


def test_profile_info_refuses_what_replay_refuses_and_names_the_gaps(tmp_path: Path, capsys):
    """profile-info said nothing of a profile replay then refused (one context value left at a
    batch: nothing to interpolate)."""
    path = _shipped_copy(tmp_path, ("decode", "verify", "drafter", "prefill", "sd_switch"))
    assert main(["profile-info", str(path)]) == 0
    assert "not measured (replay prices them by its cost model): train, drafter_train" in (
        capsys.readouterr().out
    )
    lines = path.read_text().splitlines(keepends=True)
    decode_b1 = [ln for ln in lines if ln.startswith("decode,1,")]
    path.write_text("".join(ln for ln in lines if ln not in decode_b1[1:]))
    assert main(["profile-info", str(path)]) == 2
    assert "batch 1: only one context tokens per sequence value measured" in capsys.readouterr().err


def test_profile_info_says_when_model_is_not_the_profiled_one(capsys):
    assert main(["profile-info", str(SHIPPED), "--model", "Qwen2.5-7B"]) == 0
    assert "note: --model Qwen2.5-7B: not the model the profile measured (hidden_size 1536 vs " in (
        capsys.readouterr().out
    )
    assert main(["profile-info", str(SHIPPED), "--model", "Qwen2.5-1.5B"]) == 0
    assert "not the model the profile measured" not in capsys.readouterr().out
