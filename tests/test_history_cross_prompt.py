"""History drafter's cross-prompt tier (issue #20, ``HistoryConfig.is_cross_prompt``): other
prompts' sequences draft where the prompt's own group has a shorter match; the group's own
statistics win ties; against a reference built from two plain indexes (the group's, and one
that holds every sequence); the shared index's generations (the oldest dropped whole, its
running sequences indexed anew, the size bounded).

Run: ``python -m pytest tests/test_history_cross_prompt.py -q``.
"""

from __future__ import annotations

import random

import pytest

from tltrun.model.history_drafter import HistoryConfig, HistoryDrafter, usable_match

ONE_GROUP = "all"  # the reference's single group: every sequence is history for every other


def test_another_prompts_sequence_drafts_where_the_group_has_nothing():
    history = HistoryDrafter(HistoryConfig(ngram_min=2, ngram_max=4))
    history.add("a", "g", [1, 2, 3, 40, 41, 42, 43, 44])
    history.add("c", "other", [7, 2, 3, 40])
    assert history.propose("c", 3) == [41, 42, 43]
    off = HistoryDrafter(HistoryConfig(ngram_min=2, ngram_max=4, is_cross_prompt=False))
    off.add("a", "g", [1, 2, 3, 40, 41, 42, 43, 44])
    off.add("c", "other", [7, 2, 3, 40])
    assert off.propose("c", 3) == [] and not off.shared


def test_the_groups_own_statistics_win_a_tie_and_a_longer_shared_match_wins():
    history = HistoryDrafter(HistoryConfig(ngram_min=2, ngram_max=3))
    # another prompt continues [5, 6] with 9 three times, the own group once with 1
    for i in range(3):
        history.add(("x", i), "other", [5, 6, 9])
    history.add("sib", "g", [5, 6, 1])
    history.add("q", "g", [8, 5, 6])
    # both indexes match [5, 6] (2 tokens; [8, 5, 6] is only the own tail): the group's 1
    assert history.propose("q", 1) == [1]
    # [4, 5, 6] occurs only in the other group: 3 tokens against 2, so its continuation
    history.add(("x", 3), "other", [4, 5, 6, 7])
    history.add("r", "g", [4, 5, 6])
    assert history.propose("r", 1) == [7]


def _reference(group_only: HistoryDrafter, everything: HistoryDrafter, key, num_tokens: int):
    """What the cross-prompt rule drafts, from two plain indexes: the group's unless the index
    of every sequence matches a strictly longer context."""
    cfg = group_only.config
    context = group_only.tokens(key)[-cfg.ngram_max :]
    own = usable_match(group_only.automata[group_only.sequences[key].group], context, cfg.ngram_min)
    shared = usable_match(everything.automata[ONE_GROUP], context, cfg.ngram_min)
    sam, state, _ = shared if shared[2] > own[2] else own
    return sam.continuation(state, num_tokens) if state >= 0 else []


@pytest.mark.parametrize("seed", range(6))
def test_cross_prompt_drafts_equal_the_two_index_reference(seed):
    """Sequences of three prompt groups grown in random interleaving (small alphabet: many
    repeats across groups), one shared generation: every proposal equals the reference."""
    rng = random.Random(seed)
    cfg = dict(ngram_min=2, ngram_max=4, max_draft_tokens=6)
    drafter = HistoryDrafter(HistoryConfig(**cfg))
    group_only = HistoryDrafter(HistoryConfig(**cfg, is_cross_prompt=False))
    everything = HistoryDrafter(HistoryConfig(**cfg, is_cross_prompt=False))
    targets = {}
    for key in range(9):
        prompt = [rng.randrange(4) for _ in range(rng.randint(1, 4))]
        group = key % 3
        drafter.add(key, group, prompt)
        group_only.add(key, group, prompt)
        everything.add(key, ONE_GROUP, prompt)
        targets[key] = [rng.randrange(4) for _ in range(rng.randint(5, 30))]
    num_checked = num_from_other_prompts = 0
    while any(targets.values()):
        key = rng.choice([k for k, t in targets.items() if t])
        tok = targets[key].pop(0)
        for d in (drafter, group_only, everything):
            d.extend(key, [tok])
        for d in (1, 6):
            want = _reference(group_only, everything, key, d)
            assert drafter.propose(key, d) == want
            num_checked += bool(want)
            num_from_other_prompts += want != group_only.propose(key, d)
        tree = drafter.propose_tree(key, 6, 3)  # its first branch is the chain
        assert tree[:1] == ([want] if want else [])
    assert num_checked > 50  # the comparison saw real drafts ...
    assert num_from_other_prompts > 5  # ... and drafts the prompt's group alone would not make


def test_generations_drop_the_oldest_whole_and_keep_running_sequences():
    history = HistoryDrafter(HistoryConfig(ngram_min=2, ngram_max=3, max_shared_tokens=20))
    history.add("run", "g1", [3, 4, 60, 61, 62, 63, 64])  # generation 0: 7 tokens
    history.add("old", "g2", [1, 2, 50, 51, 52, 53, 54, 55, 56, 57])  # 7 < 10: generation 0
    history.finish("old")
    history.add("mid", "g3", [5, 6, 70, 71, 72, 73])  # 17 >= 10: generation 1
    history.finish("mid")
    history.add("late", "g4", [5, 6, 80, 81, 82])  # 6 < 10: generation 1
    history.add("late2", "g5", [8, 8])  # 11 >= 10: generation 2, and 0 is dropped
    assert sorted(history.shared) == [1, 2]
    assert history.sequences["old"].shared is None  # finished: gone with its generation
    assert history.sequences["run"].shared[0] == 2  # running: indexed anew in the new one
    history.add("q", "g6", [9, 1, 2])  # 9 < 10: generation 2
    assert history.propose("q", 2) == []  # "old" is no longer shared history
    history.extend("run", [65, 66])  # the running sequence still grows in the shared index
    history.add("q2", "g7", [64, 65])  # 14 >= 10: generation 3, 1 dropped ("late" moves)
    assert history.propose("q2", 1) == [66]
    assert sorted(history.shared) == [2, 3] and history.sequences["late"].shared[0] == 3
    # generation 2: run (9 tokens), late2, q (5); 3: late (5), q2 (2)
    assert history.num_shared_tokens == 9 + 5 + 5 + 2


def test_shared_size_stays_bounded_over_many_sequences():
    cap = 200
    history = HistoryDrafter(HistoryConfig(max_shared_tokens=cap, max_history_tokens=10**6))
    rng = random.Random(0)
    for i in range(300):
        history.add(i, i % 7, [rng.randrange(50) for _ in range(rng.randint(1, 20))])
        history.finish(i)
        # two generations: a full older one (< cap / 2 + one sequence) and the newer one
        assert history.num_shared_tokens < cap + 2 * 20
    assert len(history.shared) == 2


def test_the_newer_generation_wins_a_tie():
    history = HistoryDrafter(HistoryConfig(ngram_min=2, ngram_max=3, max_shared_tokens=10))
    history.add("a", "g1", [1, 2, 30])  # generation 0
    history.add("pad", "g2", [9, 9, 9])  # generation 0: 6 tokens
    history.add("b", "g3", [1, 2, 40])  # 6 >= 5: generation 1
    history.add("q", "g4", [5, 1, 2])  # [1, 2] matches in both: the recent continuation
    assert sorted(history.shared) == [0, 1]
    assert history.propose("q", 1) == [40]
