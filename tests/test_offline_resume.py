"""``--checkpoint-every`` / ``--resume`` of ``tltrun sft`` and ``tltrun train-drafter``
(tltrun/train/resumable.py): a run stopped after a state was written and resumed ends with the
uninterrupted run's weights and log, bit for bit (sft stopped in-process by Ctrl-C at a step;
train-drafter killed with SIGKILL in a subprocess, and stopped in-process at the library level);
a failed or torn state write leaves the previous state; the refusals (a flag that changes the
run, no state, a fresh run over a state, other data, both loss weights 0) are one ``error:``
line and exit 2; a finished run's state is gone and resuming it says so.

Run: ``.venv/bin/python -m pytest tests/test_offline_resume.py -q`` (~15 s; the subprocess kill
is ~6 s of it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from process_tools import sigkill_when
from safetensors.torch import load_file
from test_hostile import assert_one_error_line, run
from tiny_models import tiny_model

from tltrun.cli.main import main
from tltrun.cli.train_drafter import TrainDrafterConfig
from tltrun.model import hf_checkpoint
from tltrun.model.drafter import EagleDrafter
from tltrun.model.hf_checkpoint import save_hf
from tltrun.train import drafter_training, resumable, sft
from tltrun.train.drafter_training import DrafterTrainConfig, records_from_outputs, train_drafter
from tltrun.train.resumable import STATE_FILE, Checkpointing
from tltrun.train.sft_config import SFTConfig
from tltrun.train.tasks import TaskConfig
from tltsim.errors import UsageError

# A tiny SFT run (one 32-wide layer, short chains, two held-out prompts): seconds on a CPU.
SFT_FLAGS = (
    "--num-steps 8 --num-layers 1 --hidden-size 32 --num-heads 2 --num-kv-heads 1 "
    "--intermediate-size 64 --warmup-steps 2 --batch-tokens 1024 --num-eval-prompts 2 "
    "--num-sample-prompts 1 --group-size 1 --eval-batch-size 2 --max-new-tokens 8 "
    "--task-median-ops 2 --task-max-ops 8 --checkpoint-every 3"
)
DRAFTER_FLAGS = "--train-lr 1e-3 --train-batch-size 2 --checkpoint-every 5"


def assert_bitwise_equal(a: Path, b: Path, weights: str, log: str, log_key: str | None) -> None:
    """The two runs' weights (``torch.equal`` per tensor) and logs are identical."""
    wa, wb = load_file(a / weights), load_file(b / weights)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs"
    la, lb = (json.loads((d / log).read_text()) for d in (a, b))
    if log_key is not None:
        la, lb = la[log_key], lb[log_key]
    assert la == lb


# ---- tltrun sft: stopped in-process, resumed -------------------------------------------------


def test_sft_stopped_and_resumed_ends_as_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert main(["sft", "--out", str(whole), *SFT_FLAGS.split()]) == 0, capsys.readouterr().err
    assert not (whole / STATE_FILE).exists()  # a finished run leaves no state behind

    real_loss, num_calls = sft.response_loss, [0]

    def ctrl_c_at_step_4(model, batch):  # steps 0-3 done; the state holds 3 of them
        num_calls[0] += 1
        if num_calls[0] == 5:
            raise KeyboardInterrupt
        time.sleep(0.5)  # the first process's steps are slow: its seconds must count
        return real_loss(model, batch)

    monkeypatch.setattr(sft, "response_loss", ctrl_c_at_step_4)
    assert main(["sft", "--out", str(stopped), *SFT_FLAGS.split()]) == 130
    assert not (stopped / "metrics.json").exists()
    state = torch.load(stopped / STATE_FILE, weights_only=True)
    assert state["next_step"] == 3 and len(state["log"]) == 3 and state["train_s"] >= 1.5
    monkeypatch.setattr(sft, "response_loss", real_loss)
    capsys.readouterr()
    # --checkpoint-every does not change the run: a resume may change it
    assert main(["sft", "--out", str(stopped), "--resume", "--checkpoint-every", "2"]) == 0
    assert_bitwise_equal(whole, stopped, "model.safetensors", "metrics.json", "train_log")
    assert not (stopped / STATE_FILE).exists()
    # metrics.json's training time is the whole run's, the killed process's seconds included
    assert json.loads((stopped / "metrics.json").read_text())["train_s"] >= state["train_s"]
    capsys.readouterr()
    assert main(["sft", "--out", str(stopped), "--resume"]) == 0  # finished: one line, exit 0
    out, err = capsys.readouterr()
    assert (
        out == f"{stopped}: the run already finished (metrics.json is written); nothing to resume\n"
    )
    assert err == ""


# ---- tltrun train-drafter: killed in a subprocess, resumed -----------------------------------


@pytest.fixture(scope="module")
def drafter_inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny target and its generations.jsonl (12 sequences of 8-40 tokens)."""
    root = tmp_path_factory.mktemp("drafter")
    save_hf(tiny_model(seed=0), root / "model")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(12):
        ids = torch.randint(4, 97, (8 + 3 * i,), generator=gen).tolist()
        rows.append({"prompt_token_ids": ids[:5], "output_token_ids": ids[5:]})
    (root / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": root / "model", "data": root / "generations.jsonl"}


def drafter_argv(inputs: dict[str, Path], out: Path, num_steps: int) -> list[str]:
    return ["train-drafter", "--model", str(inputs["model"]), "--data", str(inputs["data"]),
            "--out", str(out), "--train-num-steps", str(num_steps), *DRAFTER_FLAGS.split()]  # fmt: skip


# Runs tltrun's CLI with every drafter step slowed down (time only: the steps compute the
# same), so that the test can kill it between states; the pytest process's torch thread count
# (float reductions depend on it, and the runs are compared with in-process ones).
SLOW_CLI = """
import sys, time, torch
from tltrun.cli.main import main
from tltrun.train import drafter_training
torch.set_num_threads(int(sys.argv[1]))
step = drafter_training.drafter_train_step
def slow_step(*args, **kwargs):
    time.sleep(0.05)
    return step(*args, **kwargs)
drafter_training.drafter_train_step = slow_step
sys.exit(main(sys.argv[2:]))
"""


def test_train_drafter_killed_and_resumed_ends_as_the_uninterrupted_run(
    drafter_inputs, tmp_path, capsys
):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    num_steps = 60
    assert main(drafter_argv(drafter_inputs, whole, num_steps)) == 0, capsys.readouterr().err
    assert not (whole / STATE_FILE).exists()
    cmd = [sys.executable, "-c", SLOW_CLI, str(torch.get_num_threads()),
           *drafter_argv(drafter_inputs, killed, num_steps)]  # fmt: skip
    # a few more steps after the first state: the kill lands between states
    sigkill_when(cmd, (killed / STATE_FILE).exists, "a first state", settle_s=0.3)
    next_step = torch.load(killed / STATE_FILE, weights_only=True)["next_step"]
    assert 5 <= next_step < num_steps and not (killed / "history.json").exists()
    assert main(["train-drafter", "--out", str(killed), "--resume"]) == 0, capsys.readouterr().err
    assert_bitwise_equal(whole, killed, "model.safetensors", "history.json", None)
    assert not (killed / STATE_FILE).exists()
    capsys.readouterr()
    assert main(["train-drafter", "--out", str(killed), "--resume"]) == 0
    assert "the run already finished" in capsys.readouterr().out


def test_train_drafter_resume_on_a_replaced_target_is_refused(
    drafter_inputs, tmp_path, monkeypatch, capsys
):
    """The drafter trains on the target's hidden states: a resume after the checkpoint at
    --model was replaced (same shapes, other weights) is one error line, the state kept; the
    restored checkpoint resumes."""
    model = tmp_path / "target"
    shutil.copytree(drafter_inputs["model"], model)
    out = tmp_path / "run"
    real_step, num_calls = drafter_training.drafter_train_step, [0]

    def stop_at_step_7(*args, **kwargs):  # the state holds 5 steps
        num_calls[0] += 1
        if num_calls[0] == 8:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(drafter_training, "drafter_train_step", stop_at_step_7)
    assert main(drafter_argv({**drafter_inputs, "model": model}, out, 12)) == 130
    monkeypatch.setattr(drafter_training, "drafter_train_step", real_step)
    shutil.move(model, tmp_path / "kept")
    save_hf(tiny_model(seed=1), model)
    capsys.readouterr()
    rc, stdout, err = run("tltrun", ["train-drafter", "--out", str(out), "--resume"], capsys)
    assert_one_error_line(rc, stdout, err)
    assert "--resume with another target checkpoint than the run started on" in err
    assert torch.load(out / STATE_FILE, weights_only=True)["next_step"] == 5
    shutil.rmtree(model)
    shutil.move(tmp_path / "kept", model)
    assert main(["train-drafter", "--out", str(out), "--resume"]) == 0, capsys.readouterr().err


def test_the_checkpoint_digest_follows_the_contents_not_the_path(tmp_path, monkeypatch):
    """Equal copies agree; a changed weight or config does not, whole-file hashed or sampled
    (files over DIGEST_WHOLE_BYTES: header and evenly spread blocks)."""
    save_hf(tiny_model(seed=0), tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for whole_bytes in (hf_checkpoint.DIGEST_WHOLE_BYTES, 0):  # 0: every file sampled
        monkeypatch.setattr(hf_checkpoint, "DIGEST_WHOLE_BYTES", whole_bytes)
        digest = hf_checkpoint.checkpoint_digest
        assert digest(tmp_path / "a") == digest(tmp_path / "b")
        weights = tmp_path / "b" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0x40  # a bit of the last tensor (the last block is always sampled)
        weights.write_bytes(bytes(data))
        assert digest(tmp_path / "a") != digest(tmp_path / "b")
        shutil.copy(tmp_path / "a" / "model.safetensors", weights)
        config = tmp_path / "b" / "config.json"
        config.write_text(config.read_text().replace('"rope_theta"', '"rope_theta" '))
        assert digest(tmp_path / "a") != digest(tmp_path / "b")
        shutil.copy(tmp_path / "a" / "config.json", config)


# ---- train_drafter stopped in-process (no subprocess: the fast twin of the test above) -------


def drafter_records(inputs: dict[str, Path]):
    from tltrun.model.hf_checkpoint import load_hf

    target = load_hf(inputs["model"])
    rows = [json.loads(line) for line in inputs["data"].read_text().splitlines()]
    seqs = [(r["prompt_token_ids"] + r["output_token_ids"], 5) for r in rows]
    return target, records_from_outputs(target, seqs)


def test_train_drafter_stopped_and_resumed_ends_as_the_uninterrupted_run(
    drafter_inputs, tmp_path, monkeypatch
):
    target, records = drafter_records(drafter_inputs)
    cfg = DrafterTrainConfig(num_steps=12, batch_size=2, lr=1e-3)
    whole = EagleDrafter.for_target(target, seed=0)
    whole_out = Checkpointing(out=tmp_path / "whole", command="t", every=5)
    whole_out.out.mkdir()
    whole_history = train_drafter(whole, records, cfg, False, whole_out)
    # the last step writes a state too (a kill during the export that follows redoes no step)
    assert torch.load(whole_out.out / STATE_FILE, weights_only=True)["next_step"] == 12

    real_step, num_calls = drafter_training.drafter_train_step, [0]

    def stop_at_step_7(*args, **kwargs):  # 7 steps done; the state holds 5
        num_calls[0] += 1
        if num_calls[0] == 8:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    stopped = Checkpointing(out=tmp_path / "stopped", command="t", every=5)
    stopped.out.mkdir()
    monkeypatch.setattr(drafter_training, "drafter_train_step", stop_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(EagleDrafter.for_target(target, seed=0), records, cfg, False, stopped)
    monkeypatch.setattr(drafter_training, "drafter_train_step", real_step)
    resumed = EagleDrafter.for_target(target, seed=0)  # fresh weights: the state holds them
    resume = Checkpointing(out=stopped.out, command="t", every=5, is_resume=True)
    assert train_drafter(resumed, records, cfg, False, resume) == whole_history
    for (name, a), (_, b) in zip(
        whole.state_dict().items(), resumed.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), f"{name} differs"
    # other records than the state's: refused (the data's fingerprint)
    with pytest.raises(UsageError, match="other training data than the run started on"):
        train_drafter(EagleDrafter.for_target(target, seed=0), records[1:], cfg, False, resume)


# ---- atomic writes ---------------------------------------------------------------------------


def small_state(
    out: Path, next_step: int
) -> tuple[Checkpointing, torch.nn.Module, torch.optim.Optimizer]:
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    checkpoints = Checkpointing(out=out, command="t", every=1)
    checkpoints.save(next_step, module, optimizer, [{"step": s} for s in range(next_step)], None)
    return checkpoints, module, optimizer


def test_a_failed_state_write_leaves_the_previous_state(tmp_path, monkeypatch):
    checkpoints, module, optimizer = small_state(tmp_path, 1)
    before = (tmp_path / STATE_FILE).read_bytes()

    def disk_full(obj, f):  # half the bytes reach the file, then the write fails
        f.write(before[: len(before) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(resumable.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoints.save(2, module, optimizer, [{"step": 0}, {"step": 1}], None)
    assert (tmp_path / STATE_FILE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]  # no partial .tmp left
    monkeypatch.undo()
    assert checkpoints.load(module, optimizer, None)["next_step"] == 1


def test_a_stray_half_written_temp_file_is_never_read(tmp_path):
    """A kill mid-write leaves ``resume_state.pt.tmp``: the state read is the previous one,
    and the next write replaces the stray file."""
    checkpoints, module, optimizer = small_state(tmp_path, 2)
    stray = tmp_path / (STATE_FILE + ".tmp")
    stray.write_bytes((tmp_path / STATE_FILE).read_bytes()[:100])
    assert checkpoints.load(module, optimizer, None)["log"] == [{"step": 0}, {"step": 1}]
    checkpoints.save(3, module, optimizer, [{"step": s} for s in range(3)], None)
    assert not stray.exists()
    assert checkpoints.load(module, optimizer, None)["next_step"] == 3


# ---- refusals: one error line, exit 2 --------------------------------------------------------


@pytest.fixture
def run_dirs(drafter_inputs, tmp_path) -> dict[str, str]:
    """``sft`` and ``drafter``: run directories as a killed run leaves them, its recorded config
    and a state file (garbage bytes: only the "damaged state" rows get as far as reading it);
    ``empty``; and the drafter's inputs."""
    sft_cfg = SFTConfig(out=str(tmp_path / "sft"), num_steps=8, lr=3e-3)
    drafter_cfg = TrainDrafterConfig(
        model=str(drafter_inputs["model"]), data=str(drafter_inputs["data"]),
        out=str(tmp_path / "drafter"),
    )  # fmt: skip
    configs = {
        "sft": ("sft_config.json", {"sft": asdict(sft_cfg), "task": asdict(TaskConfig())}),
        "drafter": (
            "train_config.json",
            {"train_drafter": asdict(drafter_cfg), "train": asdict(DrafterTrainConfig())},
        ),
    }
    dirs = {"empty": tmp_path / "empty", **drafter_inputs}
    dirs["empty"].mkdir()
    for name, (file, config) in configs.items():
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        (dirs[name] / file).write_text(json.dumps(config))
        (dirs[name] / STATE_FILE).write_bytes(b"not a torch file")
    return {k: str(v) for k, v in dirs.items()}


SFT_RUN = "sft --out {sft} --resume"
DRAFTER_RUN = "train-drafter --out {drafter} --resume"
REFUSALS = {
    "sft --resume changing a flag": (SFT_RUN + " --lr 0.5", "sft.lr: 0.003 -> 0.5"),
    "sft --resume changing a task flag": (SFT_RUN + " --task-max-ops 9", "task.max_ops: 52 -> 9"),
    "sft --resume with no state": ("sft --out {empty} --resume", "no resume_state.pt"),
    "sft --resume without --out": ("sft --resume", "--resume needs --out"),
    "sft fresh run over a state": ("sft --out {sft}", "pass --resume to continue it"),
    "sft --resume of a damaged state": (SFT_RUN, "not a readable resumable state"),
    "train-drafter --resume changing a flag": (
        DRAFTER_RUN + " --train-lr 0.5 --device cpu",
        "train.lr: 3e-05 -> 0.5",
    ),
    "train-drafter --resume with no state": (
        "train-drafter --out {empty} --resume",
        "no resume_state.pt",
    ),
    "train-drafter fresh run over a state": (
        "train-drafter --model {model} --data {data} --out {drafter}",
        "pass --resume",
    ),
    "train-drafter --resume of a damaged state": (DRAFTER_RUN, "not a readable resumable"),
    "train-drafter both loss weights 0": (
        "train-drafter --model {model} --data {data} --out {empty} "
        "--train-regression-weight 0 --train-classification-weight 0",
        "--train-regression-weight and --train-classification-weight are both 0",
    ),
}


@pytest.mark.parametrize("argv, says", REFUSALS.values(), ids=REFUSALS.keys())
def test_refusals_are_one_error_line(argv, says, run_dirs, capsys):
    config_files = {p: p.stat().st_mtime_ns for p in Path(run_dirs["sft"]).parent.rglob("*.json")}
    rc, out, err = run("tltrun", argv.format(**run_dirs).split(), capsys)
    assert_one_error_line(rc, out, err)
    assert says in err
    # a refused run changes nothing: the recorded configs and states stay as they were
    assert {p: p.stat().st_mtime_ns for p in config_files} == config_files
    assert all((Path(run_dirs[d]) / STATE_FILE).is_file() for d in ("sft", "drafter"))


@pytest.mark.parametrize(
    "argv, holder",
    [(SFT_RUN, "sft"), (DRAFTER_RUN, "drafter"), ("sft --out {empty} --num-steps 1", "empty")],
)
def test_a_second_process_on_the_same_out_is_refused(argv, holder, run_dirs, capsys):
    """Two runs in one directory would overwrite each other's state: the second is refused
    while the first holds the directory's lock (``RunLock``, as tltrun train's launcher)."""
    from tltrun.train.state import RunLock

    with RunLock(Path(run_dirs[holder]), "tltrun train-drafter"):
        rc, out, err = run("tltrun", argv.format(**run_dirs).split(), capsys)
    assert_one_error_line(rc, out, err)
    assert "another tltrun train-drafter is running in this directory" in err
    assert f"(tltrun train-drafter pid {os.getpid()} holds " in err
    assert not (Path(run_dirs["empty"]) / "sft_config.json").exists()  # refused before writing


def test_a_fresh_run_over_a_finished_one_is_not_taken_for_finished(tmp_path):
    """A fresh run into a finished run's directory drops its finish file: killed before its
    first state, it is "no state to resume from", not "already finished"."""

    def resume():
        return resumable.configs_to_resume(
            str(tmp_path), "tltrun sft", "sft_config.json", "metrics.json", sft.CONFIG_SECTIONS
        )

    (tmp_path / "metrics.json").write_text("{}")
    (tmp_path / "sft_config.json").write_text("{}")
    assert resume() is None  # finished
    resumable.start_fresh(tmp_path, "tltrun sft", config_file="sft_config.json")
    with pytest.raises(UsageError, match="no resume_state.pt to resume from"):
        resume()
