"""Inputs of ``tltrun train`` checked before any worker starts (found by a read-only user-story
hunt):

* a prompt and its response must fit the model's positions (max_position_embeddings): the
  longest prompt is --max-prompt-tokens or, where less, what the model's positions leave beside
  --max-new-tokens (the torch engine decoded 120 positions of a 64-position model without a
  word; vLLM refused to start a model of 512 positions: max_model_len was 1024 + N);
* a ``file.py:function`` reward must take (prompt, response, answer, **the data's other
  columns): one that cannot failed on every call and the run trained on zero rewards.

Run: ``python -m pytest tests/test_train_inputs.py -q``.
"""

# ruff: noqa: F811 (pytest fixtures imported from test_train_data)
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from test_train_data import bpe_model, data_dir  # noqa: F401 (fixtures)

from tltrun.data.dataset import DataError
from tltrun.data.tokenizer import ChatTemplateError, load_tokenizer
from tltrun.train.config import TrainConfig
from tltrun.train.prompts import load_run_data, max_request_tokens, prompt_cap
from tltrun.train.tasks import TaskConfig
from tltsim.errors import UsageError


def config(model: str, data: str | None, **fields) -> TrainConfig:
    extra = {"data": data, "prompt_key": "question", "reward": "exact"} if data else {}
    return TrainConfig(model_dir=model, out="unused", **extra, **fields)


def test_the_positions_cap_the_prompt(bpe_model, data_dir):  # noqa: F811
    cfg = config(str(bpe_model), str(data_dir / "train.csv"), max_new_tokens=40)
    assert prompt_cap(cfg, 1 << 20) == (1024, "the max prompt length (--max-prompt-tokens)")
    cap, what = prompt_cap(cfg, 64)
    assert cap == 24 and "model's 64 positions leave beside --max-new-tokens 40" in what
    assert max_request_tokens(cfg, TaskConfig(), 64) == 64
    with pytest.raises(DataError, match=r"prompt of 30 tokens is longer than what the model's 64"):
        load_run_data(cfg, TaskConfig(), lambda row: 30, 64)
    assert load_run_data(cfg, TaskConfig(), lambda row: 24, 64).num_train_rows > 0


def test_no_room_for_a_prompt_is_one_line(bpe_model, data_dir):  # noqa: F811
    cfg = config(str(bpe_model), str(data_dir / "train.csv"), max_new_tokens=64)
    with pytest.raises(UsageError, match="--max-new-tokens 64: leaves no room for a prompt"):
        load_run_data(cfg, TaskConfig(), lambda row: 1, 64)
    builtin = config(str(bpe_model), None, max_new_tokens=40)
    task = TaskConfig()
    with pytest.raises(UsageError, match="the built-in task's prompts"):
        load_run_data(builtin, task, lambda row: 1, task.max_prompt_chars + 40)
    assert max_request_tokens(builtin, task, 1 << 20) == task.max_prompt_chars + 1 + 40


def test_a_reward_function_that_cannot_take_the_call_is_one_line(
    bpe_model,  # noqa: F811
    data_dir,  # noqa: F811
    tmp_path,
    capsys,
):
    from tltrun.cli.main import main

    narrow = tmp_path / "narrow.py"
    narrow.write_text("def score(prompt, response):\n    return 1.0\n")
    wide = tmp_path / "wide.py"
    wide.write_text("def score(prompt, response, answer, **columns):\n    return 1.0\n")
    base = ["train", "--model-dir", str(bpe_model), "--data", str(data_dir / "train.csv"),
            "--prompt-key", "question", "--num-steps", "1", "--max-new-tokens", "8"]  # fmt: skip
    out = tmp_path / "run"
    assert main([*base, "--out", str(out), "--reward", f"{narrow}:score"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the function is called with (prompt, response, answer)" in err
    assert "too many positional arguments" in err and not out.exists()
    from tltrun.data.rewards import check_user_function

    check_user_function(f"{wide}:score", ("answer", "id", "source"))  # takes what it is given
    no_columns = tmp_path / "no_columns.py"
    no_columns.write_text("def score(prompt, response, answer):\n    return 1.0\n")
    with pytest.raises(UsageError, match=r"columns as keywords \(id\): .*unexpected keyword"):
        check_user_function(f"{no_columns}:score", ("id",))


def test_a_drafter_of_another_target_is_refused_before_any_worker(
    bpe_model,  # noqa: F811
    data_dir,  # noqa: F811
    tmp_path,
):
    """It was refused in the workers, after they had started (torch's SIGTERM lines first)."""
    from tiny_models import tiny_model

    from tltrun.model.drafter import EagleDrafter, export_vllm
    from tltrun.train.launch import check_inputs

    other = tiny_model(seed=0, hidden_size=64, head_dim=16)
    export_vllm(EagleDrafter.for_target(other, seed=1), tmp_path / "drafter")
    cfg = config(
        str(bpe_model),
        str(data_dir / "train.csv"),
        max_new_tokens=8,
        drafter_dir=str(tmp_path / "drafter"),
        policy="tlt",
    )
    with pytest.raises(UsageError, match="hidden_size=64 but the target has 48"):
        check_inputs(cfg, TaskConfig())


def test_input_paths_are_recorded_absolute(bpe_model, data_dir, tmp_path, monkeypatch):  # noqa: F811
    """A run recorded --model-dir and --data as typed: resumed from another directory, its
    model and data were not found (and a respelled path counted as a changed setting)."""
    from tltrun.cli.main import main
    from tltrun.train import launch

    ran = []
    monkeypatch.setattr(launch, "run_train", lambda cfg, task, **kw: ran.append(cfg) or "o")
    monkeypatch.chdir(data_dir)
    model = Path("..") / bpe_model.relative_to(data_dir.parent)
    argv = ["train", "--model-dir", str(model), "--out", str(tmp_path / "o"), "--data",
            "train.csv", "--prompt-key", "question", "--reward", "exact"]  # fmt: skip
    assert main(argv) == 0
    assert ran[0].model_dir == str(bpe_model.resolve())
    assert ran[0].data == str((data_dir / "train.csv").resolve())
    assert ran[0].out == str(tmp_path / "o")  # as given (the run directory itself)


@pytest.mark.parametrize(
    ("config", "flags"),
    [
        ('reward = "exact"\n', ["--data", "{data}"]),
        ('data = "{data}"\n', ["--reward", "exact"]),
        ("prompt_split = [2, 1]\n", ["--prompts-per-step", "3"]),
        ("prompt_split = [2, 1]\n", ["--prompt-split", "4,4"]),
        ("prompts_per_step = 1\n", ["--num-workers", "1"]),
    ],
)  # fmt: skip
def test_a_config_file_is_validated_with_the_flags_over_it(
    bpe_model,  # noqa: F811
    data_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
    config,
    flags,  # noqa: F811
):
    """The file was validated alone, before the flags: settings valid together were refused."""
    from tltrun.cli.main import main
    from tltrun.train import launch

    ran = []
    monkeypatch.setattr(launch, "run_train", lambda cfg, task, **kw: ran.append(cfg) or "o")
    data = str(data_dir / "train.csv")
    (tmp_path / "c.toml").write_text(config.replace("{data}", data))
    argv = ["train", "--model-dir", str(bpe_model), "--out", str(tmp_path / "o"), "--config",
            str(tmp_path / "c.toml"), "--prompt-key", "question", "--max-new-tokens", "64"]  # fmt: skip
    if "data" not in config and "{data}" not in flags:
        argv += ["--data", data, "--reward", "exact"]
    assert main([*argv, *(f.replace("{data}", data) for f in flags)]) == 0
    assert len(ran) == 1


def test_a_config_file_and_flags_invalid_together_name_the_file(bpe_model, tmp_path, capsys):  # noqa: F811
    from tltrun.cli.main import main

    (tmp_path / "c.toml").write_text("prompt_split = [2, 1]\n")
    argv = ["train", "--model-dir", str(bpe_model), "--out", str(tmp_path / "o"), "--config",
            str(tmp_path / "c.toml")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert (
        "prompt_split (2, 1): need 2 counts >= 1 summing to --prompts-per-step=8" in err
        and f"--config {tmp_path / 'c.toml'}" in err
    )
    assert "\n" not in err


def test_request_slots_never_exceed_a_workers_responses():
    """10^12 slots tried to allocate 36 PB of KV cache in a worker (an internal error)."""
    cfg = TrainConfig(model_dir="m", out="o", max_running_requests=10**12, group_size=4)
    assert cfg.max_running(3) == 12
    assert (
        TrainConfig(model_dir="m", out="o", max_running_requests=5, group_size=4).max_running(3)
        == 5
    )
    assert TrainConfig(model_dir="m", out="o", group_size=4).max_running(3) == 12


@pytest.mark.parametrize(
    ("config", "flags", "says"),
    [
        # tltbase drafts from the history alone: these were recorded and never read
        ("", ["--policy", "tltbase", "--tlt-drafter-explore", "rollout"],
         "--tlt-drafter-explore: not read by --policy tltbase"),
        # a file's keys are named as the file's, not as flags the user never typed
        ("tlt_threshold = 16\n", ["--policy", "nospec"],
         "tlt_threshold (--config {config}): not read by --policy nospec"),
        ("[task]\nbogus = 1\n", [], "--config {config} [task]: unknown field(s) bogus"),
        ("[task]\nmax_ops = 300\n", [], "--config {config} [task]: max_ops must be"),
        # --data's settings without --data, the torch engine's under vllm: read by nothing
        ("", ["--data-num-rows", "5", "--skip-bad-rows"],
         "--data-num-rows, --skip-bad-rows: settings of --data, which is not given"),
        ("", ["--max-prompt-tokens", "7"], "--max-prompt-tokens: settings of --data"),
        ("", ["--backend", "vllm", "--fuse-projections", "--no-history-cross-prompt"],
         "--fuse-projections, --history-cross-prompt: settings of the torch engine"),
        ("", ["--backend", "vllm", "--dtype", "float64"],
         "dtype 'float64': backend vllm takes float32, bfloat16, float16"),
        ("", ["--backend", "vllm", "--eager", "--attn-impl", "flex"],
         "--attn-impl, --eager: settings of the torch engine"),
        ("", ["--attn-impl", "paged"], "--attn-impl 'paged': expected one of sdpa, flex"),
        # Triton's interpreter runs no bf16 tree attention: refused before any worker
        ("", ["--attn-impl", "triton", "--dtype", "bfloat16"], "--attn-impl triton: "),
        # spot training's and overlong shaping's settings where neither runs (hunt: recorded,
        # never read, then refused as changes on --resume)
        ("", ["--policy", "nospec", "--drafter-lr", "0.5"],
         "--drafter-lr: settings of spot drafter training, which this run does not do (--policy "
         "nospec drafts with no EAGLE drafter, --spot-training turns it on)"),
        ("spot_training = true\nis_spot_training = true\n", [], "are one setting; keep one"),
        ("drafter_batch_size = 7\n", ["--no-spot-training"],
         "drafter_batch_size (--config {config}): settings of spot drafter training"),
        ("", ["--overlong-penalty", "0.5"], "--overlong-penalty: applies over --overlong-buffer"),
    ],
)  # fmt: skip
def test_unused_and_bad_config_settings_are_named_where_they_were_set(
    bpe_model,
    tmp_path,
    capsys,
    config,
    flags,
    says,  # noqa: F811
):
    from tltrun.cli.main import main

    path = tmp_path / "c.TOML"  # (an upper-case suffix was read as JSON)
    path.write_text(config)
    argv = ["train", "--model-dir", str(bpe_model), "--out", str(tmp_path / "o"), "--config",
            str(path), *flags]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says.format(config=path) in err and "\n" not in err, err


def test_under_torchrun_the_world_size_is_the_number_of_workers_before_any_check(
    bpe_model,
    tmp_path,
    monkeypatch,  # noqa: F811
):
    """fsdp_size 4 under a 4-rank job was checked against the default 2 workers and refused."""
    from tltrun.cli.main import main
    from tltrun.train import launch

    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29977", "TORCHELASTIC_RUN_ID": "x"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    ran = []
    monkeypatch.setattr(launch, "run_train", lambda cfg, task, **kw: ran.append(cfg) or "o")
    (tmp_path / "c.toml").write_text("fsdp_size = 4\nprompts_per_step = 4\n")
    argv = ["train", "--model-dir", str(bpe_model), "--out", str(tmp_path / "o"), "--config",
            str(tmp_path / "c.toml")]  # fmt: skip
    assert main(argv) == 0
    assert ran[0].num_workers == 4 and ran[0].fsdp_size == 4


def test_more_reward_processes_than_cores_is_refused():
    import os

    with pytest.raises(ValueError, match="reward_processes 100000: at most this machine's"):
        TrainConfig(model_dir="m", out="o", reward_processes=100_000)
    TrainConfig(model_dir="m", out="o", reward_processes=os.cpu_count() or 1)


def test_a_run_recorded_with_relative_paths_resumes_unchanged(tmp_path, monkeypatch):
    """Older runs recorded --model-dir / --data / --reward file.py:fn as typed; the resume now
    records them absolute, which is the same setting, not a change of the run."""
    from tltrun.train.config_checks import absolute_paths, is_same_path

    (tmp_path / "m").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    (tmp_path / "r.py").write_text("def score(prompt, response, answer):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(TrainConfig(model_dir="m", out="o", data="d.jsonl", reward="r.py:score"))
    assert cfg.model_dir == str(tmp_path / "m") and cfg.data == str(tmp_path / "d.jsonl")
    assert cfg.reward == f"{tmp_path / 'r.py'}:score" and cfg.out == "o"
    for name, old in (("model_dir", "m"), ("data", "d.jsonl"), ("reward", "r.py:score")):
        assert is_same_path(TrainConfig, name, old, getattr(cfg, name))
    assert not is_same_path(TrainConfig, "model_dir", "elsewhere", cfg.model_dir)
    assert not is_same_path(TrainConfig, "lr", 1e-5, 2e-5)


def test_spot_training_by_default_only_where_the_policy_drafts_with_eagle():
    """nospec and tltbase spot-trained a drafter nothing used (the simulator never does);
    asked for, they still do; one worker has no idle worker to train on."""

    def harvesting(**fields) -> bool:
        return TrainConfig(model_dir="m", out="o", **fields).is_spot_harvesting

    assert harvesting(policy="tlt") and harvesting(policy="static", static_strategy="4_1_4")
    assert not harvesting(policy="nospec") and not harvesting(policy="tltbase")
    assert not harvesting(policy="tlt", tlt_drafters=("history",))
    assert harvesting(policy="nospec", is_spot_training=True)
    assert not harvesting(policy="tlt", is_spot_training=False)
    assert not harvesting(policy="tlt", num_workers=1, is_spot_training=True)


def test_a_resume_that_changes_the_history_settings_says_the_index_starts_empty(tmp_path):
    """The index was emptied without a word (RolloutHistory.load_state_dict refuses another
    config's state); the launcher says so, as for a changed SD policy."""
    from tltrun.train.config_checks import warn_restarted_state
    from tltrun.train.state import RunDirWarning

    with pytest.warns(RunDirWarning, match="--history-cross-prompt changed: the history drafter"):
        warn_restarted_state(tmp_path, {"train.is_history_cross_prompt": [True, False]})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunDirWarning)
        warn_restarted_state(tmp_path, {"train.lr": [1e-3, 2e-3]})


def test_spot_training_asked_of_one_worker_is_a_warning(bpe_model, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Hunt: --spot-training on 1 worker (or a 2 -> 1 resume of a spot-training run) trained no
    drafter, unsaid."""
    from tltrun.cli.main import main
    from tltrun.train import launch

    monkeypatch.setattr(launch, "run_train", lambda cfg, task, **kw: "o")
    argv = ["train", "--model-dir", str(bpe_model), "--out", str(tmp_path / "o"),
            "--num-workers", "1", "--prompts-per-step", "2", "--spot-training"]  # fmt: skip
    assert main(argv) == 0
    assert (
        "warning: --spot-training: idle workers train the drafter, and 1 worker is never idle"
        in (capsys.readouterr().err)
    )
    assert main([*argv[:-1], "--policy", "tlt"]) == 0  # the default: nothing to say
    assert "warning" not in capsys.readouterr().err


def test_a_data_warning_is_one_warning_line(bpe_model, data_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Hunt: tltrun train printed its data warnings in Python's two-line form (file, line, source
    line), its own handler passing every warning but two classes to Python's."""
    from tltrun.cli.main import main
    from tltrun.train import launch

    monkeypatch.setattr(launch, "run_train", lambda cfg, task, **kw: launch.check_inputs(cfg, task))
    data = str(data_dir / "train.csv")
    argv = ["train", "--model-dir", str(bpe_model), "--out", str(tmp_path / "o"), "--data", data,
            "--eval-data", data, "--eval-every", "1", "--prompts-per-step", "2", "--reward", "exact", "--prompt-key", "question", "--max-new-tokens", "16"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "evaluation prompts are training prompts too" in err
    assert "DataWarning" not in err and "launch.py" not in err, err


def test_prompts_the_tokenizer_cannot_encode_are_a_warning(tmp_path, monkeypatch, capsys):
    """Hunt: generate and sft warn of prompts encoded with <unk>; train trained on them unsaid."""
    from tiny_models import save_train_model

    from tltrun.cli.main import main
    from tltrun.train import launch

    model = save_train_model(tmp_path / "m", TaskConfig())
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"prompt": "na\\u00efve caf\\u00e9 1+2", "answer": "3"}\n{"prompt": "1+2", "answer": "3"}\n'
    )
    monkeypatch.setattr(launch, "run_train", lambda cfg, task, **kw: launch.check_inputs(cfg, task))
    argv = ["train", "--model-dir", str(model), "--out", str(tmp_path / "o"), "--data", str(data),
            "--reward", "exact", "--prompts-per-step", "2", "--max-new-tokens", "8"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().err == (
        "warning: 1 prompt(s) of --data/--eval-data hold 2 token(s) the tokenizer cannot encode "
        "(<unk>): the model sees another text\n"
    )
    data.write_text('{"prompt": "1+2", "answer": "3"}\n{"prompt": "2+2", "answer": "4"}\n')
    assert main(argv) == 0
    assert capsys.readouterr().err == ""


def test_a_format_penalty_beside_a_user_reward_function_is_refused():
    """Hunt: --format-penalty with a file.py:function reward was recorded and never applied
    (a user function has no answer form to miss)."""
    with pytest.raises(ValueError, match="format_penalty 0.5: a file.py:function reward has no"):
        TrainConfig(model_dir="m", out="o", data="d.jsonl", reward="r.py:score", format_penalty=0.5)
    TrainConfig(model_dir="m", out="o", data="d.jsonl", reward="math", format_penalty=0.5)


def test_a_final_assistant_message_is_continued_not_closed(bpe_model):  # noqa: F811
    """Hunt: an R1-style prefill (the prompt ends in an assistant "<think>\\n") was closed with
    <|im_end|> and followed by a new assistant turn; TRL continues it. A template that drops
    the continued message (as R1's drops an assistant turn's thinking) is a bad row."""
    tok = load_tokenizer(bpe_model)
    user = {"role": "user", "content": "What is 1 plus 2?"}
    prefill = [user, {"role": "assistant", "content": "<think>\n"}]
    assert tok.prompt_text(prefill) == (
        "<|im_start|>user\nWhat is 1 plus 2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert tok.prompt_text([user]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    tok.hf.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}"
        "{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="cannot continue the final assistant message"):
        tok.prompt_text(prefill)


@pytest.mark.slow
def test_a_qwen3_model_trains_on_user_data_and_saves_as_qwen3(data_dir, tmp_path):  # noqa: F811
    """A Qwen3 checkpoint (per-head q/k norms) through a whole run: rollouts with TLT's EAGLE
    drafter, spot training, GRPO updates of every weight, the q/k norms included, and a final
    actor transformers loads as Qwen3ForCausalLM."""
    import transformers
    from safetensors.torch import load_file
    from test_train_data import config, log_rows, save_bpe_model

    from tltrun.train.launch import run_train

    model = save_bpe_model(tmp_path / "qwen3", model_type="qwen3")
    out = tmp_path / "run"
    cfg = config(model, out, data_dir / "train.jsonl", prompt_key="messages", eval_every=0,
                 eval_split=0.0)  # fmt: skip
    run_train(cfg, TaskConfig())
    log = log_rows(out)
    assert [r["step"] for r in log] == [0, 1] and any(r["sd_on_fraction"] > 0 for r in log)
    assert any(r["drafter_updates"] > 0 for r in log)
    final = out / "final" / "actor"
    assert type(transformers.AutoModelForCausalLM.from_pretrained(final)).__name__ == (
        "Qwen3ForCausalLM"
    )
    before, after = load_file(model / "model.safetensors"), load_file(final / "model.safetensors")
    name = "model.layers.0.self_attn.k_norm.weight"
    assert not torch.equal(before[name], after[name])  # GRPO trained the q/k norms too


TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.name }}</call>{% endfor %}"
    "{{ m.content or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_messages_reach_the_template_whole(bpe_model, tmp_path):  # noqa: F811
    """A message's other keys (Qwen3's template renders an assistant's reasoning_content as a
    <think> block; tool calls, with content null) reach the chat template as transformers
    gives them: they were dropped, so the prompt differed from apply_chat_template's. Null
    ones (Arrow's fill for rows without the key) are not keys."""
    import shutil

    import pandas as pd
    from transformers import AutoTokenizer

    from tltrun.data.dataset import DataSpec, load_rows

    model = tmp_path / "model"
    shutil.copytree(bpe_model, model)
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    for stale in ("chat_template.json",):
        (model / stale).unlink(missing_ok=True)
    turns = [
        {"role": "user", "content": "What is 3 plus 4?"},
        {"role": "assistant", "content": None, "reasoning_content": "add them",
         "tool_calls": [{"name": "add"}]},
        {"role": "tool", "content": "7", "name": "add"},
    ]  # fmt: skip
    rows = [{"messages": turns, "answer": "7"}, {"messages": turns[:1], "answer": "1"}]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")  # Arrow fills the missing keys
    loaded = load_rows(DataSpec(path=str(tmp_path / "train.parquet"), prompt_key="messages"))
    first, second = (r.prompt for r in loaded.rows)
    assert [dict(m) for m in first] == turns and [dict(m) for m in second] == turns[:1]
    want = AutoTokenizer.from_pretrained(model).apply_chat_template(
        turns, add_generation_prompt=True, tokenize=False
    )
    assert "<think>add them</think><call>add</call><|im_end|>" in want
    tok = load_tokenizer(str(model))
    assert tok.decode(tok.encode_prompt(first)) == tok.decode(tok.encode_prompt(turns))
    assert "<think>add them</think>" in tok.decode(tok.encode_prompt(first))
    assert loaded.rows[0].prompt_text.startswith("user: What is 3 plus 4?\nassistant: \ntool: 7")


def test_message_keys_are_json_safe_and_a_nan_tool_call_is_a_bad_row(tmp_path):
    """Python's json writes NaN: a NaN reasoning_content was passed to the template as is, and
    a NaN tool_calls let a null content through to a template TypeError traceback."""
    from tltrun.data.dataset import DataSpec, load_rows

    user = '{"role": "user", "content": "hi"}'
    lines = [
        f'{{"m": [{user}, {{"role": "assistant", "content": "ok", "reasoning_content": NaN}}]}}',
        f'{{"m": [{user}, {{"role": "assistant", "content": null, "tool_calls": NaN}}]}}',
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    spec = DataSpec(path=str(tmp_path / "d.jsonl"), prompt_key="m", answer_key=None)
    with pytest.raises(
        DataError, match=r"d.jsonl:2: key 'm': message 1: 'content': expected a string, got null"
    ):
        load_rows(spec)
    loaded = load_rows(dataclasses.replace(spec, is_skip_bad_rows=True))
    assert loaded.num_skipped == 1 and loaded.rows[0].prompt[1] == {
        "role": "assistant",
        "content": "ok",
    }
