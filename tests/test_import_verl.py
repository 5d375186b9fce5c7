"""``tltsim import-verl``: veRL's rollout dumps (``STEP.jsonl`` of text rows) -> a trace, token
counts from the model's own tokenizer, GRPO groups by prompt text, the cap's responses marked.

Run: ``python -m pytest tests/test_import_verl.py -q``.
"""

from __future__ import annotations

import functools
import json
import random
import re
import warnings
from pathlib import Path

import pytest

from tltsim.cli.main import main
from tltsim.errors import InputWarning
from tltsim.trace.errors import TraceError
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


@functools.cache
def _loaded(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def count(tokenizer: Path, text: str) -> int:
    return len(_loaded(tokenizer).encode(text).ids)


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def write_dump(directory: Path, step: int, rows: list[dict], ensure_ascii: bool = True) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({**r, "score": 0.0, "step": step}, ensure_ascii=ensure_ascii) for r in rows]
    (directory / f"{step}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


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
    with pytest.warns(InputWarning, match="no --max-response-tokens: responses cut"):
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
    words = [text(rng, 1) for _ in range(4000)]
    cap = 2000  # the run's; a cut response recounts to it give or take non-canonical splits
    outputs = {}
    for name, num_tokens in (("cut", cap), ("cut_resplit", cap - 3), ("stopped", cap - 50)):
        # words until the recount reaches num_tokens (each word is a token or two here)
        out = ""
        for w in words:
            grown = (out + " " + w).strip()
            if count(tokenizer, grown) > num_tokens:
                break
            out = grown
        outputs[name] = out
    assert cap - 4 <= count(tokenizer, outputs["cut_resplit"]) < cap - 1  # within the slack
    rows = [{"input": "q0", "output": outputs[k]} for k in ("cut", "cut_resplit", "stopped")]
    rows += [{"input": "q1", "output": "four"}] * 6  # drawn twice: 2 x the group size of 3
    rows += [{"input": "q2", "output": "nine"}] * 3
    write_dump(tmp_path / "d", 5, rows)
    cfg = VerlImportConfig(tokenizer=str(tokenizer / "tokenizer.json"), max_response_tokens=cap)
    (step,) = import_verl(tmp_path / "d", cfg, progress=False).steps
    assert [len(p.responses) for p in step.prompts] == [3, 3, 3, 3]
    cut, resplit, stopped = step.prompts[0].responses
    assert (cut.tokens, cut.finish) == (resplit.tokens, resplit.finish) == (cap, "length")
    assert (stopped.tokens, stopped.finish) == (count(tokenizer, outputs["stopped"]) + 1, "stop")
    # the second draw of q1 is its own group, named apart
    assert step.prompts[2].id == step.prompts[1].id + "#1"


def test_a_cap_below_the_runs_is_refused_not_clamped(tokenizer, tmp_path):
    rows = [{"input": "q", "output": text(random.Random(3), 60)}] * 2
    write_dump(tmp_path / "d", 1, rows)
    cfg = VerlImportConfig(tokenizer=str(tokenizer), max_response_tokens=20)
    with pytest.raises(TraceError, match=r"1\.jsonl:1: the output recounts to \d+ tokens, past"):
        import_verl(tmp_path / "d", cfg, progress=False)


def test_prompt_ids_link_a_prompts_steps_and_text_keeps_its_line_separators(tokenizer, tmp_path):
    """A prompt seen again in a later step (a second epoch) keeps its id: the simulated
    history drafter indexes its earlier rollouts by it. veRL writes ensure_ascii=False, so a
    U+2028 in a response stands unescaped in its line (str.splitlines split the row there)."""
    odd = "line\u2028separator\u2029and\x85next"
    for step in (1, 2):
        rows = [{"input": f"q{p}", "output": odd if p == 0 else "four"}
                for p in (0, step) for _ in range(2)]  # fmt: skip
        write_dump(tmp_path / "d", step, rows, ensure_ascii=False)
    cfg = VerlImportConfig(tokenizer=str(tokenizer), max_response_tokens=100)
    first, second = import_verl(tmp_path / "d", cfg, progress=False).steps
    assert first.prompts[0].id == second.prompts[0].id  # q0 in both steps
    assert first.prompts[1].id != second.prompts[1].id  # q1, then q2
    assert first.prompts[0].responses[0].tokens == count(tokenizer, odd) + 1


def test_the_cli_writes_a_trace_replay_reads(tokenizer, tmp_path, capsys):
    rng = random.Random(2)
    rows = [{"input": f"q{p}", "output": text(rng, rng.randint(1, 20))}
            for p in range(4) for _ in range(2)]  # fmt: skip
    write_dump(tmp_path / "d", 1, rows)
    out = tmp_path / "run.json"
    argv = ["import-verl", str(tmp_path / "d"), "--tokenizer", str(tokenizer), "--out", str(out)]
    assert main([*argv, "--max-response-tokens", "60"]) == 0
    assert "1 steps, 4 prompts, 8 responses" in capsys.readouterr().out
    trace = load_trace(out)
    assert trace.meta["max_response_tokens"] == 60 and trace.meta["importer"]["kind"] == "verl"
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
         r"2\.jsonl:1: field 'step': 3, but the file is step 2\n"),  # (not "killed")
        ({"1.jsonl": "\n"}, r"1\.jsonl: no rows"),
        ({"1.jsonl": '{"input": "q", "output": "a"}\n', "val_1.jsonl": ""},
         r"val_1\.jsonl: not a veRL dump name"),
        ({"notes.txt": ""}, r"no STEP\.jsonl files"),
        ({"99999999999.jsonl": '{"input": "q", "output": "a"}\n'},
         r"step 99999999999 is past 2147483647"),
        ({"1.jsonl": '{"input": "q", "output": "a"}\n', "01.jsonl": ""},
         r"01\.jsonl and 1\.jsonl are both step 1"),
        # a killed run's half-written last step: the way out is named
        ({"1.jsonl": '{"input": "q", "output": "a"}\n', "2.jsonl": '{"input": "q", "ou'},
         r"2\.jsonl:1: not a JSON line .*last step.*--max-steps leaves it out"),
    ],
)  # fmt: skip
def test_bad_dumps_are_one_line_errors(tokenizer, tmp_path, capsys, files, message):
    dumps = tmp_path / "d"
    dumps.mkdir()
    for name, content in files.items():
        (dumps / name).write_text(content)
    argv = ["import-verl", str(dumps), "--tokenizer", str(tokenizer), "--max-response-tokens", "9"]
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


def test_counts_ignore_a_tokenizer_file_saved_with_padding_or_truncation(tokenizer, tmp_path):
    """Hunt: a tokenizer.json saved with padding on counted every text of a batch as its
    longest (all 'at the cap'), one with truncation on cut long texts without a word."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="<|im_end|>")
    tok.enable_truncation(max_length=4)
    (tmp_path / "m").mkdir()
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    rng = random.Random(4)
    rows = [{"input": "q", "output": text(rng, n)} for n in (1, 3, 30)]
    write_dump(tmp_path / "d", 1, rows)
    cfg = VerlImportConfig(tokenizer=str(tmp_path / "m"), max_response_tokens=100)
    (step,) = import_verl(tmp_path / "d", cfg, progress=False).steps
    got = [r.tokens for r in step.prompts[0].responses]
    assert got == [count(tokenizer, r["output"]) + 1 for r in rows] and got[-1] > 5


def test_equally_common_group_sizes_do_not_depend_on_the_row_order(tokenizer, tmp_path):
    """Hunt: two prompts drawn twice (16 rows) beside two drawn once (8): whichever came first
    set the step's group size, so one row order made groups of 16 in a run of 8."""
    rows = {
        q: [{"input": q, "output": "four"}] * n for q, n in zip("ABCD", (16, 16, 8, 8), strict=True)
    }
    for step, order in ((1, "CDAB"), (2, "ABCD")):
        write_dump(tmp_path / "d", step, [r for q in order for r in rows[q]])
    cfg = VerlImportConfig(tokenizer=str(tokenizer), max_response_tokens=100)
    trace = import_verl(tmp_path / "d", cfg, progress=False)
    assert [[len(p.responses) for p in s.prompts] for s in trace.steps] == [[8] * 6] * 2
    assert trace.meta["group_size"] == 8


def test_a_cap_above_the_runs_and_special_thinking_tags_are_said(tokenizer, tmp_path):
    """Hunt: with a cap larger than the run's, its cut responses read as stopped a token past
    it without a word; a tokenizer marking <think> special lost the tags from every response
    (veRL's decode skips special tokens) without a word."""
    rng = random.Random(5)
    cut = text(rng, 30)  # six responses cut at the run's cap: the same length
    rows = [{"input": "q", "output": cut}] * 6 + [{"input": "r", "output": "four"}] * 8
    write_dump(tmp_path / "d", 1, rows)
    run_cap = count(tokenizer, cut)
    cfg = VerlImportConfig(tokenizer=str(tokenizer), max_response_tokens=run_cap + 100)
    with pytest.warns(InputWarning, match=f"6 of 14 end within 2 tokens of the longest "
                      rf"\({run_cap} tokens and an EOS\): was the run's cap {run_cap}\?"):  # fmt: skip
        import_verl(tmp_path / "d", cfg, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the run's cap: cut, nothing to say
        cfg = VerlImportConfig(tokenizer=str(tokenizer), max_response_tokens=run_cap)
        (step,) = import_verl(tmp_path / "d", cfg, progress=False).steps
    assert {r.finish for r in step.prompts[0].responses} == {"length"}
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<think>"), AddedToken("</think>")])
    (tmp_path / "m").mkdir()
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    cfg = VerlImportConfig(tokenizer=str(tmp_path / "m"), max_response_tokens=run_cap)
    with pytest.warns(InputWarning, match="marks </think>, <think> special: .* 2 token"):
        import_verl(tmp_path / "d", cfg, progress=False)
