"""A killed ``tltrun profile`` keeps what it measured: after every complete round the points so
far are written (rollout ops, then training ops), with the sidecar's ``partial`` saying how far
the run got, and the finished run's write drops it; ``write_profile`` replaces both files whole,
so a kill mid-write leaves the previous profile, not a torn one.

Run: .venv/bin/python -m pytest tests/test_profile_killed.py -q
"""

from __future__ import annotations

import csv
import json

import pytest
from test_profile_run import NOW, _vllm_grid, _vllm_model, model_dirs, tiny_grid  # noqa: F401

from tltrun.profile import measure as measure_module
from tltrun.profile.measure import run_profile
from tltrun.profile.timing import Series
from tltsim.cost import profile as profile_module
from tltsim.cost.profile import OPS, load_profile, write_profile


class Killed(BaseException):
    """Stands in for SIGKILL: nothing in run_profile catches it, so no final write happens."""


def test_killed_in_the_rollout_ops_keeps_the_completed_rounds(model_dirs, tmp_path):  # noqa: F811
    target, drafter = model_dirs
    out = tmp_path / "p.csv"

    def kill_after_second_round(r: int) -> None:
        if r == 1:
            raise Killed

    with pytest.raises(Killed):
        run_profile(tiny_grid(target, drafter, out), NOW, between_rounds=kill_after_second_round)
    profile = load_profile(out)
    assert set(profile.ops) == set(OPS) - {"train", "drafter_train"}
    assert {r.num_repeats for r in profile.rows} == {2}
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["partial"] == (
        "the run did not finish; measured: 2 of 3 rounds of the rollout ops; no training ops"
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_killed_vllm_profile_keeps_its_first_round(tmp_path):
    """The vLLM backend's rows (contexts averaged over the timed calls) after one round."""
    target, drafter = _vllm_model(tmp_path)
    out = tmp_path / "p.csv"

    def kill_after_first_round(r: int) -> None:
        raise Killed

    with pytest.raises(Killed):
        run_profile(_vllm_grid(target, drafter, out), NOW, between_rounds=kill_after_first_round)
    profile = load_profile(out)
    assert set(profile.ops) == set(OPS) - {"train", "drafter_train"}
    assert {r.num_repeats for r in profile.rows} == {1}
    assert profile.meta["partial"].endswith("1 of 3 rounds of the rollout ops; no training ops")
    decode = profile.rows_of("decode")  # as a whole run's: the point's context + 2
    assert {(r.batch, round(r.context_tokens / r.batch)) for r in decode} == {
        (b, c + 2) for b in (1, 3) for c in (8, 24)
    }


def test_killed_in_the_training_ops_keeps_both(model_dirs, tmp_path, monkeypatch):  # noqa: F811
    """Killed in the training ops' second round: every rollout round and the first training
    round are on disk; a finished run's files carry no ``partial``."""
    target, drafter = model_dirs
    out = tmp_path / "p.csv"
    calls = [0]

    def killed_in_second_round() -> None:
        calls[0] += 1  # round 1: one warm-up and one timed call; round 2 warms up again
        if calls[0] == 3:
            raise Killed

    real = measure_module.train_series
    monkeypatch.setattr(
        measure_module,
        "train_series",
        lambda *a: [*real(*a), Series(("train", 3, 8), killed_in_second_round)],
    )
    with pytest.raises(Killed):
        run_profile(tiny_grid(target, drafter, out), NOW)
    profile = load_profile(out)
    assert set(profile.ops) == set(OPS)
    trained = {r for r in profile.rows if r.op in ("train", "drafter_train")}
    assert {r.num_repeats for r in trained} == {1}
    assert {r.num_repeats for r in set(profile.rows) - trained} == {3}
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["partial"] == (
        "the run did not finish; measured: every round of the rollout ops, 1 of 3 of the "
        "training ops"
    )
    monkeypatch.setattr(measure_module, "train_series", real)
    run_profile(tiny_grid(target, drafter, out), NOW)
    assert "partial" not in json.loads(out.with_suffix(".json").read_text())
    assert {r.num_repeats for r in load_profile(out).rows} == {3}


def test_a_write_killed_midway_leaves_the_previous_profile(tmp_path, monkeypatch):
    """The CSV and the sidecar go to temporary names and replace the old files only when
    whole: a profile rewritten every round is never read half-written."""
    rows = [
        profile_module.ProfileRow("decode", b, 8 * b, 1, 1e-3 * b, 1e-3 * b, 1e-3 * b, 3)
        for b in (1, 2, 4)
    ]
    meta = {**{k: "x" for k in profile_module.META_KEYS}, "tp": 1}
    out = tmp_path / "p.csv"
    write_profile(rows, out, meta)
    before = (out.read_text(), out.with_suffix(".json").read_text())

    real_writer = csv.writer

    class TornWriter:
        def __init__(self, f):
            self.inner, self.num_rows = real_writer(f), 0

        def writerow(self, row):
            self.num_rows += 1
            if self.num_rows == 3:
                raise Killed
            self.inner.writerow(row)

    monkeypatch.setattr(profile_module.csv, "writer", TornWriter)
    with pytest.raises(Killed):
        write_profile(rows[:2], out, {**meta, "partial": "yes"})
    assert (out.read_text(), out.with_suffix(".json").read_text()) == before
    assert len(load_profile(out).rows) == 3


def test_a_rerun_killed_before_its_first_round_leaves_no_earlier_profile(
    model_dirs,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    """Hunt: a profile into an earlier one's --out, killed while the model loaded, left the
    earlier files unmarked, as if this run's (of another model, say)."""
    from tltrun.cli.main import main

    target, drafter = model_dirs
    out = tmp_path / "p.csv"
    run_profile(tiny_grid(target, drafter, out), NOW)  # the earlier, finished profile

    def killed(cfg, now):
        raise Killed

    monkeypatch.setattr(measure_module, "run_profile", killed)
    with pytest.raises(Killed):
        main(["profile", "--model", str(target), "--out", str(out)])
    assert not out.exists() and not out.with_suffix(".json").exists()
