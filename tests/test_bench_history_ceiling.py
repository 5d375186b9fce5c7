"""benchmarks/bench_history.py's ceiling of point-mass history drafts on realized rollouts."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_history.py"
_SPEC = importlib.util.spec_from_file_location("bench_history", _PATH)
bench_history = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_history"] = bench_history
_SPEC.loader.exec_module(bench_history)
ceiling = bench_history.point_mass_ceiling


def test_a_response_that_repeats_its_prompt_is_drafted_in_full_chains():
    # [2, 3] first occurs in the prompt with 6 tokens after it (then the prompt ends): 6 + the
    # bonus; from then on the output itself holds 8 tokens of continuation: 8 + the bonus
    accepts = ceiling([1, 2, 3] * 3, [[1, 2, 3] * 10], max_draft_tokens=8)
    assert accepts == [7, 9, 9, 5]


def test_tokens_never_seen_before_are_never_drafted():
    accepts = ceiling([1, 2], [list(range(10, 40))])
    assert accepts == [1] * 30


def test_a_finished_sibling_is_copied_but_a_running_one_only_up_to_where_it_is():
    unique = list(range(200, 225))
    shared = list(range(100, 120))
    own = unique + shared
    finished = ceiling([1], [own, shared], max_draft_tokens=4)  # the sibling stops at 20
    # unique tokens, then shared[0] and shared[1] before [shared0, shared1] matches the
    # sibling, whose 18 further tokens come 4 per draft + the bonus
    assert finished[:31] == [1] * 27 + [5, 5, 5, 3]  # own's 31 iterations, then the sibling's
    assert ceiling([1], [own]) == [1] * len(own)
    # an identical sibling in lockstep is never ahead: it offers nothing
    assert ceiling([1], [own, own])[: len(own)] == [1] * len(own)


def test_the_ceiling_bounds_what_the_history_drafter_proposes():
    """HistoryDrafter's own chain, replayed on the same rollouts, never beats the ceiling."""
    rng = random.Random(0)
    words = [[rng.randrange(50) for _ in range(rng.randrange(2, 6))] for _ in range(8)]
    prompt = [rng.randrange(50) for _ in range(12)]
    group = [sum((rng.choice(words) for _ in range(12)), []) for _ in range(4)]
    bound = ceiling(prompt, group, max_draft_tokens=6)
    drafter = bench_history.HistoryDrafter(bench_history.HistoryConfig())
    chain = []
    for k, resp in enumerate(group):  # own index only (the siblings add to the ceiling)
        drafter.add(("own", k), ("g", k), prompt)
        t = 0
        while t < len(resp):
            proposal = drafter.propose(("own", k), 6)
            a = 0
            while a < len(proposal) and t + a < len(resp) and proposal[a] == resp[t + a]:
                a += 1
            step = min(a + 1, len(resp) - t)
            chain.append(step)
            drafter.extend(("own", k), resp[t : t + step])
            t += step
    assert sum(chain) == sum(bound) == sum(len(r) for r in group)
    assert len(chain) >= len(bound)  # fewer iterations: a longer mean accept length
