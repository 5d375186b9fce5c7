"""Rewards on what reasoning models write (Qwen3, DeepSeek-R1 distills): the built-in rewards
score only the text after the last ``</think>`` (``scoring.final_part``); a response whose
thinking never ended (cut at the token cap mid-thought, or opened by the prompt's template)
has no answer and is not well formed; a user's function still sees the whole response. And
an answer field listing numbers ('2, 3') is a list, not its last number. How math-verify, exact
and regex read answers: LaTeX without dollars, numbers with words or spaced digits, edges.

Run: ``python -m pytest tests/test_rewards_thinking.py -q``.
"""

from __future__ import annotations

import pytest
from test_rewards import rewards
from test_train_data import bpe_model  # noqa: F401 (fixture)

from tltrun.data.rewards import parse_reward
from tltrun.data.scoring import RewardItem, final_part, score_in_process
from tltrun.data.tokenizer import load_tokenizer

DRAFT = "<think>\nMaybe \\boxed{42}. Hmm wait, re-check step 1: 3*7 is"  # cut at the cap


def scored(spec: str, response: str, answer: str | None, is_open: bool = False):
    item = RewardItem(sample_id="s", prompt="q?", response=response, answer=answer,
                      is_thinking_open=is_open)  # fmt: skip
    (outcome,) = score_in_process(parse_reward(spec), [item])
    assert outcome.error is None, outcome.error
    return outcome.reward, outcome.is_format_ok


@pytest.mark.parametrize(
    "spec,response,answer,expected",
    [
        # cut mid-thought: a boxed draft, or a bare number, earned full credit
        ("math", DRAFT, "42", (0.0, False)),
        ("math", "<think>\nSo 40 + 2 = 42 and then multiply by", "42", (0.0, False)),
        ("exact", "<think>\\boxed{Paris} or maybe", "Paris", (0.0, False)),
        ("regex:Answer:\\s*(?P<answer>\\d+)", "<think>Answer: 42 maybe, let me", "42", (0.0, False)),
        # a draft in the thinking no longer beats the final answer, nor stands in for a wrong one
        ("math", "<think>draft \\boxed{41}</think>\nThe final answer is \\boxed{42}.", "42", (1.0, True)),
        ("math", "<think>draft \\boxed{41}</think>\nThe final answer is 42.", "42", (1.0, False)),
        ("math", "<think>maybe \\boxed{42}? no.</think>\nThe final answer is 41.", "42", (0.0, False)),
        ("math", "<think>2+2=4, and 42 maybe</think>\nI could not solve it.", "42", (0.0, False)),
        ("exact", "<think>\\boxed{London}</think>\n\\boxed{Paris}", "Paris", (1.0, True)),
        ("regex:Answer:\\s*(?P<answer>\\d+)", "<think>Answer: 41</think>Answer: 42", "42", (1.0, True)),
        # no thinking at all: as before
        ("math", "so \\boxed{42}", "42", (1.0, True)),
        # an empty box is no answer, so not the form the format penalty asks for
        ("math", "\\boxed{}", "42", (0.0, False)),
        # an answer listing numbers is a list (it was read as its last number)
        ("math", "\\boxed{2, 3}", "2, 3", (1.0, True)),
        ("math", "\\boxed{3}", "2, 3", (0.0, True)),
        ("math", "\\boxed{1000}", "1 000", (1.0, True)),
    ],
)  # fmt: skip
def test_the_built_in_rewards_score_the_final_part(spec, response, answer, expected):
    assert scored(spec, response, answer) == expected


def test_a_prompt_that_opens_the_thinking_and_a_users_function(tmp_path):
    """DeepSeek-R1 distills' templates end the prompt in ``<think>\\n``: the response starts
    mid-thought and only closes it; until it does it holds no answer. A user's function gets
    the whole response, thinking included (its own rule)."""
    assert scored("math", "So 40 + 2 = 42 and", "42", is_open=True) == (0.0, False)
    assert scored("math", "draft \\boxed{41}</think>\n\\boxed{42}", "42", is_open=True) == (
        1.0,
        True,
    )
    assert final_part("a</think>b</think>c") == "c" and final_part("plain") == "plain"
    assert final_part("<think>unended") is None and final_part("x", is_thinking_open=True) is None
    module = tmp_path / "mine.py"
    module.write_text("def whole(prompt, response, answer, **meta):\n    return len(response)\n")
    assert scored(f"{module}:whole", DRAFT, "42") == (float(len(DRAFT)), True)


def test_thinking_tags_a_tokenizer_marks_special_are_kept_in_the_response(bpe_model, tmp_path):  # noqa: F811 (the fixture)
    """Hunt: decode skipped special tokens, and a tokenizer marking <think>/</think> special
    lost the tags: every answer after the thinking scored 0, silently. The stop and pad
    tokens are still dropped."""
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "special"
    shutil.copytree(bpe_model, model)
    hf = AutoTokenizer.from_pretrained(model)
    hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    hf.save_pretrained(model)
    tok = load_tokenizer(str(model))
    assert len(tok.encode("</think>")) == 1  # one special token
    text = "<think>\nMaybe 41.</think>\nThe answer is \\boxed{42}"
    response = tok.decode([*tok.encode(text), *tok.eos_ids, tok.pad_id])
    assert response == text
    assert scored("math", response, "42") == (1.0, True)


def test_a_template_that_opens_the_thinking_is_seen_from_the_prompt(bpe_model, tmp_path):  # noqa: F811 (the fixture)
    """DeepSeek-R1 distills' templates end the generation prompt in ``<think>\\n``: the
    rewards then know the response starts mid-thought (tltrun.data.scoring.final_part)."""
    import shutil

    from tltrun.train.responses import opens_thinking

    model = tmp_path / "r1"
    shutil.copytree(bpe_model, model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(
        template.replace("assistant\n", "assistant\n<think>\n")
    )
    question = [{"role": "user", "content": "What is 1 plus 2?"}]
    for directory, expected in ((bpe_model, False), (model, True)):
        tok = load_tokenizer(str(directory))
        assert opens_thinking(tok, question) is expected
    # a final assistant message the response continues, stopped mid-thought (a response cut
    # at the cap there scored its whole text: only a prompt ending in <think> counted)
    tok = load_tokenizer(str(bpe_model))
    for prefill, expected in (
        ("<think>\n1 plus 2 is", True),
        ("<think>\n1 plus 2 is 3.\n</think>\nThe answer is", False),
        ("The answer is", False),
    ):
        assert opens_thinking(tok, [*question, {"role": "assistant", "content": prefill}]) is (
            expected
        ), prefill
    # a draft that repeats the question is still the open draft (the question is looked for
    # before the continued message)
    for question_text, draft in (("What is 1 plus 2?", "<think>\nThe user asks: What is 1 plus 2? So"),
                                 ("2", "<think>\nx = 2")):  # fmt: skip
        asked = [{"role": "user", "content": question_text}]
        assert opens_thinking(tok, [*asked, {"role": "assistant", "content": draft}]), draft
    # a question that mentions <think> opens nothing; the R1 template after it still does
    mention = [{"role": "user", "content": "Put your reasoning after <think>. What is 1+2?"}]
    assert not opens_thinking(tok, mention)
    assert opens_thinking(load_tokenizer(str(model)), mention)
    # a plain-text prompt (no template) opens thinking where it ends in <think> only
    assert not tok.is_chat_template
    assert not opens_thinking(tok, "Start your answer with <think>. What is 2+2?")
    assert opens_thinking(tok, "User: What is 2+2?\nAssistant: <think>\n")


def test_math_reward_reads_a_latex_answer_without_dollars_as_latex():
    """MATH-style answers ('2\\sqrt{2}', '2^{10}', '2x+3') were parsed bare first, where
    math-verify reads their leading number: \\boxed{2} scored 1 and the right answer 0."""
    cases = [
        ("\\boxed{2\\sqrt{2}}", "2\\sqrt{2}"),
        ("\\boxed{2}", "2\\sqrt{2}"),
        ("\\boxed{1024}", "2^{10}"),
        ("\\boxed{2}", "2^{10}"),
        ("\\boxed{2x+3}", "2x+3"),
        ("\\boxed{2}", "2x+3"),
        ("\\boxed{1,000}", "1,000"),
    ]
    assert rewards("math", cases) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_math_reward_reads_a_number_with_words_or_spaced_digits_as_text():
    """Hunt: an answer field of a number and words or spaced digits was parsed as LaTeX, its
    words a product of letters: '18 dollars' matched nothing, not even itself, and '1 000' was
    1*0, which \\boxed{0} matched; '\\boxed{42.}' (a sentence's period) held no number."""
    cases = [
        ("\\boxed{18}", "18 dollars"),
        ("18 dollars", "18 dollars"),
        ("\\boxed{0}", "1 000"),
        ("\\boxed{1000}", "1 000"),
        ("\\boxed{1.5}", "1.5 million"),
        ("\\boxed{42.}", "42"),
        ("\\boxed{x^2}", "x^2"),
    ]
    assert rewards("math", cases) == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def test_exact_and_regex_edges():
    """Hunt: \\boxed{\\text{Paris}} did not match Paris; an answer normalising to nothing
    ('...') matched the empty response; a regex that can match empty text took its empty
    match after the answer."""
    cases = [("\\boxed{\\text{Paris}}", "Paris"), ("", "..."), ("...", "...")]
    assert rewards("exact", cases) == [1.0, 0.0, 1.0]
    assert rewards("regex:(?P<answer>\\d+)?$", [("x 42", "42"), ("x 41", "42")]) == [1.0, 0.0]
