"""Rollout engine: speculative decoding is lossless under greedy decoding (chain and tree, several
strategies, SD switched on and off mid-rollout) for batch sizes 1..16 with mixed prompt and
output lengths and continuous batching; trace replay reproduces lengths exactly; the engine
drives a policy once per iteration with measured seconds; the harvest is exact (weight updates,
graph pool, compaction, shared prompts: test_engine_paths.py).

Run: ``python -m pytest tests/test_engine.py -q``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_tools import (
    DRAFTER,
    POLICIES,
    SWITCHING,
    TARGET,
    RecordingPolicy,
    engine,
    make_requests,
)
from tiny_models import VOCAB, tiny_model

from tltrun.model.drafter import EagleDrafter
from tltrun.model.transformer import CausalContext
from tltrun.rollout.interface import SamplingParams
from tltrun.rollout.measured_trace import (
    accept_hist_by_strategy,
    measured_step,
    prompt_of,
    requests_from_step,
)
from tltsim.policy import NoSpec, SpecDecision, StaticSpec, update_accept_len_ema
from tltsim.trace.schema import Prompt, Response, Step


@pytest.mark.parametrize("num_requests", [1, 2, 3, 5, 8, 12, 16])
def test_greedy_sd_equals_plain_greedy(num_requests):
    reqs = make_requests(num_requests, seed=num_requests)
    running = max(1, num_requests // 3)  # fewer slots than requests: continuous batching
    plain = engine(max_running_requests=running).generate(reqs, NoSpec())
    want = [o.output_token_ids for o in plain.outputs]
    assert [len(w) for w in want] == [r.max_new_tokens for r in reqs] or any(
        o.finish == "stop" for o in plain.outputs
    )
    # catchup_pairs 0: every lagging drafter re-prefilled first (the switch-on path); None:
    # lags within max_verify_tokens fed by the drafting step itself; 6: some of each
    for (name, make), catchup in itertools.product(POLICIES.items(), (None, 0, 6)):
        result = engine(DRAFTER, max_running_requests=running, catchup_pairs=catchup).generate(
            reqs, make()
        )
        got = [o.output_token_ids for o in result.outputs]
        assert got == want, f"{name}, catchup_pairs={catchup}: SD output differs from plain greedy"
        assert [o.finish for o in result.outputs] == [o.finish for o in plain.outputs]


def test_kernel_reference_attention_gives_the_same_outputs():
    # attn_impl="ref" routes every target forward through kernels.tree_attention's reference.
    reqs = make_requests(5, seed=21)
    want = [o.output_token_ids for o in engine().generate(reqs, NoSpec()).outputs]
    got = engine(DRAFTER, attn_impl="ref").generate(reqs, StaticSpec(4, 2, 8))
    assert [o.output_token_ids for o in got.outputs] == want


def test_lossless_when_eos_falls_inside_accepted_drafts():
    # Make the target's most frequent greedy token the EOS, so many requests stop mid-tree.
    reqs = make_requests(10, seed=7, max_new=40)
    counts = torch.bincount(
        torch.tensor(
            [t for o in engine().generate(reqs, NoSpec()).outputs for t in o.output_token_ids]
        )
    )
    model = tiny_model(seed=0, eos_token_ids=(int(counts.argmax()),))
    model.load_state_dict(TARGET.state_dict())
    drafter = EagleDrafter.for_target(model)
    drafter.load_state_dict(DRAFTER.state_dict())
    plain = engine(model=model).generate(reqs, NoSpec())
    assert sum(o.finish == "stop" for o in plain.outputs) >= 3
    for policy in (StaticSpec(4, 1, 4), StaticSpec(4, 4, 16)):
        sd = engine(drafter, model=model).generate(reqs, policy)
        assert [o.output_token_ids for o in sd.outputs] == [
            o.output_token_ids for o in plain.outputs
        ]


def test_accept_histograms_account_for_every_token():
    reqs = make_requests(6, seed=3, max_new=40)
    result = engine(DRAFTER).generate(reqs, StaticSpec(4, 2, 8))
    num_sd = [0] * len(reqs)
    index = {r.id: i for i, r in enumerate(reqs)}
    for it in result.iterations:
        assert it.num_new_tokens <= sum(a + 1 for a in it.accept_lens) or it.is_prefill
    for o in result.outputs:
        emitted = 1 + sum(
            (i + 1) * n for i, n in enumerate(o.accept_hist)
        )  # prefill token + verifies
        # the last verify may overshoot the stop by up to draft_steps tokens
        assert emitted - 4 <= len(o.output_token_ids) <= emitted
        num_sd[index[o.id]] = sum(o.accept_hist)
    assert sum(num_sd) == sum(len(it.accept_lens) for it in result.iterations)
    assert any(a > 0 for it in result.iterations for a in it.accept_lens)


def test_per_response_histograms_by_strategy_add_up():
    # SD switching between strategies: each response's histograms by strategy sum to its
    # accept_hist, and over the responses to the step's histograms by strategy
    result = engine(DRAFTER, max_running_requests=3).generate(
        make_requests(7, seed=12), RecordingPolicy(SWITCHING)
    )
    by_step = accept_hist_by_strategy(result.iterations)
    total: dict[str, list[int]] = {}
    for o in result.outputs:
        own = [0] * len(o.accept_hist)
        for name, hist in o.accept_hist_by_strategy.items():
            assert name != "off" and len(hist) <= SpecDecision.parse(name).draft_steps + 1
            for i, n in enumerate(hist):
                own[i] += n
                total.setdefault(name, [0] * 17)[i] += n
        assert own == o.accept_hist
    assert len(total) >= 3
    for name, hist in by_step.items():
        assert total[name][: len(hist)] == hist and not any(total[name][len(hist) :])
    step = measured_step(0, result)
    table = step.measured.to_dict()["response_accept_hist_by_strategy"]  # as JSON: lists
    for p in step.prompts:  # one entry per response, in the prompt's order
        outs = [o for o in result.outputs if prompt_of(o.id) == p.id]
        assert table.get(p.id, [{}] * len(outs)) == [o.accept_hist_by_strategy for o in outs]


def test_trace_replay_generates_exactly_the_trace_lengths():
    step = Step(
        0,
        (
            Prompt("p0", 5, (Response(9), Response(1), Response(30))),
            Prompt("p1", 17, (Response(12), Response(4))),
        ),
    )
    reqs = requests_from_step(step, VOCAB, seed=0)
    for policy, drafter in ((NoSpec(), None), (StaticSpec(3, 2, 6), DRAFTER)):
        result = engine(drafter, max_running_requests=2).generate(reqs, policy)
        assert [len(o.output_token_ids) for o in result.outputs] == step.response_lengths()
        assert all(o.finish == "length" for o in result.outputs)
        measured = measured_step(0, result, policy_name=policy.name, hardware="cpu")
        assert [p.id for p in measured.prompts] == ["p0", "p1"]
        assert measured.response_lengths() == step.response_lengths()
        assert [p.prompt_tokens for p in measured.prompts] == [5, 17]
        assert measured.measured.rollout_s > 0
        has_hist = all(
            r.accept_hist is not None for p in measured.prompts for r in p.responses if r.tokens > 1
        )
        assert has_hist == (drafter is not None)


def test_engine_drives_the_policy_once_per_iteration_with_measured_time():
    policy = RecordingPolicy(SWITCHING)
    result = engine(DRAFTER, max_running_requests=3, catchup_pairs=0).generate(
        make_requests(7, seed=11), policy, step=4
    )
    assert policy.calls[0] == ("start", 4)
    decode_records = [i for i in result.iterations if not i.is_prefill]
    decides = [c[1] for c in policy.calls if c[0] == "decide"]
    observes = [c[1] for c in policy.calls if c[0] == "observe"]
    assert len(decides) == len(observes) == len(decode_records) > len(SWITCHING)
    kinds = [c[0] for c in policy.calls[1:]]
    assert all(
        a == "decide" and b == "observe" for a, b in zip(kinds[::2], kinds[1::2], strict=True)
    )
    # each decode iteration's seconds, plus the drafter re-prefill run just before it
    switch_s, charged = 0.0, []
    for i in result.iterations:
        if i.is_drafter_prefill:
            switch_s += i.wall_s
        elif not i.is_prefill:
            charged.append(i.wall_s + switch_s)
            switch_s = 0.0
    for obs, fb, rec, want_s in zip(decides, observes, decode_records, charged, strict=True):
        assert obs.step == fb.step == 4 and obs.num_active == fb.num_active == rec.num_active
        assert fb.iteration_s > 0 and fb.iteration_s == want_s
        assert fb.accepted_tokens == rec.num_new_tokens and fb.decision.strategy == rec.strategy
        assert obs.mean_context_tokens > 0
    # the shared estimate (tltsim.policy.update_accept_len_ema) over the SD iterations so far
    ema = 0.0
    for obs, rec in zip(decides, decode_records, strict=True):
        assert obs.accept_len_ema == ema
        if rec.strategy != "off":
            ema = update_accept_len_ema(ema, rec.num_new_tokens / rec.num_active)
    assert any(o.accept_len_ema >= 1.0 for o in decides)  # after the first SD iteration
    # SD switched on for requests the drafter had not seen: a drafter re-prefill is recorded,
    # and the bandit's feedback of the iteration that needed it carries its seconds.
    assert any(i.is_drafter_prefill and i.is_prefill and i.wall_s > 0 for i in result.iterations)
    assert any(c > r.wall_s for c, r in zip(charged, decode_records, strict=True))


def test_short_drafter_lags_are_fed_by_the_drafting_step():
    """A request the drafter has seen nothing of is re-prefilled (its group's prompt fed once);
    one lagging at most catchup_pairs pairs is caught up inside the drafting step, one lagging
    more is re-prefilled first. No re-prefill record without a request to re-prefill."""
    reqs = make_requests(7, seed=11)
    seen, records = {}, {}
    for catchup in (None, 0, 2):
        eng = engine(DRAFTER, max_running_requests=3, catchup_pairs=catchup)
        choose, calls = eng._stale_drafter, []

        def spy(running, choose=choose, calls=calls, eng=eng):
            stale = choose(running)
            state = {
                s.slot: (
                    int(eng.cache.lens[s.slot] - eng.draft_cache.lens[s.slot]),
                    int(eng.draft_cache.lens[s.slot]),
                )
                for s in running
            }
            behind = [state[s.slot] for s in running if not s.is_drafter_fresh]
            calls.append((behind, [state[s.slot] for s in stale]))
            return stale

        eng._stale_drafter = spy
        result = eng.generate(reqs, RecordingPolicy(SWITCHING))
        seen[catchup] = calls
        records[catchup] = [i.num_active for i in result.iterations if i.is_drafter_prefill]
        assert records[catchup] == [len(stale) for _, stale in calls if stale]
    assert engine(DRAFTER, catchup_pairs=2).catchup_pairs() == 2
    assert engine(DRAFTER).catchup_pairs() == 64  # max_verify_tokens, no graph pool
    for catchup, cap in ((None, 64), (0, 0), (2, 2)):
        for behind, stale in seen[catchup]:
            assert stale == [(n, m) for n, m in behind if n > cap or m == 0]
    # the SWITCHING cycle's off iterations leave lags of 1-3 pairs behind seen requests
    lags = [n for behind, _ in seen[None] for n, m in behind if m > 0]
    assert lags and max(lags) > 2
    assert sum(records[None]) < sum(records[2]) < sum(records[0])


def test_step_by_step_rollout_equals_generate():
    """start_rollout, step() until done, finish_rollout: the same outputs and iteration kinds
    as generate (which runs exactly that), each step's records returned as it runs."""
    reqs = make_requests(7, seed=3)
    want = engine(DRAFTER, max_running_requests=3).generate(reqs, RecordingPolicy(SWITCHING))
    eng = engine(DRAFTER, max_running_requests=3)
    with pytest.raises(RuntimeError, match="no rollout in progress"):
        eng.step()
    eng.start_rollout(reqs, RecordingPolicy(SWITCHING))
    records = []
    while not eng.is_rollout_done:
        assert len(eng.scheduler.running) <= 3
        ran = eng.step()
        assert sum(not r.is_prefill for r in ran) <= 1  # at most one decode iteration a step
        records += ran
    got = eng.finish_rollout()
    assert [o.output_token_ids for o in got.outputs] == [o.output_token_ids for o in want.outputs]
    assert got.iterations == records
    kinds = [(i.is_prefill, i.strategy, i.num_active) for i in got.iterations]
    assert kinds == [(i.is_prefill, i.strategy, i.num_active) for i in want.iterations]
    with pytest.raises(RuntimeError):
        eng.finish_rollout()


def test_sampled_sd_is_reproducible_from_the_seed():
    reqs = make_requests(6, seed=2)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    runs = [
        engine(DRAFTER, sampling=params, seed=s).generate(reqs, StaticSpec(3, 2, 6))
        for s in (1, 1, 2)
    ]
    out = [[o.output_token_ids for o in r.outputs] for r in runs]
    assert out[0] == out[1] and out[0] != out[2]
    for o, r in zip(runs[0].outputs, reqs, strict=True):
        assert 1 <= len(o.output_token_ids) <= r.max_new_tokens


def test_harvest_holds_the_target_hidden_states():
    eng = engine(DRAFTER, is_harvesting=True)
    result = eng.generate(make_requests(5, seed=9), StaticSpec(4, 2, 8))
    records = eng.pop_harvest()
    assert sorted(r.request_id for r in records) == sorted(o.id for o in result.outputs)
    assert eng.harvest == []
    for rec in records:
        ids = rec.token_ids[None]
        with torch.no_grad():
            _, hidden = TARGET(ids, torch.arange(ids.shape[1])[None], CausalContext())
        assert rec.hidden.shape == (ids.shape[1] - 1, TARGET.config.hidden_size)
        assert (rec.hidden - hidden[0, :-1]).abs().max() < 1e-4
