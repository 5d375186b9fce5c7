"""The whole-iteration decode step of the graph pool (``tltrun.rollout.static_decode``): on the
CPU it runs uncaptured, the reference of its CUDA graph. Checked against the eager engine token
for token (greedy and sampled with top-k / top-p, hidden states harvested), on a padded bucket
(free rows untouched but their length), for host traffic a capture would refuse, and the
decode record's context tokens (now counted on the host) against the cache.

Run: ``python -m pytest tests/test_static_decode.py -q``.
"""

from __future__ import annotations

import pytest
import torch
from engine_tools import DRAFTER, TARGET, engine, make_requests, random_slots
from test_capture_hygiene import HostTraffic, compiled_flex_path  # noqa: F401 (a fixture)
from tiny_models import VOCAB
from torch.utils._python_dispatch import TorchDispatchMode

from tltrun.model.kvcache import KVCache
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.graphs import CapturePlan, GraphPool
from tltrun.rollout.interface import Request, SamplingParams
from tltrun.rollout.static_decode import DecodeSources, StaticDecode
from tltsim.policy import NoSpec, TLTAdaptive

SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9)
MAX_TOKENS = 64


def _outputs(eng: RolloutEngine, reqs, policy):
    result = eng.generate(reqs, policy)
    harvest = {tuple(r.token_ids.tolist()): r.hidden for r in eng.pop_harvest()}
    return [o.output_token_ids for o in result.outputs], harvest


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SAMPLED])
def test_decode_step_equals_the_eager_iteration_token_for_token(sampling, monkeypatch):
    # every batch 1..5 has its own bucket: one uniform per real row, as the eager sampler draws
    calls = []
    call = StaticDecode.__call__
    monkeypatch.setattr(StaticDecode, "__call__", lambda s, n: calls.append(n) or call(s, n))
    reqs = make_requests(9, seed=4, max_new=40)
    fields = dict(max_running_requests=5, sampling=sampling, is_harvesting=True)
    want, want_hidden = _outputs(engine(**fields), reqs, NoSpec())
    eng = engine(**fields, cuda_graphs=True, graph_batch_sizes=(1, 2, 3, 4, 5))
    got, got_hidden = _outputs(eng, reqs, NoSpec())
    assert got == want and len(set(map(tuple, want))) > 1
    assert calls and set(calls) >= {5, 1}  # the step ran, full and in the tail
    assert want_hidden.keys() == got_hidden.keys()
    for ids, hidden in want_hidden.items():
        torch.testing.assert_close(got_hidden[ids], hidden, atol=1e-5, rtol=1e-5)


def test_sampled_decode_step_differs_from_greedy_and_follows_the_seed():
    reqs = make_requests(6, seed=8, max_new=30)

    def run(seed, sampling=SAMPLED):
        fields = dict(sampling=sampling, seed=seed, cuda_graphs=True)
        return _outputs(engine(**fields), reqs, NoSpec())[0]

    assert run(1) == run(1) and run(1) != run(2)
    assert run(1) != run(1, SamplingParams(temperature=0.0))


def _decode_state(bucket: int, sampling: SamplingParams):
    """A pool's decode step at ``bucket`` over random slot state (tokens, hidden, lengths)."""
    cache, sources = random_slots(bucket + 1, MAX_TOKENS, sampling, seed=bucket)
    plan = CapturePlan(decode_buckets=(bucket,))
    pool = GraphPool(TARGET, cache, plan, "sdpa", is_capturing=False, decoding=sources)
    return pool, cache, sources


def test_padded_decode_step_writes_the_real_rows_only():
    pool, cache, src = _decode_state(4, SamplingParams(temperature=0.0))
    before = (cache.lens.clone(), src.tokens.clone(), src.hidden.clone())
    lens = before[0][:2]
    ids = src.tokens[torch.arange(2), lens][:, None]  # (2,1) the pending tokens
    with torch.no_grad():  # the same forward on the two real slots, eagerly
        logits, hidden = TARGET(ids, lens[:, None], cache.context(torch.arange(2), 1))
    step = pool.decode_step(2)
    assert step is pool.decode_steps[4] and pool.decode_step(5) is None
    nxt = step(2)
    assert torch.equal(nxt, logits[:, 0].argmax(-1))
    assert cache.lens[:2].tolist() == (lens + 1).tolist()
    assert cache.lens[2:4].tolist() == [0, 0]  # free rows of the bucket: length 0
    assert cache.lens[4] == before[0][4]  # outside the bucket: untouched
    for r in range(2):
        assert src.tokens[r, lens[r] + 1] == nxt[r]
        torch.testing.assert_close(src.hidden[r, lens[r]], hidden[r, 0])
    is_written = torch.zeros_like(src.tokens, dtype=torch.bool)
    is_written[torch.arange(2), lens + 1] = True
    assert torch.equal(src.tokens[~is_written], before[1][~is_written])  # free rows included
    is_written = torch.zeros(src.hidden.shape[:2], dtype=torch.bool)
    is_written[torch.arange(2), lens] = True
    assert torch.equal(src.hidden[~is_written], before[2][~is_written])
    with pytest.raises(ValueError, match="batch 4: got 5"):
        step(5)


def test_a_decode_step_needs_a_one_token_forward():
    _, cache, src = _decode_state(2, SamplingParams(temperature=0.0))
    plan = CapturePlan(spec_graphs=((2, "2_1_2"),))
    pool = GraphPool(TARGET, cache, plan, "sdpa", is_capturing=False, decoding=src)
    assert pool.decode_steps == {}  # no decode bucket, no decode step
    with pytest.raises(ValueError, match="1 token per row, got 3"):
        StaticDecode(pool.verify[(2, "2_1_2")], src)


def test_pools_without_decode_sources_keep_bare_forwards():
    cache = KVCache.for_model(TARGET.config, 2, MAX_TOKENS)
    pool = GraphPool(TARGET, cache, CapturePlan(decode_buckets=(2,)), "sdpa", False)
    assert pool.decode_steps == {} and pool.decode_step(1) is None
    assert pool.decode_forward(1) is pool.decode[2]


@pytest.mark.parametrize("impl", ["flex", "sdpa"])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SAMPLED])
def test_decode_step_body_is_capturable(impl, sampling, compiled_flex_path):  # noqa: F811
    pool, cache, src = _decode_state(4, sampling)
    pool = GraphPool(TARGET, cache, pool.plan, impl, is_capturing=False, decoding=src)
    step = pool.decode_steps[4]
    step.num_real.fill_(3)
    with torch.no_grad(), HostTraffic() as guard:
        step.run()
    assert guard.seen == []


def test_decode_records_count_the_cache_context_on_the_host(monkeypatch):
    # the record's context tokens come from the sequences (cache = all but the pending token):
    # checked against the cache's lengths on every plain and speculative iteration
    seen = []
    iterate = RolloutEngine._decode_iteration

    def checked(self, rollout):
        running = list(rollout.scheduler.running)
        on_device = int(sum(self.cache.lens[s.slot] for s in running))
        records = iterate(self, rollout)
        seen.append((records[-1].context_tokens, on_device))
        return records

    monkeypatch.setattr(RolloutEngine, "_decode_iteration", checked)
    policy = TLTAdaptive(threshold=2, warmup_checks=1, strategies=("3_2_6",), bucket_starts=(1,))
    engine(DRAFTER, cuda_graphs=True).generate(make_requests(6, seed=2), policy)
    assert len(seen) > 10 and all(a == b for a, b in seen)


class _OpsOutside(TorchDispatchMode):
    """Counts the aten ops dispatched outside ``StaticDecode.run`` (what a graph replays)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.is_inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.is_inside:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SAMPLED])
def test_a_pooled_decode_iteration_leaves_the_host_one_fill(sampling, monkeypatch):
    # the host's device work per plain iteration under the pool: the real-row count's fill and
    # the output view (reading the tokens back dispatches nothing); the eager epilogue this
    # replaced dispatched 42-48 ops around the forward graph (the eager engine ~260)
    counter = _OpsOutside()
    run = StaticDecode.run

    def inside(self):
        counter.is_inside = True
        try:
            run(self)
        finally:
            counter.is_inside = False

    monkeypatch.setattr(StaticDecode, "run", inside)
    eng = engine(cuda_graphs=True, sampling=sampling)
    eng.start_rollout(
        [Request(f"r{i}", (5 + i, 9), 40, ignore_eos=True) for i in range(4)], NoSpec()
    )
    eng.step()  # admission and prefill
    with counter:
        records = eng.step()
    assert [r.is_prefill for r in records] == [False] and records[0].num_active == 4
    assert sorted(counter.ops) == ["aten.fill_.Scalar", "aten.slice.Tensor"]
    eager = _OpsOutside()
    eng = engine(cuda_graphs=False, sampling=sampling)
    eng.start_rollout(
        [Request(f"r{i}", (5 + i, 9), 40, ignore_eos=True) for i in range(4)], NoSpec()
    )
    eng.step()
    with eager:
        eng.step()
    assert len(eager.ops) > 100  # the guard sees a forward's ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture is CUDA-only")
def test_captured_decode_step_replays_the_uncaptured_one_and_draws_fresh_uniforms():
    from tiny_models import tiny_model

    def state(sampling, is_capturing):
        model = tiny_model(seed=3).to("cuda")
        gen = torch.Generator().manual_seed(0)
        cache = KVCache.for_model(model.config, 4, MAX_TOKENS, device="cuda")
        lens = torch.randint(1, 30, (4,), generator=gen)
        sources = DecodeSources(
            tokens=torch.randint(0, VOCAB, (4, MAX_TOKENS), generator=gen).cuda(),
            hidden=torch.zeros(4, MAX_TOKENS, model.config.hidden_size, device="cuda"),
            sampling=sampling,
            generator=torch.Generator("cuda").manual_seed(3),
        )
        plan = CapturePlan(decode_buckets=(4,))
        pool = GraphPool(model, cache, plan, "sdpa", is_capturing, decoding=sources)
        cache.lens.copy_(lens)  # after the capture, which runs on free slots
        return pool.decode_steps[4], cache, sources, lens.cuda()

    greedy = SamplingParams(temperature=0.0)
    (captured, cache, src, lens), (eager, e_cache, e_src, _) = (
        state(greedy, True),
        state(greedy, False),
    )
    assert captured.graph is not None and eager.graph is None
    e_cache.k.copy_(cache.k)  # the capture wrote scratch entries: same KV on both sides
    e_cache.v.copy_(cache.v)
    for _ in range(3):
        torch.testing.assert_close(captured(3), eager(3))
        torch.testing.assert_close(src.hidden, e_src.hidden, atol=1e-4, rtol=1e-4)
        assert torch.equal(src.tokens, e_src.tokens) and torch.equal(cache.lens, e_cache.lens)
    step, cache, src, lens = state(SamplingParams(temperature=5.0), True)
    draws = set()
    for _ in range(20):
        cache.lens.copy_(lens)
        draws.add(tuple(step(4).tolist()))
    assert len(draws) > 1  # each replay advanced the registered generator
