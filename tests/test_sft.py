"""Tests of ``tltrun sft`` (tltrun/train/sft.py, tltrun/train/sft_eval.py) on a tiny model: the checkpoint
loads in ``transformers``, the loss falls, runs are reproducible, bad flags exit 2.

Run: ``.venv/bin/python -m pytest tests/test_sft.py -q``.
"""

from __future__ import annotations

import json
import math
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tltrun.cli.main import main  # noqa: E402
from tltrun.model.tokenizer import CharTokenizer  # noqa: E402
from tltrun.train.sft import collate, example_tokens, length_batches, run_sft  # noqa: E402
from tltrun.train.sft_config import SFTConfig  # noqa: E402
from tltrun.train.tasks import TaskConfig, make_examples  # noqa: E402

TINY = dict(
    num_steps=12,
    num_layers=1,
    hidden_size=32,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    lr=3e-3,
    warmup_steps=2,
    batch_tokens=2048,
    num_eval_prompts=8,
    num_sample_prompts=2,
    group_size=2,
    eval_batch_size=8,
    max_new_tokens=24,
)
# TINY as tltrun sft flags, less --num-steps
TINY_FLAGS = [
    x for k, v in TINY.items() if k != "num_steps" for x in (f"--{k.replace('_', '-')}", str(v))
]
# Short chains keep the tiny run fast; the full distribution is tested in test_tasks.py.
TINY_TASK = TaskConfig(median_ops=2.0, max_ops=8)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    metrics = run_sft(SFTConfig(out=str(out), **TINY), TINY_TASK, show_progress=False)
    return out, metrics


def test_checkpoint_is_a_loadable_hf_llama(tiny_run):
    out, _ = tiny_run
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (out / "model.safetensors").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == CharTokenizer.eos_id
    ids = torch.tensor([CharTokenizer().encode("3 a+4 b*2\n")])
    logits = model(input_ids=ids).logits  # (1, T, V)
    assert logits.shape == (1, ids.shape[1], CharTokenizer().vocab_size)
    assert torch.isfinite(logits).all()


def test_loss_decreases_and_metrics_are_written(tiny_run):
    out, metrics = tiny_run
    losses = [row["loss"] for row in metrics["train_log"]]
    assert len(losses) == TINY["num_steps"]
    # Untrained: ~ln(100) = 4.6 nats per token; a few steps must already beat it clearly.
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["greedy"]["num_prompts"] == TINY["num_eval_prompts"]
    assert [r["num_prompts"] for r in saved["greedy"]["by_difficulty"]] and sum(
        r["num_prompts"] for r in saved["greedy"]["by_difficulty"]
    ) == TINY["num_eval_prompts"]
    assert (
        saved["response_tokens"]["sampled"]["num"]
        == TINY["num_sample_prompts"] * TINY["group_size"]
    )
    resolved = json.loads((out / "sft_config.json").read_text())
    assert resolved["sft"]["num_steps"] == TINY["num_steps"]
    assert resolved["task"]["max_ops"] == TINY_TASK.max_ops


def test_same_seed_same_run(tmp_path, tiny_run):
    _, first = tiny_run
    again = run_sft(SFTConfig(out=str(tmp_path), **TINY), TINY_TASK, show_progress=False)
    assert [r["loss"] for r in again["train_log"]] == [r["loss"] for r in first["train_log"]]
    assert again["examples"] == first["examples"]


def test_labels_mask_the_prompt_and_batches_respect_the_token_budget():
    tok = CharTokenizer()
    examples = make_examples(TaskConfig(), random.Random(0), 200)
    ex = examples[0]
    ids, labels = example_tokens(ex, ex.solutions[0], tok)
    num_prompt = len(ex.prompt) + 1  # + BOS
    assert labels[:num_prompt] == [-100] * num_prompt
    assert labels[num_prompt:] == ids[num_prompt:] and ids[-1] == tok.eos_id
    assert tok.decode(ids[num_prompt:]) == ex.solutions[0]
    seqs = [example_tokens(e, e.solutions[0], tok) for e in examples]
    batches = length_batches(seqs, 1024, random.Random(0))
    assert sum(len(b) for b in batches) == len(seqs)
    for b in batches:
        batch = collate(b, tok.pad_id)
        assert batch["input_ids"].numel() <= 1024 or len(b) == 1
        assert int(batch["attention_mask"].sum()) == sum(len(x) for x, _ in b)


def test_bad_flags_exit_2_with_one_line(tmp_path, capsys):
    assert main(["sft", "--out", str(tmp_path), "--num-steps", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --num-steps must be >= 0, got -1"  # the flag, not the field
    assert main(["sft", "--num-steps", "3"]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["sft", "--out", str(tmp_path), "--task-max-ops", "99"]) == 2
    assert "--task-max-ops must be in [1, 52]" in capsys.readouterr().err
    # an odd head size was an internal error (RoPE's rotate-half) after the run dir was made
    argv = ["--hidden-size", "6", "--num-heads", "2", "--num-kv-heads", "1"]
    assert main(["sft", "--out", str(tmp_path / "odd"), *argv]) == 2
    assert "a head size of 3: RoPE needs an even one" in capsys.readouterr().err
    assert not (tmp_path / "odd").exists()
    with pytest.raises(SystemExit) as exc:  # argparse's own errors also exit 2
        main(["sft", "--out", str(tmp_path), "--num-steps", "many"])
    assert exc.value.code == 2


def test_standalone_eval_reproduces_the_run(tiny_run, capsys):
    out, metrics = tiny_run
    assert main(["sft-eval", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"greedy accuracy {metrics['greedy']['accuracy']:.3f}" in printed
    assert main(["sft-eval", str(out / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "sft_config.json" in err and "\n" not in err


def test_task_prints_samples_and_length_statistics(capsys):
    assert main(["task", "--num-prompts", "2", "--group-size", "4", "--seed", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("answer: ") >= 2
    assert "response chars over 32 prompts x 4 samples:" in printed
    assert main(["task", "--num-prompts", "0"]) == 2


def test_a_bad_data_row_stops_the_run_or_is_skipped_with_a_warning(tmp_path):
    from tltrun.data.dataset import DataError, SkippedRowsWarning
    from tltrun.train.sft import data_pairs

    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "1+1=", "response": "2"}\n{"prompt": \n{"prompt": "2+2=", "response": "4"}\n'
    )
    cfg = SFTConfig(out=str(tmp_path / "o"), data=str(path))
    # the error's advice names a flag tltrun sft has (it once named one only train had)
    with pytest.raises(DataError, match=r"d\.jsonl:2: bad JSON .*--skip-bad-rows skips"):
        data_pairs(cfg, seed=0, num_rows=10)
    skipping = SFTConfig(out=str(tmp_path / "o"), data=str(path), skip_bad_rows=True)
    with pytest.warns(SkippedRowsWarning, match=r"skipped 1 bad rows of .*d\.jsonl:2: bad JSON"):
        assert data_pairs(skipping, seed=0, num_rows=10) == [("1+1=", "2"), ("2+2=", "4")]


def test_a_non_finite_loss_stops_the_run_before_its_update(tmp_path, monkeypatch, capsys):
    """A diverged step (NaN loss) was trained on and then failed at evaluation as an internal
    error ('probability tensor contains inf/nan'); a learning rate of 1e38 overflowed in AdamW."""
    import tltrun.train.sft as sft

    flags = TINY_FLAGS
    real = sft.response_loss
    monkeypatch.setattr(sft, "response_loss", lambda model, batch: real(model, batch) * math.nan)
    assert main(["sft", "--out", str(tmp_path / "nan"), "--num-steps", "3", *flags]) == 2
    err = capsys.readouterr().err
    assert "error: sft step 0: loss + gradient norm is nan: training diverged" in err, err
    assert main(["sft", "--out", str(tmp_path / "lr"), *flags, "--lr", "1e38"]) == 2
    assert "lr must be in (0, 1.0], got 1e+38" in capsys.readouterr().err


def test_no_steps_and_no_evaluation_prompts_are_reported_as_such(tmp_path, capsys):
    """--num-steps 0 (allowed) failed at its summary (a None loss formatted as a number); an
    evaluation of 0 prompts was reported as accuracy 0.000."""
    flags = TINY_FLAGS
    assert main(["sft", "--out", str(tmp_path / "s0"), *flags, "--num-steps", "0"]) == 0
    assert "no steps trained" in capsys.readouterr().out
    flags = [*flags, "--num-eval-prompts", "0", "--num-steps", "1"]
    assert main(["sft", "--out", str(tmp_path / "e0"), *flags]) == 0
    assert "greedy: no held-out prompts evaluated" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "e0" / "metrics.json").read_text())
    assert metrics["greedy"]["accuracy"] is None and metrics["greedy"]["num_prompts"] == 0


def test_data_outside_the_tokenizer_alphabet_is_trained_with_a_warning(tmp_path):
    """'naïve' trained silently as 'na<unk>ve', a response that can never match exactly."""
    import warnings

    from tltrun.model.tokenizer import UnknownCharsWarning
    from tltrun.train.sft import data_pairs

    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "1+1=", "response": "2"}\n{"prompt": "na\\u00efve", "response": "x"}\n'
    )
    cfg = SFTConfig(out=str(tmp_path / "o"), data=str(path))
    with pytest.warns(UnknownCharsWarning, match=r"1 of 2 rows hold 1 characters .*\('ï'\)"):
        assert data_pairs(cfg, seed=0, num_rows=10)[1] == ("naïve", "x")
    path.write_text('{"prompt": "1+1=", "response": "2"}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        data_pairs(cfg, seed=0, num_rows=10)


def test_built_in_task_settings_beside_data_are_refused(tmp_path, capsys):
    """--num-sample-prompts, --group-size and --task-* with --data were recorded and ignored."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "response": "2"}\n')
    argv = ["sft", "--out", str(tmp_path / "o"), "--data", str(path), "--num-steps", "1"]
    assert main([*argv, "--group-size", "3", "--task-max-ops", "30"]) == 2
    err = capsys.readouterr().err
    assert "error: --group-size, --task-max-ops: settings of the built-in task" in err, err
    assert not (tmp_path / "o").exists()
