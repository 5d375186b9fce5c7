"""``tltrun profile``'s inputs and what it says about its own numbers: a sidecar path taken by a
directory refused before measuring, a floored verify row (the profile then charges more than it
measured) and a context beyond the model's positions each said once.

Run: .venv/bin/python -m pytest tests/test_profile_inputs.py -q
"""

# ruff: noqa: F811 (model_dirs: the fixture imported from test_profile_run)
from __future__ import annotations

import datetime
import json
import warnings

import numpy as np
import pytest
from test_profile_run import model_dirs, tiny_grid  # noqa: F401 (model_dirs: a fixture)

from tltrun.cli.main import main
from tltrun.cli.profile import _check_model_fits
from tltsim.errors import InputWarning
from tltsim.policy import SpecDecision


def test_a_sidecar_path_taken_by_a_directory_is_refused_before_measuring(
    model_dirs, tmp_path, capsys
):
    """It was found at the first write, after the first round, leaving two temporary files."""
    target, _ = model_dirs
    (tmp_path / "p.json").mkdir()
    assert main(["profile", "--model", str(target), "--out", str(tmp_path / "p.csv")]) == 2
    assert "its sidecar" in capsys.readouterr().err
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p.json"]


def test_a_floored_verify_row_is_said(recwarn):
    """verify = iteration - draft_steps x drafter, floored at 10% of the iteration: where the
    floor engages the profile charges more than was measured; the final rows say so."""
    from tltrun.profile.timing import Measure
    from tltrun.profile.torch_engine import point_rows

    d = SpecDecision.parse("2_1_2")
    timed = {
        ("decode", 1, 8): np.full(3, 1e-3),
        ("switch", 1, 8): np.full(3, 2e-3),
        ("draft", 1, 8, d): np.full(3, 3.0e-3),  # 1.5 ms a step: 3 ms of a 2.8 ms iteration
        ("iteration", 1, 8, d): np.full(3, 2.8e-3),
    }
    row = Measure(0, 3, "median").row
    rows = point_rows(1, 8, [d], timed, row)
    assert not [w for w in recwarn if issubclass(w.category, InputWarning)]  # per round: quiet
    with pytest.warns(InputWarning, match="strategy 2_1_2 at batch 1, context 8: 2 x drafter"):
        assert point_rows(1, 8, [d], timed, row, is_warned=True) == rows
    verify = next(r for r in rows if r.op == "verify")
    assert verify.seconds == pytest.approx(0.28e-3)  # the floor: 3 ms + 0.28 ms > 2.8 ms
    timed[("draft", 1, 8, d)] = np.full(3, 2.0e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InputWarning)
        point_rows(1, 8, [d], timed, row, is_warned=True)


def test_context_beyond_the_models_positions_is_said(model_dirs, tmp_path):
    target, _ = model_dirs
    positions = json.loads((target / "config.json").read_text())["max_position_embeddings"]
    cfg = tiny_grid(target, None, tmp_path / "p.csv", context_per_seq=(8, positions + 1))
    with pytest.warns(InputWarning, match=f"beyond .*max_position_embeddings \\({positions}\\)"):
        _check_model_fits(cfg)


def test_the_dtype_defaults_as_the_engines_and_the_sidecar_records_it(model_dirs, tmp_path):
    """--dtype defaulted to float32 everywhere: a GPU profile timed fp32 for bf16 runs."""
    import dataclasses

    from tltrun.profile.measure import profile_meta

    target, _ = model_dirs
    cfg = tiny_grid(target, None, tmp_path / "p.csv")
    assert cfg.dtype is None and cfg.dtype_name == "float32"
    assert dataclasses.replace(cfg, device="cuda").dtype_name == "bfloat16"
    assert dataclasses.replace(cfg, device="cuda", dtype="float32").dtype_name == "float32"
    meta = profile_meta(cfg, datetime.datetime(2026, 1, 1))
    assert meta["config"]["dtype"] == "float32"
    # vLLM takes no float64 (its pydantic refusal was an internal error; review)
    with pytest.raises(ValueError, match="--dtype float64: expected one of float32, bfloat16"):
        dataclasses.replace(cfg, backend="vllm", dtype="float64")
