"""What ``tltrun sft`` and ``tltrun train-drafter`` leave in their ``--out`` and say about it (a
hunt's findings): a fresh run removes an earlier run's model and refuses a directory no run of
its command wrote (train-drafter --out of its --model replaced the target with the drafter); a
killed run's sft-eval and SIGTERM are one line saying how to continue; an evaluation on
training prompts says so; a file's rows meet other rows each epoch; the model's positions
cover --max-new-tokens.

Run: ``python -m pytest tests/test_sft_outputs.py -q`` (~30 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_sft import TINY_FLAGS

from tltrun.cli.main import main
from tltrun.model.tokenizer import CharTokenizer
from tltrun.train import resumable
from tltrun.train.sft import _held_out_pairs, pair_stream
from tltrun.train.sft_config import SFTConfig
from tltsim.errors import UsageError

# the tiny model of test_sft, less the built-in task's settings (--data refuses them)
BUILT_IN_ONLY = ("--num-sample-prompts", "--group-size")
DATA_FLAGS = [
    x
    for flag, value in zip(TINY_FLAGS[::2], TINY_FLAGS[1::2], strict=True)
    if flag not in BUILT_IN_ONLY
    for x in (flag, value)
]
ROWS = "".join(
    json.dumps({"prompt": f"Q{i}: {i}+{i + 1}=", "response": str(2 * i + 1)}) + "\n"
    for i in range(12)
)


@pytest.fixture(scope="module")
def data_run(tmp_path_factory):
    """A finished one-step sft on a file's rows."""
    root = tmp_path_factory.mktemp("sftdata")
    (root / "d.jsonl").write_text(ROWS)
    argv = ["sft", "--out", str(root / "run"), "--data", str(root / "d.jsonl"), *DATA_FLAGS]
    return root, [*argv, "--num-steps", "1", "--num-eval-prompts", "3"]


def test_a_files_evaluation_is_said_to_read_training_prompts(data_run, capsys):
    root, argv = data_run
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "over 3 TRAINING prompts (the data holds no prompt training did not see)" in printed
    metrics = json.loads((root / "run" / "metrics.json").read_text())
    assert metrics["greedy"]["is_held_out"] is False and "held-out" not in printed
    # the positions cover the longest prompt and --max-new-tokens (24) of response
    config = json.loads((root / "run" / "config.json").read_text())
    longest_prompt = max(len(json.loads(line)["prompt"]) for line in ROWS.splitlines())
    assert config["max_position_embeddings"] >= 1 + longest_prompt + 24 + 1  # BOS, EOS


@pytest.mark.parametrize(
    ("task", "is_held_out"),
    [
        ("tower_of_hanoi?max_disks=3&max_pegs=3", False),  # 6 distinct problems, all trained on
        ("basic_arithmetic", True),
    ],
)
def test_a_small_gym_task_has_no_held_out_prompts_and_says_so(tmp_path, task, is_held_out):
    cfg = SFTConfig(out=str(tmp_path), data=f"reasoning-gym:{task}", num_eval_prompts=4)
    from tltrun.train.sft import data_pairs

    pairs = data_pairs(cfg, seed=cfg.seed, num_rows=200)
    evaluation, held_out = _held_out_pairs(cfg, pairs)
    assert held_out is is_held_out and evaluation
    assert any(p not in {q for q, _ in pairs} for p, _ in evaluation) is is_held_out


def test_rows_of_one_length_meet_other_rows_each_epoch():
    """The length sort is stable: the same rows, in file order, made the same batches."""
    tok = CharTokenizer()
    pairs = [(f"q{i:02d}", "r") for i in range(12)]
    stream = pair_stream(pairs, tok, 28, random.Random(0))  # 3 rows of 7 tokens per batch
    epochs = [{frozenset(tok.decode(x) for x, _ in next(stream)) for _ in range(4)}
              for _ in range(3)]  # fmt: skip
    assert len({frozenset(e) for e in epochs}) > 1, epochs


def test_a_fresh_run_removes_an_earlier_runs_outputs_and_refuses_other_files(tmp_path):
    earlier = tmp_path / "sft"
    earlier.mkdir()
    for name in ("sft_config.json", "model.safetensors", "config.json", "metrics.json"):
        (earlier / name).write_text("{}")
    (earlier / "notes.txt").write_text("the user's")
    resumable.start_fresh(earlier, "tltrun sft", config_file="sft_config.json")
    assert sorted(p.name for p in earlier.iterdir()) == ["notes.txt", "sft_config.json"]
    # a model directory no sft run wrote, and an sft run's directory for train-drafter
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_text("{}")
    (model / "config.json").write_text("{}")
    with pytest.raises(UsageError, match=r"holds config.json, model.safetensors that no tltrun"):
        resumable.start_fresh(model, "tltrun sft", config_file="sft_config.json")
    with pytest.raises(UsageError, match=r"holds sft_config.json that no tltrun train-drafter"):
        resumable.start_fresh(earlier, "tltrun train-drafter", config_file="train_config.json")
    assert (model / "model.safetensors").is_file()


def test_train_drafter_into_its_own_model_directory_is_refused(data_run, capsys):
    root, argv = data_run
    if not (root / "run" / "metrics.json").is_file():
        assert main(argv) == 0
    model = str(root / "run")
    rc = main(["train-drafter", "--model", model, "--data", str(root / "d.jsonl"), "--out", model])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        f"error: --out {model} is the --model directory; choose another --out"
    ]
    assert json.loads((root / "run" / "config.json").read_text())["architectures"] != [
        "EagleLlamaForCausalLM"
    ]


def test_sft_eval_of_an_unfinished_run_says_how_to_continue(data_run, tmp_path, capsys):
    root, argv = data_run
    if not (root / "run" / "metrics.json").is_file():
        assert main(argv) == 0
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "sft_config.json").write_text((root / "run" / "sft_config.json").read_text())
    assert main(["sft-eval", str(killed)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {killed}: the tltrun sft run did not finish (no metrics.json); "
                   "start it again"]  # fmt: skip


@pytest.mark.slow
def test_sigterm_to_sft_is_one_line_saying_how_to_resume(tmp_path):
    out = tmp_path / "run"
    (tmp_path / "d.jsonl").write_text(ROWS)
    cmd = [sys.executable, "-m", "tltrun.cli.main", "sft", "--out", str(out), "--data",
           str(tmp_path / "d.jsonl"), *DATA_FLAGS, "--num-steps", "100000",
           "--checkpoint-every", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (out / resumable.STATE_FILE).is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-800:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 143, err[-800:]
    assert lines[-1] == (
        f"error: {out}: stopped by SIGTERM; continue from its last state with tltrun sft "
        f"--out {out} --resume"
    ), err[-800:]
    assert "Traceback" not in err


def test_data_settings_without_data_and_empty_keys_are_refused(tmp_path, capsys):
    (tmp_path / "r.jsonl").write_text('{"prompt": "2+2", "solution": "4"}\n')
    for extra, message in [
        (["--prompt-key", "q", "--data-num-rows", "5"], "--prompt-key, --data-num-rows: "
         "settings of --data, which is not given"),
        (["--data", "x.jsonl", "--response-key", ""], "--response-key: expected a column name"),
        # --data's settings its kind does not read (hunt: recorded, ignored)
        (["--data", "reasoning-gym:chain_sum", "--prompt-key", "foo"],
         "--prompt-key: not read for a reasoning-gym task"),
        (["--data", "x.jsonl", "--data-num-rows", "5"], "--data-num-rows: not read for a file"),
        # a column no row has: its flag, not --skip-bad-rows (which then skipped every row)
        (["--data", str(tmp_path / "r.jsonl")], "key 'response': missing (columns: prompt, "
         "solution; --response-key names another)"),
    ]:  # fmt: skip
        assert main(["sft", "--out", str(tmp_path / "o"), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "o").exists()


def test_train_drafter_of_no_steps_says_so(data_run, tmp_path, capsys):
    """--train-num-steps 0 printed "loss 0.000, top-1 agreement 0.000" for an untrained drafter."""
    root, argv = data_run
    if not (root / "run" / "metrics.json").is_file():
        assert main(argv) == 0
    capsys.readouterr()
    gens = tmp_path / "generations.jsonl"
    row = {"id": "p0", "prompt_token_ids": [1, 20, 21, 22], "output_token_ids": [23, 24, 25, 2]}
    gens.write_text(json.dumps(row) + "\n")
    argv = ["train-drafter", "--model", str(root / "run"), "--data", str(gens)]
    assert main([*argv, "--out", str(tmp_path / "d"), "--train-num-steps", "0"]) == 0
    printed = capsys.readouterr().out
    assert "for no steps (--train-num-steps 0: the initial drafter)" in printed, printed
    assert "loss" not in printed


def test_skip_bad_rows_skips_chat_rows_too(tmp_path):
    """Chat-message rows stopped the run even with --skip-bad-rows."""
    from tltrun.data.dataset import DataError, SkippedRowsWarning
    from tltrun.train.sft import data_pairs

    path = tmp_path / "d.jsonl"
    chat = {"prompt": [{"role": "user", "content": "1+1="}], "response": "2"}
    path.write_text(json.dumps(chat) + "\n" + '{"prompt": "2+2=", "response": "4"}\n')
    with pytest.raises(DataError, match="no chat messages.*--skip-bad-rows skips such rows"):
        data_pairs(SFTConfig(out=str(tmp_path / "o"), data=str(path)), seed=0, num_rows=10)
    skipping = SFTConfig(out=str(tmp_path / "o"), data=str(path), skip_bad_rows=True)
    with pytest.warns(SkippedRowsWarning, match=r"skipped 1 bad rows of .*d\.jsonl"):
        assert data_pairs(skipping, seed=0, num_rows=10) == [("2+2=", "4")]
    path.write_text(json.dumps(chat) + "\n")
    with pytest.warns(SkippedRowsWarning), pytest.raises(DataError, match="no row left"):
        data_pairs(skipping, seed=0, num_rows=10)


def test_saved_weights_get_the_umasks_permissions(tmp_path):
    """safetensors wrote model.safetensors 0600 beside 0644 files under umask 022."""
    import stat

    from tiny_models import tiny_model

    from tltrun.model.drafter import EagleDrafter, export_vllm
    from tltrun.model.hf_checkpoint import save_hf

    old = os.umask(0o027)
    try:
        model = tiny_model(seed=0)
        save_hf(model, tmp_path / "m")
        export_vllm(EagleDrafter.for_target(model, seed=1), tmp_path / "d")
    finally:
        os.umask(old)
    for root in ("m", "d"):
        for name in ("config.json", "model.safetensors"):
            mode = stat.S_IMODE((tmp_path / root / name).stat().st_mode)
            assert mode == 0o640, (root, name, oct(mode))


def test_a_run_is_resumed_and_evaluated_from_another_directory(tmp_path, monkeypatch, capsys):
    """Relative --data was recorded as given: sft-eval and --resume worked only from the
    directory the run started in, and a respelled path was refused as other data."""
    from tltrun.cli.args import offline_configs_from_args
    from tltrun.cli.main import build_parser
    from tltrun.train.tasks import TaskConfig

    here, there = tmp_path / "a", tmp_path / "b"
    here.mkdir()
    there.mkdir()
    (here / "d.jsonl").write_text(ROWS)
    monkeypatch.chdir(here)
    argv = ["sft", "--out", "run", "--data", "d.jsonl", *DATA_FLAGS, "--num-steps", "1"]
    assert main([*argv, "--num-eval-prompts", "2"]) == 0
    recorded = json.loads((here / "run" / "sft_config.json").read_text())["sft"]
    assert recorded["data"] == str(here / "d.jsonl") and recorded["out"] == "run"
    monkeypatch.chdir(there)
    capsys.readouterr()
    assert main(["sft-eval", "../a/run"]) == 0, capsys.readouterr().err
    # a resume given the data again, spelt from here: the same file, not other data
    (here / "run" / resumable.STATE_FILE).write_bytes(b"")  # as a killed run leaves it
    args = build_parser().parse_args(["sft", "--out", "../a/run", "--resume", "--data",
                                      "../a/d.jsonl"])  # fmt: skip
    sections = {"sft": (SFTConfig, ""), "task": (TaskConfig, "task-")}
    configs = offline_configs_from_args(args, sections, command="tltrun sft",
                                        config_file="sft_config.json",
                                        finished_file="no-such-file")  # fmt: skip
    assert configs["sft"].data == str(here / "d.jsonl")


def test_a_run_refused_at_its_data_leaves_no_directory(tmp_path, capsys):
    """A bad row was found after sft_config.json and run.lock were written into a new --out."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}],
                                "response": "2"}) + "\n")  # fmt: skip
    out = tmp_path / "new" / "run"
    assert main(["sft", "--out", str(out), "--data", str(data), *DATA_FLAGS]) == 2
    assert "no chat messages" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_files_evaluation_compares_final_answers(tmp_path, monkeypatch):
    """Hunt: a model reproducing multi-line or boxed references exactly scored 0 (the
    response's final answer was compared with the whole reference)."""
    from tltrun.rollout import engine as engine_module
    from tltrun.rollout.interface import RequestOutput, RolloutResult
    from tltrun.train.sft_eval import evaluate_pairs

    tok = CharTokenizer()
    # and a thinking reference, whose boxed draft inside <think> was the answer compared
    think = "<think>\nguess \\boxed{13}? no, 14\n</think>\nThe answer is 14."
    pairs = [("1+1=", "1 plus 1\nso \\boxed{2}"), ("2+2=", "2 plus 2\nis\n4"), ("3+3=", "6"),
             ("7+7=", think)]  # fmt: skip
    replies = {"1+1=": "1 plus 1\nso \\boxed{2}", "2+2=": "so: 4", "3+3=": "7", "7+7=": think}

    class Replay:  # the engine, answering each prompt with its reply
        def __init__(self, model, drafter, config):
            pass

        def generate(self, requests, policy):
            outputs = []
            for r in requests:
                text = replies[tok.decode(list(r.prompt_token_ids[1:]))]
                outputs.append(RequestOutput(id=r.id, prompt_token_ids=r.prompt_token_ids,
                                             output_token_ids=tok.encode(text), finish="stop"))  # fmt: skip
            return RolloutResult(outputs=outputs, iterations=[], wall_s=0.0, backend="torch")

    monkeypatch.setattr(engine_module, "RolloutEngine", Replay)
    cfg = SFTConfig(out=str(tmp_path), data="rows.jsonl")
    result = evaluate_pairs(None, tok, cfg, pairs, is_held_out=True, show_progress=False)
    # right: the boxed reply (its final answer 2) and the thinking one reproduced exactly;
    # "so: 4" is wrong (its last line is not "4")
    assert result["greedy"]["accuracy"] == 2 / 4


def test_sft_eval_of_weights_trained_on_evaluates_them(data_run, tmp_path, capsys):
    """Hunt: tltrun train's final/actor carries the sft_config.json of the model it started
    from (for this command), and sft-eval refused it as "the tltrun sft run did not finish"."""
    import shutil

    root, argv = data_run
    if not (root / "run" / "metrics.json").is_file():
        assert main(argv) == 0
    actor = tmp_path / "final" / "actor"
    shutil.copytree(root / "run", actor)
    (actor / "metrics.json").unlink()
    capsys.readouterr()
    assert main(["sft-eval", str(actor)]) == 0
    assert "greedy accuracy" in capsys.readouterr().out
    (root / "run" / "metrics.json").rename(root / "metrics.json")  # the run's own: unfinished
    try:
        assert main(["sft-eval", str(root / "run")]) == 2
        assert "did not finish (no metrics.json)" in capsys.readouterr().err
    finally:
        (root / "metrics.json").rename(root / "run" / "metrics.json")


def test_sft_eval_says_when_the_runs_data_changed(tmp_path, capsys):
    """Hunt: sft-eval read the --data file as it is now and printed other numbers than the
    run's metrics.json, unsaid."""
    (tmp_path / "d.jsonl").write_text(ROWS)
    argv = ["sft", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "d.jsonl"),
            *DATA_FLAGS, "--num-steps", "1", "--num-eval-prompts", "3"]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["sft-eval", str(tmp_path / "run")]) == 0
    assert "warning" not in capsys.readouterr().err
    (tmp_path / "d.jsonl").write_text(ROWS.replace('"response": "', '"response": "x'))
    assert main(["sft-eval", str(tmp_path / "run")]) == 0
    assert "its --data changed since the run" in capsys.readouterr().err


def test_a_stop_a_clean_up_raised_over_still_says_how_to_resume(tmp_path, capsys):
    """SIGTERM inside torch.save: its zip writer's exit raised RuntimeError("unexpected pos")
    over the stop, which then read as an internal error, exit 1 (a CI run's flake)."""
    import argparse

    from tltrun.cli.args import stop_says_how_to_resume
    from tltsim.cli.args import Terminated, run_command
    from tltsim.errors import StoppedError

    def cut_mid_write():
        try:
            raise Terminated
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")

    with pytest.raises(StoppedError) as stopped, stop_says_how_to_resume(tmp_path, "tltrun sft"):
        cut_mid_write()
    assert stopped.value.exit_code == 143 and "stopped by SIGTERM" in str(stopped.value)

    def command(args):
        try:
            raise KeyboardInterrupt
        finally:
            raise RuntimeError("clean-up failed")

    assert run_command(command, argparse.Namespace(), "tltrun") == 130
    assert capsys.readouterr().err.strip() == "interrupted"
