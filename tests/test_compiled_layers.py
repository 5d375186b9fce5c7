"""``EngineConfig.compile_layers`` (issue #18 item 5): each decoder layer's work around the
attention context compiled by ``torch.compile`` (``tltrun.model.transformer.compiled_pieces``),
so a decode step is fewer, fused kernels. On CPU inductor compiles C++ kernels: these tests run
the same code path a GPU would, minus the Triton backend.

Run: ``python -m pytest tests/test_compiled_layers.py -q`` (compiles: ~30 s on 2 cores).
"""

from __future__ import annotations

import argparse

import pytest
import torch
from tiny_models import VOCAB, tiny_config, tiny_model

from tltrun.model import transformer
from tltrun.model.drafter import EagleDrafter
from tltrun.model.kvcache import KVCache, StaticContext
from tltrun.model.transformer import (
    CausalContext,
    Transformer,
    fuse_projections,
    set_compiled_layers,
)
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import Request, SamplingParams
from tltsim.policy import NoSpec, StaticSpec

pytestmark = pytest.mark.slow

REQUESTS = [Request(f"r{i}", tuple(range(5, 5 + 3 * i + 1)), 10) for i in range(3)]


def _compiles() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _generate(policy, **fields) -> list[tuple[int, ...]]:
    model = tiny_model(seed=3)
    drafter = EagleDrafter.for_target(model, seed=1)
    cfg = EngineConfig(
        max_running_requests=3, max_model_len=64, sampling=SamplingParams(0.0), **fields
    )
    engine = RolloutEngine(model, drafter, cfg)
    return [tuple(o.output_token_ids) for o in engine.generate(REQUESTS, policy).outputs]


def test_compiled_layers_generate_the_eager_engines_tokens(monkeypatch):
    monkeypatch.setattr(transformer, "compile_failure", None)
    want = _generate(NoSpec())
    pieces, calls = transformer.compiled_pieces(), []
    monkeypatch.setattr(transformer, "compiled_pieces", lambda: calls.append(1) or pieces)
    for graphs in (False, True):  # eager forwards, and the graph pool's static ones (CPU)
        for policy in (NoSpec(), StaticSpec(strategy="3_2_6"), StaticSpec(strategy="4_1_4")):
            got = _generate(policy, compile_layers=True, cuda_graphs=graphs)
            assert got == want, (policy, graphs)
    assert transformer.compile_failure is None
    assert calls  # the compiled pieces ran (an uncompiled run would equal ``want`` too)


@pytest.mark.parametrize("fused", [False, True])
def test_one_compile_serves_every_layer(monkeypatch, fused):
    """The pieces take the layer as an argument: dynamo guards on its structure, not its identity,
    so a deeper model compiles the same number of graphs (none per layer); with q/k/v and gate/up fused too
    (each layer's stacked tensor an input, not a constant)."""
    monkeypatch.setattr(transformer, "compile_failure", None)
    torch._dynamo.reset()
    counts = []
    for layers in (2, 6):
        model = Transformer(tiny_config(num_hidden_layers=layers, attention_bias=fused))
        model = set_compiled_layers(fuse_projections(model) if fused else model).eval()
        ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(5).expand(2, -1)
        start = _compiles()
        with torch.no_grad():
            got, _ = model(ids, positions, CausalContext())
        counts.append(_compiles() - start)
        set_compiled_layers(model, False)
        with torch.no_grad():
            want, _ = model(ids, positions, CausalContext())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counts[0] == 2, counts  # the piece before attention and the piece after it
    assert counts[1] == 0, counts  # six layers: served by the two-layer model's compiles


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_layers_write_the_static_cache_themselves(monkeypatch, fused):
    """Under a ``StaticContext`` (the graph pool's forwards) a compiled layer stores its new keys
    and values itself (``kv_write``): ``attend`` is handed none, and the cache, logits and
    hidden states are what the uncompiled layers give (slot lengths differ per row, tree mask)."""
    monkeypatch.setattr(transformer, "compile_failure", None)
    cfg = tiny_config(attention_bias=fused)
    model = Transformer(cfg).eval()
    if fused:
        fuse_projections(model)
    gen = torch.Generator().manual_seed(4)
    batch, num_tokens = 3, 4
    ids = torch.randint(0, VOCAB, (batch, num_tokens), generator=gen)
    tree_mask = torch.ones(batch, num_tokens, num_tokens, dtype=torch.bool).tril()
    tree_mask[:, 3, 2] = False  # token 3 is token 2's sibling
    handed = []
    real_attend = StaticContext.attend

    def attend(self, layer, q, k, v):
        handed.append((layer, k is None, v is None))
        return real_attend(self, layer, q, k, v)

    monkeypatch.setattr(StaticContext, "attend", attend)
    results = []
    for is_compiled in (False, True):
        cache = KVCache.for_model(cfg, num_slots=4, max_tokens=16)
        cache.k.normal_(generator=torch.Generator().manual_seed(5))  # a committed context
        cache.v.normal_(generator=torch.Generator().manual_seed(6))
        cache.lens[:batch] = torch.tensor([5, 0, 9])
        positions = cache.lens[:batch, None] + torch.arange(num_tokens)
        set_compiled_layers(model, is_compiled)
        handed.clear()
        with torch.no_grad():
            logits, hidden = model(ids, positions, StaticContext(cache, batch, tree_mask, "sdpa"))
        layers = range(cfg.num_hidden_layers)
        assert handed == [(layer, is_compiled, is_compiled) for layer in layers]
        results.append((logits, hidden, cache.k.clone(), cache.v.clone()))
    assert transformer.compile_failure is None
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_training_forwards_stay_eager():
    """With gradients recorded the layers run eagerly (the GRPO and SFT updates, gradient
    checkpointing): nothing compiles, and the gradients are the uncompiled model's."""
    grads = []
    for is_compiled in (False, True):
        model = set_compiled_layers(tiny_model(seed=3).train(), is_compiled)
        ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
        start = _compiles()
        logits, _ = model(ids, torch.arange(6).expand(2, -1), CausalContext())
        logits.float().logsumexp(-1).mean().backward()
        assert _compiles() == start
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_failed_compile_warns_once_and_runs_eagerly(monkeypatch, graphs):
    """Eagerly run pieces do what the compiled ones would: with the graph pool's forwards (CPU:
    uncaptured) the piece before attention writes the KV cache itself (``kv_write``)."""
    from torch._dynamo.exc import TorchDynamoException

    def broken(*args):
        raise TorchDynamoException("inductor: no compiler for this device")

    monkeypatch.setattr(transformer, "compile_failure", None)
    monkeypatch.setattr(transformer, "compiled_pieces", lambda: (broken, broken))
    want = _generate(NoSpec())
    with pytest.warns(RuntimeWarning, match="no compiler for this device"):
        got = _generate(NoSpec(), compile_layers=True, cuda_graphs=graphs)
    assert got == want
    assert "TorchDynamoException" in transformer.compile_failure


def test_compile_layers_flags():
    from tltrun.cli.args import add_engine_args, engine_config_from_args
    from tltrun.cli.train import register

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    base = ["--max-running-requests", "2", "--max-model-len", "8"]
    assert engine_config_from_args(parser.parse_args(base)).compile_layers is False
    assert engine_config_from_args(parser.parse_args([*base, "--compile-layers"])).compile_layers
    top = argparse.ArgumentParser()
    register(top.add_subparsers(dest="cmd"))
    assert top.parse_args(["train", "--compile-layers"]).compile_layers is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: inductor's Triton kernels")
def test_compiled_layers_under_captured_graphs_on_cuda(monkeypatch):
    """float32 on CUDA: greedy decoding and greedy SD through captured graphs whose layers are
    inductor's Triton kernels equal plain eager greedy decoding."""
    monkeypatch.setattr(transformer, "compile_failure", None)
    want = _generate(NoSpec(), device="cuda", dtype="float32", cuda_graphs=False)
    for policy in (NoSpec(), StaticSpec(strategy="3_2_6")):
        got = _generate(policy, device="cuda", dtype="float32", compile_layers=True)
        assert got == want, policy
    assert transformer.compile_failure is None
