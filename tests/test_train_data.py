"""``tltrun train`` on a user's model, data and reward (issue #16), end to end on CPU: a tiny
Qwen2-shaped model saved with a byte-level BPE tokenizer trained here with the ``tokenizers``
library and a chat template; JSONL (chat messages), Parquet (plain text + --chat-template) and
CSV (plain text) datasets; a user's reward module. Each run: 2 steps, 2 workers, TLT on and spot
training on. Also: the rollout dump, evaluation, bad rows and keys as one-line errors, and a
resume after SIGKILL that reproduces an uninterrupted run's rollouts.

Run: ``python -m pytest tests/test_train_data.py -q`` (a few minutes: each run spawns two
worker processes that import torch).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest
import torch
from tiny_models import cuda_param, tiny_model

from tltrun.cli.main import main
from tltrun.data.tokenizer import load_tokenizer
from tltrun.model.hf_checkpoint import save_hf
from tltrun.train.config import TrainConfig
from tltrun.train.launch import run_train
from tltrun.train.tasks import TaskConfig
from tltsim.fidelity.fit_history import prompt_ids_name_prompts
from tltsim.trace.files import load_trace

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTIONS = [f"What is {a} plus {b}?" for a in range(6) for b in range(4)]

REWARD_MODULE = '''
def score(prompt, response, answer, **meta):
    """Toy reward with spread (random-weight responses are never right): a response's
    length parity, plus 1 when it contains the answer."""
    return float(len(response) % 2) + float(str(answer) in response)
'''


def save_bpe_model(out: Path, model_type: str = "qwen2") -> Path:
    """Qwen2-shaped (or ``model_type``) tiny model + byte-level BPE tokenizer with a chat
    template, two stop ids (<|im_end|> in config.json, <|endoftext|> in generation_config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(QUESTIONS * 4 + ["user assistant system 0123456789"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    im_end, text_end = fast.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model = tiny_model(
        seed=0,
        model_type=model_type,
        attention_bias=model_type == "qwen2",
        vocab_size=len(fast),
        eos_token_ids=(im_end,),
        bos_token_id=None,
    )
    save_hf(model, out)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [im_end, text_end], "pad_token_id": text_end})
    )
    return out


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> Path:
    return save_bpe_model(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    rows = [{"question": q, "answer": str(i % 7)} for i, q in enumerate(QUESTIONS)]
    with (root / "train.jsonl").open("w") as fh:
        for r in rows:
            fh.write(json.dumps({"messages": [{"role": "user", "content": r["question"]}],
                                 "answer": r["answer"]}) + "\n")  # fmt: skip
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame(rows).to_csv(root / "train.csv", index=False)
    (root / "my_reward.py").write_text(REWARD_MODULE)
    return root


def config(model_dir: Path, out: Path, data: Path, **overrides) -> TrainConfig:
    fields = dict(
        model_dir=str(model_dir),
        out=str(out),
        data=str(data),
        prompt_key="question",
        reward=f"{data.parent / 'my_reward.py'}:score",
        num_workers=2,
        num_steps=2,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=24,
        prompt_split=(1, 3),
        max_running_requests=4,
        policy="tlt",
        tlt_strategies=("3_1_3", "2_1_2"),
        tlt_bucket_starts=(1, 3),
        tlt_threshold=8,
        is_spot_training=True,
        lr=1e-2,
        checkpoint_every=1,
        seed=0,
        eval_split=0.2,
        eval_every=2,
        eval_max_prompts=4,
    )
    fields.update(overrides)
    return TrainConfig(**fields)


def log_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_tokenizer_from_model_dir_applies_chat_template_and_gathers_stop_ids(bpe_model):
    tok = load_tokenizer(bpe_model)
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    text_end = tok.hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_ids == (im_end, text_end) and tok.pad_id == text_end
    chat = tok.encode_prompt([{"role": "user", "content": "What is 1 plus 2?"}])
    assert tok.decode(chat).startswith("user\nWhat is 1 plus 2?")  # specials dropped
    assert tok.hf.convert_ids_to_tokens(chat[:1]) == ["<|im_start|>"]
    plain = tok.encode_prompt("What is 1 plus 2?")
    assert tok.decode(plain) == "What is 1 plus 2?" and len(plain) < len(chat)
    wrapped = load_tokenizer(bpe_model, is_chat_template=True).encode_prompt("What is 1 plus 2?")
    assert wrapped == chat


def test_chat_template_refusals_are_bad_rows_and_a_broken_template_one_line(bpe_model, tmp_path):
    """Gemma's and Mistral's templates raise on a system message (``raise_exception``): that row
    is bad (named, skippable); a template that is not Jinja stops the run naming the model."""
    from tltrun.data.dataset import DataError, DataSpec, load_rows
    from tltrun.data.tokenizer import TokenizerError

    tok = load_tokenizer(bpe_model)
    tok.hf.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported')"
        " }}{% endif %}" + CHAT_TEMPLATE
    )
    path = tmp_path / "sys.jsonl"
    user = {"role": "user", "content": "What is 1 plus 2?"}
    rows = [[{"role": "system", "content": "Be brief."}, user], [user]]
    path.write_text("".join(json.dumps({"messages": m, "answer": "3"}) + "\n" for m in rows))

    def load(is_skip: bool):
        spec = DataSpec(path=str(path), prompt_key="messages", is_skip_bad_rows=is_skip)
        return load_rows(
            spec,
            prompt_tokens=lambda row: len(tok.encode_prompt(row.prompt)),
            max_prompt_tokens=1024,
        )

    with pytest.raises(DataError) as err:
        load(is_skip=False)
    assert str(err.value) == (
        f"{path}:1: key 'messages': the model's chat template refused the prompt: System role "
        "not supported (--skip-bad-rows skips such rows)"
    )
    loaded = load(is_skip=True)
    assert [r.prompt_id for r in loaded.rows] == ["sys.jsonl:1"] and loaded.num_skipped == 1
    tok.hf.chat_template = "{% for m in messages %}{{ m['content'] }"
    with pytest.raises(TokenizerError, match=r"the chat template is not valid Jinja \(line 1"):
        load(is_skip=True)


def test_a_file_is_read_whole_whatever_data_num_rows(data_dir, bpe_model):
    """--data-num-rows sizes a reasoning-gym task; a file holds what it holds."""
    from tltrun.train.prompts import load_run_data

    cfg = TrainConfig(
        model_dir=str(bpe_model),
        out="unused",
        data=str(data_dir / "train.csv"),
        prompt_key="question",
        reward="exact",
        data_num_rows=5,
    )
    data = load_run_data(cfg, TaskConfig(), lambda row: 1, 1 << 20)
    assert data.num_train_rows == len(QUESTIONS) > 5


def test_an_evaluation_file_is_fingerprinted_whole_whatever_eval_max_prompts(data_dir, bpe_model):
    """A resume may change --eval-max-prompts: the evaluation file's fingerprint (compared on
    resume) is taken before the cut, so it must not depend on it (it was read only that long)."""
    from tltrun.train.prompts import load_run_data

    def data(eval_max_prompts: int):
        cfg = TrainConfig(
            model_dir=str(bpe_model),
            out="unused",
            data=str(data_dir / "train.csv"),
            eval_data=str(data_dir / "train.parquet"),
            prompt_key="question",
            reward="exact",
            eval_every=1,
            eval_max_prompts=eval_max_prompts,
        )
        return load_run_data(cfg, TaskConfig(), lambda row: 1, 1 << 20)

    few, many = data(2), data(64)
    assert len(few.eval_rows) == 2 and len(many.eval_rows) == len(QUESTIONS) > 2
    assert few.eval_fingerprint == many.eval_fingerprint


def test_the_data_fingerprint_covers_the_columns_a_reward_receives(bpe_model, tmp_path):
    """A resume compares the data's fingerprint: a change in a column other than prompt and
    answer (the reward's **meta) is a change too; rows with no other column hash as they did
    before the columns were included (runs recorded then still resume)."""
    import hashlib

    from tltrun.train.prompts import load_run_data

    def fingerprint(frame: pd.DataFrame) -> str:
        frame.to_csv(tmp_path / "d.csv", index=False)
        cfg = TrainConfig(
            model_dir=str(bpe_model), out="unused", data=str(tmp_path / "d.csv"), reward="exact"
        )
        return load_run_data(cfg, TaskConfig(), lambda row: 1, 1 << 20).train_fingerprint

    rows = {"prompt": ["1+1", "2+2"], "answer": ["2", "4"]}
    level_1 = fingerprint(pd.DataFrame({**rows, "level": [1, 1]}))
    assert level_1 != fingerprint(pd.DataFrame({**rows, "level": [1, 2]}))
    assert level_1 == fingerprint(pd.DataFrame({**rows, "level": [1, 1]}))
    before = hashlib.sha1()
    for i, (prompt, answer) in enumerate(zip(rows["prompt"], rows["answer"], strict=True)):
        before.update(json.dumps([f"d.csv:{i}", prompt, answer]).encode())
    assert fingerprint(pd.DataFrame(rows)) == before.hexdigest()


def test_data_without_an_answer_column_trains_with_the_users_reward(bpe_model, tmp_path, capsys):
    """--answer-key '': rows need no answer (a format or preference reward); the user's function
    receives answer=None and the other columns; a reward that needs an answer is refused."""
    from tltrun.data.scoring import RewardItem, Scorer
    from tltrun.train.prompts import load_run_data, reward_spec

    data = tmp_path / "prefs.csv"
    pd.DataFrame({"question": QUESTIONS[:6], "style": ["short", "long"] * 3}).to_csv(
        data, index=False
    )
    module = tmp_path / "style_reward.py"
    module.write_text(
        "def score(prompt, response, answer, **meta):\n"
        "    assert answer is None, answer\n"
        "    return float(len(response) < 10) if meta['style'] == 'short' else 0.5\n"
    )
    cfg = TrainConfig(model_dir=str(bpe_model), out="unused", data=str(data),
                      prompt_key="question", answer_key="", reward=f"{module}:score")  # fmt: skip
    rows = load_run_data(cfg, TaskConfig(), lambda row: 1, 1 << 20).step_rows(0, 6)
    assert [row.answer for row in rows] == [None] * 6
    scorer = Scorer(reward_spec(cfg))
    scores = {
        row.meta["style"]: scorer.score(
            RewardItem(
                sample_id="s",
                prompt=str(row.prompt),
                response="ok",
                answer=row.answer,
                meta=row.meta,
            )  # fmt: skip
        )[0]
        for row in rows
    }
    assert scores == {"short": 1.0, "long": 0.5}
    # the default --answer-key on this file: a missing column, one line naming it
    base = ["train", "--model-dir", str(bpe_model), "--data", str(data), "--prompt-key",
            "question", "--num-steps", "1", "--max-new-tokens", "16"]  # fmt: skip
    code = main([*base, "--out", str(tmp_path / "a"), "--reward", f"{module}:score"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "'answer'" in err and "prefs.csv" in err and "\n" not in err
    # a reward that compares with an answer cannot score answerless rows
    code = main([*base, "--out", str(tmp_path / "b"), "--reward", "math", "--answer-key", ""])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--answer-key ''" in err and "'math'" in err and "\n" not in err
    assert not (tmp_path / "b").exists()
    # flags that would be ignored: refused (an --eval-data without --data evaluated the
    # built-in task; reasoning-gym rows have no columns to name)
    common = [
        "train",
        "--model-dir",
        str(bpe_model),
        "--num-steps",
        "1",
        "--out",
        str(tmp_path / "c"),
    ]
    code = main([*common, "--eval-data", str(data)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--eval-data without --data" in err and "\n" not in err
    gym = ["--data", "reasoning-gym:chain_sum"]
    for flags in (["--prompt-key", "question"], ["--answer-key", ""], ["--answer-key", "x"]):
        code = main([*common, *gym, *flags])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "--prompt-key and --answer-key name columns" in err, flags
    # a task setting beside --data, TLT's beside a policy that takes none: ignored, and a
    # later --resume changing one was refused as a change of the run
    for flags, message in (
        ([*gym, "--task-max-ops", "9"], "--task-max-ops: settings of the built-in task"),
        (["--policy", "nospec", "--tlt-threshold", "5"], "--tlt-threshold: not read by --policy nospec"),
        (["--policy", "tlt", "--static-strategy", "2_1_2"], "--static-strategy: not read by"),
    ):  # fmt: skip
        code = main([*common, *flags])
        err = capsys.readouterr().err.strip()
        assert code == 2 and message in err and "\n" not in err, (flags, err)
    assert not (tmp_path / "c").exists()


def test_model_dir_without_tokenizer_is_one_line(tmp_path, capsys):
    save_hf(tiny_model(), tmp_path / "m")
    code = main(["train", "--model-dir", str(tmp_path / "m"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "missing tokenizer.json" in err and "\n" not in err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "extra"),
    [
        ("jsonl", {"prompt_key": "messages"}),
        ("parquet", {"chat_template": True}),
        ("csv", {"dump_rollouts": True}),
    ],
)
def test_two_steps_on_each_data_format_with_tlt_and_spot_training(
    bpe_model, data_dir, tmp_path, fmt, extra
):
    out = tmp_path / fmt
    cfg = config(bpe_model, out, data_dir / f"train.{fmt}", **extra)
    run_train(cfg, TaskConfig())
    log = log_rows(out)
    assert [r["step"] for r in log] == [0, 1]
    assert all(r["reward_errors"] == 0 for r in log)
    assert any(r["drafter_updates"] > 0 for r in log)  # spot training ran
    assert any(r["sd_on_fraction"] > 0 for r in log)  # TLT drafted
    assert len({r["actor_sha1"][0] for r in log}) == 2  # the actor moved
    # evaluation after the last step, on the held-out 20% (4 prompts at most)
    assert log[-1]["eval_num_prompts"] == 4 and "eval_reward_mean" in log[-1]
    assert "eval_reward_mean" not in log[0]
    # the rollout dump: every response with its reward and advantage
    dump = [
        json.loads(x) for x in (out / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert len(dump) == cfg.prompts_per_step * cfg.group_size
    for row in dump:
        assert row["num_response_tokens"] <= cfg.max_new_tokens and row["finish"] in (
            "stop",
            "length",
        )
        expected = float(len(row["response"]) % 2) + float(row["answer"] in row["response"])
        assert row["reward"] == expected
        assert set(row["sd_strategies"]) <= {"off", "3_1_3", "2_1_2"}
    by_group: dict[str, list[float]] = {}
    for row in dump:
        by_group.setdefault(row["id"].rpartition("/")[0], []).append(row["advantage"])
    assert all(abs(sum(a)) < 1e-6 for a in by_group.values())  # group-normalised
    # the trace names each group by its dataset prompt id (the history drafter's key, #20)
    trace = load_trace(out / "trace.json")
    step1 = trace.steps[1]
    assert {p.id for p in step1.prompts} == {r["prompt_id"] for r in dump}
    assert step1.measured.is_prompt_id_stable is True and prompt_ids_name_prompts(trace)
    if fmt == "jsonl" or extra.get("chat_template"):
        assert all(r["prompt"].startswith("<|im_start|>user\n") for r in dump)
    else:
        assert all(r["prompt"].startswith("What is") for r in dump)
    assert (out / "final" / "actor" / "tokenizer.json").is_file()
    saved = json.loads((out / "config.json").read_text())
    # 20% of 24 rows (5) held out of training, 4 of them evaluated (eval_max_prompts)
    assert (saved["data"]["num_train_rows"], saved["data"]["num_eval_rows"]) == (19, 4)


def test_bad_rows_and_keys_are_one_line_errors_before_any_worker(
    bpe_model, data_dir, tmp_path, capsys
):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"question": "fine", "answer": "1"}) + "\n" + json.dumps({"answer": "2"}) + "\n"
    )
    base = ["train", "--model-dir", str(bpe_model), "--reward", "exact", "--num-steps", "1",
            "--max-new-tokens", "16"]  # fmt: skip
    code = main(
        [*base, "--out", str(tmp_path / "a"), "--data", str(bad), "--prompt-key", "question"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "bad.jsonl" in err and "2" in err and "question" in err
    code = main([*base, "--out", str(tmp_path / "b"), "--data", str(data_dir / "train.csv"),
                 "--prompt-key", "nope"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "nope" in err
    code = main([*base, "--out", str(tmp_path / "c"), "--data", str(data_dir / "train.csv"),
                 "--prompt-key", "question", "--reward", "missing.py:score"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "missing.py" in err
    # a strategy the workers' engines cannot run: refused here, not in a worker mid-rollout
    code = main([*base, "--out", str(tmp_path / "d"), "--data", str(data_dir / "train.csv"),
                 "--prompt-key", "question", "--policy", "static", "--static-strategy", "8_4_100"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "error: policy 'static': strategy 8_4_100 verifies 100 tokens, more than max_verify_tokens=64"
    )
    assert code == 2 and not (tmp_path / "d" / "worker_errors.log").exists()
    assert not (tmp_path / "a" / "log.jsonl").exists()


@pytest.mark.slow
def test_resume_after_sigkill_reproduces_the_rollouts(bpe_model, data_dir, tmp_path):
    """--deterministic: spot budgets from harvested tokens, the bandit on a modelled clock, so
    an uninterrupted run and a killed-and-resumed one must produce the same responses."""
    data = data_dir / "train.jsonl"
    common = dict(prompt_key="messages", num_steps=3, is_deterministic=True, eval_every=0,
                  eval_split=0.0)  # fmt: skip
    reference = tmp_path / "reference"
    run_train(config(bpe_model, reference, data, **common), TaskConfig())
    out = tmp_path / "killed"
    cfg = config(bpe_model, out, data, **common)
    flags = [
        (f"--{'' if v else 'no-'}{k.removeprefix('is_').replace('_', '-')}" if isinstance(v, bool)
         else f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}")
        for k, v in asdict(cfg).items()
        if v is not None and v != () and v != ""
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "tltrun.cli.main", "train", *flags]
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.DEVNULL)
    marker = out / "ckpt" / "step_000001" / "state.json"
    deadline = time.monotonic() + 180
    while not marker.is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before the kill (exit {proc.returncode})"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists(), "the kill came too late"
    done = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for step in range(3):
        name = f"rollouts/step_{step:06d}.jsonl"
        assert (out / name).read_text() == (reference / name).read_text(), name
    assert [r["rollout_sha1"] for r in log_rows(out)] == [
        r["rollout_sha1"] for r in log_rows(reference)
    ]
    assert [r["data_position"] for r in log_rows(out)] == [
        r["data_position"] for r in log_rows(reference)
    ]


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=pytest.mark.slow),
        cuda_param("bf16 training on a GPU"),
    ],
)
def test_the_gpu_recipe_trains_one_worker_in_mixed_precision(bpe_model, data_dir, tmp_path, device):
    """The README's GPU flags (--dtype bfloat16 --gradient-checkpointing
    --max-tokens-per-microbatch) on one worker (NCCL takes one rank per GPU), TLT on: on CUDA
    the engine decodes in bf16 and the actor trains under bf16 autocast over fp32 master weights
    and optimizer state; on a CPU the engine decodes in bf16 too and the actor trains in fp32
    (the path CI checks, so a CUDA failure is CUDA's: a bf16 engine's weight digest failed on
    both until 2026-11-27)."""
    out = tmp_path / device
    cfg = config(bpe_model, out, data_dir / "train.jsonl", prompt_key="messages",
                 device=device, dtype="bfloat16", gradient_checkpointing=True,
                 max_tokens_per_microbatch=64, num_workers=1, prompt_split=(4,))  # fmt: skip
    run_train(cfg, TaskConfig())
    log = log_rows(out)
    assert [r["step"] for r in log] == [0, 1]
    assert all(r["reward_errors"] == 0 for r in log)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in log)
    assert any(r["sd_on_fraction"] > 0 for r in log)  # TLT drafted
    assert len({r["actor_sha1"][0] for r in log}) == 2  # the actor moved
    from safetensors import safe_open

    with safe_open(str(out / "final" / "actor" / "model.safetensors"), "pt") as weights:
        dtypes = {weights.get_tensor(name).dtype for name in weights.keys()}  # noqa: SIM118
    assert dtypes == {torch.float32}  # the master weights, not the bf16 compute copy
