"""A prompt and its response must fit the model's positions (max_position_embeddings): the
longest prompt of a ``tltrun train`` run is --max-prompt-tokens or, where less, what the
model's positions leave beside --max-new-tokens (found by a read-only hunt: the torch engine
decoded 120 positions of a 64-position model without a word; vLLM refused to start a model of
512 positions because max_model_len was the default 1024 prompt tokens + N).

Run: ``python -m pytest tests/test_prompt_cap.py -q``.
"""

from __future__ import annotations

import pytest
from test_train_data import bpe_model, data_dir  # noqa: F401 (fixtures)

from tltrun.data.dataset import DataError
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
