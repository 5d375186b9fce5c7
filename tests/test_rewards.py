"""Rewards (tltrun.data.rewards, tltrun.data.scoring): each kind on right and wrong responses
(math-verify on ``\\boxed{3/4}`` vs ``0.75``, exact, regex, a reasoning-gym task, a user module
written here, the built-in task), --reward parsing errors as one line, the process pool (order
kept, a raising and a sleeping reward under the timeout scored 0 with the error and the pool
still working after, on_error="raise"), and DAPO's overlong shaping. CPU only.

Run: ``python -m pytest tests/test_rewards.py -q`` (~10 s: the pool tests spawn processes).
"""

from __future__ import annotations

import time

import pytest

import tltrun.data.rewards as rewards_module
from tltrun.data.dataset import DataSpec, load_rows
from tltrun.data.rewards import (
    RewardError,
    RewardItem,
    RewardOutcome,
    RewardPool,
    RewardSpec,
    Shaping,
    apply_shaping,
    parse_reward,
)
from tltrun.data.scoring import final_answer, last_boxed, normalize, score_in_process
from tltrun.train.tasks import TaskConfig, make_examples
from tltsim.errors import UsageError

USER_MODULE = '''
import os
import time

def contains(prompt, response, answer, **meta):
    """1 if the answer appears in the response; meta's weight scales it."""
    return float(answer in response) * meta.get("weight", 1.0)

def boom(prompt, response, answer, **meta):
    raise ValueError("boom on " + prompt)

def sleepy(prompt, response, answer, **meta):
    if response == "sleep":
        time.sleep(60)
    return 0.5

def not_a_float(prompt, response, answer, **meta):
    return "1.0"

def nan(prompt, response, answer, **meta):
    return float("nan")

def numpy_bool(prompt, response, answer, **meta):
    import numpy as np
    return np.isclose(float(response), float(answer))

def crash(prompt, response, answer, **meta):
    os._exit(7)

def interrupt(prompt, response, answer, **meta):
    raise KeyboardInterrupt("the function's own")

async def coroutine(prompt, response, answer, **meta):
    return 1.0

def generator(prompt, response, answer, **meta):
    yield 1.0
'''


def item(response: str, answer: str | None, sample_id: str = "s0", **meta) -> RewardItem:
    return RewardItem(sample_id=sample_id, prompt="q?", response=response, answer=answer, meta=meta)


def rewards(spec_text: str, pairs: list[tuple[str, str | None]]) -> list[float]:
    outcomes = score_in_process(parse_reward(spec_text), [item(r, a) for r, a in pairs])
    assert all(o.error is None for o in outcomes), outcomes
    return [o.reward for o in outcomes]


@pytest.fixture
def user_module(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_MODULE)
    return path


def test_math_reward_uses_math_verify():
    assert rewards(
        "math",
        [
            ("So the answer is \\boxed{3/4}.", "0.75"),
            ("So the answer is \\boxed{2/3}.", "0.75"),
            ("We get \\boxed{\\frac{1}{2}}", "0.5"),
            ("First \\boxed{5}, corrected: \\boxed{4}", "4"),  # the last box counts
            ("First \\boxed{4}, corrected: \\boxed{5}", "4"),
            ("48 + 24 = 72 clips in total.", "She sold 48/2 = 24 in May.\n#### 72"),  # GSM8K gold
            ("The final answer is 71", "#### 72"),
            ("no number here", "3"),
        ],
    ) == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    # scientific notation, which math-verify 0.9 reads without its exponent ("1e-05" as 1):
    # a float answer column stringified by str(), a CSV's text, a model's boxed answer
    assert rewards(
        "math",
        [
            ("\\boxed{0.00001}", "1e-05"),
            ("\\boxed{1}", "1e-05"),
            ("\\boxed{10000000000000000}", "1e+16"),
            ("\\boxed{1}", "1E+16"),
            ("\\boxed{2.5e-6}", "0.0000025"),
            ("\\boxed{2.5e-6}", "2.5"),
            ("\\boxed{3\\times 10^{400}}", "3e400"),
        ],
    ) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    # ... and in an unboxed response (it went to math-verify as written: "1e-05" read as 1)
    assert rewards(
        "math",
        [
            ("The answer is 1e-05", "1"),
            ("The answer is 1e-05", "0.00001"),
            ("The answer is 1e-05", "1e-05"),
            ("2.5e-06", "2.5"),
            ("The answer is 3e8.", "3"),
            ("The answer is 3e8.", "300000000"),
        ],
    ) == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_exact_and_regex_rewards():
    assert normalize("  Hello \n  World.. ") == "hello world"
    assert last_boxed("a \\boxed{x^{2}} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("unclosed \\boxed{x") is None
    assert final_answer("work\n\nParis.\n\n") == "Paris."
    assert rewards(
        "exact",
        [
            ("thinking...\nParis.", "paris"),
            ("The capital is \\boxed{ PARIS }, as\nwe know", "Paris"),
            ("Paris\nis my guess", "Paris"),  # the last line is what counts
            ("London", "Paris"),
        ],
    ) == [1.0, 1.0, 0.0, 0.0]
    assert rewards(
        r"regex:Answer:\s*(?P<answer>\w+)",
        [
            ("Answer: 3 ... no wait. Answer: 5", "5"),
            ("Answer: 3 ... no wait. Answer: 5", "3"),  # the last match counts
            ("I don't know", "3"),
        ],
    ) == [1.0, 0.0, 0.0]
    outcome = score_in_process(parse_reward("exact"), [item("x", None)])[0]
    assert outcome.reward == 0.0 and "needs an answer field" in outcome.error


def test_builtin_reward_is_the_tasks_reward():
    import random

    (example,) = make_examples(TaskConfig(), random.Random(0), num_prompts=1)
    answer = str(example.answer)
    wrong = str((example.answer + 1) % 10)
    right = example.solutions[0]
    assert rewards("builtin", [(right, answer), (right, wrong), ("garbage", answer)]) == [
        1.0,
        0.0,
        0.0,
    ]


def test_reasoning_gym_reward_uses_the_librarys_scorer():
    rows = load_rows(DataSpec(path="reasoning-gym:basic_arithmetic", num_rows=4, seed=3)).rows
    spec = parse_reward("reasoning-gym:basic_arithmetic")

    def items(template: str) -> list[RewardItem]:
        """One item per row, its response ``template`` with the row's answer filled in."""
        return [
            RewardItem(
                sample_id=r.prompt_id,
                prompt=r.prompt_text,
                response=template.format(answer=r.answer),
                answer=r.answer,
                meta=r.meta,
            )
            for r in rows
        ]

    right = items("Thinking.\n<answer>{answer}</answer>")
    bare = items(" {answer}\n")
    wrong = items("<answer>{answer}1</answer>")
    outcomes = score_in_process(spec, right + bare + wrong)
    assert [o.reward for o in outcomes[:8]] == [1.0] * 8
    assert all(o.reward < 1.0 for o in outcomes[8:])
    assert [o.is_format_ok for o in outcomes] == [True] * 4 + [False] * 4 + [True] * 4
    # Without the generation coordinates (a file with a question/answer column), the entry
    # is rebuilt from the row and scored the same way.
    stripped = [
        RewardItem(
            sample_id=i.sample_id, prompt=i.prompt, response=i.response, answer=i.answer, meta={}
        )
        for i in right + wrong
    ]
    assert [o.reward for o in score_in_process(spec, stripped)] == [
        o.reward for o in outcomes[:4] + outcomes[8:]
    ]
    # A regenerated entry with the row's answer but another question (another hash seed made
    # another problem of the coordinates) is not the row's: the row's own copy is scored.
    from tltrun.data.scoring import Scorer

    scorer, row = Scorer(spec), right[0]
    assert scorer._gym_entry(row)[1]["question"] == row.meta["question"]
    other = RewardItem(sample_id="s", prompt=row.prompt, response=row.response,
                       answer=row.answer, meta={**row.meta, "question": "What is 1 + 1?"})  # fmt: skip
    dataset, entry = scorer._gym_entry(other)
    assert entry["question"] == "What is 1 + 1?" and dataset is scorer._gym_default


def test_user_module_reward(user_module):
    spec = parse_reward(f"{user_module}:contains")
    assert spec == RewardSpec(kind="python", arg=f"{user_module.resolve()}:contains")
    outcomes = score_in_process(
        spec,
        [
            item("it is 42", "42"),
            item("it is 41", "42"),
            item("it is 42", "42", weight=0.5, answer_len=2),
        ],
    )
    assert [o.reward for o in outcomes] == [1.0, 0.0, 0.5]
    # A meta column named like an argument is not passed twice.
    assert score_in_process(spec, [item("42", "42", prompt="dup")])[0].reward == 1.0
    bad = score_in_process(
        parse_reward(f"{user_module}:not_a_float"), [item("x", "1")]
    ) + score_in_process(parse_reward(f"{user_module}:nan"), [item("x", "1")])
    assert [o.reward for o in bad] == [0.0, 0.0]
    assert bad[0].error == "TypeError: the reward function returned str, expected a float"
    assert bad[1].error == "ValueError: the reward function returned nan, expected a finite float"
    # numpy's bool (np.isclose and the like) counts as 0 or 1, as Python's does
    close = score_in_process(
        parse_reward(f"{user_module}:numpy_bool"), [item("1.0", "1"), item("2", "1")]
    )
    assert [(o.reward, o.error) for o in close] == [(1.0, None), (0.0, None)]


def test_bad_reward_flags_are_one_line(tmp_path, user_module, monkeypatch):
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    # a script-style reward parsing the command line at import (tltrun's, in the launcher)
    (tmp_path / "script.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--judge-url', "
        "required=True)\np.parse_args()\ndef f(p, r, a): return 1.0\n"
    )
    (tmp_path / "exits.py").write_text("import sys\nsys.exit('bye')\n")
    (tmp_path / "hangs.py").write_text("import time\ntime.sleep(10**6)\n")
    monkeypatch.setattr(rewards_module, "STARTUP_TIMEOUT_S", 5.0)
    cases = {
        "nonsense": "expected builtin, math, exact",
        "regex:no group": "expected a named group (?P<answer>...)",
        "regex:(": "not a regular expression",
        "reasoning-gym:basic_arithmetc": "unknown; ",
        f"{tmp_path}/missing.py:f": "no such file",
        f"{user_module}:nope": "has no function 'nope'",
        f"{tmp_path}/broken.py:f": "importing broken.py failed: ModuleNotFoundError",
        f"{tmp_path}/script.py:f": "SystemExit: 2 (it printed: ",
        f"{tmp_path}/exits.py:f": "importing exits.py failed: SystemExit: bye",
        f"{tmp_path}/hangs.py:f": "importing the module did not finish within 5 s",
    }
    for text, expected in cases.items():
        with pytest.raises(UsageError) as err:
            parse_reward(text)
        assert expected in str(err.value) and "\n" not in str(err.value), (text, str(err.value))
    with pytest.raises(UsageError, match=r"required: --judge-url\)$"):
        parse_reward(f"{tmp_path}/script.py:f")
    # a reasoning-gym --data without --reward implies its task's scorer: the error names --data
    with pytest.raises(UsageError, match=r"^--data reasoning-gym task 'basic_arithmetc': unknown"):
        parse_reward("reasoning-gym:basic_arithmetc", flag="--data")
    with pytest.raises(UsageError, match="--reward-timeout-s"):
        RewardPool(parse_reward("exact"), timeout_s=0)
    with pytest.raises(UsageError, match="--reward-errors"):
        RewardPool(parse_reward("exact"), on_error="ignore")


def test_pool_keeps_order_and_survives_raising_and_hanging_rewards(user_module):
    items = [item(f"it is {i}", str(i % 3), sample_id=f"s{i}") for i in range(7)]
    with RewardPool(parse_reward(f"{user_module}:contains"), num_processes=2) as pool:
        assert [o.reward for o in pool.score(items)] == [
            float(str(i % 3) in f"it is {i}") for i in range(7)
        ]
        assert pool.score([]) == []
    with RewardPool(parse_reward(f"{user_module}:boom"), num_processes=1) as pool:
        (outcome,) = pool.score([item("x", "1")])
        # a failed reward scores 0, format penalty or not (it was shaped to -penalty)
        assert outcome == RewardOutcome(reward=0.0, error="ValueError: boom on q?")
    with RewardPool(parse_reward(f"{user_module}:sleepy"), num_processes=2, timeout_s=1.0) as pool:
        start = time.monotonic()
        outcomes = pool.score([item("sleep", "1", "a"), item("ok", "1", "b"), item("ok", "1", "c")])
        elapsed = time.monotonic() - start
        assert [o.reward for o in outcomes] == [0.0, 0.5, 0.5]
        assert outcomes[0].error == "timeout after 1 s" and outcomes[1].error is None
        assert outcomes[0].is_format_ok  # a timeout is no format verdict either
        assert elapsed < 20, elapsed  # the hung call was killed, not waited for (60 s)
        # The hung process was replaced: the pool scores the next batch, hangs included.
        outcomes = pool.score([item("ok", "1"), item("sleep", "1"), item("ok", "1")])
        assert [o.error for o in outcomes] == [None, "timeout after 1 s", None]
        assert pool.num_errors == 2
    with RewardPool(parse_reward(f"{user_module}:crash"), num_processes=1) as pool:
        outcomes = pool.score([item("x", "1"), item("y", "1")])
        assert [o.error for o in outcomes] == ["reward process died (exit code 7)"] * 2
    # a process that dies idle between calls (the OOM killer) is replaced at the next call
    # (sending to it raised BrokenPipeError out of the run)
    with RewardPool(parse_reward(f"{user_module}:contains"), num_processes=1) as pool:
        assert [o.reward for o in pool.score([item("it is 4", "4")])] == [1.0]
        pool._slots[0].process.kill()
        pool._slots[0].process.join()
        outcomes = pool.score([item("it is 4", "4"), item("it is 5", "4")])
        assert [(o.reward, o.error) for o in outcomes] == [(1.0, None), (0.0, None)]


def test_pool_on_error_raise_names_the_sample(user_module):
    with RewardPool(parse_reward(f"{user_module}:sleepy"), timeout_s=1.0, on_error="raise") as pool:
        with pytest.raises(RewardError) as err:
            pool.score([item("ok", "1", "p0:0"), item("sleep", "1", "p3:1")])
        message = str(err.value)
        assert "sample p3:1: timeout after 1 s" in message and "\n" not in message
        assert [o.reward for o in pool.score([item("ok", "1")])] == [0.5]


def test_pool_with_math_and_reasoning_gym_in_processes():
    with RewardPool(parse_reward("math"), num_processes=2) as pool:
        outcomes = pool.score([item("\\boxed{3/4}", "0.75"), item("\\boxed{1/4}", "0.75")])
    assert [(o.reward, o.error) for o in outcomes] == [(1.0, None), (0.0, None)]
    rows = load_rows(DataSpec(path="reasoning-gym:chain_sum", num_rows=3, seed=5)).rows
    items = [item(f"<answer>{r.answer}</answer>", r.answer, r.prompt_id, **r.meta) for r in rows]
    items += [item("<answer>nonsense</answer>", r.answer, r.prompt_id, **r.meta) for r in rows]
    with RewardPool(parse_reward("reasoning-gym:chain_sum"), num_processes=2) as pool:
        outcomes = pool.score(items)
    assert [o.reward for o in outcomes[:3]] == [1.0] * 3
    assert all(o.reward < 1.0 and o.error is None for o in outcomes[3:])


def test_overlong_shaping_follows_dapo_eq_13():
    # L_max = 100, L_cache = 20: no penalty up to 80 tokens, linear to -1 at 100, -1 beyond.
    shaping = Shaping(overlong_buffer_tokens=20)

    def shaped(num_tokens: int, reward: float = 1.0, **kw) -> float:
        return apply_shaping(
            reward,
            num_response_tokens=num_tokens,
            max_response_tokens=100,
            shaping=kw.pop("s", shaping),
            **kw,
        )

    assert [shaped(n) for n in (10, 80, 85, 90, 100, 120)] == [1.0, 1.0, 0.75, 0.5, 0.0, 0.0]
    assert shaped(90, reward=0.0) == -0.5
    assert shaped(90, s=Shaping(overlong_buffer_tokens=20, overlong_penalty=0.5)) == 0.75
    # Off by default: the identity whatever the length or format.
    assert (
        apply_shaping(
            0.3,
            num_response_tokens=100,
            max_response_tokens=100,
            shaping=Shaping(),
            is_format_ok=False,
        )
        == 0.3
    )
    assert shaped(10, s=Shaping(format_penalty=0.2), is_format_ok=False) == 0.8
    with pytest.raises(UsageError, match="larger than the max response length"):
        apply_shaping(1.0, num_response_tokens=1, max_response_tokens=10, shaping=shaping)
    with pytest.raises(UsageError, match="--format-penalty"):
        Shaping(format_penalty=float("nan"))


def test_a_user_module_with_a_postponed_annotation_dataclass_imports(tmp_path):
    """The module ran without being in sys.modules, where dataclasses looks it up under
    'from __future__ import annotations': 'NoneType' object has no attribute '__dict__'."""
    from tltrun.data.scoring import load_user_function

    path = tmp_path / "dc_reward.py"
    path.write_text(
        "from __future__ import annotations\nfrom dataclasses import dataclass\n\n\n"
        "@dataclass\nclass Cfg:\n    weight: float = 2.0\n\n\n"
        "def score(prompt, response, answer, **meta):\n"
        "    return Cfg().weight * float(answer in response)\n"
    )
    assert load_user_function(f"{path}:score")("q", "it is 4", "4") == 2.0


def test_reward_processes_end_with_their_parent(tmp_path):
    """A rank stopped by SIGTERM or SIGKILL runs no close(): its busy reward processes stayed
    behind, re-parented, running (a hung one forever; found by a hygiene hunt)."""
    import os
    import signal
    import subprocess
    import sys

    (tmp_path / "hang.py").write_text(
        "import time\ndef hang(prompt, response, answer, **meta):\n    time.sleep(600)\n"
    )
    script = f"""
import sys, time
from tltrun.data.rewards import RewardPool, parse_reward
from tltrun.data.scoring import RewardItem
pool = RewardPool(parse_reward("{tmp_path}/hang.py:hang", is_module_checked=False),
                  num_processes=2, timeout_s=600)
print(*(s.process.pid for s in pool._slots), flush=True)
pool.score([RewardItem(sample_id="a", prompt="p", response="r", answer="1", meta={{}})])
"""
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    pids = [int(p) for p in parent.stdout.readline().split()]
    time.sleep(3)  # both started, one busy with the hung call
    assert all(_alive(pid) for pid in pids)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its new parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_failed_reward_scores_0_unshaped():
    """Hunt: the overlong term was added to a reward that raised (README: it scores 0), so a
    long response whose reward failed trained as -1."""
    from types import SimpleNamespace

    from tltrun.data.scoring import RewardOutcome
    from tltrun.rollout.interface import Request, RequestOutput
    from tltrun.train.responses import ResponseScorer

    class Pool:  # the failed one first, then a reward of 1
        def score(self, items):
            return [RewardOutcome(reward=0.0, error="ValueError: bad"), RewardOutcome(reward=1.0)]

    row = SimpleNamespace(prompt="p", prompt_text="p", answer="1", meta={}, source="d.jsonl:0")
    tok = SimpleNamespace(
        decode=lambda ids: "x" * len(ids), prompt_text=str, is_chat_template=False
    )
    scorer = ResponseScorer(SimpleNamespace(max_new_tokens=8), tok, Pool(),
                            Shaping(overlong_buffer_tokens=4))  # fmt: skip
    requests = [Request(f"g/{i}", (1, 2), 8) for i in range(2)]
    outputs = [RequestOutput(id=r.id, prompt_token_ids=(1, 2), output_token_ids=[5] * n,
                             finish="stop") for r, n in zip(requests, (8, 6), strict=True)]  # fmt: skip
    _, scored = scorer.score(0, requests, outputs, {"g": row})
    # failed: 0, not 0 + the overlong -1; the other: 1 + (4 - 6) / 4
    assert [(shaped, raw) for shaped, raw, _ in scored] == [(0.0, 0.0), (0.5, 1.0)]


def test_a_user_functions_own_base_exception_is_said_per_sample(user_module):
    """Hunt: a reward function raising KeyboardInterrupt (or its own BaseException) was
    "reward process died (exit code 1)", the exception unsaid."""
    with RewardPool(parse_reward(f"{user_module}:interrupt"), timeout_s=30.0) as pool:
        [outcome] = pool.score([item("r", "1")])
    assert outcome.reward == 0.0 and "KeyboardInterrupt: the function's own" in outcome.error


@pytest.mark.parametrize(
    ("name", "kind"), [("coroutine", "an async"), ("generator", "a generator")]
)
def test_async_and_generator_reward_functions_are_refused_at_launch(user_module, name, kind):
    """Hunt: they passed the launch check and failed on every call ("returned coroutine")."""
    with pytest.raises(UsageError, match=f"{name}: {kind} function; the reward is a plain"):
        parse_reward(f"{user_module}:{name}")


def test_a_reasoning_gym_scorer_of_another_task_is_refused():
    """Hunt: --reward reasoning-gym:tower_of_hanoi on basic_arithmetic rows failed on every
    row (KeyError), and an --eval-data of another task than --data's was scored by the generic
    compare; both unsaid."""
    from tltrun.train.config import TrainConfig
    from tltrun.train.prompts import reward_spec

    def spec(**fields):
        return reward_spec(TrainConfig(model_dir="m", out="o", **fields))

    assert spec(data="reasoning-gym:chain_sum").arg == "chain_sum"
    with pytest.raises(UsageError, match=r"--data reasoning-gym:chain_sum: another reasoning-gym "
                       r"task than the run's reward scores \('tower_of_hanoi', --reward"):  # fmt: skip
        spec(data="reasoning-gym:chain_sum", reward="reasoning-gym:tower_of_hanoi")
    with pytest.raises(UsageError, match=r"--eval-data reasoning-gym:tower_of_hanoi: another"):
        spec(data="reasoning-gym:chain_sum", eval_data="reasoning-gym:tower_of_hanoi", eval_every=1)
