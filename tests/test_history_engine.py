"""History drafter (issue #20) in the rollout engine: lossless decoding with no EAGLE drafter
(greedy token for token, chain and tree; the exact sampled distribution on a tiny vocabulary),
the engine's history kept lazily and bounded across rollouts, switching between EAGLE, history
and off, TLTBase on an engine without EAGLE; the measured trace of a mixed rollout (version 2)
and the stable prompt ids callers key requests by. The suffix automaton, the drafter's
proposals and the policy side: tests/test_history_drafter.py.

Run: ``python -m pytest tests/test_history_engine.py -q``.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import VOCAB, tiny_model

from tltrun.model.drafter import EagleDrafter
from tltrun.model.transformer import CausalContext
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import Request, SamplingParams
from tltrun.rollout.rollout_history import RolloutHistory
from tltrun.rollout.speculative import DraftTree, logits_to_probs
from tltsim.policy import NoSpec, SpecDecision, StaticSpec, make_policy

GREEDY = SamplingParams(temperature=0.0)
TARGET = tiny_model(seed=0)

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


def _count_static_verifies(monkeypatch) -> list[int]:
    """Batch sizes of the pool's static verifies from now on (the graph path ran)."""
    from tltrun.rollout.static_verify import StaticVerify

    calls: list[int] = []
    call = StaticVerify.__call__
    monkeypatch.setattr(StaticVerify, "__call__", lambda s, t, n: calls.append(n) or call(s, t, n))
    return calls


@pytest.mark.parametrize("ids,graphs", [(True, False), (False, False), (True, True)])
def test_greedy_history_drafting_equals_plain_greedy(ids, graphs, monkeypatch):
    # graphs: the pool's static verify (on CPU uncaptured), trees padded to the full shape
    calls = _count_static_verifies(monkeypatch)
    draft = RolloutHistory.draft

    def checked(self, *args, **kwargs):  # the engine skips the check (a device read): here
        tree = draft(self, *args, **kwargs)
        return DraftTree(tree.tokens, tree.parents)  # raises on a parent after its child

    monkeypatch.setattr(RolloutHistory, "draft", checked)
    reqs = _requests(3, group=3, seed=1, ids=ids)
    want = [o.output_token_ids for o in _engine().generate(reqs, NoSpec()).outputs]
    # 3_2_12: EAGLE's beam offers 10 nodes, so its verify graph (shared) holds 10, not 12
    strategies = (
        "history:4_1_4",
        "history:1_1_1",
        "history:3_2_6",
        "history:5_4_16",
        "history:3_2_12",
    )
    for strategy in strategies:
        eng = _engine(cuda_graphs=graphs)  # no EAGLE drafter loaded
        for step in range(2):  # the second rollout drafts from the first
            result = eng.generate(reqs, StaticSpec(strategy=strategy), step)
            assert [o.output_token_ids for o in result.outputs] == want, (strategy, step)
            hist = result.accept_hist_by_drafter()
            assert set(hist) == {"history"} and sum(hist["history"]) > 0
            assert all(it.drafter == "history" for it in result.iterations if it.accept_lens)
        assert bool(calls) == graphs
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


def _index(eng: RolloutEngine) -> tuple:
    d = eng.history.drafter
    return sorted(d.sequences), d.num_tokens, d.num_shared_tokens


def test_an_evaluation_rollout_leaves_the_history_index_as_it_was():
    """tltrun train's evaluation rolls out requests without prompt ids (rollout-local
    groups) by plain decoding; the index must forget them: they stayed in the cross-prompt
    index (and drafted for later training prompts), and indexing them at the rollout's end
    evicted the training prompts' history (a full index lost all of it), so the next sampled
    step changed."""
    train = _requests(2, group=2, seed=5, max_new=20)
    evals = _requests(4, group=1, seed=6, max_new=40, ids=False)
    spec = StaticSpec(strategy="history:4_1_4")

    def run(with_eval: bool) -> tuple[list, tuple]:
        # a cap the training rollout nearly fills: the eval's tokens would evict it
        eng = _engine(sampling=SamplingParams(temperature=1.0), seed=0, history_max_tokens=100)
        eng.generate(train, spec, 0)
        before = _index(eng)
        if with_eval:  # as tltrun.train.responses.evaluate
            state = eng.generator.get_state()
            eng.generate(evals, NoSpec(), 0)
            eng.generator.set_state(state)
        assert _index(eng) == before, (with_eval, before, _index(eng))
        return [o.output_token_ids for o in eng.generate(train, spec, 1).outputs], before

    (plain, index), (evaluated, _) = run(False), run(True)
    assert index[2] > 0 and len(index[0]) == len(train)  # training is shared and all kept
    assert evaluated == plain


def test_a_rollout_local_group_that_drafts_is_never_shared():
    """Requests without a prompt id may draft from history during their rollout (their own
    group and the shared index), but never enter the cross-prompt index, which cannot forget
    a string: afterwards nothing of them is left to draft from."""
    eng = _engine(history_max_tokens=10_000)
    eng.generate(_requests(2, group=2, seed=5, max_new=20), StaticSpec(strategy="history:4_1_4"))
    shared = eng.history.drafter.num_shared_tokens
    local = _requests(3, group=2, seed=6, max_new=30, ids=False)
    result = eng.generate(local, StaticSpec(strategy="history:4_1_4"))
    assert sum(len(o.output_token_ids) for o in result.outputs) > 0
    assert eng.history.drafter.num_shared_tokens == shared > 0
    assert all(key[0] == 0 for key in eng.history.drafter.sequences)  # rollout 1's dropped


def test_a_restored_history_index_drafts_and_samples_as_the_engine_that_wrote_it():
    """A checkpoint between rollouts keeps the index (``RolloutHistory.state_dict``): an engine
    that loads it, with the writer's sampling generator, samples the next rollout exactly as
    the writer does; a fresh index (what a resume had before) samples differently."""
    import io

    sampled = dict(sampling=SamplingParams(temperature=1.0), seed=5, max_model_len=128)
    policy = StaticSpec(strategy="history:4_1_4")
    writer = _engine(**sampled)
    writer.generate(_requests(3, group=2, seed=6, max_new=60), policy, 0)
    buffer = io.BytesIO()  # the checkpoint's way: torch.save, then torch.load
    torch.save(
        {"history": writer.history.state_dict(), "rng": writer.generator.get_state()}, buffer
    )
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    restored, fresh = _engine(**sampled), _engine(**sampled)
    assert restored.history.load_state_dict(state["history"])
    assert restored.history.num_tokens == writer.history.num_tokens > 0
    nxt = _requests(2, group=2, seed=7, max_new=60)  # new prompts: the cross-prompt tier drafts
    outputs = {}
    for name, eng in (("writer", writer), ("restored", restored), ("fresh", fresh)):
        eng.generator.set_state(state["rng"])
        result = eng.generate(nxt, policy, 1)
        outputs[name] = [o.output_token_ids for o in result.outputs]
    assert outputs["restored"] == outputs["writer"]
    assert outputs["fresh"] != outputs["writer"]
    # written with other settings: not restored, the index starts empty
    other = _engine(**sampled, ngram_max=5)
    assert not other.history.load_state_dict(state["history"]) and other.history.num_tokens == 0


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
    with pytest.raises(ValueError, match="EAGLE drafter .strategy 4_1_4. but the engine has none"):
        _engine().generate(_requests(1, 2, seed=0), StaticSpec(strategy="4_1_4"))


def test_tltbase_runs_on_an_engine_without_eagle():
    reqs = _requests(2, group=4, seed=3)
    want = [o.output_token_ids for o in _engine().generate(reqs, NoSpec()).outputs]
    policy = make_policy("tltbase", threshold=3, warmup_checks=2)
    result = _engine().generate(reqs, policy)
    assert [o.output_token_ids for o in result.outputs] == want
    assert {it.drafter for it in result.iterations} == {None, "history"}
    # history_strategies: a bandit over two history arms, both tried, lossless all the same
    policy = make_policy(
        "tltbase", threshold=8, warmup_checks=1, history_strategies=("8_1_8", "2_1_2")
    )
    result = _engine().generate(reqs, policy)
    assert [o.output_token_ids for o in result.outputs] == want
    keys = {k for o in result.outputs for k in o.accept_hist_by_strategy}
    assert {"history:8_1_8", "history:2_1_2"} <= keys


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


@pytest.mark.parametrize(
    "strategy,graphs",
    [
        ("history:2_1_2", False),
        ("history:2_3_5", False),
        ("history:2_3_5", True),
        ("history:2_1_2", True),
    ],  # fmt: skip
)
def test_sampled_distribution_with_history_drafting_is_the_targets(strategy, graphs, monkeypatch):
    # graphs: the pool's static verify, trees padded to the full shape, sibling ranks bounded;
    # a chain's verify graph (sampled: EAGLE's chains carry q) gets the drafts as one-hot q
    calls = _count_static_verifies(monkeypatch)
    reqs = [
        Request(f"r{i}", PROMPT, 3, ignore_eos=True, prompt_id="p") for i in range(NUM_RESPONSES)
    ]
    eng = RolloutEngine(
        SMALL,
        None,
        EngineConfig(
            max_running_requests=500, max_model_len=16, seed=7, ngram_min=1, ngram_max=4,
            cuda_graphs=graphs,
        ),
    )  # fmt: skip
    result = eng.generate(reqs, StaticSpec(strategy=strategy))
    hist = result.accept_hist_by_drafter()["history"]
    assert bool(calls) == graphs
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


# ---- measured traces and the callers' prompt ids ----------------------------------------------


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
