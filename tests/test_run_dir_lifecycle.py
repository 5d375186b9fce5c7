"""The life of a ``tltrun train`` run directory across fresh starts and resumes (review of
session 29, each case reproduced on real runs first): a fresh run never inherits a killed
run's leftovers; a resume keeps the resume-neutral settings it was given, accepts what it may
change and refuses inputs that changed under it (data, evaluation rows, --model-dir); cut logs
leave no trace of the steps a resume redoes; a damaged config.json is one line.

Fast: fake run directories (tests/test_run_integrity.py's helpers) and the launcher up to the
point where workers would start. Run: ``python -m pytest tests/test_run_dir_lifecycle.py -q``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from test_run_integrity import fake_checkpoint, fake_logs, make_fake_run
from test_train import TASK, config
from tiny_models import save_train_model

from tltrun.cli.main import main
from tltrun.cli.train_drafter import TrainDrafterConfig
from tltrun.data.readers import READER_VERSION
from tltrun.train import run_logs
from tltrun.train import state as ts
from tltrun.train.launch import prepare_run_dir
from tltsim.errors import UsageError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_train_model(tmp_path_factory.mktemp("tiny"), TASK)


def data(**changes) -> dict:
    """The launcher's record of a run's inputs (tltrun.train.launch.check_inputs)."""
    return {
        "fingerprint": "both",
        "train_fingerprint": "train",
        "eval_fingerprint": "eval",
        "model_sha256": "weights",
        "eval_max_prompts": 64,  # TrainConfig's default
        "reader_version": READER_VERSION,
        **changes,
    }


def test_a_fresh_run_clears_a_killed_runs_leftovers(model_dir, tmp_path):
    """A run killed during its first checkpoint leaves ckpt/.tmp_step_* (another world size's
    rank files in it), an exported drafter and TensorBoard events: a fresh run in the same
    directory committed those files inside its own checkpoint and showed the events twice."""
    leftovers = [
        "ckpt/.tmp_step_000001/rank1.pt",
        "drafter/model.safetensors",
        "drafter.old/model.safetensors",
        "tensorboard/events.out.tfevents.1",
        "rollouts/step_000000.jsonl",
        "reward_errors.log",
        "worker_errors.log",
        "trace.json",
        "log.jsonl",
        "config.json",  # the killed run wrote it first: what marks the rest as a run's
    ]
    for rel in leftovers:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("from the killed run\n")
    prepare_run_dir(config(model_dir, tmp_path), TASK, is_resume=False, is_override_config=False)
    assert [rel for rel in leftovers if (tmp_path / rel).exists()] == ["config.json"]
    # the run's own inputs stay, whatever their names (--drafter-dir OUT/drafter was deleted)
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    (tmp_path / "tensorboard").mkdir()
    cfg = config(model_dir, tmp_path, drafter_dir=str(tmp_path / "drafter"))
    prepare_run_dir(cfg, TASK, is_resume=False, is_override_config=False)
    assert (tmp_path / "drafter" / "config.json").is_file()
    assert not (tmp_path / "tensorboard").exists()
    # a directory no run wrote a config.json in is not cleared (--out . over a user's files)
    plain = tmp_path / "plain"
    (plain / "tensorboard").mkdir(parents=True)
    prepare_run_dir(config(model_dir, plain), TASK, is_resume=False, is_override_config=False)
    assert (plain / "tensorboard").is_dir()
    # a finished run without checkpoints left its final model: refused, nothing touched
    (tmp_path / "final" / "actor").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"final model \(final/\) of an earlier run that fin"):
        prepare_run_dir(
            config(model_dir, tmp_path), TASK, is_resume=False, is_override_config=False
        )
    # and --resume is no way round: with no checkpoint it would retrain from step 0 over final/
    with pytest.raises(UsageError, match=r"the run finished \(final/\) and no checkpoint is left"):
        prepare_run_dir(cfg, TASK, is_resume=True, is_override_config=False)
    assert (tmp_path / "final" / "actor").is_dir()


def test_resume_keeps_the_neutral_settings_it_was_given(model_dir, tmp_path):
    """--resume --num-steps 6 then a plain --resume (what a stop message says to run) went back
    to config.json's 3 steps and ended the run early, silently."""
    make_fake_run(model_dir, tmp_path)  # 3 steps, checkpoints 1..3
    longer = config(model_dir, tmp_path, num_steps=6, keep_checkpoints=2)
    prepare_run_dir(longer, TASK, is_resume=True, is_override_config=False)
    now = ts.effective_config(tmp_path)["train"]
    assert (now["num_steps"], now["keep_checkpoints"]) == (6, 2)
    history = [json.loads(x) for x in (tmp_path / ts.CONFIG_HISTORY).read_text().splitlines()]
    assert history[-1]["diff"] == {"train.keep_checkpoints": [0, 2], "train.num_steps": [3, 6]}
    # a checkpoint past --num-steps: said, not silently nothing
    with pytest.warns(ts.RunDirWarning, match="at step 3, past --num-steps 2: no step runs"):
        prepare_run_dir(
            config(model_dir, tmp_path, num_steps=2), TASK, is_resume=True, is_override_config=False
        )


def test_resume_refuses_inputs_that_changed_and_accepts_fewer_eval_prompts(model_dir, tmp_path):
    make_fake_run(model_dir, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "data": data()}))

    def resume(inputs: dict, is_override_config: bool = False, **fields) -> None:
        cfg = config(model_dir, tmp_path, **fields)
        prepare_run_dir(cfg, TASK, is_resume=True, is_override_config=is_override_config,
                        data=inputs)  # fmt: skip

    with pytest.raises(UsageError, match=r"different data .*rows of --data changed"):
        resume(data(train_fingerprint="other"))
    with pytest.raises(UsageError, match=r"rows of --eval-data / --eval-split changed"):
        resume(data(eval_fingerprint="other"))
    # the KL reference is reloaded from --model-dir: other weights there are refused
    with pytest.raises(UsageError, match="other weights in --model-dir"):
        resume(data(model_sha256="retrained"))
    # --eval-max-prompts may change on resume (it was refused as "different data", even with
    # --override-config): a reasoning-gym evaluation set is generated that many rows long
    gym = "reasoning-gym:chain_sum"
    changed = dict(eval_max_prompts=7, data=gym, eval_data=gym, is_override_config=True)
    resume(data(eval_fingerprint="other", eval_max_prompts=7), **changed)
    # ... and stays allowed on the next resume at 7 (the history now says 7; config.json's
    # evaluation fingerprint is still the one taken at 64)
    resume(data(eval_fingerprint="other", eval_max_prompts=7), **changed)
    # a file's (or a split's) rows are fingerprinted before the cut: still compared
    with pytest.raises(UsageError, match=r"rows of --eval-data / --eval-split changed"):
        file_eval = {**changed, "eval_data": None}
        resume(data(eval_fingerprint="other", eval_max_prompts=7), **file_eval)
    # a run recorded before the split fingerprints compares the combined one, as then
    (tmp_path / ts.CONFIG_HISTORY).unlink()
    combined = {"fingerprint": "both", "reader_version": READER_VERSION}  # (its reading: now's)
    (tmp_path / "config.json").write_text(json.dumps({**saved, "data": combined}))
    resume(data(train_fingerprint="new", model_sha256="new"))
    with pytest.raises(UsageError, match="different data"):
        resume(data(fingerprint="other"))


def test_a_run_of_an_older_data_reader_resumes_with_a_warning(model_dir, tmp_path):
    """Review: session 38's readers read whole float answers, NaN and pandas' index otherwise,
    so a run started before them had other fingerprints of the same file and its resume was
    refused ('rows of --data changed; restore them'). Its data cannot be compared: said. The
    KL reference's weights still can: still refused."""
    make_fake_run(model_dir, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    older = {k: v for k, v in data().items() if k != "reader_version"}
    (tmp_path / "config.json").write_text(json.dumps({**saved, "data": older}))

    def resume(inputs: dict) -> None:
        prepare_run_dir(config(model_dir, tmp_path), TASK, is_resume=True,
                        is_override_config=False, data=inputs)  # fmt: skip

    with pytest.warns(
        ts.RunDirWarning,
        match=r"reader version 1, now 3: whole float .*; chat messages' other keys\), so .*cannot be told",
    ):
        resume(data(train_fingerprint="read otherwise"))
    with pytest.raises(UsageError, match="other weights in --model-dir"):
        resume(data(train_fingerprint="read otherwise", model_sha256="retrained"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resume(data())  # the same fingerprints: nothing to say


def test_resume_without_a_run_and_a_damaged_config_are_one_line(model_dir, tmp_path, capsys):
    base = ["train", "--model-dir", str(model_dir), "--num-steps", "1"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*base, "--out", str(empty), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {empty}: --resume, but no run was started here (no config.json)"
    assert not (empty / "config.json").exists()
    # a directory that is not there is not made (the refusal left it, holding run.lock)
    missing = tmp_path / "missing"
    assert main([*base, "--out", str(missing), "--resume"]) == 2
    assert "no such directory" in capsys.readouterr().err and not missing.exists()
    # the same without --model-dir, which a resume reads from the run (it said "--model-dir
    # and --out are required", though --out was given)
    for out, says in ((missing, "no such directory"), (empty, "no config.json")):
        assert main(["train", "--out", str(out), "--resume"]) == 2
        assert f"no run was started here ({says})" in capsys.readouterr().err
    out = tmp_path / "run"
    make_fake_run(model_dir, out)
    saved = json.loads((out / "config.json").read_text())
    bad_type = {**saved, "train": {**saved["train"], "group_size": 2.5}}
    damages = {  # what is written -> what the one line says (no Python exception text)
        "[]": "config.json: not what tltrun train wrote (expected an object with 'train' and",
        "null": "(expected an object with 'train' and 'task' objects, got None)",
        json.dumps({**saved, "train": []}): "config.json: not what tltrun train wrote (expected "
        "a 'train' object, got list)",
        json.dumps(bad_type): "config.json: group_size: expected an integer, got 2.5",
    }
    for damaged, expected in damages.items():
        (out / "config.json").write_text(damaged)
        assert main([*base, "--out", str(out), "--resume"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and expected in err, err
    (out / "config.json").write_text(json.dumps(saved))
    histories = {
        '{"step": 1, "diff": []}': 'line 1: not what tltrun train wrote (expected a "diff" object',
        '{"step": 1, "diff": {"x.lr": [1, 2]}}': "(expected 'train.<field>' or 'task.<field>'",
        '{"step": 1, "diff": {"train.lr": 2}}': "(expected [old, new] for train.lr, got 2)",
        "{": "config_history.jsonl, line 1: not JSON as tltrun train writes it",
        # a value the history set is not blamed on config.json alone
        '{"step": 1, "diff": {"train.group_size": [2, 2.5]}}': "config.json + config_history"
        ".jsonl: group_size: expected an integer, got 2.5",
    }
    for line, expected in histories.items():
        (out / ts.CONFIG_HISTORY).write_text(line + "\n")
        assert main([*base, "--out", str(out), "--resume"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and expected in err, err


def test_cut_logs_drop_the_redone_steps_reward_errors_and_trace(tmp_path):
    """Resumed at step 1: reward errors of steps 1 and 2 were logged twice and trace.json kept
    steps the run redoes."""
    fake_logs(tmp_path, 3)
    steps = [{"step": s, "prompts": [{"id": "p", "prompt_tokens": 3, "responses": [4]}]}
             for s in range(3)]  # fmt: skip
    (tmp_path / "trace_steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    meta = {"source": "tltrun train"}
    run_logs.write_trace(tmp_path, meta)
    errors = ["step 0: a: boom\n", "step 1: b: boom\n", "  continued\n", "step 2: c: bo"]
    (tmp_path / "reward_errors.log").write_text("".join(errors))
    run_logs.prepare_logs(tmp_path, 1)
    assert (tmp_path / "reward_errors.log").read_text() == "step 0: a: boom\n"
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert [s["step"] for s in trace["steps"]] == [0] and trace["meta"]["source"] == meta["source"]
    run_logs.prepare_logs(tmp_path, 0)  # back to step 0: no trace at all
    assert not (tmp_path / "trace.json").exists()


def test_a_kill_mid_drafter_export_does_not_block_the_next(tmp_path):
    """A kill between the two renames of export_drafter_atomic left drafter.old: every later
    export (every resume) failed with 'Directory not empty'."""
    from tiny_models import tiny_model

    from tltrun.model.drafter import EagleDrafter
    from tltrun.train.checkpoint import export_drafter_atomic

    drafter = EagleDrafter.for_target(tiny_model(seed=0))
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter.old").mkdir()
    (tmp_path / "drafter.old" / "model.safetensors").write_text("older")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_drafter_atomic(drafter, tmp_path / "drafter")
    assert (tmp_path / "drafter" / "model.safetensors").stat().st_size > 100
    assert not (tmp_path / "drafter.old").exists()


def test_a_checkpoint_directory_left_behind_is_never_reused(tmp_path):
    """select_checkpoint (resume) deletes tmp leftovers; the worker clears its tmp directory
    before writing (tltrun.train.worker), so a stale rank file cannot be committed."""
    fake_checkpoint(tmp_path, 1)
    stale = ts.tmp_checkpoint_dir(tmp_path, 2)
    stale.mkdir(parents=True)
    (stale / "rank1.pt").write_text("stale")
    assert ts.select_checkpoint(tmp_path, 2) == ts.checkpoint_dir(tmp_path, 1)
    assert not stale.exists()


def test_a_resume_refuses_what_the_run_cannot_change_and_says_a_new_policy_starts_afresh(
    model_dir, tmp_path
):
    """Found on real runs (read-only hunt): --override-config --group-size or a lower
    --max-new-tokens trained a step, then every write of the trace failed (its earlier steps
    no longer validated); --prompts-per-step skipped data rows (a step's place in the data is
    its number x prompts per step); a changed TLT setting crashed every worker on the saved
    policy state (now it starts afresh, and the launcher says so)."""
    make_fake_run(model_dir, tmp_path)

    def resume(**fields) -> None:
        cfg = config(model_dir, tmp_path, **fields)
        prepare_run_dir(cfg, TASK, is_resume=True, is_override_config=True)

    base = config(model_dir, tmp_path)
    for fields, flag in (
        ({"group_size": base.group_size + 1}, "--group-size"),
        ({"max_new_tokens": base.max_new_tokens - 1}, "--max-new-tokens"),
        ({"prompts_per_step": 2 * base.prompts_per_step,
          "prompt_split": tuple(2 * n for n in base.prompt_split)}, "--prompts-per-step"),
        ({"drafter_dir": str(tmp_path / "other_drafter")}, "--drafter-dir"),
        ({"seed": base.seed + 1}, "--seed"),  # it reshuffled the epoch: rows repeated, skipped
    ):  # fmt: skip
        with pytest.raises(UsageError, match=f"cannot change {flag} .* even with --override"):
            resume(**fields)
    assert not (tmp_path / ts.CONFIG_HISTORY).exists()  # nothing recorded
    # first of all the resume's refusals (hunt): without --override-config it asked for that
    # flag, which the next refusal rejected; and a new seed redraws the evaluation split, so
    # the inputs' fingerprints differ too: that was reported as changed data
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "data": data()}))
    for is_override_config in (False, True):
        with pytest.raises(UsageError, match="cannot change --seed .* even with --override"):
            cfg = config(model_dir, tmp_path, seed=base.seed + 1)
            prepare_run_dir(cfg, TASK, is_resume=True, is_override_config=is_override_config,
                            data=data(train_fingerprint="resplit", eval_fingerprint="resplit"))  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.warns(ts.RunDirWarning, match="--tlt-threshold changed: the SD policy starts"):
        resume(tlt_threshold=base.tlt_threshold + 1, max_new_tokens=base.max_new_tokens + 8)
    # deterministic mode rewards the bandit with modelled costs, not seconds (hunt: a resume
    # that turned it off mixed both units in one window, unsaid)
    with pytest.warns(ts.RunDirWarning, match="--deterministic changed: the SD policy starts"):
        resume(is_deterministic=not base.is_deterministic, tlt_threshold=base.tlt_threshold + 1,
               max_new_tokens=base.max_new_tokens + 8)  # fmt: skip


def test_a_policy_state_learned_in_the_other_reward_mode_is_not_loaded(model_dir, tmp_path):
    """ModelledFeedback's state (deterministic mode: modelled costs) does not load into a
    plain policy (the clock's seconds); the worker loads a checkpoint's state only where the
    run's mode at that checkpoint is the mode now (config.json + the overrides of resumes that
    started before it); a deterministic checkpoint written before the wrapping still loads."""
    from tltrun.train.checkpoint import is_reward_mode_kept
    from tltrun.train.spot import ModelledFeedback
    from tltsim.policy import DecodeObs, PolicyStateError, SpecFeedback, TLTAdaptive

    def trained(policy):
        for i in range(40):  # past the warm-up: SD on, the bandit rewarded
            obs = DecodeObs(now_s=i, step=0, instance=0, num_active=1, accept_len_ema=2.0)
            decision = policy.decide(obs)
            policy.observe(SpecFeedback(step=0, instance=0, num_active=1, decision=decision,
                                        accepted_tokens=3, iteration_s=0.5))  # fmt: skip
        return policy

    modelled = trained(ModelledFeedback(TLTAdaptive(seed=0))).state_dict()
    with pytest.raises(PolicyStateError):
        TLTAdaptive(seed=0).load_state_dict(modelled)
    again = ModelledFeedback(TLTAdaptive(seed=0))
    again.load_state_dict(modelled)
    assert again.state_dict() == modelled
    older = ModelledFeedback(TLTAdaptive(seed=0))  # an unwrapped state of before 2026-11-29
    older.load_state_dict(modelled["modelled_reward_state"])
    assert older.state_dict() == modelled
    make_fake_run(model_dir, tmp_path)  # 3 steps, not deterministic
    assert is_reward_mode_kept(tmp_path, 3, False) and not is_reward_mode_kept(tmp_path, 3, True)
    with pytest.warns(ts.RunDirWarning):
        prepare_run_dir(config(model_dir, tmp_path, is_deterministic=True), TASK,
                        is_resume=True, is_override_config=True)  # fmt: skip
    # checkpoint 3 was learned before the resume that switched (its override is at step 3)
    assert not is_reward_mode_kept(tmp_path, 3, True)
    assert is_reward_mode_kept(tmp_path, 4, True)  # a checkpoint the switched run wrote


def test_a_new_run_of_no_steps_is_refused(model_dir, tmp_path):
    """--num-steps 0 wrote final/ (the start model), said logs and checkpoints were written,
    and left a directory that --resume refused ("the run finished") and a new run too."""
    with pytest.raises(UsageError, match="--num-steps 0: a new run trains at least one step"):
        prepare_run_dir(config(model_dir, tmp_path, num_steps=0), TASK, is_resume=False,
                        is_override_config=False)  # fmt: skip
    assert not (tmp_path / "config.json").exists()


def test_an_out_that_is_a_file_is_the_usual_refusal(model_dir, tmp_path, capsys):
    """It was "error: X: File exists", unlike every other command's message."""
    taken = tmp_path / "my_trace.json"
    taken.write_text("{}")
    argv = ["train", "--model-dir", str(model_dir), "--max-new-tokens", "16", "--out", str(taken)]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: --out {taken}: exists and is not a directory\n"
    assert taken.read_text() == "{}"


def test_a_resume_without_tensorboard_still_drops_the_redone_steps_points(tmp_path):
    """--tensorboard is free to change on resume, but without it the steps the resumed run
    redid kept their old points (steps 3-4 of the killed attempt beside the new ones)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    first = SummaryWriter(str(tmp_path / "tensorboard"))
    for step in range(5):
        first.add_scalar("train/rollout_s", float(step), step)
    first.close()
    assert run_logs.tensorboard_writer(tmp_path, 3, is_on=False) is None
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/rollout_s")] == [0, 1, 2]
    assert run_logs.tensorboard_writer(tmp_path / "none", 0, is_on=False) is None
    assert not (tmp_path / "none").exists()  # nothing written where no tensorboard was


def test_rollout_dtype_defaults_by_device_and_is_recorded_resolved(
    model_dir, tmp_path, monkeypatch
):
    """`tltrun train --device cuda` rolled out in float32 (issue #18: bf16 on CUDA, fp32 stays
    the CPU default). config.json records the dtype resolved, so that a resume on the same
    device compares equal and one whose default would change the run's dtype is refused."""
    make_fake_run(model_dir, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["train"]["dtype"] == "float32"
    prepare_run_dir(config(model_dir, tmp_path), TASK, is_resume=True, is_override_config=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    on_gpu = config(model_dir, tmp_path, device="cuda")
    assert (on_gpu.dtype, on_gpu.dtype_name) == (None, "bfloat16")
    assert config(model_dir, tmp_path, device="cuda", dtype="float32").dtype_name == "float32"
    # tltrun train-drafter's target, whose hidden states the drafter learns to draft from
    drafter = TrainDrafterConfig(model="m", data="d", out="o", device="cuda")
    assert drafter.dtype_name == "bfloat16"
    assert TrainDrafterConfig(model="m", data="d", out="o").dtype_name == "float32"
    with pytest.raises(
        UsageError, match=r"--device: 'cpu' -> 'cuda'; --dtype: 'float32' -> 'bfloat16'\)"
    ):
        prepare_run_dir(on_gpu, TASK, is_resume=True, is_override_config=False)


def test_resuming_a_finished_run_says_so_and_touches_nothing(model_dir, tmp_path, capsys):
    """Hunt: --resume of a run that finished relaunched the workers, which rewrote final/ and
    added an empty TensorBoard file, and printed "written to" as if it had trained."""
    from tltrun.train.launch import RunFinished

    make_fake_run(model_dir, tmp_path)  # 3 steps, checkpoints 1..3
    (tmp_path / "final" / "actor").mkdir(parents=True)
    # a final/ without its record (a run before 2026-11-29 wrote it in place, maybe torn) or
    # of fewer steps than the checkpoint (review: a run extended by a resume that was killed
    # writing its final/ kept the old one): not finished, the workers write it again
    for record in (None, {"num_steps": 2}):
        if record is not None:
            (tmp_path / "final" / ts.FINAL_STATE).write_text(json.dumps(record))
        assert prepare_run_dir(
            config(model_dir, tmp_path), TASK, is_resume=True, is_override_config=False
        ) == ts.checkpoint_dir(tmp_path, 3)
    (tmp_path / "final" / ts.FINAL_STATE).write_text(json.dumps({"num_steps": 3}))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(RunFinished, match=r"already finished \(3 steps, final/ written\)"):
        prepare_run_dir(config(model_dir, tmp_path), TASK, is_resume=True, is_override_config=False)
    assert main(["train", "--out", str(tmp_path), "--resume"]) == 0
    assert "nothing to resume (pass --num-steps above 3 to train on)" in capsys.readouterr().out
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert [p for p in after if p.name != "run.lock"] == before  # (the lock file stays)


def test_a_stopped_run_is_told_whether_a_checkpoint_holds_its_steps(tmp_path):
    """Hunt: a run stopped before its first checkpoint was told to 'continue from the last
    checkpoint'; --resume then began again at step 0 without a word."""
    assert run_logs.resume_hint(tmp_path, "tltrun train --out o") == (
        "it wrote no checkpoint yet (--checkpoint-every): tltrun train --out o --resume starts "
        "it again from step 0"
    )
    ts.tmp_checkpoint_dir(tmp_path, 2).mkdir(parents=True)  # being written: not one yet
    assert "no checkpoint yet" in run_logs.resume_hint(tmp_path, "tltrun train --out o")
    first, newest = (fake_checkpoint(tmp_path, step) for step in (1, 3))
    assert run_logs.resume_hint(tmp_path, "tltrun train --out o") == (
        "continue from its last checkpoint (step_000003) with tltrun train --out o --resume"
    )
    # a damaged one is not promised (--resume then refused it): the newest that looks intact
    for ckpt, says in ((newest, "(step_000001)"), (first, "none of its checkpoints is intact")):
        weights = ckpt / "actor" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-1])
        assert says in run_logs.resume_hint(tmp_path, "tltrun train --out o")


def test_a_resume_on_one_worker_says_the_default_spot_training_stops(tmp_path, monkeypatch, capsys):
    """Hunt: a default tlt run resumed from 2 workers on 1 dropped its drafter's optimizer
    state without a word (the warning looked at an explicit --spot-training only)."""
    from test_run_integrity import fake_checkpoint, fake_logs
    from test_train import TASK, config
    from tiny_models import tiny_model

    from tltrun.cli.main import main
    from tltrun.model.hf_checkpoint import save_hf
    from tltrun.train import launch

    model = tmp_path / "m"
    save_hf(tiny_model(seed=0), model)
    out = tmp_path / "run"
    out.mkdir()
    cfg = config(model, out, policy="tlt", prompt_split=(), is_spot_training=None)
    launch.prepare_run_dir(cfg, TASK, is_resume=False, is_override_config=False)
    fake_checkpoint(out, 1)
    fake_logs(out, 1)
    monkeypatch.setattr(launch, "run_train", lambda cfg, task, **kw: "o")
    argv = ["train", "--out", str(out), "--resume", "--override-config", "--num-workers", "1"]
    assert main(argv) == 0
    assert (
        "warning: --policy tlt's spot training: idle workers train the drafter, and 1 worker is "
        "never idle: no drafter training in this run" in capsys.readouterr().err
    )
