"""The reward functions behind ``--reward`` (what each kind computes: ``rewards.py``'s
docstring), and the types that cross into the reward processes: ``RewardSpec`` (which reward),
``RewardItem`` (one response), ``RewardOutcome`` (its reward, or the error that zeroed it).
``Scorer`` loads one reward once per process; ``rewards.RewardPool`` runs it with a timeout.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tltsim.errors import UsageError

REWARD_KINDS = ("builtin", "math", "exact", "regex", "reasoning-gym", "python")
# Keys of a row's meta that cannot be passed as **meta to a user reward (its own arguments).
RESERVED_ARGS = ("prompt", "response", "answer")


@dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """What ``--reward`` names: a kind of REWARD_KINDS and its argument (the regex pattern, the
    reasoning-gym task, or ``/abs/path/module.py:function``). Picklable: it travels to the
    reward processes, which rebuild the function from it."""

    kind: str
    arg: str = ""

    def __post_init__(self) -> None:
        if self.kind not in REWARD_KINDS:
            raise UsageError(
                f"--reward: unknown kind {self.kind!r}; expected one of {REWARD_KINDS}"
            )

    def __str__(self) -> str:
        if self.kind == "python":
            return self.arg
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


@dataclass(frozen=True, kw_only=True)
class RewardItem:
    """One response to score."""

    sample_id: str
    prompt: str
    response: str
    answer: str | None
    meta: dict = field(default_factory=dict)
    # the rendered prompt ends in an open <think> (DeepSeek-R1 distills' templates): the response
    # starts inside its thinking (``final_part``)
    is_thinking_open: bool = False


@dataclass(frozen=True, kw_only=True)
class RewardOutcome:
    """A response's reward; ``error`` (one line) when the reward failed and 0 was given instead.
    ``is_format_ok``: the response has the form its reward looks for (``rewards.py`` docstring),
    what ``Shaping.format_penalty`` keys on."""

    reward: float
    error: str | None = None
    is_format_ok: bool = True


def compile_answer_pattern(pattern: str) -> re.Pattern[str]:
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise UsageError(f"--reward regex:{pattern}: not a regular expression ({err})") from None
    if "answer" not in compiled.groupindex:
        raise UsageError(
            f"--reward regex:{pattern}: expected a named group (?P<answer>...) in the pattern"
        )
    return compiled


def load_user_function(arg: str) -> Callable[..., Any]:
    path_text, _, name = arg.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"--reward {arg}: no such file {path}")
    if not name.isidentifier():
        raise UsageError(f"--reward {arg}: expected module.py:function, got function {name!r}")
    # A module name of our own so two reward files named alike do not collide in sys.modules.
    module_name = f"tlt_user_reward_{abs(hash(str(path)))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"--reward {arg}: cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    # registered as an import registers it: a dataclass under 'from __future__ import
    # annotations' looks its module up in sys.modules ('NoneType' has no '__dict__' without)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    # the user's module: any failure is theirs to fix, an exit at import (sys.exit, argparse
    # parsing tltrun's command line) included
    except (Exception, SystemExit) as err:
        del sys.modules[module_name]
        raise UsageError(f"--reward {arg}: importing {path.name} failed: {one_line(err)}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UsageError(f"--reward {arg}: {path.name} has no function {name!r}")
    return function


def one_line(err: BaseException) -> str:
    message = " ".join(str(err).split())
    return f"{type(err).__name__}: {message}"[:300] if message else type(err).__name__


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number in scientific notation and nothing else: math-verify 0.9 reads "1e-05" as 1 and
# "2.5e-06" as 2.5 (the exponent is lost), so both sides are written out positionally first.
MAX_WRITTEN_EXPONENT = 100
_SCIENTIFIC = re.compile(r"\s*[+-]?(?:\d+\.?\d*|\.\d+)[eE][+-]?\d+\s*")


def positional(text: str) -> str:
    """``text`` unchanged, unless it is one number in scientific notation: then written out
    (``1e-05`` -> ``0.00001``, ``1E+16`` -> ``10000000000000000``), or as ``m\\times 10^{e}``
    where it has more than ``MAX_WRITTEN_EXPONENT`` digits to write."""
    if not _SCIENTIFIC.fullmatch(text):
        return text
    from decimal import Decimal

    number = Decimal(text.strip())
    exponent = number.adjusted()
    try:
        if abs(exponent) <= MAX_WRITTEN_EXPONENT:
            return format(number.normalize(), "f")
        return f"{format(number.scaleb(-exponent).normalize(), 'f')}\\times 10^{{{exponent}}}"
    except ArithmeticError:  # beyond Decimal's exponent range: math-verify's reading stands
        return text


# a number in scientific notation inside free text (not part of a word or of another number)
_SCIENTIFIC_IN_TEXT = re.compile(r"(?<![\w.])[+-]?(?:\d+\.?\d*|\.\d+)[eE][+-]?\d+(?!\w|\.\d)")


def positional_in_text(text: str) -> str:
    """``text`` with each number in scientific notation written out (``positional``) where it
    has a positional form: an unboxed response went to math-verify as it was, which reads
    ``1e-05`` as 1 (so 'The answer is 1e-05' matched the answer 1, and not 0.00001)."""

    def written(match: re.Match) -> str:
        out = positional(match.group())
        return match.group() if "\\times" in out else out

    return _SCIENTIFIC_IN_TEXT.sub(written, text)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces
    balanced; None if there is none or it is unclosed."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def final_part(response: str, is_thinking_open: bool = False) -> str | None:
    """The part of a reasoning model's response that holds its answer: after the last
    ``</think>``; None if the response's thinking never closed (opened in it, or by the prompt:
    a response cut at the token cap mid-thought); the whole response if it does not think. The
    built-in rewards score this part only: drafts inside the thinking scored (a response cut
    mid-thought got credit for a boxed draft, a reward hack) and beat the final answer."""
    if THINK_CLOSE in response:
        return response.rsplit(THINK_CLOSE, 1)[1]
    if is_thinking_open or THINK_OPEN in response:
        return None
    return response


def final_answer(response: str) -> str:
    """The response's final answer for ``exact``: the last ``\\boxed{}`` content if present,
    else its last non-empty line."""
    boxed = last_boxed(response)
    if boxed is not None:  # \\boxed{\\text{Paris}} is Paris
        wrapped = re.fullmatch(r"\\(?:text|textbf|mathrm)\{(.*)\}", boxed.strip(), re.DOTALL)
        return wrapped[1] if wrapped else boxed
    lines = [line for line in response.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _exact_form(text: str) -> str:
    return normalize(text) or " ".join(text.split())


def normalize(text: str) -> str:
    """Stripped, whitespace runs as one space, casefolded, trailing periods removed."""
    return " ".join(text.split()).casefold().rstrip(".").rstrip()


def _need_answer(item: RewardItem, kind: str) -> str:
    if item.answer is None:
        raise ValueError(f"reward {kind!r} needs an answer field; this row has none (--answer-key)")
    return item.answer


class Scorer:
    """One reward function, loaded once per process: ``score(item) -> (reward, is_format_ok)``."""

    def __init__(self, spec: RewardSpec) -> None:
        self.spec = spec
        self._pattern: re.Pattern[str] | None = None
        self._user_function: Callable[..., Any] | None = None
        self._gym_datasets: dict[str, Any] = {}
        if spec.kind == "regex":
            self._pattern = compile_answer_pattern(spec.arg)
        elif spec.kind == "python":
            self._user_function = load_user_function(spec.arg)
        elif spec.kind == "math":
            import math_verify  # noqa: F401  (loaded before the first timed call)
        elif spec.kind == "reasoning-gym":
            from tltrun.data.gym import create

            self._gym_default = create(spec.arg, seed=0, num_rows=1, config={})

    def score(self, item: RewardItem) -> tuple[float, bool]:
        kind = self.spec.kind
        if kind == "builtin":
            from tltrun.train.tasks import parse_answer, reward

            answer = _need_answer(item, kind)
            return reward(item.response, int(answer)), parse_answer(item.response) is not None
        if kind == "python":  # the user's function sees the whole response
            return self._python(item)
        answer = item.answer if kind == "reasoning-gym" else _need_answer(item, kind)
        final = final_part(item.response, item.is_thinking_open)
        if final is None:  # thinking that never ended: no answer, not well formed
            return 0.0, False
        item = replace(item, response=final)
        if kind == "math":
            return self._math(item, answer)
        if kind == "exact":
            # text that normalises to nothing ('...') is compared as written: such an answer
            # matched every empty response
            matched = _exact_form(final_answer(item.response)) == _exact_form(answer)
            return float(matched), bool((last_boxed(item.response) or "").strip())
        if kind == "regex":
            assert self._pattern is not None
            # the last match that captured something: a pattern that can match empty text
            # ('(?P<answer>\d+)?$') took its empty match at the end, after the answer
            matches = [m for m in self._pattern.finditer(item.response) if m.group("answer")]
            if not matches:
                return 0.0, False
            return float(normalize(matches[-1].group("answer")) == normalize(answer)), True
        return self._gym(item)

    def _math(self, item: RewardItem, answer: str) -> tuple[float, bool]:
        from math_verify import parse, verify

        gold_text = answer.rsplit("####", 1)[-1].strip() if "####" in answer else answer
        written = positional(gold_text)
        # LaTeX (m\times 10^{e}) parses only as math: plain, math-verify reads "10" out of it
        # as LaTeX first when it holds any ('2\sqrt{2}' read bare is [2]: then \boxed{2} scored 1)
        is_latex = written != gold_text or _is_math_notation(gold_text)
        gold = parse(f"${written}$" if is_latex else gold_text)
        if not gold:
            gold = parse(f"${gold_text}$")
        if not gold:
            raise ValueError(f"math-verify cannot parse the answer field {gold_text[:80]!r}")
        boxed = last_boxed(item.response)
        if (
            boxed is not None
        ):  # a sentence's period inside the box: '\\boxed{42.}' read as no number
            boxed = boxed.strip().removesuffix(".")
        predicted = parse(
            f"\\boxed{{{positional(boxed)}}}"
            if boxed is not None
            else positional_in_text(item.response)
        )
        is_boxed = bool(boxed)  # an empty \\boxed{} is no answer
        if not predicted:
            return 0.0, is_boxed
        return float(verify(gold, predicted)), is_boxed

    def _gym(self, item: RewardItem) -> tuple[float, bool]:
        from reasoning_gym.utils import extract_answer

        answer_tag = extract_answer(item.response)
        extracted = answer_tag if answer_tag is not None else item.response.strip()
        dataset, entry = self._gym_entry(item)
        score = dataset.score_answer(extracted, entry)
        return _check_number(score, "the reasoning-gym scorer"), answer_tag is not None

    def _gym_entry(self, item: RewardItem) -> tuple[Any, dict[str, Any]]:
        coords = item.meta.get("reasoning_gym")
        if isinstance(coords, dict) and coords.get("task") == self.spec.arg:
            from tltrun.data.gym import create

            key = repr(sorted((k, repr(v)) for k, v in coords.items() if k != "index"))
            if key not in self._gym_datasets:
                self._gym_datasets[key] = create(
                    coords["task"],
                    seed=int(coords["seed"]),
                    num_rows=int(coords["size"]),
                    config=dict(coords.get("config") or {}),
                )
            dataset = self._gym_datasets[key]
            entry = dataset[int(coords["index"])]
            # The regenerated entry must be the row's; a mismatch means the row's coordinates
            # are not the ones it was generated from (or another hash seed made another problem
            # of them: tltrun.cli.main.PINNED_HASH_SEED), and the JSON copy is all there is.
            question = item.meta.get("question")
            is_same_question = question is None or str(entry.get("question")) == question
            is_same_answer = item.answer is None or str(entry.get("answer")) == item.answer
            if is_same_question and is_same_answer:
                return dataset, entry
        entry = {
            "question": item.meta.get("question", item.prompt),
            "answer": item.answer,
            "metadata": item.meta.get("metadata", {}),
        }
        return self._gym_default, entry

    def _python(self, item: RewardItem) -> tuple[float, bool]:
        assert self._user_function is not None
        meta = {k: v for k, v in item.meta.items() if k not in RESERVED_ARGS}
        value = self._user_function(item.prompt, item.response, item.answer, **meta)
        return _check_number(value, "the reward function"), True


def _check_number(value: Any, what: str) -> float:
    import numpy as np

    if isinstance(value, np.bool_):  # np.isclose(...) and the like: a bool counts as 0 or 1
        value = bool(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{what} returned {type(value).__name__}, expected a float")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{what} returned {out}, expected a finite float")
    return out


def score_one(scorer: Scorer, item: RewardItem) -> RewardOutcome:
    """One item scored in this process; an exception becomes a 0 with the error's line (and
    no format penalty: the failed reward judged no form, and "scores 0" is what README says)."""
    try:
        reward, is_format_ok = scorer.score(item)
    except Exception as err:  # a reward's failure is data, reported per sample
        return RewardOutcome(reward=0.0, error=one_line(err))
    return RewardOutcome(reward=reward, error=None, is_format_ok=is_format_ok)


def score_in_process(spec: RewardSpec, items: Sequence[RewardItem]) -> list[RewardOutcome]:
    """The same rewards without a pool or a timeout, in this process: for tests and for tools
    that score a handful of responses (``tltrun`` itself always uses a RewardPool)."""
    scorer = Scorer(spec)
    return [score_one(scorer, item) for item in items]


def _is_math_notation(text: str) -> bool:
    """Whether an answer field is read as LaTeX math (``$...$``) rather than as text: LaTeX
    marks (``\\``, ``^``, braces, ``_``) or an expression of numbers and one-letter variables
    ('2x+3'). A number with words ('18 dollars', '1.5 million') or spaced digits ('1 000') is
    text: as math its words were products of letters ('18*a*do*l*l*r*s', which nothing
    matched) and '1 000' was 1*0, which \\boxed{0} matched."""
    if re.search(r"[\\^{}_]", text):
        return True
    # words, or one number in groups of three ('1 000', '1,000.5'); a list ('2, 3') is math
    if re.search(r"[A-Za-z]{2}", text) or re.fullmatch(
        r"\d{1,3}(?:[ ,]\d{3})+(?:\.\d+)?", text.strip()
    ):
        return False
    return not _is_plain_number(text)


def _is_plain_number(text: str) -> bool:
    """'42', '-3.5', '1,000', '50%': what math-verify reads right bare (anything else, e.g.
    '2x+3' or '2\\sqrt{2}', it reads as its leading number unless given as LaTeX)."""
    return re.fullmatch(r"[-+]?[\d,]*\.?\d+%?", text.strip()) is not None
