"""Evaluation during ``tltrun train`` (a read-only hunt's findings): the built-in task's
evaluation stream is apart from every training stream (at seed 0 it was step 1's: an int seed
of -1 is seeded as 1); evaluation reward errors are counted in the log row (they were in
reward_errors.log only, and eval_reward_mean read them as zeros); the log holds the raw reward
mean beside the shaped one (evaluation reports raw rewards) and the report draws the raw one;
evaluation settings without effect are one line; evaluation prompts that training also sees
are said so.

Run: ``python -m pytest tests/test_train_eval.py -q``.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
from test_train_data import bpe_model, data_dir  # noqa: F401 (fixtures)

from tltrun.train.config import TrainConfig
from tltrun.train.config_checks import check_eval_flags
from tltrun.train.prompts import _EVAL_STREAM, DataWarning, builtin_rows, load_run_data
from tltrun.train.responses import EvalSummary
from tltrun.train.step_log import eval_columns
from tltrun.train.tasks import TaskConfig
from tltsim.errors import UsageError


def prompts(rows) -> set[str]:
    return {row.prompt for row in rows}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_built_in_evaluation_stream_is_not_a_training_stream(seed):
    task = TaskConfig()
    evaluation = prompts(builtin_rows(task, seed, _EVAL_STREAM, 16))
    assert len(evaluation) == 16
    for step in range(8):  # chance repeats of a problem only, never a whole stream
        assert len(evaluation & prompts(builtin_rows(task, seed, step, 16))) <= 1
    # the stream is a pure function of the seed
    assert prompts(builtin_rows(task, seed, _EVAL_STREAM, 16)) == evaluation


def test_evaluation_reward_errors_are_counted_in_the_row():
    evals = [
        EvalSummary(rewards=[0.0, 1.0], lengths=[3, 4], num_truncated=0, num_prompts=2,
                    errors=["step0/e0/0: RuntimeError: boom"]),
        EvalSummary(rewards=[0.0], lengths=[5], num_truncated=1, num_prompts=1,
                    errors=["step0/e1/0: RuntimeError: boom"]),
    ]  # fmt: skip
    row = eval_columns(evals, eval_s=0.5)
    assert row["eval_reward_errors"] == 2 and row["eval_reward_mean"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"eval_split": 0.2}, "--eval-split without --eval-every: nothing is evaluated (and"),
        ({"eval_data": "x.jsonl"}, "--eval-data without --eval-every"),
        ({"eval_num_samples": 3}, "--eval-num-samples without --eval-every"),
        ({"eval_every": 1, "eval_num_samples": 3, "temperature": 0.0},
         "--eval-num-samples 3 at --temperature 0.0: greedy responses are all the same"),
    ],
)  # fmt: skip
def test_evaluation_settings_without_effect_are_one_line(fields, message):
    cfg = TrainConfig(model_dir="m", out="o", data="d.jsonl", reward="exact", **fields)
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        check_eval_flags(cfg)


def test_evaluation_settings_that_take_effect_pass():
    check_eval_flags(TrainConfig(model_dir="m", out="o"))
    cfg = TrainConfig(model_dir="m", out="o", data="d.jsonl", reward="exact", eval_every=2,
                      eval_split=0.2, eval_num_samples=4)  # fmt: skip
    check_eval_flags(cfg)


def test_evaluation_prompts_that_training_sees_are_counted(bpe_model, tmp_path):  # noqa: F811
    rows = [{"id": f"d{i}", "question": f"q{i % 4}", "answer": "1"} for i in range(20)]
    data = tmp_path / "dup.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TrainConfig(model_dir=str(bpe_model), out="o", data=str(data), prompt_key="question",
                      reward="exact", eval_every=1, eval_split=0.2, max_new_tokens=64)  # fmt: skip
    run = load_run_data(cfg, TaskConfig(), lambda row: 4, 512)
    assert len(run.eval_rows) == 4 and run.num_eval_in_training() == 4  # 4 distinct prompts
    distinct = tmp_path / "distinct.jsonl"
    distinct.write_text("".join(json.dumps({**r, "question": f"q{i}"}) + "\n"
                                for i, r in enumerate(rows)))  # fmt: skip
    cfg = TrainConfig(model_dir=str(bpe_model), out="o", data=str(distinct),
                      prompt_key="question", reward="exact", eval_every=1, eval_split=0.2,
                      max_new_tokens=64)  # fmt: skip
    assert load_run_data(cfg, TaskConfig(), lambda row: 4, 512).num_eval_in_training() == 0


def test_the_launcher_says_which_evaluation_rows_it_takes_and_text_that_reads_as_messages(
    bpe_model,  # noqa: F811
    tmp_path,
):
    """Hunt: a 1,319-row --eval-data was evaluated on its first 64 rows, unsaid; pandas' to_csv of
    a messages column (its repr) was trained on as text without the chat template, unsaid."""
    from tltrun.train.prompts import warn_data

    rows = [{"question": f"q{i}", "answer": "1"} for i in range(6)]
    rows[0]["question"] = str([{"role": "user", "content": "What is 3 plus 0?"}])
    data, held = tmp_path / "d.jsonl", tmp_path / "e.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held.write_text(
        "".join(json.dumps({"question": f"e{i}", "answer": "1"}) + "\n" for i in range(5))
    )
    cfg = TrainConfig(model_dir=str(bpe_model), out="o", data=str(data), eval_data=str(held),
                      prompt_key="question", reward="exact", eval_every=1, eval_max_prompts=3,
                      max_new_tokens=64, prompts_per_step=2)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_data(cfg, load_run_data(cfg, TaskConfig(), lambda row: 4, 512))
    assert [str(w.message) for w in caught] == [
        "--eval-max-prompts 3: each evaluation takes the first 3 of 5 evaluation rows",
        "1 prompt(s) are text that reads like a list of chat messages (a CSV of a messages "
        "column?): they are used as text, without the chat template; keep messages in JSONL or "
        "Parquet",
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[1:]))
    quiet = replace(cfg, eval_max_prompts=5)  # every evaluation row, no message-like text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_data(quiet, load_run_data(quiet, TaskConfig(), lambda row: 4, 512))


def test_training_on_a_directory_s_only_test_split_is_said(bpe_model, tmp_path):  # noqa: F811
    """Hunt: a DatasetDict (or hub shards) holding only a test split was trained on, unsaid."""
    import datasets

    from tltrun.train.prompts import warn_data

    rows = [{"question": f"q{i}", "answer": "1"} for i in range(4)]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dd")
    )
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "test-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    said = {}
    for source in ("dd", "shards", "train.jsonl"):
        cfg = TrainConfig(model_dir=str(bpe_model), out="o", data=str(tmp_path / source),
                          prompt_key="question", reward="exact", max_new_tokens=64,
                          prompts_per_step=2)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_data(cfg, load_run_data(cfg, TaskConfig(), lambda row: 4, 512))
        said[source] = [str(w.message) for w in caught]
    assert said == {
        "dd": [f"--data {tmp_path / 'dd'}: its only split is 'test': training on it"],
        "shards": [f"--data {tmp_path / 'shards'}: its only split is 'test': training on it"],
        "train.jsonl": [],
    }


def test_the_launcher_warns_of_evaluation_prompts_training_sees(bpe_model, tmp_path):  # noqa: F811
    from tltrun.train.launch import check_inputs

    rows = [{"id": f"d{i}", "question": f"q{i % 4}", "answer": "1"} for i in range(20)]
    data = tmp_path / "dup.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TrainConfig(model_dir=str(bpe_model), out=str(tmp_path / "o"), data=str(data),
                      prompt_key="question", reward="exact", eval_every=1, eval_split=0.2,
                      max_new_tokens=64)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_inputs(cfg, TaskConfig())
    said = [str(w.message) for w in caught if issubclass(w.category, DataWarning)]
    assert said == [
        "4 of 4 evaluation prompts are training prompts too: eval_reward_mean is not a held-out "
        "score"
    ]


def test_the_report_draws_the_raw_reward_where_the_log_has_it(tmp_path, monkeypatch):
    from analysis import train_plots

    drawn = []
    real_plot = train_plots.plt.Axes.plot

    def spy(self, xs, ys, *args, **kwargs):
        drawn.append((kwargs.get("label"), list(ys)))
        return real_plot(self, xs, ys, *args, **kwargs)

    monkeypatch.setattr(train_plots.plt.Axes, "plot", spy)
    rows = [{"step": s, "reward_mean": -0.6, "reward_raw_mean": 0.2, "eval_reward_mean": 0.1}
            for s in range(2)]  # fmt: skip
    train_plots._reward([("run", rows)], tmp_path)
    assert ("run: rollouts", [0.2, 0.2]) in drawn
    old = [{k: v for k, v in r.items() if k != "reward_raw_mean"} for r in rows]  # older logs
    drawn.clear()
    train_plots._reward([("run", old)], tmp_path)
    assert ("run: rollouts", [-0.6, -0.6]) in drawn


def test_the_step_time_figure_draws_evaluation_apart_from_other(tmp_path, monkeypatch):
    from analysis import train_plots

    bars = []
    real_bar = train_plots.plt.Axes.bar

    def spy(self, xs, heights, *args, **kwargs):
        bars.append((kwargs.get("label"), [round(h, 6) for h in heights]))
        return real_bar(self, xs, heights, *args, **kwargs)

    monkeypatch.setattr(train_plots.plt.Axes, "bar", spy)
    rows = [
        {"step": 0, "rollout_s": 1.0, "train_s": 0.5, "step_s": 2.0, "drafter_train_s": 0.0},
        {"step": 1, "rollout_s": 1.0, "train_s": 0.5, "step_s": 3.0, "drafter_train_s": 0.0,
         "eval_s": 1.0},
    ]  # fmt: skip
    train_plots._step_time([("run", rows)], tmp_path)
    assert ("evaluation", [0.5]) in bars and ("other", [0.5]) in bars  # step 2.5, eval 0.5
    # the drafter's wait past the rollout (hunt: deterministic mode's ~1 s was "other")
    bars.clear()
    train_plots._step_time([("run", [{**r, "spot_wait_s": 0.2} for r in rows])], tmp_path)
    assert ("drafter sync / spot wait after the rollout", [0.2]) in bars
    assert ("other", [0.3]) in bars


def test_data_smaller_than_a_step_and_a_files_num_rows_are_warned_about(bpe_model, tmp_path):  # noqa: F811
    """Both ran without a word: every step trained some rows twice; --data-num-rows was
    ignored for a file."""
    from tltrun.train.launch import check_inputs

    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"id": f"d{i}", "question": f"q{i}", "answer": "1"}) + "\n"
                            for i in range(2)))  # fmt: skip
    cfg = TrainConfig(model_dir=str(bpe_model), out=str(tmp_path / "o"), data=str(data),
                      prompt_key="question", reward="exact", max_new_tokens=64,
                      prompts_per_step=4, data_num_rows=1)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_inputs(cfg, TaskConfig())
    said = [str(w.message) for w in caught if issubclass(w.category, DataWarning)]
    assert said == [
        f"--data {data}: 2 training rows for --prompts-per-step 4: every step trains some rows "
        "more than once",
        "--data-num-rows 1: a file is read whole (the flag sets how many reasoning-gym problems "
        "are generated)",
    ]


@pytest.mark.parametrize(
    ("train", "label"),
    [
        # is_spot_training null: the default, on where the policy drafts with EAGLE
        ({"policy": "tlt", "is_spot_training": None}, "rl (tlt, spot)"),
        ({"policy": "tlt", "is_spot_training": False}, "rl (tlt, frozen drafter)"),
        ({"policy": "static", "is_spot_training": None, "static_strategy": "4_1_4"},
         "rl (static, spot)"),
        ({"policy": "tlt", "is_spot_training": True, "num_workers": 1}, "rl (tlt, frozen drafter)"),
        ({"policy": "nospec", "is_spot_training": None}, "rl (nospec)"),
    ],
)  # fmt: skip
def test_the_report_labels_a_run_by_its_effective_spot_training(tmp_path, train, label):
    """A default tlt run (is_spot_training null since session 36) was labelled "frozen
    drafter" beside its own spot-training bars."""
    import json

    from analysis.train_plots import load_run

    run = tmp_path / "rl"
    run.mkdir()
    row = {"step": 0, "reward_mean": 0, "accept_len": 1, "rollout_s": 1, "train_s": 1,
           "step_s": 2, "drafter_train_s": 0}  # fmt: skip
    (run / "log.jsonl").write_text(json.dumps(row) + "\n")
    (run / "config.json").write_text(json.dumps({"train": {"num_workers": 2, **train}}))
    assert load_run(run)[0] == label


def test_the_report_says_when_runs_differ_in_length(tmp_path):
    """Runs of 3 and 14 steps were compared without a word: their means cover other steps."""
    import json

    from analysis.train_plots import report
    from tltsim.errors import InputWarning

    row = {"reward_mean": 0, "accept_len": 1, "rollout_s": 1, "train_s": 1, "step_s": 2,
           "drafter_train_s": 0}  # fmt: skip
    dirs = []
    for name, num_steps in (("a", 3), ("b", 5)):
        run = tmp_path / name
        run.mkdir()
        lines = [json.dumps({"step": i, **row}) for i in range(num_steps)]
        (run / "log.jsonl").write_text("\n".join(lines) + "\n")
        dirs.append(str(run))
    with pytest.warns(InputWarning, match=r"runs of different lengths \(a: 3 steps, b: 5 steps\)"):
        report(dirs, str(tmp_path / "out"))


def test_greedy_grpo_is_said_to_learn_nothing(bpe_model, tmp_path, capsys, monkeypatch):  # noqa: F811
    """Hunt: --temperature 0 made every group's responses alike, every advantage 0 and every
    step's loss 0.0, and the run ended as if it had trained."""
    from tltrun.cli.main import main
    from tltrun.train import launch

    monkeypatch.setattr(launch, "run_train", lambda cfg, task, **kwargs: tmp_path / "o")
    argv = ["train", "--model-dir", str(bpe_model), "--out", str(tmp_path / "o"),
            "--max-new-tokens", "64"]  # fmt: skip
    assert main([*argv, "--temperature", "0"]) == 0
    assert "warning: --temperature 0.0: greedy decoding gives a group's responses the same " in (
        capsys.readouterr().err
    )
    assert main([*argv, "--temperature", "0.7"]) == 0
    assert "greedy" not in capsys.readouterr().err


def test_a_step_whose_every_reward_call_failed_is_said(tmp_path, capsys):
    """Hunt: a reward that failed on every call (a forgotten return, another task's scorer)
    trained on zeros, with the failures in log.jsonl and reward_errors.log only."""
    from tltrun.train.step_log import said_reward_failed

    cfg = TrainConfig(model_dir="m", out="o", prompts_per_step=2, group_size=4)
    assert not said_reward_failed({"reward_errors": 7}, cfg, tmp_path, 3)
    assert capsys.readouterr().err == ""
    assert said_reward_failed({"reward_errors": 8}, cfg, tmp_path, 3)
    assert capsys.readouterr().err == (
        "warning: step 3: every reward call failed and scored 0, so the run trains on no "
        f"signal: see {tmp_path / 'reward_errors.log'}; --reward-errors raise stops at the first\n"
    )


def test_more_worker_threads_than_cores_is_said(monkeypatch):
    """Hunt: 2 workers x 2 threads on 2 cores made a step's 1.5 s rollout 119 s, unsaid (only
    one worker's threads past the cores was refused); said after the worker count's check (a
    refused 10^8 workers had a warning line before its error)."""
    import os

    from tltrun.train import elastic

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        elastic.warn_contention(2, 2)  # 4 threads on 4 cores
    with pytest.warns(elastic.ContentionWarning, match=r"^2 workers x --num-threads 3 = 6 "
                      "threads on this machine's 4 cores: they contend"):  # fmt: skip
        elastic.warn_contention(2, 3)
