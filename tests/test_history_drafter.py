"""History drafter (issue #20): the suffix automaton against brute force and against a
from-scratch build, proposals from the own prompt, siblings and earlier rollouts, eviction, the
n-gram fallback; lossless decoding through the engine with no EAGLE drafter (greedy token for
token, chain and tree; the exact sampled distribution on a tiny vocabulary); the policy side
(SpecDecision.drafter, TLTBase, TLTAdaptive's drafter arms).

Run: ``python -m pytest tests/test_history_drafter.py -q``.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import VOCAB, tiny_model

from tltrun.model.drafter import EagleDrafter
from tltrun.model.history_drafter import HistoryConfig, HistoryDrafter, SuffixAutomaton, tree_nodes
from tltrun.model.transformer import CausalContext
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import Request, SamplingParams
from tltrun.rollout.speculative import DraftTree, logits_to_probs, verify_with_uniforms
from tltsim.policy import (
    DecodeObs,
    NoSpec,
    SpecDecision,
    SpecFeedback,
    StaticSpec,
    TLTAdaptive,
    TLTBase,
    TLTConfig,
    make_policy,
    to_vllm_dynamic_table,
)

GREEDY = SamplingParams(temperature=0.0)
TARGET = tiny_model(seed=0)

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
    # the same strings grown a few tokens at a time, interleaved at random
    rng = random.Random(100 + seed)
    inc = SuffixAutomaton()
    sids = [inc.add_string() for _ in strings]
    done = [0] * len(strings)
    while any(d < len(s) for d, s in zip(done, strings, strict=True)):
        i = rng.choice([i for i, s in enumerate(strings) if done[i] < len(s)])
        step = rng.randint(1, 4)
        inc.extend(sids[i], strings[i][done[i] : done[i] + step])
        done[i] += step
    assert inc.strings == strings
    assert inc.num_states == scratch.num_states
    assert _canonical(inc) == _canonical(scratch)


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
    history = HistoryDrafter(HistoryConfig(ngram_min=2, ngram_max=4))
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
    history = HistoryDrafter(HistoryConfig(ngram_min=2, ngram_max=4, max_history_tokens=20))
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


# ---- the engine: lossless with the history drafter and no EAGLE drafter ------------------------


def _requests(num_prompts: int, group: int, seed: int, max_new: int = 30, ids: bool = True):
    rng = random.Random(seed)
    prompts = [
        tuple(rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 12)))
        for _ in range(num_prompts)
    ]
    return [
        Request(
            f"r{p}-{g}",
            prompts[p],
            rng.randint(1, max_new),
            prompt_id=f"p{p}" if ids else None,
        )
        for p in range(num_prompts)
        for g in range(group)
    ]


def _engine(drafter=None, model=TARGET, **overrides) -> RolloutEngine:
    fields = dict(max_running_requests=4, max_model_len=96, sampling=GREEDY, ngram_min=1)
    fields.update(overrides)
    return RolloutEngine(model, drafter, EngineConfig(**fields))


class Cycling:
    """Cycles through decisions, SD off and EAGLE ones included."""

    name = "cycling"

    def __init__(self, names):
        self.decisions = [SpecDecision.parse(n) for n in names]
        self.num_calls = 0

    def start_rollout(self, step):
        pass

    def decide(self, obs):
        self.num_calls += 1
        return self.decisions[self.num_calls % len(self.decisions)]

    def observe(self, feedback):
        pass


@pytest.mark.parametrize("ids", [True, False])
def test_greedy_history_drafting_equals_plain_greedy(ids):
    reqs = _requests(3, group=3, seed=1, ids=ids)
    want = [o.output_token_ids for o in _engine().generate(reqs, NoSpec()).outputs]
    for strategy in ("history:4_1_4", "history:1_1_1", "history:3_2_6", "history:5_4_16"):
        eng = _engine()  # no EAGLE drafter loaded
        for step in range(2):  # the second rollout drafts from the first
            result = eng.generate(reqs, StaticSpec(strategy=strategy), step)
            assert [o.output_token_ids for o in result.outputs] == want, (strategy, step)
            hist = result.accept_hist_by_drafter()
            assert set(hist) == {"history"} and sum(hist["history"]) > 0
            assert all(it.drafter == "history" for it in result.iterations if it.accept_lens)
        if ids:  # greedy repeats rollout 0, so rollout 1 accepts whole drafts
            assert max(hist["history"]) == hist["history"][-1]
        else:  # rollout-local groups are dropped when the rollout ends
            assert eng.history.num_tokens == 0


def test_eager_history_drafts_verify_only_the_longest_proposal():
    reqs = _requests(3, group=3, seed=1)
    eng = _engine()
    widths: list[int] = []
    draft = eng.history.draft

    def spy(*args, **kwargs):
        assert kwargs["is_trimmed"]  # no CUDA graphs here: the forward takes any width
        tree = draft(*args, **kwargs)
        widths.append(tree.num_drafted)
        return tree

    eng.history.draft = spy
    eng.generate(reqs, StaticSpec(strategy="history:4_1_4"), 0)
    first, widths[:] = list(widths), []
    eng.generate(reqs, StaticSpec(strategy="history:4_1_4"), 1)
    # rollout 0 drafts from the prompts and siblings only: some iterations find less than 4
    # tokens for every sequence, and verify that many (at least one)
    assert 1 <= min(first) < 4 and max(first) == 4
    # greedy rollout 1 repeats rollout 0: its history offers whole drafts
    assert sum(widths) / len(widths) > sum(first) / len(first)


def test_engine_history_is_lazy_and_bounded_across_rollouts():
    reqs = _requests(3, group=3, seed=4)
    want = [o.output_token_ids for o in _engine().generate(reqs, NoSpec()).outputs]
    eng = _engine(history_max_tokens=60)
    eng.generate(reqs, NoSpec())
    assert eng.history.num_tokens == 0  # never asked for a history draft: nothing indexed
    total = sum(len(r.prompt_token_ids) + len(w) for r, w in zip(reqs, want, strict=True))
    assert total > 2 * 60
    for step in range(3):
        result = eng.generate(reqs, StaticSpec(strategy="history:4_1_4"), step)
        assert [o.output_token_ids for o in result.outputs] == want
        assert 0 < eng.history.num_tokens <= 60  # all finished: evictable down to the bound


def test_greedy_switching_between_eagle_history_and_off():
    reqs = _requests(3, group=2, seed=2)
    want = [o.output_token_ids for o in _engine().generate(reqs, NoSpec()).outputs]
    drafter = EagleDrafter.for_target(TARGET, seed=3)  # untrained: lossless all the same
    policy = Cycling(["history:4_1_4", "3_1_3", "off", "history:3_2_6", "4_2_8", "history:2_1_2"])
    result = _engine(drafter).generate(reqs, policy)
    assert [o.output_token_ids for o in result.outputs] == want
    assert set(result.accept_hist_by_drafter()) == {"eagle", "history"}
    # an EAGLE iteration after a history one re-prefills the EAGLE drafter first
    assert any(it.is_drafter_prefill for it in result.iterations[5:])
    keys = {k for o in result.outputs for k in o.accept_hist_by_strategy}
    assert "history:4_1_4" in keys and "3_1_3" in keys


def test_eagle_decision_without_a_drafter_still_raises():
    with pytest.raises(ValueError, match="has no drafter"):
        _engine().generate(_requests(1, 2, seed=0), StaticSpec(strategy="4_1_4"))


def test_tltbase_runs_on_an_engine_without_eagle():
    reqs = _requests(2, group=4, seed=3)
    want = [o.output_token_ids for o in _engine().generate(reqs, NoSpec()).outputs]
    policy = make_policy("tltbase", threshold=3, warmup_checks=2)
    result = _engine().generate(reqs, policy)
    assert [o.output_token_ids for o in result.outputs] == want
    assert {it.drafter for it in result.iterations} == {None, "history"}


# Exact distribution: V = 6 tokens, responses of 3 tokens, ignore_eos. Every request has the same
# prompt, so the group's finished and running siblings feed the history drafter.
SMALL_V = 6
SMALL = tiny_model(seed=4, vocab_size=SMALL_V, bos_token_id=1)
PROMPT = (2, 4, 5, 2)
NUM_RESPONSES = 6000


def _target_joint() -> torch.Tensor:
    """(V, V, V) exact probability of every 3-token response under SMALL at temperature 1."""
    seqs = torch.tensor(list(itertools.product(range(SMALL_V), repeat=3)))  # (V^3, 3)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits, _ = SMALL(ids, torch.arange(ids.shape[1])[None], CausalContext())
    probs = logits_to_probs(logits[:, len(PROMPT) - 1 : -1], SamplingParams()).double()  # (N,3,V)
    p = probs.gather(2, seqs[..., None]).squeeze(-1).prod(dim=1)
    return p.reshape(SMALL_V, SMALL_V, SMALL_V)


@pytest.mark.parametrize("strategy", ["history:2_1_2", "history:2_3_5"])
def test_sampled_distribution_with_history_drafting_is_the_targets(strategy):
    reqs = [
        Request(f"r{i}", PROMPT, 3, ignore_eos=True, prompt_id="p") for i in range(NUM_RESPONSES)
    ]
    eng = RolloutEngine(
        SMALL,
        None,
        EngineConfig(max_running_requests=500, max_model_len=16, seed=7, ngram_min=1, ngram_max=4),
    )
    result = eng.generate(reqs, StaticSpec(strategy=strategy))
    hist = result.accept_hist_by_drafter()["history"]
    assert sum(hist[1:]) > 0.2 * sum(hist)  # drafts are accepted: the SD path really ran
    counts = torch.zeros(SMALL_V**3, dtype=torch.float64)
    for o in result.outputs:
        a, b, c = o.output_token_ids
        counts[(a * SMALL_V + b) * SMALL_V + c] += 1
    p = _target_joint().reshape(-1)
    p = p / p.sum()  # float32 softmaxes: the product sums to 1 within ~1e-7
    # cells of small expected count pooled, as chi-square needs ~5 per cell
    is_big = p * NUM_RESPONSES >= 5
    observed = torch.cat([counts[is_big], counts[~is_big].sum()[None]]).numpy()
    expected = torch.cat([p[is_big], p[~is_big].sum()[None]]).numpy() * NUM_RESPONSES
    pvalue = chisquare(observed, expected).pvalue
    assert pvalue > 0.01, f"{strategy}: chi-square p = {pvalue:.4f}"


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


def test_measured_trace_keys_history_verifies_by_arm_and_is_version_2(tmp_path):
    """A rollout mixing EAGLE and history iterations: the measured step keys the history
    drafter's verifies by arm ("history:4_1_4") in every histogram and the iteration counts,
    EAGLE's by plain strategy; the trace is written as version 2 and loads back equal; a
    NoSpec run's trace stays version 1."""
    import json

    from tltrun.rollout.measured_trace import measured_step
    from tltsim.trace.files import load_trace, save_trace
    from tltsim.trace.schema import Trace, version_of

    reqs = _requests(3, group=2, seed=2)
    drafter = EagleDrafter.for_target(TARGET, seed=3)
    policy = Cycling(["history:4_1_4", "3_1_3", "off"])
    result = _engine(drafter).generate(reqs, policy)
    step = measured_step(0, result, policy_name="cycling")
    m = step.measured
    assert set(m.accept_hist_by_strategy) == {"history:4_1_4", "3_1_3"}
    hists = result.accept_hist_by_drafter()
    assert list(m.accept_hist_by_strategy["history:4_1_4"]) == hists["history"]
    assert list(m.accept_hist_by_strategy["3_1_3"]) == hists["eagle"]
    assert {"history:4_1_4", "3_1_3", "off"} <= set(m.policy.iterations_per_strategy)
    per_response = {k for r in m.response_accept_hist_by_strategy.values() for h in r for k in h}
    assert per_response == {"history:4_1_4", "3_1_3"}
    assert m.arm_drafters() == {"eagle", "history"}
    trace = Trace(meta={}, steps=(step,))
    path = tmp_path / "t.json"
    save_trace(trace, path)
    assert json.loads(path.read_text())["version"] == version_of(trace) == 2
    assert load_trace(path) == trace
    plain = measured_step(0, _engine().generate(reqs, NoSpec()), policy_name="nospec")
    assert version_of(Trace(meta={}, steps=(plain,))) == 1


def test_callers_key_requests_by_a_stable_prompt_id(tmp_path):
    """generate: the prompts file's id; bench replays: the trace prompt's id within its step
    (a replay draws new prompt tokens each step, and traces name prompts by position)."""
    from tltrun.cli.generate import GenerateConfig, read_prompts
    from tltrun.rollout.measured_trace import requests_from_step
    from tltsim.trace.schema import Prompt, Response, Step

    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"id": "q7", "prompt_token_ids": [3, 4]}\n{"id": 5, "prompt_token_ids": [6]}\n'
    )
    cfg = GenerateConfig(model="m", prompts=str(path), out="o", max_new_tokens=4, group_size=2)
    reqs, _ = read_prompts(str(path), "m", cfg)
    assert [(r.id, r.prompt_id) for r in reqs] == [
        ("q7/0", "q7"),
        ("q7/1", "q7"),
        ("5/0", "5"),
        ("5/1", "5"),
    ]
    step = Step(3, (Prompt("s0p1", 4, (Response(2), Response(3))),))
    reqs = requests_from_step(step, VOCAB, seed=0)
    assert [(r.id, r.prompt_id) for r in reqs] == [
        ("s0p1/0", "step3/s0p1"),
        ("s0p1/1", "step3/s0p1"),
    ]


def test_tltbase_with_own_strategies_takes_tlts_default_buckets():
    """--policy tltbase --tlt-strategies with four chains (as for tlt) gets TLTConfig's four
    default buckets instead of failing on TLTBase's one-bucket default."""
    from tltsim.policy import TLTConfig, make_policy

    policy = make_policy("tltbase", strategies=("4_1_4", "3_1_3", "2_1_2", "1_1_1"))
    assert policy.config.bucket_starts == TLTConfig().bucket_starts
    assert policy.config.drafters == ("history",)
    assert make_policy("tltbase").config.bucket_starts == (1,)  # the default stays one bucket
