"""EAGLE drafting inside the CUDA-graph pool (issue #18: SD graphs = drafting + verify). The
static drafting step (what a drafting graph replays) equals the eager ``eagle_draft``: same
tree tokens and parents, draft probabilities allclose, the same drafter-cache commit, for a
chain and a tree, a batch smaller than its bucket and pending pairs of different counts per
slot; pending pairs past its bound fall back to the eager drafting. An engine with the pool
built uncaptured on CPU generates greedy outputs identical to NoSpec and to the eager engine
(with the same accept lengths). The plan lists drafting graphs only for EAGLE arms. The
capture itself runs on CUDA only (marked ``gpu``).

Run: ``python -m pytest tests/test_draft_graphs.py -q``.
"""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from tltrun.model.drafter import EagleDrafter
from tltrun.model.kvcache import KVCache
from tltrun.rollout import engine as engine_module
from tltrun.rollout.draft_graphs import (
    DraftBuffers,
    StaticDraft,
    draft_sources,
    max_pending_pairs,
    num_tree_nodes,
)
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.graphs import CapturePlan, GraphPool, capture_plan
from tltrun.rollout.interface import Request, SamplingParams
from tltrun.rollout.prefill import eagle_draft
from tltrun.train.drafter_training import DrafterTrainConfig, TrainRecord, train_drafter
from tltsim.policy import NoSpec, SpecDecision, StaticSpec, TLTAdaptive, TLTBase, bucket_arms

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)
TARGET = tiny_model(seed=3)
MAX_TOKENS = 64

# ---------------------------------------------------------------------------------------------
# The static drafting step against the eager drafting, on synthetic engine state
# ---------------------------------------------------------------------------------------------


def _slot_state(
    pending: list[int], num_slots: int, sampling: SamplingParams, target=TARGET, impl=None
):
    """An engine's per-slot state (``tltrun.rollout.prefill.SlotEngine``) on ``target``'s
    device with random tokens, hidden states and drafter cache: real slot s has target length
    20 + 7s and ``pending[s]`` pairs its drafter has not seen; free slots hold garbage and
    stale lengths."""
    gen = torch.Generator().manual_seed(len(pending) * 100 + sum(pending))
    cfg, device = target.config, target.lm_head.weight.device
    draft_cache = KVCache.for_model(cfg, num_slots, MAX_TOKENS, num_layers=1)
    draft_cache.k.copy_(torch.randn(draft_cache.k.shape, generator=gen))
    draft_cache.v.copy_(torch.randn(draft_cache.v.shape, generator=gen))
    target_lens = torch.randint(1, 40, (num_slots,), generator=gen)
    draft_cache.lens.copy_(torch.randint(0, 40, (num_slots,), generator=gen))
    for s, num in enumerate(pending):
        target_lens[s] = 20 + 7 * s
        draft_cache.lens[s] = target_lens[s] - num
    tokens = torch.randint(0, VOCAB, (num_slots, MAX_TOKENS), generator=gen)
    hidden = torch.randn(num_slots, MAX_TOKENS, cfg.hidden_size, generator=gen)
    for name in ("k", "v", "lens"):
        setattr(draft_cache, name, getattr(draft_cache, name).to(device))
    return SimpleNamespace(
        config=EngineConfig(
            max_running_requests=num_slots,
            max_model_len=48,
            sampling=sampling,
            device=device.type,
            attn_impl=impl,
        ),
        device=device,
        max_tokens=MAX_TOKENS,
        drafter=EagleDrafter.for_target(target, seed=1),
        cache=SimpleNamespace(lens=target_lens.to(device)),
        draft_cache=draft_cache,
        tokens=tokens.to(device),
        hidden=hidden.to(device),
        generator=torch.Generator(device).manual_seed(7),
    )


def _static_step(state, bucket: int, decision: SpecDecision, max_pending: int) -> StaticDraft:
    src = draft_sources(state)
    return StaticDraft(
        src, bucket, decision, max_pending, DraftBuffers.for_steps(src, [(bucket, decision)])
    )


def _assert_same_draft(eager_state, static_state, want, got, num_real: int) -> None:
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    if want.draft_probs is None:
        assert got.draft_probs is None
    else:
        torch.testing.assert_close(got.draft_probs, want.draft_probs, atol=1e-5, rtol=1e-5)
    # the catch-up committed the same pairs: lengths and the entries below them
    lens = eager_state.draft_cache.lens[:num_real]
    assert torch.equal(static_state.draft_cache.lens[:num_real], lens)
    for s in range(num_real):
        n = int(lens[s])
        torch.testing.assert_close(
            static_state.draft_cache.k[:, s, :, :n], eager_state.draft_cache.k[:, s, :, :n]
        )


@pytest.mark.parametrize(
    "strategy,sampling,impl",
    [
        ("4_1_4", GREEDY, "sdpa"),
        ("3_2_6", GREEDY, "sdpa"),
        ("3_2_6", SAMPLED, "sdpa"),  # a tree drafts top-k at any temperature: no draws
        ("5_4_16", GREEDY, "sdpa"),
        ("3_2_6", GREEDY, "flex"),  # the catch-up's attention by length
    ],
)
@pytest.mark.parametrize("pending,bucket", [([1, 5, 3], 4), ([2], 2), ([4, 1, 2, 3, 1], 8)])
def test_static_drafting_equals_eager_drafting(strategy, sampling, impl, pending, bucket):
    decision = SpecDecision.parse(strategy)
    max_pending = max_pending_pairs(("5_1_5",))  # 6: deeper than some strategies here
    eager = _slot_state(pending, bucket, sampling, impl=impl)
    static = copy.deepcopy(eager)
    slots = torch.arange(len(pending))
    want = eagle_draft(eager, slots, decision)
    got = _static_step(static, bucket, decision, max_pending)(len(pending))
    assert got is not None and got.tokens.shape == (len(pending), num_tree_nodes(decision))
    _assert_same_draft(eager, static, want, got, len(pending))
    assert bool((static.draft_cache.lens[len(pending) : bucket] == 0).all())  # padding: free


@pytest.mark.parametrize("pending", [[1, 3], [3, 2, 1, 2]])
def test_sampled_chain_drafts_the_eager_draws_without_padding(pending):
    # a full bucket draws the same random numbers as the eager chain, in the same order
    decision = SpecDecision.parse("4_1_4")
    eager = _slot_state(pending, len(pending), SAMPLED)
    static = copy.deepcopy(eager)
    want = eagle_draft(eager, torch.arange(len(pending)), decision)
    got = _static_step(static, len(pending), decision, 5)(len(pending))
    assert want.draft_probs is not None
    _assert_same_draft(eager, static, want, got, len(pending))
    assert torch.equal(static.generator.get_state(), eager.generator.get_state())


def test_pending_pairs_past_the_bound_fall_back():
    state = _slot_state([1, 6, 2], 4, GREEDY)
    before = state.draft_cache.lens.clone()
    step = _static_step(state, 4, SpecDecision.parse("4_2_8"), max_pending=5)
    assert step(3) is None  # slot 1 has 6 pending pairs
    assert torch.equal(state.draft_cache.lens, before)  # nothing ran
    state.draft_cache.lens[1] += 1
    assert step(3) is not None
    with pytest.raises(ValueError, match="drafting step of batch 4"):
        step(5)


# ---------------------------------------------------------------------------------------------
# The plan: drafting graphs for EAGLE arms only, counted as graphs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        TLTAdaptive(),
        TLTAdaptive(drafters=("eagle", "history")),
        TLTAdaptive(threshold=12, bucket_starts=(1, 7), strategies=("6_2_10", "4_1_4", "5_2_4")),
        TLTBase(),
    ],
)
def test_plan_drafts_every_eagle_arm_and_nothing_else(policy):
    plan = capture_plan(policy, 40, is_drafting=True)
    assert capture_plan(policy, 40).draft_graphs == ()  # no drafter: no drafting graphs
    assert set(plan.draft_graphs) <= set(plan.spec_graphs)
    assert plan.num_graphs == len(plan.decode_buckets) + len(plan.spec_graphs) + len(
        plan.draft_graphs
    )
    buckets = policy.config.buckets()
    eagle = set()
    for batch in range(1, policy.config.threshold + 1):
        for arm in bucket_arms(buckets, batch):
            if arm.drafter == "eagle":
                assert plan.draft_bucket(batch, arm.strategy) is not None, (batch, arm)
                eagle.add((plan.spec_bucket(batch, arm.strategy), arm.strategy))
    assert set(plan.draft_graphs) == eagle
    if isinstance(policy, TLTBase):
        assert plan.draft_graphs == ()


def test_static_spec_plan_and_a_pool_without_drafter():
    plan = capture_plan(StaticSpec(strategy="3_2_6"), 4, is_drafting=True)
    assert plan.draft_graphs == plan.spec_graphs and plan.num_graphs == 6
    assert plan.only(("x",)).draft_graphs == ()
    cache = KVCache.for_model(TARGET.config, 4, MAX_TOKENS)
    with pytest.raises(ValueError, match="no drafter"):
        GraphPool(TARGET, cache, plan, "sdpa", is_capturing=False)


# ---------------------------------------------------------------------------------------------
# The engine with the pool on CPU: drafting steps run uncaptured, outputs unchanged
# ---------------------------------------------------------------------------------------------


def _requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            f"r{i}",
            tuple(rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 16))),
            rng.randint(6, 40),
        )
        for i in range(n)
    ]


def _engine(drafter, **fields) -> RolloutEngine:
    cfg = EngineConfig(max_running_requests=5, max_model_len=64, sampling=GREEDY, **fields)
    return RolloutEngine(TARGET, drafter, cfg)


def _trained_drafter() -> EagleDrafter:
    """Briefly trained on the target's greedy outputs, so drafts are accepted: the drafter
    then has several pending pairs per slot after a verify, different per slot."""
    eng = _engine(None, is_harvesting=True)
    eng.generate(_requests(16, seed=100), NoSpec())
    records = [TrainRecord(r.token_ids, r.num_prompt_tokens, r.hidden) for r in eng.pop_harvest()]
    drafter = EagleDrafter.for_target(TARGET, seed=5)
    cfg = DrafterTrainConfig(num_steps=60, lr=1e-2, batch_size=8, seed=0)
    train_drafter(drafter, records, cfg, is_progress_shown=False)
    return drafter


DRAFTER = _trained_drafter()
ENGINE_POLICIES = {
    "chain-4_1_4": lambda: StaticSpec(4, 1, 4),
    "tree-3_2_6": lambda: StaticSpec(3, 2, 6),
    "tlt": lambda: TLTAdaptive(
        threshold=4, warmup_checks=2, strategies=("4_2_8", "3_1_3"), bucket_starts=(1, 3)
    ),
}


def _spy_steps(monkeypatch) -> list[tuple[int, int, list[int] | None]]:
    """Records (running, bucket, pending pairs per slot or None when it fell back)."""
    calls = []
    call = StaticDraft.__call__

    def spy(self, num_real):
        tree = call(self, num_real)
        pending = None if tree is None else self.num_pending[:num_real].tolist()
        calls.append((num_real, self.batch, pending))
        return tree

    monkeypatch.setattr(StaticDraft, "__call__", spy)
    return calls


@pytest.mark.parametrize("name", sorted(ENGINE_POLICIES))
def test_engine_drafting_in_the_pool_changes_no_output(name, monkeypatch):
    reqs = _requests(7, seed=31)
    want = [o.output_token_ids for o in _engine(None).generate(reqs, NoSpec()).outputs]
    eager = _engine(DRAFTER).generate(reqs, ENGINE_POLICIES[name]())
    calls = _spy_steps(monkeypatch)
    got = _engine(DRAFTER, cuda_graphs=True).generate(reqs, ENGINE_POLICIES[name]())
    assert [o.output_token_ids for o in got.outputs] == want
    assert [o.output_token_ids for o in eager.outputs] == want
    # the same drafts: every verify accepted as many tokens as the eager engine's
    assert [i.accept_lens for i in got.iterations] == [i.accept_lens for i in eager.iterations]
    ran = [c for c in calls if c[2] is not None]
    assert ran and len(ran) == len(calls)  # drafting always fit the pool's bound here
    if name != "tlt":  # (TLT speculates in the short tail only: batches 1 and 2 here)
        assert any(n < b for n, b, _ in ran)  # batch 3 padded to bucket 4
        assert any(len(set(p)) > 1 for _, _, p in ran)  # different pending counts per slot


def test_engine_falls_back_to_eager_drafting_past_the_bound(monkeypatch):
    reqs = _requests(4, seed=8)
    want = [o.output_token_ids for o in _engine(None).generate(reqs, NoSpec()).outputs]
    calls = _spy_steps(monkeypatch)
    eager_calls = []
    monkeypatch.setattr(
        engine_module,
        "eagle_draft",
        lambda eng, slots, d: eager_calls.append(len(slots)) or eagle_draft(eng, slots, d),
    )
    eng = _engine(DRAFTER, cuda_graphs=True)
    eng.start_rollout(reqs, StaticSpec(3, 2, 6))
    for _ in range(3):
        eng.step()
    assert calls and not eager_calls
    # slot 0's drafter forgets every pair it had seen (exact pairs: re-feeding them changes
    # nothing): more pending pairs than the bound (draft steps 3 + 1), so it drafts eagerly
    assert eng.graphs.max_pending == 4 and int(eng.cache.lens[0]) > 4
    eng.draft_cache.lens[0] = 0
    eng.step()
    assert calls[-1][2] is None and len(eager_calls) == 1
    while not eng.is_rollout_done:
        eng.step()
    assert [o.output_token_ids for o in eng.finish_rollout().outputs] == want
    assert calls[-1][2] is not None  # back in the pool afterwards


# ---------------------------------------------------------------------------------------------
# CUDA capture (GPU only)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture is CUDA-only")
@pytest.mark.parametrize("strategy,sampling", [("3_2_6", GREEDY), ("4_1_4", SAMPLED)])
def test_captured_drafting_replays_the_static_step(strategy, sampling):
    target = tiny_model(seed=3).to("cuda")
    decision = SpecDecision.parse(strategy)
    pending = [1, 4, 2]
    graph_state = _slot_state(pending, 4, sampling, target)
    plain_state = _slot_state(pending, 4, sampling, target)
    cache = graph_state.draft_cache
    saved = [t.clone() for t in (cache.k, cache.v, cache.lens)]
    plan = CapturePlan(spec_graphs=((4, strategy),), draft_graphs=((4, strategy),))
    target_cache = KVCache.for_model(target.config, 4, MAX_TOKENS, device="cuda")
    pool = GraphPool(
        target, target_cache, plan, "sdpa", is_capturing=True, drafting=draft_sources(graph_state)
    )
    step = pool.draft_step(3, strategy)
    # the drafting graph is captured into the pool (and counted in its memory)
    assert step.graph is not None and pool.captured_bytes > 0 and plan.num_graphs == 2
    for t, value in zip((cache.k, cache.v, cache.lens), saved, strict=True):
        t.copy_(value)  # capture writes scratch entries into (what it takes for) free slots
    with torch.no_grad():
        got = step(3)
        want = _static_step(plain_state, 4, decision, pool.max_pending)(3)
    if want.draft_probs is None:
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    else:  # a replay draws from the registered generator: a valid draw from the same q
        torch.testing.assert_close(got.draft_probs[:, 1], want.draft_probs[:, 1])
        q = got.draft_probs[:, 1:].gather(-1, got.tokens[:, 1:, None])
        assert bool((q > 0).all())
    assert torch.equal(graph_state.draft_cache.lens[:3], plain_state.draft_cache.lens[:3])


def test_a_strategy_asking_more_verify_tokens_than_its_tree_offers_runs_in_the_pool():
    # 3_2_12: depth 3, top-2 beam: 2 + 4 + 4 = 10 candidates < 12, so the tree has 11 nodes;
    # the pool's verify step must take that shape, as the eager forward does
    reqs = _requests(4, seed=12)
    want = [o.output_token_ids for o in _engine(None).generate(reqs, NoSpec()).outputs]
    got = _engine(DRAFTER, cuda_graphs=True).generate(reqs, StaticSpec(3, 2, 12))
    assert [o.output_token_ids for o in got.outputs] == want
    assert any(i.accept_lens for i in got.iterations)
