"""Tests of the built-in task (tltrun.train.tasks) and the character tokenizer (tltrun.model.tokenizer).

Run: ``.venv/bin/python -m pytest tests/test_tasks.py -q``.
"""

from __future__ import annotations

import json
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tltrun.model.tokenizer import DEFAULT_CHARS, CharTokenizer
from tltrun.train.tasks import (
    LABELS,
    TaskConfig,
    apply_op,
    length_stats,
    make_examples,
    parse_answer,
    parse_problem,
    reward,
    sample_problem,
    worked_solution,
)

CFG = TaskConfig()


def test_generation_is_reproducible_from_seed():
    a = make_examples(CFG, random.Random(7), 50, num_solutions=3)
    b = make_examples(CFG, random.Random(7), 50, num_solutions=3)
    c = make_examples(CFG, random.Random(8), 50, num_solutions=3)
    assert a == b
    assert [e.prompt for e in a] != [e.prompt for e in c]


def test_worked_example_by_hand():
    problem = parse_problem("7 a+5 b*3 c-4\n")
    assert problem.values() == [7, 2, 6, 2]
    terse = TaskConfig(max_check_prob=0.0, recheck_prob=0.0)
    assert (
        worked_solution(problem, terse, random.Random(0))
        == "a+5: 7+5=2\nb*3: 2*3=6\nc-4: 6-4=2\nanswer: 2\n"
    )


def test_reference_solutions_get_reward_one_and_corrupted_answers_zero():
    for ex in make_examples(CFG, random.Random(1), 200, num_solutions=2):
        for sol in ex.solutions:
            assert reward(sol, ex.answer) == 1.0
            wrong = (ex.answer + 1) % CFG.modulus
            corrupted = sol[: sol.rindex("answer:")] + f"answer: {wrong}\n"
            assert reward(corrupted, ex.answer) == 0.0


def test_check_lines_and_rechecks_are_arithmetically_right():
    """Every line 'x<op>y=z' in a reference solution (steps, checks) is a true equation."""
    for ex in make_examples(CFG, random.Random(2), 100, num_solutions=4):
        for sol in ex.solutions:
            for line in sol.splitlines():
                body = line.strip().removeprefix("check ").removesuffix(" ok")
                if "=" not in body or body.startswith("answer"):
                    continue
                expr = body.split(" ")[-1]
                lhs, rhs = expr.split("=")
                a, op, x = int(lhs[0]), lhs[1], int(lhs[2])
                assert apply_op(a, op, x, CFG.modulus) == int(rhs), (line, sol)


@pytest.mark.parametrize(
    "response",
    [
        "",
        "\n\n",
        "a 7+5=2\n",  # truncated: no answer line
        "answer: 2\nb 2*3=6\n",  # answer not on the last line
        "answer: two\n",
        "answer 2\n",  # missing colon
        "the answer: 2\n",
        "answer: 2 3\n",
        "answer: 2.0\n",
    ],
)
def test_malformed_responses_get_zero(response):
    assert reward(response, 2) == 0.0


def test_answer_parse_tolerates_whitespace():
    assert parse_answer("a 7+5=2\nanswer:2") == 2
    assert parse_answer("a 7+5=2\n  answer:   12  \n\n") == 12
    assert reward("x\nanswer: 2", 2) == 1.0


@given(st.integers(min_value=0, max_value=2**32))
@settings(max_examples=50, deadline=None)
def test_prompt_round_trips_and_answer_is_the_chain(seed):
    problem = sample_problem(CFG, random.Random(seed))
    assert parse_problem(problem.prompt) == problem
    assert 1 <= problem.num_ops <= CFG.max_ops
    value = problem.start
    for op, x in problem.ops:
        value = apply_op(value, op, x, CFG.modulus)
    assert problem.answer == value
    assert len(problem.prompt) <= CFG.max_prompt_chars


def test_length_distribution_is_long_tailed():
    """A step of 32 prompts x 8 samples: the longest response is >= 8x the median (published RL
    traces: 10-25x), and the samples of one prompt differ in length."""
    batch = make_examples(CFG, random.Random(0), 32, num_solutions=8)
    lengths = [len(s) for ex in batch for s in ex.solutions]
    assert len(lengths) >= 256
    assert length_stats(lengths)["max_over_median"] >= 8
    assert max(lengths) <= CFG.max_response_chars
    spreads = [max(map(len, ex.solutions)) / min(map(len, ex.solutions)) for ex in batch]
    assert all(len({len(s) for s in ex.solutions}) > 1 for ex in batch if ex.problem.num_ops >= 4)
    assert statistics.median(spreads) >= 1.5
    # Not a lucky seed: over many steps the typical step is long-tailed too.
    ratios = []
    for seed in range(1, 21):
        step = make_examples(CFG, random.Random(seed), 32, num_solutions=8)
        ratios.append(
            length_stats([len(s) for ex in step for s in ex.solutions])["max_over_median"]
        )
    assert statistics.median(ratios) >= 8


def test_difficulty_is_heavy_tailed():
    problems = [sample_problem(CFG, random.Random(s)) for s in range(2000)]
    ops = sorted(p.num_ops for p in problems)
    assert ops[len(ops) // 2] == pytest.approx(CFG.median_ops, abs=1)
    assert ops[-1] >= 8 * ops[len(ops) // 2]


def test_bad_task_config_is_rejected():
    with pytest.raises(ValueError, match="max_ops"):
        TaskConfig(max_ops=len(LABELS) + 1)
    with pytest.raises(ValueError, match="recheck_prob"):
        TaskConfig(recheck_prob=1.0)


# ---- tokenizer ---------------------------------------------------------------------------


@given(st.text(alphabet=DEFAULT_CHARS, max_size=200))
@settings(max_examples=100, deadline=None)
def test_tokenizer_round_trip(text):
    tok = CharTokenizer()
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(ids) == len(text) + 2
    assert tok.decode(ids) == text


def test_tokenizer_vocab_and_unknown_characters():
    tok = CharTokenizer()
    assert tok.vocab_size < 128
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode("é", add_bos=False) == [tok.unk_id]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_tokenizer_saves_in_hf_layout_and_autotokenizer_agrees(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = CharTokenizer()
    tok.save(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert json.loads((tmp_path / "special_tokens_map.json").read_text())["eos_token"] == "</s>"
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (
        tok.pad_id,
        tok.bos_id,
        tok.eos_id,
    )
    ex = make_examples(CFG, random.Random(3), 1)[0]
    for text in (ex.prompt + ex.solutions[0], "a . b , c ' d n't  \n e"):
        ids = tok.encode(text)
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids + [tok.eos_id], skip_special_tokens=True) == text
    assert CharTokenizer.load(tmp_path).tokens == tok.tokens


def test_tokenizer_load_rejects_other_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"ab": 0}}}')
    with pytest.raises(ValueError, match="tokenizer.json"):
        CharTokenizer.load(tmp_path)
