"""``EngineConfig.fuse_projections`` (issue #18): q, k and v as one stacked projection and gate
and up as another in no-grad forwards, their parameters views of the stacked tensors, so that
every in-place update of them (weight sync, an optimizer step) reaches them; and the per-engine
layer settings of engines that share one model."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import VOCAB, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from tltrun.model.drafter import EagleDrafter
from tltrun.model.transformer import CausalContext, StackedProjections, fuse_projections
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import Request, SamplingParams
from tltsim.policy import NoSpec, StaticSpec

REQUESTS = [Request(f"r{i}", tuple(range(5, 5 + 3 * i + 1)), 12) for i in range(3)]
IDS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
POSITIONS = torch.arange(7).expand(2, -1)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, POSITIONS, CausalContext())[0]


def _stacks(model) -> list[StackedProjections]:
    stacks = [m for m in model.modules() if isinstance(m, StackedProjections)]
    assert len(stacks) == 2 * len(model.model.layers)  # an attention and an MLP a layer
    return stacks


def _stacks_of_drafter(drafter) -> list[StackedProjections]:
    return [m for m in drafter.modules() if isinstance(m, StackedProjections)]


def _shares_stack(model) -> bool:
    for m in _stacks(model):
        weight, bias = m.stacked
        for p in (getattr(m, name) for name in m.STACKS):
            if p.weight.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr():
                return False
            if bias is not None and (
                p.bias.untyped_storage().data_ptr() != bias.untyped_storage().data_ptr()
            ):
                return False
    return True


def _unfused_copy(model):
    """The same weights without the stacked path (a reference forward)."""
    ref = copy.deepcopy(model)
    for m in _stacks(ref):
        m.stacked = None
    return ref


@pytest.mark.parametrize("bias", [False, True])
def test_fused_forward_equals_the_projections_apart(bias):
    model = tiny_model(seed=2, attention_bias=bias)
    want = _logits(model)
    names = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_projections(model)
    assert _shares_stack(model)
    torch.testing.assert_close(_logits(model), want, atol=1e-6, rtol=1e-6)
    # the checkpoint's names and values are unchanged: Hugging Face's layout on disk
    assert list(model.state_dict()) == list(names)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in names.items())
    # an in-place update of q or up (load_in_place, weight sync) reaches the stacked forward
    for update in (
        model.model.layers[0].self_attn.q_proj.weight,
        model.model.layers[1].mlp.up_proj.weight,
    ):
        with torch.no_grad():
            update.mul_(-1.0)
        got = _logits(model)
        assert not torch.allclose(got, want)
        torch.testing.assert_close(got, _logits(_unfused_copy(model)), atol=1e-6, rtol=1e-6)
        want = got


class _CountGemms(TorchDispatchMode):
    """GEMMs (``count``) and RoPE rotations (``flips``: one per ``apply_rope`` call)."""

    def __init__(self):
        super().__init__()
        self.count = self.flips = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        self.flips += func is torch.ops.aten.flip.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [False, True])
def test_a_fused_layer_runs_four_gemms_where_it_ran_seven_and_one_rotation(bias):
    model = tiny_model(seed=2, attention_bias=bias)
    counts, flips = [], []
    for fused in (False, True):
        if fused:
            fuse_projections(model)
        with _CountGemms() as gemms:
            _logits(model)
        counts.append(gemms.count)
        flips.append(gemms.flips)
    num_layers = len(model.model.layers)
    # q, k, v, o, gate, up, down a layer, then one: q/k/v, o, gate/up, down; and the LM head
    assert counts == [7 * num_layers + 1, 4 * num_layers + 1]
    # RoPE: q and k apart, then both in one call (they lie side by side in the stacked output)
    assert flips == [2 * num_layers, num_layers]
    with _CountGemms() as gemms, torch.enable_grad():  # training forwards run them apart
        model(IDS, POSITIONS, CausalContext())
    assert gemms.count == 7 * num_layers + 1


def test_optimizer_made_before_fusing_still_trains_the_fused_weights():
    model = tiny_model(seed=4, attention_bias=True)
    first = model.model.layers[0].self_attn.k_proj.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fuse_projections(model)
    assert model.model.layers[0].self_attn.k_proj.weight is first  # same Parameter objects
    model.train()
    loss = model(IDS, POSITIONS, CausalContext())[0].float().square().mean()
    loss.backward()  # the grad-enabled forward runs the three projections
    assert first.grad is not None and first.grad.abs().sum() > 0
    optimizer.step()
    model.eval()
    torch.testing.assert_close(_logits(model), _logits(_unfused_copy(model)), atol=1e-6, rtol=1e-6)


def test_fusing_again_moves_nothing():
    model = fuse_projections(tiny_model(seed=7, attention_bias=True))
    stacks = [m.stacked for m in _stacks(model)]
    fuse_projections(model)  # a second engine on the same model: graphs captured over it stay valid
    assert all(
        m.stacked[0] is w and m.stacked[1] is b
        for m, (w, b) in zip(_stacks(model), stacks, strict=True)
    )


def test_copies_and_conversions_restack():
    model = fuse_projections(tiny_model(seed=5, attention_bias=True))
    clone = copy.deepcopy(model)
    assert _shares_stack(clone)  # a deep copy clones each parameter alone: re-stacked
    model.to(torch.bfloat16)
    assert _shares_stack(model) and all(
        m.stacked[0].dtype == torch.bfloat16 for m in _stacks(model)
    )
    with torch.no_grad():
        clone.model.layers[1].self_attn.v_proj.bias.add_(1.0)
    torch.testing.assert_close(_logits(clone), _logits(_unfused_copy(clone)), atol=1e-6, rtol=1e-6)


def _engine(model, drafter, **fields) -> RolloutEngine:
    cfg = EngineConfig(
        max_running_requests=3, max_model_len=64, sampling=SamplingParams(0.0), **fields
    )
    return RolloutEngine(model, drafter, cfg)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_fused_engine_generates_and_syncs_weights_as_an_unfused_one(graphs):
    def tokens(engine, policy):
        return [o.output_token_ids for o in engine.generate(REQUESTS, policy).outputs]

    base = tiny_model(seed=3, attention_bias=True)
    plain = _engine(copy.deepcopy(base), None)
    target = copy.deepcopy(base)
    fused = _engine(
        target, EagleDrafter.for_target(target, seed=1), fuse_projections=True, cuda_graphs=graphs
    )
    drafter_stacks = _stacks_of_drafter(fused.drafter)  # its layer's attention and MLP
    assert _shares_stack(fused.model) and len(drafter_stacks) == 2
    assert all(m.stacked is not None for m in drafter_stacks)
    want = tokens(plain, NoSpec())
    assert tokens(fused, NoSpec()) == want
    assert tokens(fused, StaticSpec(strategy="3_2_6")) == want  # lossless SD through it
    new = tiny_model(seed=8, attention_bias=True).state_dict()
    plain.update_weights(new)
    fused.update_weights(new)  # copied in place: the stack follows
    want = tokens(plain, NoSpec())
    assert want != tokens(_engine(copy.deepcopy(base), None), NoSpec())  # the update mattered
    assert tokens(fused, NoSpec()) == want


def test_engines_sharing_a_model_each_run_their_own_layer_settings():
    model = tiny_model(seed=6)
    layers = model.model.layers
    first = _engine(model, None)
    second = _engine(model, None, compile_layers=True)
    assert all(layer.is_compiled for layer in layers)  # the last constructed set them
    first.start_rollout(REQUESTS, NoSpec())
    assert not any(layer.is_compiled for layer in layers)  # its own, at its rollout's start
    second.start_rollout(REQUESTS, NoSpec())
    assert all(layer.is_compiled for layer in layers)
