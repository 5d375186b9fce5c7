"""``tltrun train-drafter``'s refusals and dtypes on the tiny model of ``test_cli_run`` (its
``dirs`` fixture: the model, a vLLM-layout drafter, prompts): another tokenizer's generations,
rows beyond the model's positions or with nothing to train, fp16 targets over fp32 drafters.

Run: ``python -m pytest tests/test_cli_train_drafter.py -q``.
"""

from __future__ import annotations

import json
import math

import torch
from test_cli_run import ENGINE, dirs  # noqa: F401 (fixture)

from tltrun.cli.main import main
from tltrun.model.hf_checkpoint import load_safetensors


def test_train_drafter_refuses_another_tokenizers_generations_and_overlong_rows(dirs, capsys):  # noqa: F811
    """Hunt: generations of a model with another tokenizer (ids that merely fell inside the
    vocabulary) and sequences beyond the model's positions trained a drafter, exit 0."""
    import shutil

    from tltrun.model.tokenizer import CharTokenizer

    gen, other = dirs / "gen_tok", dirs / "model_other_tok"
    for path, alphabet in ((dirs / "model_tok", "abc"), (other, "xyz")):
        shutil.copytree(dirs / "model", path)
        CharTokenizer(alphabet).save(path)
    argv = ["generate", "--model", str(dirs / "model_tok"), "--prompts", str(dirs / "prompts.jsonl"),
            "--out", str(gen), "--max-new-tokens", "4", *ENGINE]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    argv = ["train-drafter", "--data", str(gen / "generations.jsonl"), "--train-num-steps", "1"]
    assert main([*argv, "--model", str(dirs / "model_tok"), "--out", str(dirs / "t_same")]) == 0
    capsys.readouterr()
    # refused before anything is touched (review: the earlier drafter in --out was deleted)
    assert main([*argv, "--model", str(other), "--out", str(dirs / "t_same")]) == 2
    assert "whose tokenizer.json differs from --model" in capsys.readouterr().err
    assert (dirs / "t_same" / "model.safetensors").is_file()
    # the same vocabulary written otherwise (indentation, key order) is the same tokenizer
    resaved = dirs / "model_resaved_tok"
    shutil.copytree(dirs / "model_tok", resaved)
    doc = json.loads((resaved / "tokenizer.json").read_text())
    (resaved / "tokenizer.json").write_text(json.dumps(dict(reversed(doc.items())), indent=4))
    # and a sentencepiece file beside it serialised otherwise: its ids were compared already
    (dirs / "model_tok" / "tokenizer.model").write_bytes(b"sentencepiece, one serialisation")
    (resaved / "tokenizer.model").write_bytes(b"sentencepiece, another")
    assert main([*argv, "--model", str(resaved), "--out", str(dirs / "t_resaved")]) == 0
    capsys.readouterr()
    limit = json.loads((dirs / "model" / "config.json").read_text())["max_position_embeddings"]
    rows = [{"prompt_token_ids": [1, 2, 3], "output_token_ids": [4] * limit}]
    argv = ["train-drafter", "--model", str(dirs / "model"), "--out", str(dirs / "t_long"),
            "--data", _generations(dirs / "long.jsonl", rows), "--train-num-steps", "1"]  # fmt: skip
    assert main(argv) == 2
    assert f"beyond the model's max_position_embeddings ({limit})" in capsys.readouterr().err


def _generations(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_train_drafter_in_float16_trains_fp32_master_weights(dirs, capsys):  # noqa: F811
    """--dtype float16 at the default learning rate: AdamW on fp16 weights made the loss NaN
    from the second step, and the NaN drafter was exported with exit 0."""
    rows = [
        {"prompt_token_ids": [1 + i, 2, 3], "output_token_ids": [4 + i, 5, 6, 7 + i, 8]}
        for i in range(6)
    ]
    data = _generations(dirs / "fp16.jsonl", rows)
    out = dirs / "trained_fp16"
    argv = ["train-drafter", "--model", str(dirs / "model"), "--data", data, "--out", str(out),
            "--train-num-steps", "4", "--dtype", "float16"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    losses = [h["loss"] for h in json.loads((out / "history.json").read_text())]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    tensors = load_safetensors(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())


def test_train_drafter_init_keeps_its_fp32_weights_under_a_float16_target(dirs, capsys):  # noqa: F811
    """--init was cast to --dtype and back: 0 steps must export the init drafter bit for bit."""
    rows = [{"prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5, 6]}]
    out = dirs / "init_fp16"
    argv = ["train-drafter", "--model", str(dirs / "model"), "--init", str(dirs / "drafter"),
            "--data", _generations(dirs / "init.jsonl", rows), "--out", str(out),
            "--train-num-steps", "0", "--dtype", "float16"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    init = load_safetensors(dirs / "drafter" / "model.safetensors")
    exported = load_safetensors(out / "model.safetensors")
    assert set(exported) <= set(init) and exported
    assert all(torch.equal(exported[k], init[k]) for k in exported)


def test_train_drafter_refuses_data_with_nothing_to_train_and_a_learning_rate_over_1(dirs, capsys):  # noqa: F811
    """Rows without response tokens trained nothing (loss 0, exit 0); --train-lr 1e38 was an
    internal error inside AdamW."""
    empty = [{"prompt_token_ids": [1, 2, 3], "output_token_ids": []}]
    argv = ["train-drafter", "--model", str(dirs / "model"), "--train-num-steps", "3"]
    data = _generations(dirs / "empty.jsonl", empty)
    assert main([*argv, "--data", data, "--out", str(dirs / "t_empty")]) == 2
    assert "line 1: 'output_token_ids' is empty: nothing to train on" in capsys.readouterr().err
    rows = [{"prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5, 6]}]
    data = _generations(dirs / "ok.jsonl", rows)
    assert main([*argv, "--data", data, "--out", str(dirs / "t_lr"), "--train-lr", "1e38"]) == 2
    assert "lr in (0, 1.0]" in capsys.readouterr().err
