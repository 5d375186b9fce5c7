"""``tltrun train --deterministic``: two runs of ``--policy tlt`` with spot training and the same
seed write the same ``log.jsonl`` (timing columns aside) and the same final actor and drafter,
even when one worker is made slow (the ``TLTRUN_TEST_ROLLOUT_DELAY`` hook of
``tltrun.train.worker``); without the flag the same slowdown changes the spot updates.

Run: ``python -m pytest tests/test_deterministic.py -q`` (the default test spawns 2 runs of 2
workers, about 40 s on 2 cores; ``-m slow`` adds the non-deterministic contrast).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import TASK, config, model_dir, rows  # noqa: F401  (model_dir: a fixture)

from tltrun.train.launch import run_train

# log.jsonl columns measured with a clock; every other column must match exactly
TIMING = {
    "rollout_s",
    "worker_rollout_s",
    "train_s",
    "drafter_train_s",
    "idle_worker_s",
    "step_s",
    "spot_wait_s",
    "reward_s",
    "eval_s",
}


def run(model: Path, out: Path, monkeypatch, delay: str | None, **overrides) -> Path:
    if delay:
        monkeypatch.setenv("TLTRUN_TEST_ROLLOUT_DELAY", delay)
    else:
        monkeypatch.delenv("TLTRUN_TEST_ROLLOUT_DELAY", raising=False)
    fields = dict(policy="tlt", num_steps=3, checkpoint_every=10, tlt_threshold=2)
    fields.update(overrides)
    run_train(config(model, out, **fields), TASK)
    return out


def weights(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for part in ("actor", "drafter"):
        for file in sorted((out / "final" / part).glob("*.safetensors")):
            tensors.update({f"{part}/{k}": v for k, v in load_file(file).items()})
    return tensors


def untimed(out: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows(out)]


def test_deterministic_runs_match_when_a_worker_is_slow(model_dir, tmp_path, monkeypatch):  # noqa: F811
    # spot_max_epochs=2: budgets of 2-12 updates per worker and step (a few seconds in all)
    plain = run(
        model_dir, tmp_path / "a", monkeypatch, None, is_deterministic=True, spot_max_epochs=2
    )
    # worker 0 (a quarter of the prompts) would finish first; delayed, it usually finishes last
    slow = run(
        model_dir, tmp_path / "b", monkeypatch, "0:1.5", is_deterministic=True, spot_max_epochs=2
    )
    assert all(r["worker_rollout_s"][0] >= 1.5 for r in rows(slow))  # the hook took effect
    assert untimed(plain) == untimed(slow)
    a, b = weights(plain), weights(slow)
    assert set(a) == set(b) and any(k.startswith("drafter/") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = rows(plain)
    assert all(r["drafter_updates"] >= 1 and r["sd_on_fraction"] > 0 for r in log)
    assert all(r["spot_wait_s"] >= 0 for r in log)
    assert len({r["drafter_sha1"][0] for r in log}) == 3  # the drafter trained every step
    # the tokens of the kept drafter's updates only (4 sequences of <= 32 response tokens
    # each): the other workers' updates are discarded, and were counted
    assert all(0 < r["drafter_trained_tokens"] <= r["drafter_updates"] * 4 * 32 for r in log)
    assert len(set(r["actor_sha1"][0] for r in log)) == 3


@pytest.mark.slow
def test_without_the_flag_a_slow_worker_changes_spot_training(model_dir, tmp_path, monkeypatch):  # noqa: F811
    # The contrast: no update cap, so the rollout's end (preemption) decides the updates;
    # worker 1 delayed by 2 s gives worker 0 about 2 s more of spot training in every step.
    plain = run(model_dir, tmp_path / "a", monkeypatch, None, num_steps=2)
    slow = run(model_dir, tmp_path / "b", monkeypatch, "1:2", num_steps=2)
    updates = [[r["drafter_updates"] for r in rows(out)] for out in (plain, slow)]
    assert all(u_slow > u_plain for u_plain, u_slow in zip(*updates, strict=True)), updates
    assert rows(plain)[1]["drafter_sha1"] != rows(slow)[1]["drafter_sha1"]


@pytest.mark.slow
def test_deterministic_run_resumed_matches_uninterrupted(model_dir, tmp_path, monkeypatch):  # noqa: F811
    # the spot RNG streams, harvest and bandit state travel through the checkpoint
    whole = run(
        model_dir, tmp_path / "a", monkeypatch, None, is_deterministic=True, spot_max_epochs=2
    )
    part = run(
        model_dir, tmp_path / "b", monkeypatch, None, is_deterministic=True, spot_max_epochs=2,
        num_steps=2,
    )  # fmt: skip
    cfg = config(
        model_dir, part, policy="tlt", num_steps=3, checkpoint_every=10, tlt_threshold=2,
        is_deterministic=True, spot_max_epochs=2,
    )  # fmt: skip
    run_train(cfg, TASK, is_resume=True)
    assert untimed(part) == untimed(whole)
    a, b = weights(whole), weights(part)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_deterministic_tltbase_resumed_matches_uninterrupted(model_dir, tmp_path, monkeypatch):  # noqa: F811
    # the history drafter's index (earlier steps' responses, which the cross-prompt tier
    # drafts from) travels through the checkpoint: a resume drafts, so samples, the same
    # spot_max_epochs=2 as above: uncapped, the drafter's deterministic spot budgets took most
    # of this test's 200 s, for a drafter tltbase never drafts with
    fields = dict(policy="tltbase", is_deterministic=True, spot_max_epochs=2)
    whole = run(model_dir, tmp_path / "a", monkeypatch, None, **fields, num_steps=4)
    part = run(model_dir, tmp_path / "b", monkeypatch, None, **fields, num_steps=2)
    cfg = config(
        model_dir, part, num_steps=4, checkpoint_every=10, tlt_threshold=2, **fields
    )  # fmt: skip
    run_train(cfg, TASK, is_resume=True)
    assert untimed(part) == untimed(whole)
