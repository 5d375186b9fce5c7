"""The whole-verify step of the graph pool (``tltrun.rollout.static_verify``): on the CPU it runs
uncaptured, the reference of its CUDA graph. Checked against the eager engine token for token
(sampled EAGLE chains and trees, hidden states harvested; greedy and history drafting through
the pool: tests/test_engine_paths.py, tests/test_history_engine.py), the tree walk under the
strategy's static bounds against the walk that reads them from the trees, a padded bucket (free
rows untouched but their length), host traffic a capture would refuse, and what an SD
iteration still dispatches from the host.

Run: ``python -m pytest tests/test_static_verify.py -q``.
"""

from __future__ import annotations

import pytest
import torch
from engine_tools import DRAFTER, TARGET, RecordingPolicy, engine, random_slots
from hypothesis import given, settings
from hypothesis import strategies as st
from test_capture_hygiene import READS, HostTraffic, compiled_flex_path  # noqa: F401 (a fixture)
from tiny_models import VOCAB
from torch.utils._python_dispatch import TorchDispatchMode

from tltrun.model.history_drafter import tree_nodes
from tltrun.model.kvcache import KVCache
from tltrun.rollout.draft_graphs import StaticDraft
from tltrun.rollout.graphs import CapturePlan, GraphPool
from tltrun.rollout.interface import Request, SamplingParams
from tltrun.rollout.speculative import DraftTree, TreeShape, verify_with_uniforms
from tltrun.rollout.static_decode import DecodeSources
from tltrun.rollout.static_verify import StaticVerify
from tltsim.policy import SpecDecision, StaticSpec

SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9)
GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 64
SWITCHING = [SpecDecision.parse(s) for s in ("4_1_4", "off", "3_2_6", "5_4_16", "off", "2_1_2")]


def _outputs(eng, reqs, policy):
    result = eng.generate(reqs, policy)
    harvest = {tuple(r.token_ids.tolist()): r.hidden for r in eng.pop_harvest()}
    return [o.output_token_ids for o in result.outputs], harvest, result


@pytest.mark.parametrize("name", ["4_1_4", "3_2_6", "5_4_16", "switching"])
def test_sampled_sd_through_the_pool_equals_the_eager_engine(name, monkeypatch):
    # every batch 1..4 has its own bucket: the static verify draws verify()'s uniforms
    calls = []
    call = StaticVerify.__call__
    monkeypatch.setattr(StaticVerify, "__call__", lambda s, t, n: calls.append(n) or call(s, t, n))
    reqs = [Request(f"r{i}", (5 + i, 9, 4 + 2 * i), 12 + 5 * i) for i in range(6)]

    def policy():
        return RecordingPolicy(SWITCHING) if name == "switching" else StaticSpec(strategy=name)

    fields = dict(sampling=SAMPLED, is_harvesting=True, seed=11)
    want, want_hidden, eager = _outputs(engine(DRAFTER, **fields), reqs, policy())
    eng = engine(DRAFTER, **fields, cuda_graphs=True, graph_batch_sizes=(1, 2, 3, 4))
    got, got_hidden, pooled = _outputs(eng, reqs, policy())
    assert got == want
    # a policy the plan cannot foresee gets decode graphs only: its SD iterations run eagerly
    # between pooled decode steps (the state both keep must agree)
    assert set(calls) >= {4} if name != "switching" else calls == []
    assert pooled.accept_hist_by_drafter() == eager.accept_hist_by_drafter()
    assert sum(pooled.accept_hist_by_drafter()["eagle"][1:]) > 0  # drafts were accepted
    assert want_hidden.keys() == got_hidden.keys()
    for ids, hidden in want_hidden.items():
        torch.testing.assert_close(got_hidden[ids], hidden, atol=1e-5, rtol=1e-5)


def _random_tree(draw, num_nodes: int, topk: int, max_depth: int) -> list[int]:
    """Parents of an EAGLE-like tree: at most ``topk`` children a node, depth <= max_depth."""
    parents, depth, children = [0], [0], [0]
    for _ in range(num_nodes - 1):
        open_nodes = [i for i in range(len(parents)) if children[i] < topk and depth[i] < max_depth]
        if not open_nodes:
            break
        p = draw(st.sampled_from(open_nodes))
        parents.append(p)
        depth.append(depth[p] + 1)
        children.append(0)
        children[p] += 1
    return parents


def _history_tree(draw, num_drafted: int, topk: int, max_depth: int):
    """(tokens, parents) of a history draft: <= topk branches with distinct first tokens,
    padded with copies of the root's first child, as ``RolloutHistory.draft`` pads."""
    num_branches = draw(st.integers(0, topk))
    firsts = draw(st.lists(st.integers(0, VOCAB - 1), min_size=num_branches,
                           max_size=num_branches, unique=True))  # fmt: skip
    branches = [
        [f] + draw(st.lists(st.integers(0, VOCAB - 1), max_size=max_depth - 1)) for f in firsts
    ]
    toks, pars = tree_nodes(branches, num_drafted)
    root = draw(st.integers(0, VOCAB - 1))
    num_pad = num_drafted - len(toks)
    pad = toks[0] if toks else root
    return [root] + toks + [pad] * num_pad, [0] + pars + [0] * num_pad


@settings(max_examples=60, deadline=None)
@given(data=st.data(), topk=st.integers(1, 4), max_depth=st.integers(1, 5),
       is_history=st.booleans(), is_greedy=st.booleans())  # fmt: skip
def test_the_bounded_tree_walk_equals_the_walk_that_reads_the_trees(
    data, topk, max_depth, is_history, is_greedy
):
    # the bounds of a strategy (depth <= draft steps, sibling ranks < top-k) leave the walk as
    # it is, for EAGLE-like trees and for history trees whose root has extra (padding) children
    capacity = sum(topk**d for d in range(1, max_depth + 1))
    num_seqs, num_drafted = 3, data.draw(st.integers(1, min(12, capacity)))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tokens, parents = [], []
    for _ in range(num_seqs):
        if is_history:
            tok, par = _history_tree(data.draw, num_drafted, topk, max_depth)
        else:
            par = _random_tree(data.draw, num_drafted + 1, topk, max_depth)
            tok = torch.randint(0, VOCAB, (num_drafted + 1,), generator=gen).tolist()
        tokens.append(tok)
        parents.append(par)
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    logits = torch.randn(num_seqs, num_drafted + 1, VOCAB, generator=gen) * 3
    if is_greedy:
        probs = torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float()
    else:
        probs = torch.softmax(logits, -1)
    u_accept = torch.rand(num_seqs, num_drafted, generator=gen)
    u_sample = torch.rand(num_seqs, generator=gen)
    shape = TreeShape(max_depth=max_depth, max_children=topk, is_chain=False)
    want = verify_with_uniforms(tree, probs, u_accept, u_sample)
    got = verify_with_uniforms(tree, probs, u_accept, u_sample, shape=shape)
    width = want.accepted_nodes.shape[1]
    assert got.accepted_nodes.shape[1] == max_depth + 1 >= width
    assert torch.equal(got.num_accepted, want.num_accepted)
    assert torch.equal(got.accepted_nodes[:, :width], want.accepted_nodes)
    assert torch.equal(got.out_tokens[:, :width], want.out_tokens)
    extra = max_depth + 1 - width  # past the walk's end: the last node, the correction token
    assert torch.equal(got.accepted_nodes[:, width:], want.accepted_nodes[:, -1:].expand(-1, extra))
    assert torch.equal(got.out_tokens[:, width:], want.out_tokens[:, -1:].expand(-1, extra))


def _verify_state(bucket: int, strategy: str, sampling: SamplingParams, impl: str = "sdpa"):
    """A pool's verify step at ``bucket`` over random slot state (tokens, hidden, lengths)."""
    cache, sources = random_slots(bucket + 1, MAX_TOKENS, sampling, seed=bucket)
    plan = CapturePlan(spec_graphs=((bucket, strategy),))
    pool = GraphPool(TARGET, cache, plan, impl, is_capturing=False, decoding=sources)
    return pool, cache, sources


TREE_PARENTS = [0, 0, 0, 1, 1, 2, 3]  # 7 nodes, 2 children at most, depth 3: a 3_2_6 tree


def test_padded_verify_step_writes_the_real_rows_only():
    from tltrun.model.drafter import tree_layout
    from tltrun.rollout.speculative import logits_to_probs

    pool, cache, src = _verify_state(4, "3_2_6", GREEDY)
    before = (cache.lens.clone(), src.tokens.clone(), src.hidden.clone())
    lens = before[0][:2]
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 7), generator=gen)
    tokens[:, 0] = src.tokens[torch.arange(2), lens]  # the roots: the pending tokens
    tree = DraftTree(tokens, torch.tensor([TREE_PARENTS] * 2))
    depth, mask = tree_layout(tree.parents, 3)
    with torch.no_grad():  # the same verify on the two real slots, eagerly (greedy: no draws)
        ctx = cache.context(torch.arange(2), 7, tree_mask=mask)
        logits, _ = TARGET(tokens, lens[:, None] + depth, ctx)
    cache.lens.copy_(before[0])  # the eager forward wrote KV entries past the lengths only
    want = verify_with_uniforms(tree, logits_to_probs(logits, GREEDY),
                                torch.zeros(2, 6), torch.zeros(2))  # fmt: skip
    step = pool.verify_step(2, "3_2_6")
    assert step is pool.verify_steps[(4, "3_2_6")] and pool.verify_step(5, "3_2_6") is None
    accepted, out = step(tree, 2)
    assert accepted == want.num_accepted.tolist()
    assert out == [row[: a + 1] for row, a in zip(want.out_tokens.tolist(), accepted, strict=True)]
    assert cache.lens[:2].tolist() == [int(n) + a + 1 for n, a in zip(lens, accepted, strict=True)]
    assert cache.lens[2:4].tolist() == [0, 0] and cache.lens[4] == before[0][4]
    is_written = torch.zeros_like(src.tokens, dtype=torch.bool)
    is_written[:2, :] = True  # real rows: past their length anything may change
    for r in range(2):
        is_written[r, : int(lens[r]) + 1] = False
        assert src.tokens[r, lens[r] + 1 : lens[r] + 2 + accepted[r]].tolist() == out[r]
    assert torch.equal(src.tokens[~is_written], before[1][~is_written])  # free rows included
    assert torch.equal(src.hidden[2:], before[2][2:])
    for r in range(2):
        assert torch.equal(src.hidden[r, : lens[r]], before[2][r, : lens[r]])
    with pytest.raises(ValueError, match="verify step 4x7: got 2 slots, trees \\(2, 5\\)"):
        step(DraftTree(tokens[:, :5], torch.tensor([TREE_PARENTS[:5]] * 2)), 2)


@pytest.mark.parametrize("impl", ["flex", "sdpa"])
@pytest.mark.parametrize(
    "strategy,sampling", [("4_1_4", SAMPLED), ("4_1_4", GREEDY), ("3_2_6", SAMPLED)]
)
def test_verify_step_body_is_capturable(impl, strategy, sampling, compiled_flex_path):  # noqa: F811
    pool, _, _ = _verify_state(4, strategy, sampling, impl)
    step = next(iter(pool.verify_steps.values()))
    assert (step.probs_in is not None) == (strategy == "4_1_4" and sampling is SAMPLED)
    step.parents_in.copy_(torch.tensor(TREE_PARENTS if strategy == "3_2_6" else [0, 0, 1, 2, 3]))
    step.num_real.fill_(3)
    with torch.no_grad(), HostTraffic() as guard:
        step.run()
    assert guard.seen == []


class _OpsOutside(TorchDispatchMode):
    """Counts the aten ops dispatched outside the pool's graph bodies."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @classmethod
    def of(cls, monkeypatch, *graph_bodies) -> _OpsOutside:
        """A counter that leaves out the ``run`` of every class in ``graph_bodies``."""
        counter = cls()
        for body in graph_bodies:
            run = body.run

            def inside(self, run=run):
                counter.depth += 1
                try:
                    run(self)
                finally:
                    counter.depth -= 1

            monkeypatch.setattr(body, "run", inside)
        return counter


@pytest.mark.parametrize("strategy", ["4_1_4", "8_4_32", "history:4_2_8"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
def test_a_pooled_sd_iteration_reads_the_device_once(strategy, sampling, monkeypatch):
    # eagerly around its verify forward an SD iteration dispatched 158-1,003 ops and read
    # device values 5-39 times (chain 4 to tree 8_4_32, batch 4, session 23, counted as here);
    # under the pool, what is left: the drafting step's check that the pending pairs fit (one
    # read; none for the history drafter) and the copies of the tree in
    counter = _OpsOutside.of(monkeypatch, StaticVerify, StaticDraft)
    eng = engine(DRAFTER, cuda_graphs=True, sampling=sampling)
    reqs = [Request(f"r{i}", (5 + i, 9), 40, ignore_eos=True) for i in range(4)]
    eng.start_rollout(reqs, StaticSpec(strategy=strategy))
    eng.step()
    eng.step()  # past the drafter's re-prefill
    with counter:
        records = eng.step()
    decision = SpecDecision.parse(strategy)
    assert [(r.num_active, r.strategy, r.drafter) for r in records] == [
        (4, decision.strategy, decision.drafter)
    ]
    reads = sum(counter.ops.count(op) for op in READS)
    assert reads == (0 if strategy.startswith("history") else 1), counter.ops
    assert len(counter.ops) < 40, counter.ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture is CUDA-only")
@pytest.mark.parametrize("strategy", ["4_1_4", "3_2_6"])
def test_captured_verify_step_replays_the_uncaptured_one(strategy):
    from tiny_models import tiny_model

    def state(is_capturing):
        model = tiny_model(seed=3).to("cuda")
        gen = torch.Generator().manual_seed(0)
        cache = KVCache.for_model(model.config, 4, MAX_TOKENS, device="cuda")
        sources = DecodeSources(
            tokens=torch.randint(0, VOCAB, (4, MAX_TOKENS), generator=gen).cuda(),
            hidden=torch.zeros(4, MAX_TOKENS, model.config.hidden_size, device="cuda"),
            sampling=GREEDY,
            generator=torch.Generator("cuda").manual_seed(3),
        )
        plan = CapturePlan(spec_graphs=((4, strategy),))
        pool = GraphPool(model, cache, plan, "sdpa", is_capturing, decoding=sources)
        cache.lens.copy_(torch.randint(1, 30, (4,), generator=gen))  # after the capture
        return pool.verify_steps[(4, strategy)], cache, sources

    (captured, cache, src), (eager, e_cache, e_src) = state(True), state(False)
    assert captured.graph is not None and eager.graph is None
    e_cache.k.copy_(cache.k)  # the capture wrote scratch entries: same KV on both sides
    e_cache.v.copy_(cache.v)
    parents = TREE_PARENTS if strategy == "3_2_6" else [0, 0, 1, 2, 3]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (3, len(parents)), generator=gen).cuda()
        tree = DraftTree(tokens, torch.tensor([parents] * 3, device="cuda"))
        assert captured(tree, 3) == eager(tree, 3)
        torch.testing.assert_close(src.hidden, e_src.hidden, atol=1e-4, rtol=1e-4)
        assert torch.equal(src.tokens, e_src.tokens) and torch.equal(cache.lens, e_cache.lens)


def test_a_tree_verify_launches_a_fixed_number_of_ops_per_depth_level(monkeypatch):
    # what an 8_4_32 verify graph holds besides the forward: the point-mass walk tests a node's
    # siblings at once (345-359 ops, greedy / sampled); rank by rank it was 971-985 (session 23)
    from tltrun.rollout.graphs import StaticForward

    counter = _OpsOutside.of(monkeypatch, StaticForward)
    counts = {}
    for depth in (4, 8):
        pool, _, _ = _verify_state(4, f"{depth}_4_32", SAMPLED)
        step = pool.verify_steps[(4, f"{depth}_4_32")]
        step.parents_in.copy_(torch.tensor([0] + [max(0, (i - 1) // 4) for i in range(1, 33)]))
        step.num_real.fill_(3)
        counter.ops = []
        with torch.no_grad(), counter:
            step.run()
        counts[depth] = sum(op not in VIEW_OPS for op in counter.ops)
    per_level = (counts[8] - counts[4]) / 4
    assert counts[8] < 400 and per_level < 40, counts  # rank by rank: 111 a level


VIEW_OPS = {
    "aten.slice.Tensor", "aten.view.default", "aten.select.int", "aten.unsqueeze.default",
    "aten.expand.default", "aten.t.default", "aten.lift_fresh.default", "aten.alias.default",
    "aten._unsafe_view.default", "aten.transpose.int", "aten.squeeze.dim", "aten.unbind.int",
    "aten.permute.default", "aten.detach.default",
}  # fmt: skip


def test_sampled_chains_verify_the_drafting_buffer_in_place():
    from tltrun.rollout.static_verify import _copy_in

    eng = engine(DRAFTER, sampling=SAMPLED, cuda_graphs=True)
    eng.prepare_graphs([StaticSpec(strategy="4_1_4")])
    pool = eng.graphs
    assert pool.verify_buffers.probs is pool.draft_buffers.probs  # one buffer, not two
    drafted = pool.drafts[(4, "4_1_4")].probs_out[:3]
    verify = pool.verify_steps[(4, "4_1_4")]
    assert drafted.data_ptr() == verify.probs_in.data_ptr()  # the same view: nothing copied
    # another view of the same buffer (another bucket's drafting step) goes through a copy
    buf = torch.arange(24.0)
    dst, src = buf[:12].view(2, 2, 3), buf[6:18].view(2, 2, 3)
    want = src.clone()
    _copy_in(dst, src)
    assert torch.equal(dst, want)
    fresh = torch.rand(2, 2, 3)
    _copy_in(dst, fresh)
    assert torch.equal(dst, fresh)
