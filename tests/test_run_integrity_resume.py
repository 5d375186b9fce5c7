"""Resumes of real ``tltrun train`` runs (tiny model, 2 workers, 3 steps, a checkpoint after
every step; the fast checks on fake run directories: tests/test_run_integrity.py): the real
checkpoints verify; damaged checkpoints and a torn log resume like the uninterrupted run;
--override-config resumes run with the new setting; a changed policy starts afresh;
--keep-checkpoints on resume prunes the older ones.

Run: ``python -m pytest tests/test_run_integrity_resume.py -q`` (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_run_integrity import NUM_WORKERS, cli, flip_bytes, truncate
from test_train import TASK, config
from tiny_models import save_train_model

from tltrun.train import state as ts
from tltrun.train.launch import run_train


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_train_model(tmp_path_factory.mktemp("tiny"), TASK)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    keys = ("step", "reward_mean", "loss", "num_tokens", "actor_sha1", "rollout_sha1")
    return {k: row[k] for k in keys}


@pytest.fixture(scope="module")
def reference_run(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    run_train(config(model_dir, out), TASK)
    return out


@pytest.mark.slow
def test_real_checkpoints_verify(reference_run):
    for step in (1, 2, 3):
        ckpt = ts.checkpoint_dir(reference_run, step)
        assert ts.verify_checkpoint(ckpt, NUM_WORKERS) == []
        listed = json.loads((ckpt / ts.MANIFEST).read_text())["files"]
        expected = {"actor/model.safetensors", "drafter/model.safetensors"}
        expected |= {"dcp/.metadata", "drafter_dcp/.metadata"}  # DCP: actor, drafter + AdamW
        expected |= {f"{d}/__{r}_0.distcp" for d in ("dcp", "drafter_dcp") for r in (0, 1)}
        assert expected <= set(listed)


@pytest.mark.slow
def test_damaged_checkpoints_and_torn_log_resume_like_the_uninterrupted_run(
    model_dir, reference_run, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    shutil.rmtree(out / "final")
    flip_bytes(ts.checkpoint_dir(out, 3) / "actor/model.safetensors")
    truncate(ts.checkpoint_dir(out, 2) / "dcp/__0_0.distcp")
    with (out / "log.jsonl").open("a") as f:
        f.write('{"step": 3, "rew')
    code, err = cli(["train", "--out", str(out), "--resume"], capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 3, err
    assert any("step_000003" in w and "actor/model.safetensors: sha256" in w for w in warnings)
    assert any(
        "step_000002" in w and "dcp/__0_0.distcp" in w and "truncated" in w for w in warnings
    )
    assert any("log.jsonl: dropped a torn last line" in w for w in warnings)
    # resumed from step 1: steps 1 and 2 were redone, exactly as the first time
    assert [deterministic(r) for r in rows(out)] == [deterministic(r) for r in rows(reference_run)]
    for step in (2, 3):
        assert ts.verify_checkpoint(ts.checkpoint_dir(out, step), NUM_WORKERS) == []
    actor = "final/actor/model.safetensors"
    assert (out / actor).read_bytes() == (reference_run / actor).read_bytes()


@pytest.mark.slow
def test_override_config_resume_runs_with_the_new_setting(
    model_dir, reference_run, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    first = (out / "config.json").read_bytes()
    argv = ["train", "--out", str(out), "--resume", "--num-steps", "4", "--lr", "0.02"]
    code, err = cli(argv, capsys)
    assert code == 2 and "lr: 0.01 -> 0.02" in err
    code, err = cli(argv + ["--override-config"], capsys)
    assert code == 0, err
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3]
    history = [json.loads(line) for line in (out / ts.CONFIG_HISTORY).read_text().splitlines()]
    # the resume-neutral changes are recorded too, so that a plain --resume keeps them
    assert [(h["step"], h["diff"]) for h in history] == [
        (
            3,
            {
                "train.lr": [0.01, 0.02],
                "train.num_steps": [3, 4],
                "train.out": [str(reference_run), str(out)],
            },
        )
    ]
    assert (out / "config.json").read_bytes() == first
    assert ts.verify_checkpoint(ts.checkpoint_dir(out, 4), NUM_WORKERS) == []
    # the new learning rate is used: step 3's update differs from one at the old rate (the
    # checkpoint's optimizer state brought its lr back, so the override was recorded, unused)
    same = tmp_path / "same"
    shutil.copytree(reference_run, same)
    code, err = cli(["train", "--out", str(same), "--resume", "--num-steps", "4"], capsys)
    assert code == 0, err
    new, old = rows(out)[3], rows(same)[3]
    assert new["rollout_sha1"] == old["rollout_sha1"]  # the same weights rolled out step 3
    assert new["actor_sha1"] != old["actor_sha1"]


@pytest.mark.slow
def test_a_resume_that_changes_the_policy_starts_it_afresh(
    model_dir, reference_run, tmp_path, capsys
):
    """--override-config --policy tltbase on a NoSpec run: every worker failed on the saved
    (NoSpec) policy state, and a plain --resume after it failed the same way."""
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    argv = ["train", "--out", str(out), "--resume", "--num-steps", "4", "--policy", "tltbase",
            "--override-config"]  # fmt: skip
    code, err = cli(argv, capsys)
    assert code == 0, err
    assert "--policy changed: the SD policy starts afresh" in err
    code, err = cli(["train", "--out", str(out), "--resume", "--num-steps", "5"], capsys)
    assert code == 0, err  # the tltbase state of step 4's checkpoint loads
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3, 4]
    # the trace's meta names both launches (it named the last one's policy for every step)
    source = json.loads((out / "trace.json").read_text())["meta"]["source"]
    assert source == (
        "tltrun train, resumed with other settings: steps 0..2 policy nospec on 2 workers; "
        "steps 3..4 policy tltbase on 2 workers"
    )


@pytest.mark.slow
def test_a_resume_that_stops_drafting_carries_the_drafter_on(
    model_dir, reference_run, tmp_path, capsys
):
    """A resume under a policy that neither drafts nor spot-trains wrote checkpoints without
    drafter/: a later resume that drafts again started from a fresh, untrained drafter (hunt:
    tlt -> nospec -> tlt ended with the untrained one in final/drafter)."""
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    argv = ["train", "--out", str(out), "--resume", "--num-steps", "4", "--no-spot-training",
            "--override-config"]  # fmt: skip
    code, err = cli(argv, capsys)
    assert code == 0, err
    trained = (ts.checkpoint_dir(out, 3) / "drafter" / "model.safetensors").read_bytes()
    for carried in (ts.checkpoint_dir(out, 4) / "drafter", out / "final" / "drafter"):
        assert (carried / "model.safetensors").read_bytes() == trained
    assert ts.final_steps(out) == 4  # final/ records the steps it holds


@pytest.mark.slow
def test_keep_checkpoints_on_resume_prunes_the_older_ones(
    model_dir, reference_run, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    argv = ["train", "--out", str(out), "--resume", "--num-steps", "5", "--keep-checkpoints", "2"]
    code, err = cli(argv, capsys)
    assert code == 0, err  # a resume-neutral setting: no --override-config needed
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step_000004", "step_000005"]
    for step in (4, 5):
        assert ts.verify_checkpoint(ts.checkpoint_dir(out, step), NUM_WORKERS) == []
