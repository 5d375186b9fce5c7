"""History drafter (issue #20): the suffix automaton against brute force and against a
from-scratch build, proposals from the own prompt, siblings and earlier rollouts, eviction, the
n-gram fallback; a point-mass draft verifies exactly; the policy side (SpecDecision.drafter,
TLTBase, TLTAdaptive's drafter arms). Lossless decoding through the engine with no EAGLE
drafter, and the measured traces of such rollouts: tests/test_history_engine.py.

Run: ``python -m pytest tests/test_history_drafter.py -q``.
"""

from __future__ import annotations

import random

import pytest
import torch

from tltrun.model.history_drafter import HistoryConfig, HistoryDrafter, tree_nodes
from tltrun.model.suffix_automaton import SuffixAutomaton
from tltrun.rollout.speculative import DraftTree, verify_with_uniforms
from tltsim.policy import (
    DecodeObs,
    SpecDecision,
    SpecFeedback,
    StaticSpec,
    TLTAdaptive,
    TLTBase,
    TLTConfig,
    make_policy,
    to_vllm_dynamic_table,
)

# ---- the suffix automaton ---------------------------------------------------------------------


def _occurs(strings: list[list[int]], pattern: list[int]) -> bool:
    n = len(pattern)
    return any(s[i : i + n] == pattern for s in strings for i in range(len(s) - n + 1))


def _canonical(sam: SuffixAutomaton) -> set[tuple]:
    """The automaton as (path label of a state, its length, its link's path label, its
    transitions' tokens), states named by their shortest path from the root: equal sets mean
    isomorphic automata."""
    label = {0: ()}
    order = [0]
    for state in order:  # BFS: shortest labels first, tokens in sorted order
        for tok in sorted(sam.trans[state]):
            nxt = sam.trans[state][tok]
            if nxt not in label:
                label[nxt] = label[state] + (tok,)
                order.append(nxt)
    assert len(label) == sam.num_states  # every state reachable
    return {
        (
            label[s],
            sam.length[s],
            label.get(sam.link[s]),
            tuple(sorted(sam.trans[s])),
        )
        for s in order
    }


def _random_strings(seed: int, num: int, alphabet: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(alphabet) for _ in range(rng.randint(0, max_len))] for _ in range(num)]


@pytest.mark.parametrize("seed", range(6))
def test_interleaved_incremental_build_equals_a_from_scratch_build(seed):
    strings = _random_strings(seed, num=4, alphabet=3, max_len=30)
    scratch = SuffixAutomaton()
    for s in strings:
        scratch.add_string(s)
    inc = _interleaved(strings, seed)  # the same strings, interleaved at random
    assert inc.strings == strings
    assert inc.num_tokens == scratch.num_tokens == sum(map(len, strings))
    assert inc.num_states == scratch.num_states
    assert _canonical(inc) == _canonical(scratch)


def _interleaved(
    strings: list[list[int]], seed: int, count_depth: int | None = None
) -> SuffixAutomaton:
    """``strings`` grown a few tokens at a time, interleaved at random."""
    rng = random.Random(100 + seed)
    sam = SuffixAutomaton(count_depth)
    sids = [sam.add_string() for _ in strings]
    done = [0] * len(strings)
    while any(d < len(s) for d, s in zip(done, strings, strict=True)):
        i = rng.choice([i for i, s in enumerate(strings) if done[i] < len(s)])
        step = rng.randint(1, 4)
        sam.extend(sids[i], strings[i][done[i] : done[i] + step])
        done[i] += step
    return sam


def _num_occurrences(strings: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(s[i : i + n] == pattern for s in strings for i in range(len(s) - n + 1))


def _repetitive_strings(seed: int) -> list[list[int]]:
    """Strings that loop on a short cycle (RL's degenerate long-tail responses) beside random
    ones: long suffix-link paths, and clones that split the states a window points at."""
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        cycle = [rng.randrange(3) for _ in range(rng.randint(1, 3))]
        head = [rng.randrange(3) for _ in range(rng.randint(0, 5))]
        out.append(head + cycle * rng.randint(3, 12))
    return out


@pytest.mark.parametrize("count_depth", [None, 3])
@pytest.mark.parametrize("seed", range(6))
def test_counts_and_best_transitions_against_brute_force(seed, count_depth):
    """Built incrementally (interleaved) or in one pass (``from_strings``, a rebuild's way):
    every occurring context's state counts its occurrences, and every state's best transition
    leads to the most frequent next token, the token after its first end on a tie. With a
    ``count_depth`` D, exactly so for contexts of at most D + 1 tokens, and best transitions
    of states holding a context of at most D tokens (what a draft reads); then a few more
    interleaved tokens, on the rebuilt automaton too, keep it so."""
    depth = 10**9 if count_depth is None else count_depth
    strings = _random_strings(seed, num=4, alphabet=3, max_len=30) + _repetitive_strings(seed)
    rng = random.Random(seed)
    rebuilt = SuffixAutomaton.from_strings(strings, count_depth)
    more = [[rng.randrange(3) for _ in range(rng.randint(1, 9))] for _ in strings]
    for sid, tokens in enumerate(more):
        rebuilt.extend(sid, tokens)
    grown = [s + m for s, m in zip(strings, more, strict=True)]
    for sam, want in (
        (_interleaved(strings, seed, count_depth), strings),
        (SuffixAutomaton.from_strings(strings, count_depth), strings),
        (rebuilt, grown),
    ):
        assert sam.num_tokens == sum(map(len, want))
        for _ in range(300):
            context = [rng.randrange(3) for _ in range(rng.randint(1, min(8, depth + 1)))]
            state, matched = sam.match(context)
            if matched == len(context):
                assert sam.count[state] == _num_occurrences(want, context)
            else:
                assert _num_occurrences(want, context) == 0
        for sid, string in enumerate(want):  # where the next update's walk starts
            m = min(depth, len(string))
            assert sam.window_state(sid) == (sam.match(string[-m:] if m else [])[0], m)
        for u in range(sam.num_states):
            trans = sam.trans[u]
            if u and sam.length[sam.link[u]] + 1 > depth:  # its shortest context is longer
                continue
            if not trans:
                assert sam.best[u] is None
                continue
            top = max(sam.count[v] for v in trans.values())
            assert sam.count[trans[sam.best[u]]] == top
            sid, pos = sam.first_end[u]
            first = want[sid][pos + 1] if sid >= 0 and pos + 1 < len(want[sid]) else None
            if first is not None and sam.count[trans[first]] == top:
                assert sam.best[u] == first


@pytest.mark.parametrize("seed", range(4))
def test_a_bounded_index_drafts_what_an_unbounded_one_drafts(seed):
    """``max_draft_tokens`` bounds the statistics kept (and the work per indexed token), never
    the drafts up to that length: chains and trees equal an exact index's."""
    rng = random.Random(seed)
    strings = _random_strings(seed, num=3, alphabet=3, max_len=40) + _repetitive_strings(seed)
    bounded = HistoryDrafter(HistoryConfig(ngram_min=1, ngram_max=3, max_draft_tokens=4))
    exact = HistoryDrafter(HistoryConfig(ngram_min=1, ngram_max=3, max_draft_tokens=10**6))
    for i, s in enumerate(strings):
        for drafter in (bounded, exact):
            drafter.add(i, "g", s[:1])
    for _ in range(sum(map(len, strings))):
        i = rng.randrange(len(strings))
        n = len(bounded.tokens(i))
        if n == len(strings[i]):
            continue
        for drafter in (bounded, exact):
            drafter.extend(i, [strings[i][n]])
        for d in (1, 4):
            assert bounded.propose(i, d) == exact.propose(i, d)
        assert bounded.propose_tree(i, 4, 3) == exact.propose_tree(i, 4, 3)
    assert bounded.propose(0, 10) == exact.propose(0, 4)  # clamped to max_draft_tokens


def test_a_draft_follows_the_continuation_most_occurrences_agree_on():
    drafter = HistoryDrafter(HistoryConfig(ngram_min=2))
    # [5, 6] is followed by 1 first, then by 2 twice: the draft takes 2, and after [6, 2] the
    # 3 that both occurrences share
    drafter.add("a", "g", [5, 6, 1, 9, 5, 6, 2, 3, 8, 5, 6, 2, 3, 7])
    drafter.add("b", "g", [4, 5, 6])
    assert drafter.propose("b", 2) == [2, 3]
    tree = drafter.propose_tree("b", 2, max_branches=2)
    assert tree[0] == [2, 3] and tree[1][0] == 1


@pytest.mark.parametrize("seed", range(4))
def test_match_and_first_end_against_brute_force(seed):
    strings = _random_strings(seed, num=3, alphabet=3, max_len=25)
    sam = SuffixAutomaton()
    for s in strings:
        sam.add_string(s)
    rng = random.Random(seed)
    for _ in range(200):
        context = [rng.randrange(4) for _ in range(rng.randint(0, 8))]  # token 3 never occurs
        state, matched = sam.match(context)
        want = max(
            n for n in range(len(context) + 1) if _occurs(strings, context[len(context) - n :])
        )
        assert matched == want
        if matched:  # the first end really ends the matched suffix
            sid, pos = sam.first_end[state]
            assert strings[sid][pos - matched + 1 : pos + 1] == context[len(context) - matched :]


def test_proposal_from_the_own_prompt():
    history = HistoryDrafter(HistoryConfig(ngram_min=2, ngram_max=4))
    history.add("a", "g", [5, 6, 7, 8, 9, 10, 5, 6, 7])  # the prompt repeats 5 6 7
    assert history.propose("a", 3) == [8, 9, 10]
    assert history.propose("a", 10) == [8, 9, 10, 5, 6, 7]  # up to the own tail
    history.extend("a", [8])
    assert history.propose("a", 2) == [9, 10]


def test_proposal_from_a_sibling_and_not_from_another_group():
    # the prompt's own group only (another group's sequences: tests/test_history_cross_prompt.py)
    history = HistoryDrafter(HistoryConfig(ngram_min=2, ngram_max=4, is_cross_prompt=False))
    history.add("a", "g", [1, 2, 3, 40, 41, 42, 43, 44])
    history.add("b", "g", [1, 2, 3, 40])
    history.add("c", "other", [1, 2, 3, 40])
    assert history.propose("b", 3) == [41, 42, 43]
    assert history.propose("c", 3) == []  # its group holds no continuation
    history.finish("a")  # a finished sibling is still history
    assert history.propose("b", 8) == [41, 42, 43, 44]


def test_proposal_from_an_earlier_rollout_of_the_same_prompt_id():
    history = HistoryDrafter(HistoryConfig(ngram_min=2, ngram_max=8))
    history.add((0, "r0"), "p7", [9, 8, 20, 21, 22, 23])  # rollout 0
    history.finish((0, "r0"))
    history.add((1, "r0"), "p7", [9, 8, 20])  # rollout 1, same request id and prompt id
    assert history.propose((1, "r0"), 3) == [21, 22, 23]


def test_ngram_fallback_from_ngram_max_to_ngram_min():
    # Context 1 2 3 occurs only at the own tail; its suffix 2 3 occurs earlier, followed by 77.
    tokens = [9, 2, 3, 77, 1, 2, 3]
    for ngram_min, want in ((1, [77]), (2, [77]), (3, [])):
        history = HistoryDrafter(HistoryConfig(ngram_min=ngram_min, ngram_max=3))
        history.add("a", "g", tokens)
        assert history.propose("a", 1) == want, ngram_min
    # the longest context wins: 2 3 -> 77 earlier, but 1 2 3 -> 55 too
    history = HistoryDrafter(HistoryConfig(ngram_min=1, ngram_max=3))
    history.add("x", "g", [2, 3, 77, 1, 2, 3, 55])
    history.add("a", "g", [1, 2, 3])
    assert history.propose("a", 1) == [55]


def test_tree_proposal_has_distinct_first_tokens():
    history = HistoryDrafter(HistoryConfig(ngram_min=1, ngram_max=4))
    history.add("s1", "g", [1, 2, 10, 11, 12])
    history.add("s2", "g", [1, 2, 20, 21])
    history.add("s3", "g", [1, 2, 30])
    history.add("s4", "g", [1, 2, 10, 99])
    history.add("q", "g", [5, 1, 2])
    branches = history.propose_tree("q", 3, max_branches=3)
    assert branches[0] == history.propose("q", 3) == [10, 11, 12]
    assert branches == [[10, 11, 12], [20, 21], [30]]
    assert len({b[0] for b in history.propose_tree("q", 3, max_branches=10)}) == 3
    tokens, parents = tree_nodes(branches, max_nodes=5)
    # (depth, branch) order: 10 20 30 at depth 1, then 11 21, ...
    assert tokens == [10, 20, 30, 11, 21]
    assert parents == [0, 0, 0, 1, 2]


def test_eviction_drops_the_oldest_finished_sequences():
    config = HistoryConfig(ngram_min=2, ngram_max=4, max_history_tokens=20, is_cross_prompt=False)
    history = HistoryDrafter(config)
    history.add("old", "g", [1, 2, 50, 51, 52, 53])  # 6 tokens
    history.finish("old")
    history.add("new", "g", [1, 2, 60, 61, 62, 63])  # 12
    history.finish("new")
    history.add("run", "g", [7, 7, 7, 7])  # 16, running
    history.add("q", "h", [1, 2])  # 18
    history.add("q2", "g", [8, 1, 2])  # 21 > 20: "old" goes (the oldest finished)
    assert "old" not in history and "new" in history and "run" in history
    assert history.num_tokens == 15
    assert history.propose("q2", 2) == [60, 61]
    history.add("big", "h", list(range(100, 120)))  # only running ones and "new" left to evict
    assert "new" not in history and history.num_tokens == 29  # running sequences stay
    assert history.propose("q2", 2) == []
    # after the rebuild the index still grows incrementally
    history.extend("run", [1, 2, 70])
    assert history.propose("q2", 1) == [70]


def test_eviction_frees_down_to_a_share_of_the_cap_and_drops_old_groups_whole(monkeypatch):
    """Past the cap, the oldest finished sequences go until the index holds at most
    ``evict_to_fraction`` of it, so the next sequences add without evicting; a group that
    lost every sequence is dropped, one that lost some is rebuilt, once per round."""
    rebuilt = []
    build = SuffixAutomaton.from_strings.__func__

    def spy(cls, strings, count_depth=None):
        strings = list(strings)
        rebuilt.append(len(strings))
        return build(cls, strings, count_depth)

    monkeypatch.setattr(SuffixAutomaton, "from_strings", classmethod(spy))
    cfg = HistoryConfig(max_history_tokens=100, evict_to_fraction=0.7)
    history = HistoryDrafter(cfg)
    for i in range(10):  # groups a (4 x 10 tokens), b (4 x 10), c (2 x 10): 100 tokens
        key = ("abc"[i // 4], i)
        history.add(key, key[0], [i] * 10)
        history.finish(key)
    assert history.num_tokens == 100 and not rebuilt
    history.add(("d", 0), "d", [50] * 10)  # 110 > 100: down to 70, the oldest four go
    assert history.num_tokens == 70 and "a" not in history.automata
    assert rebuilt == []  # group a went whole: nothing to rebuild
    for i in range(3):  # 100 again: no eviction on the way
        history.add(("d", i + 1), "d", [60 + i] * 10)
    assert history.num_tokens == 100 and not rebuilt
    history.add(("e", 0), "e", [70] * 20)  # 120: down to 70, b's four and c's first go
    assert history.num_tokens == 70
    assert "b" not in history.automata and rebuilt == [1]  # c keeps one sequence: rebuilt
    assert [("c", 9) in history, ("c", 8) in history] == [True, False]
    with pytest.raises(ValueError, match="evict_to_fraction"):
        HistoryConfig(evict_to_fraction=0.0)


# ---- verify: a point-mass draft is handled exactly ---------------------------------------------


@pytest.mark.parametrize("parents", [[0, 0, 1, 2], [0, 0, 0, 1]])
def test_one_hot_draft_probs_verify_like_point_masses(parents):
    gen = torch.Generator().manual_seed(0)
    num_seqs, vocab = 2000, 5
    probs = torch.softmax(torch.randn(num_seqs, 4, vocab, generator=gen) * 2, dim=-1)
    probs[:100] = torch.nn.functional.one_hot(probs[:100].argmax(-1), vocab).float()  # greedy
    tokens = torch.randint(0, vocab, (num_seqs, 4), generator=gen)
    tokens[:, 2] = tokens[:, 1] if parents[2] == 0 else tokens[:, 2]
    par = torch.tensor(parents).expand(num_seqs, 4)
    one_hot = torch.nn.functional.one_hot(tokens, vocab).float()
    u_accept = torch.rand(num_seqs, 3, generator=gen)
    u_sample = torch.rand(num_seqs, generator=gen)
    a = verify_with_uniforms(DraftTree(tokens, par), probs, u_accept, u_sample)
    b = verify_with_uniforms(DraftTree(tokens, par, one_hot), probs, u_accept, u_sample)
    for x, y in zip(vars(a).values(), vars(b).values(), strict=True):
        assert torch.equal(x, y)
    # the emitted correction / bonus token never has target probability 0 at its node
    rows = torch.arange(num_seqs)
    node = a.accepted_nodes[rows, a.num_accepted]
    assert (probs[rows, node, a.out_tokens[rows, a.num_accepted]] > 0).all()


# ---- the policy side ---------------------------------------------------------------------------


def _obs(num_active: int, instance: int = 0) -> DecodeObs:
    return DecodeObs(now_s=0.0, step=0, instance=instance, num_active=num_active)


def test_spec_decision_drafter_field_and_arm_names():
    d = SpecDecision.parse("history:6_1_6")
    assert (d.drafter, d.strategy, d.arm) == ("history", "6_1_6", "history:6_1_6")
    eagle = SpecDecision.parse("8_4_48")
    assert eagle.drafter == "eagle" and eagle.arm == eagle.strategy == "8_4_48"
    assert SpecDecision.parse(d.arm) == d and d != SpecDecision.parse("6_1_6")
    with pytest.raises(ValueError, match="drafter must be one of"):
        SpecDecision(enabled=True, draft_steps=2, topk=1, verify_tokens=2, drafter="ngram")
    with pytest.raises(ValueError, match="drafter must be one of"):
        SpecDecision.parse("medusa:2_1_2")


def test_tltbase_is_history_only_with_tlts_switch():
    policy = make_policy("tltbase", seed=0, warmup_checks=2)
    assert isinstance(policy, TLTBase) and policy.name == "tltbase"
    policy.start_rollout(0)
    assert not policy.decide(_obs(40)).enabled  # above the threshold
    assert not policy.decide(_obs(30)).enabled  # warm-up check 1
    decision = policy.decide(_obs(30))
    assert decision.enabled and decision.arm == "history:6_1_6"
    assert policy.decide(_obs(1)).arm == "history:6_1_6"
    with pytest.raises(ValueError, match="drafters must be"):
        TLTBase(drafters=("eagle",))
    with pytest.raises(ValueError, match="EAGLE"):
        to_vllm_dynamic_table(policy, 64)
    with pytest.raises(ValueError, match="EAGLE"):
        to_vllm_dynamic_table(StaticSpec(strategy="history:4_1_4"), 64)


def test_tlt_default_arms_and_vllm_table_unchanged():
    default = TLTAdaptive()
    assert default.config.drafters == ("eagle",)
    assert all(a.drafter == "eagle" for _, _, arms in default.config.buckets() for a in arms)
    mixed = TLTAdaptive(drafters=("eagle", "history"))
    assert to_vllm_dynamic_table(mixed, 256) == to_vllm_dynamic_table(default, 256)
    with pytest.raises(ValueError, match="drafters"):
        TLTConfig(drafters=("eagle", "eagle"))
    with pytest.raises(ValueError, match="name no drafter"):
        TLTConfig(strategies=("history:8_4_48", "8_4_32", "8_4_16", "8_4_8"))


def test_tlt_bandit_chooses_between_drafters_by_reward():
    policy = TLTAdaptive(
        seed=1,
        drafters=("eagle", "history"),
        warmup_checks=1,
        epsilon=0.0,
        strategies=("4_1_4",),
        bucket_starts=(1,),
    )
    policy.start_rollout(0)
    arms = set()
    for _ in range(40):
        d = policy.decide(_obs(8))
        arms.add(d.arm)
        tokens = 40.0 if d.drafter == "history" else 10.0  # history emits more per second
        policy.observe(
            SpecFeedback(
                step=0,
                instance=0,
                num_active=8,
                decision=d,
                accepted_tokens=tokens,
                iteration_s=1.0,
            )
        )
    assert arms == {"4_1_4", "history:4_1_4"}  # both tried
    assert policy.decide(_obs(8)).arm == "history:4_1_4"  # then the better one
    state = policy.state_dict()
    restored = TLTAdaptive(
        seed=1,
        drafters=("eagle", "history"),
        warmup_checks=1,
        epsilon=0.0,
        strategies=("4_1_4",),
        bucket_starts=(1,),
    )
    restored.load_state_dict(state)
    assert restored.state_dict() == state


def test_tltbase_with_own_strategies_takes_tlts_default_buckets():
    """--policy tltbase --tlt-strategies with four chains (as for tlt) gets TLTConfig's four
    default buckets instead of failing on TLTBase's one-bucket default."""
    from tltsim.policy import TLTConfig, make_policy

    policy = make_policy("tltbase", strategies=("4_1_4", "3_1_3", "2_1_2", "1_1_1"))
    assert policy.config.bucket_starts == TLTConfig().bucket_starts
    assert policy.config.drafters == ("history",)
    assert make_policy("tltbase").config.bucket_starts == (1,)  # the default stays one bucket
