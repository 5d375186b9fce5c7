"""``tltsim import-verl``: veRL's rollout dumps (``STEP.jsonl`` of text rows) -> a trace, token
counts from the model's own tokenizer, GRPO groups by prompt text, the cap's responses marked.

Run: ``python -m pytest tests/test_import_verl.py -q``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from tltsim.cli.main import main
from tltsim.trace.files import load_trace
from tltsim.trace.verl import VerlImportConfig, import_verl

WORDS = [
    "the",
    "answer",
    "is",
    "four",
    "plus",
    "nine",
    "so",
    "we",
    "carry",
    "one",
    "and",
    "write",
    "thirteen",
    "then",
    "check",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json (a model directory's), trained in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    model = tmp_path_factory.mktemp("Qwen-tiny")
    tok.save(str(model / "tokenizer.json"))
    return model


def count(tokenizer: Path, text: str) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode(text).ids)


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def write_dump(directory: Path, step: int, rows: list[dict]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({**r, "score": 0.0, "step": step}) for r in rows]
    (directory / f"{step}.jsonl").write_text("\n".join(lines) + "\n")


def test_a_dump_becomes_groups_of_token_counts(tokenizer, tmp_path):
    rng = random.Random(0)
    dumps = tmp_path / "rollout_data"
    expected = {}
    for step in (1, 2, 10):  # veRL counts steps from 1; 10 sorts after 2
        rows = []
        for p in range(3):
            prompt = f"question {step} {p}: " + text(rng, 5 * p + 1)
            rows += [{"input": prompt, "output": text(rng, rng.randint(0, 30))} for _ in range(4)]
        rows[0]["output"] = ""  # EOS at once
        rng.shuffle(rows)  # veRL's balance_batch reorders the batch
        write_dump(dumps, step, rows)
        first_seen = list(dict.fromkeys(r["input"] for r in rows))
        expected[step] = [
            (count(tokenizer, q), sorted(count(tokenizer, r["output"]) + 1  # + the EOS
                                         for r in rows if r["input"] == q))
            for q in first_seen
        ]  # fmt: skip
    trace = import_verl(dumps, VerlImportConfig(tokenizer=str(tokenizer)), progress=False)
    assert [s.step for s in trace.steps] == [1, 2, 10]
    assert trace.meta["group_size"] == 4 and trace.meta["model"] == tokenizer.name
    assert "max_response_tokens" not in trace.meta
    for step in trace.steps:  # groups in order of first appearance, each prompt's own lengths
        got = [(p.prompt_tokens, sorted(r.tokens for r in p.responses)) for p in step.prompts]
        assert got == expected[step.step]
        assert all(r.finish == "stop" for p in step.prompts for r in p.responses)
    # the empty response is its EOS alone: one token
    assert 1 in {r.tokens for s in trace.steps for p in s.prompts for r in p.responses}


def test_the_cap_marks_cut_responses_and_a_prompt_drawn_twice_is_two_groups(tokenizer, tmp_path):
    rng = random.Random(1)
    long, short = text(rng, 40), text(rng, 2)
    cap = count(tokenizer, long) - 1  # the long answer reaches the cap: it was cut
    rows = [{"input": "q0", "output": o} for o in (long, short)]
    rows += [{"input": "q1", "output": short}] * 4  # drawn twice: 2 x the group size of 2
    rows += [{"input": "q2", "output": short}] * 2
    write_dump(tmp_path / "d", 5, rows)
    cfg = VerlImportConfig(tokenizer=str(tokenizer / "tokenizer.json"), max_response_tokens=cap)
    (step,) = import_verl(tmp_path / "d", cfg, progress=False).steps
    assert [len(p.responses) for p in step.prompts] == [2, 2, 2, 2]
    cut, stopped = step.prompts[0].responses
    assert (cut.tokens, cut.finish) == (cap, "length")
    assert (stopped.tokens, stopped.finish) == (count(tokenizer, short) + 1, "stop")


def test_the_cli_writes_a_trace_replay_reads(tokenizer, tmp_path, capsys):
    rng = random.Random(2)
    rows = [{"input": f"q{p}", "output": text(rng, rng.randint(1, 60))}
            for p in range(4) for _ in range(2)]  # fmt: skip
    write_dump(tmp_path / "d", 1, rows)
    out = tmp_path / "run.json"
    argv = ["import-verl", str(tmp_path / "d"), "--tokenizer", str(tokenizer), "--out", str(out)]
    assert main([*argv, "--max-response-tokens", "30"]) == 0
    assert "1 steps, 4 prompts, 8 responses" in capsys.readouterr().out
    trace = load_trace(out)
    assert trace.meta["max_response_tokens"] == 30 and trace.meta["importer"]["kind"] == "verl"
    assert main(["replay", str(out), "--policy", "nospec,tlt", "--out", str(tmp_path / "r")]) == 0


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"1.jsonl": '{"input": "q", "output": "a"}\n{"input": "q", "out'},
         r"1\.jsonl:2: not a JSON line"),
        ({"1.jsonl": '{"input": "q", "output": 3}\n'},
         r"1\.jsonl:1: field 'output': expected text, got int"),
        ({"1.jsonl": '{"output": "a"}\n'}, r"1\.jsonl:1: field 'input': expected text, got missing"),
        ({"2.jsonl": '{"input": "q", "output": "a", "step": 3}\n'},
         r"2\.jsonl:1: field 'step': 3, but the file is step 2"),
        ({"1.jsonl": "\n"}, r"1\.jsonl: no rows"),
        ({"1.jsonl": '{"input": "q", "output": "a"}\n', "val_1.jsonl": ""},
         r"val_1\.jsonl: not a veRL dump name"),
        ({"notes.txt": ""}, r"no STEP\.jsonl files"),
    ],
)  # fmt: skip
def test_bad_dumps_are_one_line_errors(tokenizer, tmp_path, capsys, files, message):
    dumps = tmp_path / "d"
    dumps.mkdir()
    for name, content in files.items():
        (dumps / name).write_text(content)
    argv = ["import-verl", str(dumps), "--tokenizer", str(tokenizer)]
    assert main([*argv, "--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "t.json").exists()


def test_a_missing_tokenizer_is_named(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    argv = ["import-verl", str(tmp_path / "d"), "--tokenizer", str(tmp_path), "--out", "t.json"]
    assert main(argv) == 2
    assert f"--tokenizer {tmp_path}: no tokenizer.json there" in capsys.readouterr().err
