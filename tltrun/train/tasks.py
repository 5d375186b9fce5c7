"""The built-in verifiable reasoning task: chained modular arithmetic with worked solutions
whose lengths are long-tailed per prompt and vary per sample.

A problem is a start value and a chain of labelled operations, applied left to right modulo
``modulus``::

    prompt:   "7 a+5 b*3 c-4\\n"
    solution: "a+5: 7+5=2\\nb*3: 2*3=6\\nc-4: 6-4=2\\nanswer: 2\\n"

Each line of the worked solution first copies the labelled operation from the prompt (``b*3``:
after the label, the next characters are exactly the ones that follow it in the prompt, a
lookup a two-layer transformer learns as an induction head), then writes the step with its
result. Two optional detours make samples of one prompt differ in length, as reasoning models'
samples do:

* a ``check`` line after a step, re-deriving the step's input with the inverse operation
  (``  check 2-5=7 ok``); each sample draws its own check probability, so some samples are
  terse and some check nearly every step;
* ``recheck`` passes: the whole chain is worked again before the answer (geometric count).

Difficulty (the chain length) is drawn per prompt from a log-normal distribution, so a batch's
longest solution is 10-25x its median: the long tail of RL rollouts that TLT targets.

The reward is 1.0 iff the last non-empty line of the response is ``answer: N`` with N the exact
answer, else 0.0 (malformed or truncated responses get 0).

Run ``tltrun task --num-prompts 4 --seed 0`` to print sample problems and the length statistics
of a batch of reference solutions.
"""

from __future__ import annotations

import math
import random
import re
import statistics
import string
from dataclasses import dataclass, field

# One label character per operation; the alphabet size is the structural cap on chain length.
LABELS = string.ascii_lowercase + string.ascii_uppercase
OPS = "+-*"
_ANSWER_RE = re.compile(r"^answer:\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class TaskConfig:
    """Shape of the task's problem distribution. Lengths are in characters (= tokens of the
    character tokenizer, tltrun.model.tokenizer)."""

    # Chain length is log-normal: median_ops * exp(sigma_ops * z), rounded, clipped to
    # [1, max_ops]. sigma 1.0 is the log-std of DeepSeek-R1 output lengths measured in
    # production (ServeGen, /work/shared/traces: std of ln(output_tokens) = 1.02). The median
    # of 4 operations keeps a typical worked solution at tens of characters, which a CPU can
    # train and roll out in minutes (step line: 11 characters).
    median_ops: float = field(
        default=4.0, metadata={"help": "median number of operations in a problem's chain"}
    )
    sigma_ops: float = field(default=1.0, metadata={"help": "log std. dev. of the chain length"})
    max_ops: int = field(default=len(LABELS), metadata={"help": "longest chain (one label per op)"})
    # single-digit arithmetic: 3 ops x 10 x 10 facts a small model can learn
    modulus: int = field(default=10, metadata={"help": "arithmetic modulo N, in [2, 10]"})
    # Per-sample detours, calibrated to published RL traces: a prompt's samples differ by ~2x
    # at the median prompt and 5-20x at the worst; a step's longest response is 10-25x its
    # median (/work/shared/traces/README.md notes). A sample's check probability is uniform on
    # [0, max_check_prob] (a check line is 17 chars, a step line 11); recheck passes (geometric
    # with recheck_prob, at most max_rechecks) multiply the chain by up to 1 + max_rechecks.
    # Measured over 30 steps of 32 prompts x 8 samples (``tltrun task``): per-prompt
    # longest/shortest median ~2.2x, worst ~4.5x (up to 7x); step max/median median ~11x.
    max_check_prob: float = field(
        default=0.5,
        metadata={"help": "a sample checks each step with a probability uniform in [0, X]"},
    )
    recheck_prob: float = field(
        default=0.1, metadata={"help": "probability of one more pass over the whole chain"}
    )
    max_rechecks: int = field(default=3, metadata={"help": "recheck passes per sample at most"})

    def __post_init__(self) -> None:
        if not self.median_ops >= 1:
            raise ValueError(f"median_ops must be >= 1, got {self.median_ops}")
        if not self.sigma_ops >= 0:
            raise ValueError(f"sigma_ops must be >= 0, got {self.sigma_ops}")
        if not 1 <= self.max_ops <= len(LABELS):
            raise ValueError(
                f"max_ops must be in [1, {len(LABELS)}] (one label per op), got {self.max_ops}"
            )
        if not 2 <= self.modulus <= 10:
            raise ValueError(
                f"modulus must be in [2, 10] (single-digit values), got {self.modulus}"
            )
        if not 0 <= self.max_check_prob <= 1:
            raise ValueError(f"max_check_prob must be in [0, 1], got {self.max_check_prob}")
        if not 0 <= self.recheck_prob < 1:
            raise ValueError(f"recheck_prob must be in [0, 1), got {self.recheck_prob}")
        if self.max_rechecks < 0:
            raise ValueError(f"max_rechecks must be >= 0, got {self.max_rechecks}")

    @property
    def max_prompt_chars(self) -> int:
        """Upper bound on a prompt's length: start digit + 4 chars per op + newline."""
        return 1 + 4 * self.max_ops + 1

    @property
    def max_response_chars(self) -> int:
        """Upper bound on a reference solution's length over all problems."""
        return self.max_response_chars_for(self.max_ops)

    def max_response_chars_for(self, num_ops: int) -> int:
        """Upper bound on the length of a reference solution to a problem of ``num_ops``
        operations (every step checked, every recheck pass taken): a longer response can
        no longer be a well-formed solution."""
        step_chars = len("a+0: 0+0=0\n") + len("  check 0-0=0 ok\n")
        chain_chars = step_chars * num_ops
        return (
            chain_chars + self.max_rechecks * (len("recheck\n") + chain_chars) + len("answer: 0\n")
        )


@dataclass(frozen=True)
class Problem:
    """One prompt of the task. ``ops[i]`` is (operator, operand), labelled ``LABELS[i]``."""

    start: int
    ops: tuple[tuple[str, int], ...]
    modulus: int

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def prompt(self) -> str:
        return (
            f"{self.start} "
            + " ".join(f"{LABELS[i]}{op}{x}" for i, (op, x) in enumerate(self.ops))
            + "\n"
        )

    def values(self) -> list[int]:
        """Running values: values[0] = start, values[i + 1] = after op i."""
        out = [self.start]
        for op, x in self.ops:
            out.append(apply_op(out[-1], op, x, self.modulus))
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]


@dataclass(frozen=True)
class Example:
    """A problem with sampled reference solutions (each ends with the answer line)."""

    problem: Problem
    solutions: tuple[str, ...]

    @property
    def prompt(self) -> str:
        return self.problem.prompt

    @property
    def answer(self) -> int:
        return self.problem.answer


def apply_op(a: int, op: str, x: int, modulus: int) -> int:
    if op == "+":
        return (a + x) % modulus
    if op == "-":
        return (a - x) % modulus
    if op == "*":
        return (a * x) % modulus
    raise ValueError(f"unknown operator {op!r}")


def sample_num_ops(cfg: TaskConfig, rng: random.Random) -> int:
    n = round(cfg.median_ops * math.exp(cfg.sigma_ops * rng.gauss(0.0, 1.0)))
    return min(cfg.max_ops, max(1, n))


def sample_problem(cfg: TaskConfig, rng: random.Random) -> Problem:
    num_ops = sample_num_ops(cfg, rng)
    ops = tuple((rng.choice(OPS), rng.randrange(cfg.modulus)) for _ in range(num_ops))
    return Problem(start=rng.randrange(cfg.modulus), ops=ops, modulus=cfg.modulus)


def _check_line(a: int, op: str, x: int, result: int, modulus: int) -> str:
    """Re-derive the step's input from its result with the inverse operation (multiplication
    has no inverse mod 10 in general, so it is checked by commuting the factors)."""
    if op == "+":
        return f"  check {result}-{x}={apply_op(result, '-', x, modulus)} ok\n"
    if op == "-":
        return f"  check {result}+{x}={apply_op(result, '+', x, modulus)} ok\n"
    return f"  check {x}*{a}={result} ok\n"


def _chain(problem: Problem, check_prob: float, rng: random.Random) -> str:
    values = problem.values()
    lines = []
    for i, (op, x) in enumerate(problem.ops):
        a, result = values[i], values[i + 1]
        lines.append(f"{LABELS[i]}{op}{x}: {a}{op}{x}={result}\n")
        if rng.random() < check_prob:
            lines.append(_check_line(a, op, x, result, problem.modulus))
    return "".join(lines)


def worked_solution(problem: Problem, cfg: TaskConfig, rng: random.Random) -> str:
    """One reference solution; its detours (checks, recheck passes) are drawn from ``rng``."""
    check_prob = rng.uniform(0.0, cfg.max_check_prob)
    num_rechecks = 0
    while num_rechecks < cfg.max_rechecks and rng.random() < cfg.recheck_prob:
        num_rechecks += 1
    parts = [_chain(problem, check_prob, rng)]
    for _ in range(num_rechecks):
        parts.append("recheck\n" + _chain(problem, check_prob, rng))
    parts.append(f"answer: {problem.answer}\n")
    return "".join(parts)


def make_examples(
    cfg: TaskConfig, rng: random.Random, num_prompts: int, num_solutions: int = 1
) -> list[Example]:
    """``num_prompts`` problems, each with ``num_solutions`` independently drawn solutions."""
    out = []
    for _ in range(num_prompts):
        problem = sample_problem(cfg, rng)
        solutions = tuple(worked_solution(problem, cfg, rng) for _ in range(num_solutions))
        out.append(Example(problem, solutions))
    return out


def parse_problem(prompt: str, modulus: int = 10) -> Problem:
    """Inverse of ``Problem.prompt``; raises ValueError naming what is wrong."""
    tokens = prompt.strip().split(" ")
    if not tokens[0].isdigit():
        raise ValueError(f"prompt must start with the start value, got {tokens[0]!r}")
    ops = []
    for i, tok in enumerate(tokens[1:]):
        if len(tok) != 3 or tok[0] != LABELS[i] or tok[1] not in OPS or not tok[2].isdigit():
            raise ValueError(f"operation {i} must look like {LABELS[i]}+5, got {tok!r}")
        ops.append((tok[1], int(tok[2])))
    return Problem(start=int(tokens[0]), ops=tuple(ops), modulus=modulus)


def parse_answer(response: str) -> int | None:
    """The integer on the response's last non-empty line if that line is ``answer: N``."""
    lines = [line for line in response.splitlines() if line.strip()]
    if not lines:
        return None
    match = _ANSWER_RE.match(lines[-1].strip())
    return int(match.group(1)) if match else None


def reward(response: str, answer: int) -> float:
    """1.0 iff the response's final line states exactly ``answer``; malformed -> 0.0."""
    return 1.0 if parse_answer(response) == answer else 0.0


def length_stats(lengths: list[int]) -> dict[str, float]:
    """Median, p99, max and max/median of a list of lengths (the long-tail summary)."""
    ordered = sorted(lengths)
    median = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "num": len(ordered),
        "median": median,
        "p99": p99,
        "max": ordered[-1],
        "max_over_median": ordered[-1] / median if median else math.inf,
    }
