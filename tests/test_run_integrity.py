"""Run-directory integrity of ``tltrun train`` (tltrun.train.state, tltrun.train.launch): every
checkpoint carries a sha256 manifest that ``--resume`` verifies, falling back to the newest
intact checkpoint with a warning naming the damaged file (or one ``error:`` line when none is
intact); torn and short logs; resumes that change the run's settings. The run directory's lock,
orphans and workers' failures: tests/test_run_processes.py.

These tests work on fake checkpoints (files of random bytes plus a real manifest) and on the CLI
up to the point where workers would start; tests/test_run_integrity_resume.py resumes real
3-step runs of a tiny model. Run: ``python -m pytest tests/test_run_integrity.py -q`` (seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
from test_train import TASK, config
from tiny_models import save_train_model

from tltrun.model.config import CheckpointError
from tltrun.train import run_logs
from tltrun.train import state as ts
from tltrun.train.launch import prepare_run_dir
from tltrun.train.tasks import TaskConfig
from tltsim.errors import UsageError

NUM_WORKERS = 2  # test_train's config: 2 workers, 3 steps, a checkpoint after every step


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_train_model(tmp_path_factory.mktemp("tiny"), TASK)


# ---- fake run directories -------------------------------------------------------------------


def fake_checkpoint(out: Path, next_step: int) -> Path:
    """A checkpoint directory with every file a real one has (random bytes) and its manifest."""
    ckpt = ts.checkpoint_dir(out, next_step)
    files = {
        "actor/model.safetensors": 4096,
        "actor/config.json": 100,
        "dcp/.metadata": 300,
        "dcp/__0_0.distcp": 2048,
        "drafter/model.safetensors": 1024,
        "drafter_dcp/.metadata": 200,
        "drafter_dcp/__0_0.distcp": 512,
        **{f"rank{r}.pt": 256 for r in range(NUM_WORKERS)},
        **{f"policy_rank{r}.json": 10 for r in range(NUM_WORKERS)},
    }
    for rel, size in files.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(os.urandom(size))
    ts.write_state(ckpt, next_step)
    return ckpt


def fake_logs(out: Path, num_steps: int) -> None:
    for name in ts.LOGS:
        (out / name).write_text("".join(json.dumps({"step": s}) + "\n" for s in range(num_steps)))


def flip_bytes(path: Path, num_bytes: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + num_bytes):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def delete_drafter(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "drafter")


def garble_manifest(ckpt: Path) -> None:
    (ckpt / ts.MANIFEST).write_bytes(b'{"format": "tlt-checkpoint-manif\x00\xff')


# Each kind of damage: (what it does to a checkpoint, the file a warning must name, how)
DAMAGE = {
    "flipped actor": (lambda c: flip_bytes(c / "actor/model.safetensors"),
                      "actor/model.safetensors", "sha256 differs"),
    "truncated optimizer": (lambda c: truncate(c / "dcp/__0_0.distcp"),
                            "dcp/__0_0.distcp", "truncated"),
    "deleted drafter": (delete_drafter, "drafter/model.safetensors", "missing"),
    "garbage manifest": (garble_manifest, "manifest.json", "not valid JSON"),
    "missing manifest": (lambda c: (c / ts.MANIFEST).unlink(), "manifest.json", "missing"),
    "rank file grown": (lambda c: (c / "rank1.pt").write_bytes(b"x" * 300), "rank1.pt", "grown"),
}  # fmt: skip


# ---- manifest and checkpoint choice (pure functions on files) --------------------------------


def test_manifest_lists_every_file_and_verifies(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 2)
    manifest = json.loads((ckpt / ts.MANIFEST).read_text())
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == on_disk - {ts.MANIFEST}
    assert manifest["files"]["dcp/__0_0.distcp"]["size_bytes"] == 2048
    assert ts.verify_checkpoint(ckpt, NUM_WORKERS) == []
    assert not list(ckpt.glob("*.tmp"))  # the manifest's temporary name is gone


@pytest.mark.parametrize("kind", DAMAGE)
def test_each_kind_of_damage_is_named(tmp_path, kind):
    damage, name, how = DAMAGE[kind]
    ckpt = fake_checkpoint(tmp_path, 2)
    damage(ckpt)
    problems = ts.verify_checkpoint(ckpt, NUM_WORKERS)
    assert len(problems) == 1 and problems[0].startswith(name + ":") and how in problems[0]


def test_manifest_missing_a_required_file_or_naming_another_step(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 2)
    (ckpt / "rank1.pt").unlink()
    ts.write_manifest(ckpt)  # a manifest of an incomplete directory
    assert ts.verify_checkpoint(ckpt, NUM_WORKERS) == ["rank1.pt: not in the manifest"]
    other = fake_checkpoint(tmp_path, 3)
    ts.write_state(other, 4)
    assert ts.verify_checkpoint(other, NUM_WORKERS) == [
        "state.json: next_step 4, the directory says 3"
    ]


def test_resume_falls_back_to_newest_intact_checkpoint_with_a_warning(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    flip_bytes(ts.checkpoint_dir(tmp_path, 3) / "actor/model.safetensors")
    truncate(ts.checkpoint_dir(tmp_path, 2) / "dcp/__0_0.distcp")
    (tmp_path / "ckpt" / ".tmp_step_000004").mkdir()  # a kill mid-write
    with pytest.warns(ts.RunDirWarning) as caught:
        assert ts.select_checkpoint(tmp_path, NUM_WORKERS) == ts.checkpoint_dir(tmp_path, 1)
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert "step_000002" in messages[0] and "dcp/__0_0.distcp" in messages[0]
    assert "step_000003" in messages[1] and "actor/model.safetensors: sha256" in messages[1]
    assert all("resuming from step_000001" in m for m in messages)
    assert not (tmp_path / "ckpt" / ".tmp_step_000004").exists()


def test_no_intact_checkpoint_is_one_error_naming_each_damage(tmp_path):
    for step, kind in ((1, "deleted drafter"), (2, "garbage manifest")):
        DAMAGE[kind][0](fake_checkpoint(tmp_path, step))
    with pytest.raises(CheckpointError) as err:
        ts.select_checkpoint(tmp_path, NUM_WORKERS)
    message = str(err.value)
    assert "\n" not in message and "no intact checkpoint" in message
    assert "step_000001: drafter/model.safetensors: missing" in message
    assert "step_000002: manifest.json: not valid JSON" in message
    assert ts.select_checkpoint(tmp_path / "fresh", NUM_WORKERS) is None  # nothing to resume


def test_commit_replaces_a_checkpoint_of_the_same_step(tmp_path):
    old = fake_checkpoint(tmp_path, 1)
    tmp = ts.tmp_checkpoint_dir(tmp_path, 1)
    tmp.mkdir()
    (tmp / "new").write_text("x")
    ts.commit(tmp, old)
    assert [p.name for p in old.iterdir()] == ["new"]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_000001"]


def test_prune_keeps_the_newest_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    assert ts.prune_checkpoints(tmp_path, 0, 4) == []  # 0: keep all
    deleted = ts.prune_checkpoints(tmp_path, 2, 4)
    assert deleted == [ts.checkpoint_dir(tmp_path, 1), ts.checkpoint_dir(tmp_path, 2)]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000003", "step_000004"]
    assert ts.select_checkpoint(tmp_path, NUM_WORKERS) == ts.checkpoint_dir(tmp_path, 4)


def test_prune_after_a_redone_step_spares_the_intact_checkpoints(tmp_path):
    # resumed from 3 past a damaged 5; step 4 was just committed: 5 is not counted
    for step in (2, 3, 4, 5):
        fake_checkpoint(tmp_path, step)
    truncate(ts.checkpoint_dir(tmp_path, 5) / "dcp/__0_0.distcp")
    assert ts.prune_checkpoints(tmp_path, 2, 4) == [ts.checkpoint_dir(tmp_path, 2)]
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step_000003", "step_000004", "step_000005"]
    with pytest.warns(ts.RunDirWarning):  # a kill now: 5 is skipped, 4 is there
        assert ts.select_checkpoint(tmp_path, NUM_WORKERS) == ts.checkpoint_dir(tmp_path, 4)


def test_a_failed_checkpoint_write_names_the_checkpoint_and_the_free_space(tmp_path):
    import errno
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from tltrun.train.checkpoint import CheckpointWriteError, explain_write_failure

    ckpt = ts.tmp_checkpoint_dir(tmp_path, 20)  # not created: the free space of its parent
    zip_error = RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    )
    dcp_error = CheckpointException(
        "CheckpointException ranks:dict_keys([0, 1])",
        {0: (zip_error, traceback.StackSummary()), 1: (zip_error, traceback.StackSummary())},
    )
    full = OSError(errno.ENOSPC, "No space left on device")
    for raised, shown in ((dcp_error, "RuntimeError: [enforce fail"), (full, "No space left")):
        with pytest.raises(CheckpointWriteError) as err, explain_write_failure(ckpt):
            raise raised
        message = str(err.value)
        assert "\n" not in message and str(ckpt) in message and shown in message
        assert "MiB free" in message and "--keep-checkpoints" in message
    with pytest.raises(ValueError), explain_write_failure(ckpt):  # not a write failure
        raise ValueError("a bug")
    # a peer lost mid-write (hunt: a SIGKILLed node was "full? free space"): not the disk
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    with pytest.raises(CheckpointWriteError) as err, explain_write_failure(ckpt):
        raise gloo
    assert "because another rank was lost during it" in str(err.value)
    assert "MiB free" not in str(err.value)


# ---- logs ------------------------------------------------------------------------------------


def test_torn_last_log_line_is_dropped_with_a_warning(tmp_path):
    fake_logs(tmp_path, 3)
    with (tmp_path / "log.jsonl").open("a") as f:
        f.write('{"step": 3, "reward_me')  # killed mid-append
    with pytest.warns(ts.RunDirWarning, match="log.jsonl: dropped a torn last line"):
        run_logs.prepare_logs(tmp_path, 2)
    for name in ts.LOGS:  # rows of the steps the resumed run redoes are gone too
        assert (tmp_path / name).read_text() == '{"step": 0}\n{"step": 1}\n'


def test_whole_last_row_without_newline_is_kept(tmp_path):
    fake_logs(tmp_path, 3)
    (tmp_path / "log.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}')
    run_logs.prepare_logs(tmp_path, 3)
    assert (tmp_path / "log.jsonl").read_text().endswith('{"step": 2}\n')


@pytest.mark.parametrize(
    "log, expected",
    [
        ('{"step": 0}\n{"step": 1}\n', "has steps 0..1 but the checkpoint's next_step is 3"),
        ('{"step": 0}\n{"step": 2}\n{"step": 1}\n', "expected 0, 1, 2, ... in order"),
        ('{"step": 0}\nnot json\n{"step": 2}\n', "line 2 is not valid JSON"),
        ('{"step": 0}\n{"loss": 1.0}\n{"step": 2}\n', "line 2 has no integer 'step'"),
    ],
)
def test_bad_logs_are_errors(tmp_path, log, expected):
    fake_logs(tmp_path, 3)
    (tmp_path / "log.jsonl").write_text(log)
    with pytest.raises(CheckpointError, match="log.jsonl: ") as err:
        run_logs.prepare_logs(tmp_path, 3)
    assert expected in str(err.value)
    assert (tmp_path / "log.jsonl").read_text() == log  # nothing rewritten


# ---- settings of a resumed run, without workers -----------------------------------------------


def make_fake_run(model_dir: Path, out: Path, num_steps: int = 3) -> None:
    out.mkdir(exist_ok=True)
    prepare_run_dir(config(model_dir, out), TASK, is_resume=False, is_override_config=False)
    for step in range(1, num_steps + 1):
        fake_checkpoint(out, step)
    fake_logs(out, num_steps)


def test_resume_that_changes_the_run_is_refused_with_the_diff(model_dir, tmp_path):
    make_fake_run(model_dir, tmp_path)
    first = (tmp_path / "config.json").read_bytes()
    changed = config(model_dir, tmp_path, lr=2e-2, policy="tlt", num_steps=5, tensorboard=True)
    with pytest.raises(UsageError) as err:
        prepare_run_dir(changed, TASK, is_resume=True, is_override_config=False)
    message = str(err.value)
    # num_steps and tensorboard do not change what a step computes: not listed
    assert "--lr: 0.01 -> 0.02; --policy: 'nospec' -> 'tlt'" in message
    assert "num_steps" not in message and "--override-config" in message
    task = TaskConfig(median_ops=3, max_ops=4)
    with pytest.raises(UsageError, match="--task-median-ops: 2 -> 3"):
        prepare_run_dir(config(model_dir, tmp_path), task, is_resume=True, is_override_config=False)
    # another world size changes the prompt split: a change of the run like any other (the
    # DCP checkpoint loads into it with --override-config: tests/test_torchrun_state.py)
    with pytest.raises(UsageError, match="--num-workers: 2 -> 4; --prompt-split"):
        prepare_run_dir(
            config(model_dir, tmp_path, num_workers=4, prompt_split=(1, 1, 1, 1)),
            TASK,
            is_resume=True,
            is_override_config=False,
        )
    assert not (tmp_path / ts.CONFIG_HISTORY).exists()
    assert (tmp_path / "config.json").read_bytes() == first


def test_override_config_is_recorded_and_config_json_kept(model_dir, tmp_path):
    make_fake_run(model_dir, tmp_path)
    first = (tmp_path / "config.json").read_bytes()
    changed = config(model_dir, tmp_path, lr=2e-2)
    resume = prepare_run_dir(changed, TASK, is_resume=True, is_override_config=True)
    assert resume == ts.checkpoint_dir(tmp_path, 3)
    history = [json.loads(line) for line in (tmp_path / ts.CONFIG_HISTORY).read_text().splitlines()]
    assert len(history) == 1 and history[0]["step"] == 3 and history[0]["time"].endswith("+00:00")
    assert history[0]["diff"] == {"train.lr": [0.01, 0.02]}
    assert (tmp_path / "config.json").read_bytes() == first
    # the override is now the run's setting: resuming with it again needs no override
    assert ts.effective_config(tmp_path)["train"]["lr"] == 0.02
    prepare_run_dir(changed, TASK, is_resume=True, is_override_config=False)
    with pytest.raises(UsageError, match="--lr: 0.02 -> 0.01"):
        prepare_run_dir(config(model_dir, tmp_path), TASK, is_resume=True, is_override_config=False)


def cli(argv: list[str], capsys) -> tuple[int, str]:
    from tltrun.cli.main import main

    code = main(argv)
    return code, capsys.readouterr().err.strip()


def test_cli_errors_are_one_line_before_any_worker(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    make_fake_run(model_dir, out)
    code, err = cli(["train", "--out", str(out), "--resume", "--lr", "0.5"], capsys)
    assert code == 2 and err == (
        f"error: {out}: --resume with settings that change the run (--lr: 0.01 -> 0.5); pass "
        "--override-config to resume with them (recorded in config_history.jsonl)"
    )
    (out / "log.jsonl").write_text('{"step": 0}\n')  # next_step 3 beyond the log
    code, err = cli(["train", "--out", str(out), "--resume"], capsys)
    assert code == 2 and err.startswith("error: ") and "\n" not in err
    assert "next_step beyond the log); restore the file, or start a new run" in err
    fake_logs(out, 3)
    for step in (1, 2, 3):
        flip_bytes(ts.checkpoint_dir(out, step) / "rank0.pt")
    code, err = cli(["train", "--out", str(out), "--resume"], capsys)
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert err.startswith(f"error: {out / 'ckpt'}: no intact checkpoint to resume from")
    assert err.count("rank0.pt: sha256 differs") == 3
    code, err = cli(["train", "--out", str(out), "--override-config"], capsys)
    assert code == 2 and err == "error: --override-config applies to --resume only"


def test_a_resume_without_config_json_or_with_another_tokenizer_is_refused(
    model_dir, tmp_path, capsys
):
    """A run whose config.json was lost took any flags on --resume (seed, group size) and
    wrote them as its settings, after which its own were refused; the tokenizer files (stop
    ids, chat template) in --model-dir could change unseen: the digest covered the weights."""
    from tltrun.train.launch import check_inputs

    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(model_dir, model)
    cfg = config(model, out)
    out.mkdir()
    prepare_run_dir(cfg, TASK, is_resume=False, is_override_config=False,
                    data=check_inputs(cfg, TASK))  # fmt: skip
    for step in (1, 2, 3):
        fake_checkpoint(out, step)
    fake_logs(out, 3)
    resumed = prepare_run_dir(cfg, TASK, True, False, data=check_inputs(cfg, TASK))
    assert resumed == ts.checkpoint_dir(out, 3)  # unchanged: resumes
    (model / "tokenizer_config.json").write_text(
        (model / "tokenizer_config.json").read_text().replace("{", '{"model_max_length": 7, ', 1)
    )
    with pytest.raises(UsageError, match="with another tokenizer, chat template or generation"):
        prepare_run_dir(cfg, TASK, True, False, data=check_inputs(cfg, TASK))
    (out / "config.json").unlink()
    code, err = cli(["train", "--out", str(out), "--resume", "--seed", "7"], capsys)
    assert code == 2 and err == (
        f"error: {out}: --resume, but the run's config.json is missing (its checkpoints, up to "
        "step_000003, are there): the run's settings cannot be checked; put config.json back, "
        "or start a new run in another --out"
    )
    with pytest.raises(UsageError, match="config.json is missing"):
        prepare_run_dir(cfg, TASK, is_resume=True, is_override_config=False)
    assert not (out / "config.json").exists()


def test_a_deterministic_resume_at_another_thread_count_is_warned(model_dir, tmp_path):
    """--num-threads is resume-neutral, but a --deterministic run repeats itself at one thread
    count only (a hunt saw the drafter's digest change at the first step resumed)."""
    for is_deterministic in (True, False):
        out = tmp_path / str(is_deterministic)
        out.mkdir()
        cfg = config(model_dir, out, is_deterministic=is_deterministic, num_threads=1)
        prepare_run_dir(cfg, TASK, is_resume=False, is_override_config=False)
        fake_checkpoint(out, 1)
        fake_logs(out, 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepare_run_dir(replace(cfg, num_threads=2), TASK, True, False)
        said = [str(w.message) for w in caught if "--num-threads 1 -> 2" in str(w.message)]
        assert len(said) == is_deterministic


def test_resume_reads_an_older_runs_config_under_current_names(model_dir, tmp_path, capsys):
    """A run written before a field was renamed (fuse_qkv) or removed resumes: the renamed
    setting is kept and still checked, the removed one is not the user's to lose."""
    out = tmp_path / "run"
    make_fake_run(model_dir, out)
    saved = json.loads((out / "config.json").read_text())
    del saved["train"]["fuse_projections"]
    saved["train"] |= {"fuse_qkv": True, "a_field_since_removed": 1}
    (out / "config.json").write_text(json.dumps(saved))
    assert ts.effective_config(out)["train"]["fuse_projections"] is True
    assert "fuse_qkv" not in ts.effective_config(out)["train"]
    code, err = cli(["train", "--out", str(out), "--resume", "--lr", "0.5"], capsys)
    assert code == 2 and "settings that change the run (--lr: 0.01 -> 0.5)" in err
    code, err = cli(["train", "--out", str(out), "--resume", "--no-fuse-projections"], capsys)
    assert code == 2 and "settings that change the run (--fuse-projections: True -> False)" in err


def test_fresh_run_into_a_directory_with_checkpoints_is_refused(model_dir, tmp_path):
    """A fresh run would leave the earlier run's checkpoints where --resume looks for them."""
    make_fake_run(model_dir, tmp_path)
    first = (tmp_path / "config.json").read_bytes()
    with pytest.raises(
        UsageError, match=r"checkpoints \(step_000003\) of an earlier run; pass --resume"
    ):
        prepare_run_dir(
            config(model_dir, tmp_path), TASK, is_resume=False, is_override_config=False
        )
    assert (tmp_path / "config.json").read_bytes() == first  # nothing touched


def test_weight_digests_hash_raw_bytes_of_any_dtype():
    """A bf16 engine's weights (numpy has no bfloat16) digest like any others, and float32
    digests are the bytes numpy gave before (logs of older runs compare equal)."""
    import hashlib

    import torch

    from tltrun.train.step_log import sha1_digest

    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    old = hashlib.sha1()
    old.update(b"w")
    old.update(w.numpy().tobytes())
    assert sha1_digest({"w": w}) == old.hexdigest()
    bf = w.to(torch.bfloat16)
    assert sha1_digest({"w": bf}) == sha1_digest({"w": bf.clone()})
    moved = bf.clone()
    moved[0, 0] += 1
    assert sha1_digest({"w": moved}) != sha1_digest({"w": bf})
    assert sha1_digest({"w": bf.t()}) == sha1_digest({"w": bf.t().contiguous()})


def test_the_on_device_checksum_tells_equal_weights_from_moved_ones(monkeypatch):
    """A GPU worker's weights are summed on the GPU (copying a 7B model to the host and
    SHA-1 hashing it took ~15 s a step); the same function runs on CPU tensors here, with
    small chunks so that a tensor spans several, a padded tail and a widening pass each."""
    import torch

    from tltrun.train import step_log

    monkeypatch.setattr(step_log, "CHECKSUM_CHUNK", 16)
    monkeypatch.setattr(step_log, "CHECKSUM_CHUNKS_AT_ONCE", 2)
    gen = torch.Generator().manual_seed(0)
    for w in (torch.randn(7, 11, generator=gen).to(torch.bfloat16), torch.randn(37, generator=gen),
              torch.randint(0, 255, (5,), dtype=torch.uint8, generator=gen)):  # fmt: skip
        same = step_log.device_checksum(w.clone())
        assert step_log.device_checksum(w) == same
        flat = w.reshape(-1)
        for i in (0, flat.numel() // 2, flat.numel() - 1):  # any element, any chunk
            moved = flat.clone()
            moved[i] = moved[i] + 1
            assert step_log.device_checksum(moved.view_as(w)) != same
        if flat.numel() > 1:  # two elements swapped: the plain sum cannot tell
            swapped = flat.clone()
            swapped[[0, 1]] = flat[[1, 0]]
            assert flat[0] == flat[1] or step_log.device_checksum(swapped.view_as(w)) != same
    assert step_log.device_checksum(torch.zeros(0)) == b"(0,):torch.float32:"
    odd = torch.arange(10, dtype=torch.uint8)[1:9]  # contiguous, at an odd byte offset
    assert step_log.device_checksum(odd) == step_log.device_checksum(odd.clone())
    a, b = torch.zeros(2, 3), torch.zeros(3, 2)  # equal bytes, other shapes
    assert step_log.device_checksum(a) != step_log.device_checksum(b)
