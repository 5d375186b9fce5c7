"""Rollout engine paths beside plain decoding, all compared token for token with plain greedy
or with a fresh engine: weight updates, the CUDA-graph pool path and flex attention on CPU,
finished-slot compaction, shared group prompts (prefilled once); one-line errors for bad
requests; import hygiene.

Run: ``python -m pytest tests/test_engine_paths.py -q``.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
from engine_tools import (
    DRAFTER,
    POLICIES,
    TARGET,
    engine,
    make_requests,
)
from tiny_models import VOCAB, tiny_model

from tltrun.model.drafter import EagleDrafter
from tltrun.model.transformer import CausalContext
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import Request
from tltsim.policy import NoSpec, SpecDecision, StaticSpec, TLTAdaptive


def test_update_weights_switches_to_the_new_policy_weights():
    other = tiny_model(seed=42)
    reqs = make_requests(4, seed=5)
    want = [o.output_token_ids for o in engine(model=other).generate(reqs, NoSpec()).outputs]
    model = tiny_model(seed=0)
    eng = engine(EagleDrafter.for_target(model), model=model)
    before = [o.output_token_ids for o in eng.generate(reqs, NoSpec()).outputs]
    eng.update_weights(other.state_dict())
    after = [o.output_token_ids for o in eng.generate(reqs, StaticSpec(3, 2, 6)).outputs]
    assert after == want and before != want
    with pytest.raises(ValueError, match="missing"):
        eng.update_weights({"model.norm.weight": torch.ones(48)})
    # a wrong shape anywhere refuses the whole update: nothing was copied (tensors before it
    # in the state dict were, and the engine ran a mix of two models)
    names = list(model.state_dict())
    mixed = {**tiny_model(seed=7).state_dict(), names[-1]: torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=f"{names[-1]} has shape \\(3, 3\\)"):
        eng.update_weights(mixed)
    assert [o.output_token_ids for o in eng.generate(reqs, NoSpec()).outputs] == want


GRAPH_POLICIES = {
    **POLICIES,
    "tlt": lambda: TLTAdaptive(
        threshold=3, warmup_checks=2, strategies=("4_2_8", "3_1_3"), bucket_starts=(1, 2)
    ),
    "nospec": NoSpec,
}


@pytest.mark.parametrize("name", sorted(GRAPH_POLICIES))
def test_graph_pool_path_changes_no_output(name, monkeypatch):
    # cuda_graphs=True on CPU: every decode/verify runs the pool's padded static step
    # eagerly (what a graph replays on CUDA), batches padded up to their bucket
    from tltrun.rollout.static_decode import StaticDecode
    from tltrun.rollout.static_verify import StaticVerify

    shapes = []
    verify_call, decode_call = StaticVerify.__call__, StaticDecode.__call__

    def counting_verify(self, tree, num_real):
        shapes.append((num_real, self.batch))
        return verify_call(self, tree, num_real)

    def counting_decode(self, num_real):
        shapes.append((num_real, self.batch))
        return decode_call(self, num_real)

    monkeypatch.setattr(StaticVerify, "__call__", counting_verify)
    monkeypatch.setattr(StaticDecode, "__call__", counting_decode)
    reqs = make_requests(7, seed=31)
    want = [
        o.output_token_ids for o in engine(max_running_requests=5).generate(reqs, NoSpec()).outputs
    ]
    eng = engine(DRAFTER, max_running_requests=5, cuda_graphs=True)
    got = eng.generate(reqs, GRAPH_POLICIES[name]())
    assert [o.output_token_ids for o in got.outputs] == want
    assert shapes and all(n <= b for n, b in shapes)  # the pool ran (padding: test_graphs.py)
    assert eng.graphs is not None and eng.graphs.plan.num_graphs > 0
    if name == "nospec":
        assert eng.graphs.plan.decode_buckets == (1, 2, 4, 5)


def test_defaults_are_device_dependent_and_eager_off_cpu():
    cfg = EngineConfig(max_running_requests=2, max_model_len=8)
    assert (cfg.dtype_name, cfg.attention, cfg.is_using_graphs) == ("float32", "sdpa", False)
    assert engine().graphs is None
    eng = engine(cuda_graphs=True)
    eng.generate(make_requests(2, seed=1), NoSpec())
    assert eng.graphs is not None and eng.graphs.pool is None  # CPU: nothing captured
    # the pool captures the sdpa and flex paths: under the kernels' (ref, triton) the engine
    # is eager, and says so (it was silently eager with graphs asked for)
    assert not EngineConfig(
        max_running_requests=2, max_model_len=8, attn_impl="ref"
    ).is_using_graphs
    with pytest.raises(ValueError, match="attn_impl triton runs eagerly"):
        EngineConfig(max_running_requests=2, max_model_len=8, attn_impl="triton", cuda_graphs=True)


@pytest.mark.parametrize("is_compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flex_attention_engine_equals_sdpa(is_compiled, monkeypatch):
    """Greedy SD through flex attention equals plain decoding with SDPA; compiled, the kernel
    path CUDA runs (inductor compiles it on the CPU too): bucketed new-token counts with their
    padding rows, full blocks, the folded static-batch path of the graphs (run uncaptured)."""
    from tltrun.model import attention

    monkeypatch.setattr(attention, "compile_on_cpu", is_compiled)
    monkeypatch.setattr(attention, "flex_fallbacks", {})
    reqs = make_requests(5, seed=23)
    want = [o.output_token_ids for o in engine().generate(reqs, NoSpec()).outputs]
    for cuda_graphs in (False, True):
        got = engine(DRAFTER, attn_impl="flex", cuda_graphs=cuda_graphs).generate(
            reqs, StaticSpec(4, 2, 8)
        )
        assert [o.output_token_ids for o in got.outputs] == want
    assert attention.flex_fallbacks == {}  # no shape fell back to the dense attention


def test_weight_updates_under_the_graph_pool_equal_a_fresh_engine():
    # update_weights / update_drafter copy into the parameters' storage (graphs read it at replay)
    other = tiny_model(seed=42)
    other_drafter = EagleDrafter.for_target(other, seed=9)
    reqs = make_requests(4, seed=5)
    fresh = engine(other_drafter, model=other, cuda_graphs=True).generate(reqs, StaticSpec(3, 2, 6))
    model = tiny_model(seed=0)
    eng = engine(EagleDrafter.for_target(model, seed=1), model=model, cuda_graphs=True)
    before = eng.generate(reqs, StaticSpec(3, 2, 6))
    storage = [p.data_ptr() for p in model.parameters()]
    eng.update_weights(other.state_dict())
    eng.update_drafter({k: v for k, v in other_drafter.state_dict().items()})
    after = eng.generate(reqs, StaticSpec(3, 2, 6))
    assert [p.data_ptr() for p in model.parameters()] == storage
    assert [o.output_token_ids for o in after.outputs] == [
        o.output_token_ids for o in fresh.outputs
    ]
    assert [o.output_token_ids for o in before.outputs] != [
        o.output_token_ids for o in fresh.outputs
    ]
    # the drafter's weights matter too: accept lengths equal the fresh engine's
    assert [i.accept_lens for i in after.iterations] == [i.accept_lens for i in fresh.iterations]


def test_bad_requests_and_missing_drafter_are_one_line_errors():
    eng = engine()
    with pytest.raises(ValueError, match="exceeds max_model_len=96"):
        eng.generate([Request("a", (5,) * 90, 10)], NoSpec())
    with pytest.raises(ValueError, match="duplicate request id"):
        eng.generate([Request("a", (5,), 1), Request("a", (6,), 1)], NoSpec())
    # a list prompt failed in the shared prefill (unhashable), after validation
    with pytest.raises(ValueError, match="prompt_token_ids must be a tuple of ints, got list"):
        eng.generate([Request("a", [5, 6], 1)], NoSpec())  # type: ignore[arg-type]
    # what the policy can decide is checked when the rollout starts, before any response
    with pytest.raises(ValueError, match="drafts with the EAGLE drafter .strategy 2_1_2. but"):
        eng.start_rollout([Request("a", (5,), 3)], StaticSpec(2, 1, 2))
    with pytest.raises(ValueError, match="'tlt' drafts with the EAGLE drafter"):
        eng.start_rollout([Request("a", (5,), 3)], TLTAdaptive())  # SD only in the tail
    with pytest.raises(ValueError, match="verifies 6 tokens, more than max_verify_tokens=4"):
        engine(DRAFTER, max_verify_tokens=4).start_rollout(
            [Request("a", (5,), 3)], StaticSpec(3, 2, 6)
        )
    with pytest.raises(ValueError, match=f"top 100 tokens of a vocabulary of {VOCAB}"):
        engine(DRAFTER).start_rollout([Request("a", (5,), 3)], StaticSpec(2, 100, 64))

    class Sudden(NoSpec):  # decisions no capture plan knows: checked as each one comes
        name = "sudden"

        def decide(self, obs):
            return SpecDecision.parse("2_1_2")

    with pytest.raises(ValueError, match="turned SD on .2_1_2. but the engine has no drafter"):
        eng.generate([Request("a", (5,), 3)], Sudden())


def test_engine_import_pulls_in_no_simpy():
    code = "import sys, tltrun.rollout.engine, tltrun.cli.main; assert 'simpy' not in sys.modules, 'simpy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_finished_slots_are_compacted_without_changing_any_output(monkeypatch):
    """The running batch is kept in slots 0..n-1 (Scheduler.compact moves the highest slots
    into the freed ones, the engine copies their caches): greedy outputs, plain and SD, equal
    each request generated alone, and moves did happen."""
    from tltrun.rollout.scheduler import Scheduler

    moves, layouts = [], []
    compact = Scheduler.compact

    def spy(self):
        out = compact(self)
        moves.extend(out)
        layouts.append([s.slot for s in self.running])
        return out

    monkeypatch.setattr(Scheduler, "compact", spy)
    reqs = make_requests(10, seed=7, max_new=40)
    alone = [engine(max_running_requests=1).generate([r], NoSpec()) for r in reqs]
    want = [a.outputs[0].output_token_ids for a in alone]
    for drafter, policy in ((None, NoSpec()), (DRAFTER, StaticSpec(4, 1, 4))):
        moves.clear()
        result = engine(drafter, max_running_requests=6).generate(reqs, policy)
        assert [o.output_token_ids for o in result.outputs] == want
        assert moves and all(src > dst for src, dst in moves)
    assert all(layout == list(range(len(layout))) for layout in layouts)


def group_requests(
    num_prompts: int, group: int, seed: int, max_new: int | None = None, prompt_len: int = 20
) -> list[Request]:
    """GRPO-shaped requests: ``group`` responses per prompt (identical prompt token ids)."""
    rng = random.Random(seed)
    reqs = []
    for p in range(num_prompts):
        prompt = tuple(rng.randrange(4, VOCAB) for _ in range(prompt_len))
        reqs += [Request(f"p{p}-{i}", prompt, max_new or rng.randint(1, 32)) for i in range(group)]
    return reqs


@pytest.mark.parametrize("running", [3, 5, 8])
def test_shared_prompts_change_no_output(running):
    # Followers come from same-wave leaders and (3, 5 slots) from running siblings admitted in
    # earlier waves, with SD on, off and switching (the drafter's shared prompt pairs too).
    reqs = group_requests(3, 4, seed=31)
    plain = engine(share_prompts=False, max_running_requests=running).generate(reqs, NoSpec())
    want = [o.output_token_ids for o in plain.outputs]
    for name, make in {"nospec": NoSpec, **POLICIES}.items():
        eng = engine(DRAFTER, max_running_requests=running, is_harvesting=True)
        got = eng.generate(reqs, make())
        assert [o.output_token_ids for o in got.outputs] == want, name
        for rec in eng.pop_harvest():  # followers' copied hidden states are the target's own
            ids = rec.token_ids[None]
            with torch.no_grad():
                _, hidden = TARGET(ids, torch.arange(ids.shape[1])[None], CausalContext())
            assert (rec.hidden - hidden[0, :-1]).abs().max() < 1e-4, name


def _count_tokens(module: torch.nn.Module):
    """Forward hook: counts the tokens (batch x length) ``module`` computes."""
    seen = [0]

    def hook(_mod, args, _out):
        seen[0] += args[0].shape[0] * args[0].shape[1]

    return seen, module.register_forward_hook(hook)


def test_a_group_prefills_its_prompt_once():
    # 3 prompts x 4, 8 slots, equal lengths: wave 1 = prompts 0 and 1 (2 leaders, 6
    # followers), all finish together, wave 2 = prompt 2 (1 leader, 3 followers).
    reqs = group_requests(3, 4, seed=32, max_new=10)
    decode = 12 * 9  # every request decodes its 9 tokens after the first, one per iteration
    computed = {}
    for share in (True, False):
        target_seen, h1 = _count_tokens(TARGET.model.embed_tokens)
        drafter_seen, h2 = _count_tokens(DRAFTER.fc)
        try:
            engine(max_running_requests=8, share_prompts=share).generate(reqs, NoSpec())
            nospec = target_seen[0]
            eng = engine(DRAFTER, max_running_requests=8, share_prompts=share)
            eng.generate(reqs, StaticSpec(1, 1, 1))
        finally:
            h1.remove()
            h2.remove()
        computed[share] = nospec, drafter_seen[0]
    assert computed[True][0] == 3 * 20 + 9 + decode
    assert computed[False][0] == 12 * 20 + decode
    # the drafter's re-prefill feeds each group's 19 prompt pairs once instead of 4 times;
    # drafting itself (accept-dependent, the same with both settings) cancels in the difference
    assert computed[False][1] - computed[True][1] == 9 * 19


def test_one_prepared_pool_serves_every_policy_without_a_new_capture():
    """``prepare_graphs`` captures the union of several policies' plans once; rollouts under
    each policy then keep that pool (a profile alternates policies between series: on CUDA
    each switch used to capture anew) and emit what the eager engine emits."""
    reqs = make_requests(4, seed=31)
    policies = [NoSpec(), StaticSpec(3, 2, 6), StaticSpec(4, 1, 4)]
    eng = engine(DRAFTER, cuda_graphs=True)
    eng.prepare_graphs(policies)
    pool = eng.graphs
    assert pool is not None
    for policy in policies + [NoSpec()]:
        want = engine(DRAFTER).generate(reqs, policy)
        got = eng.generate(reqs, policy)
        assert [o.output_token_ids for o in got.outputs] == [
            o.output_token_ids for o in want.outputs
        ]
        assert eng.graphs is pool  # covered: nothing rebuilt
    # a policy outside the union still gets its own pool
    eng.generate(reqs, StaticSpec(2, 1, 2))
    assert eng.graphs is not pool
