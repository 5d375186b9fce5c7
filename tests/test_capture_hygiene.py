"""What a CUDA graph capture refuses, checked on the CPU: inside a captured region no tensor may
be made from host data (an indexed assignment of a Python scalar, ``torch.tensor(...)``) and
no value may be read back (``.item()``, ``bool(t)``). On an H200 (session 21) the pool's verify
graphs and the drafter's catch-up failed to capture for exactly that (the flex path padded its
tree mask with ``mask[:, idx, idx] = True``), which no CPU test saw: capture is CUDA-only.
Here every graph body of the pool (``StaticForward.run``, ``StaticDraft.run``) runs on the CPU
under a dispatch mode that records such operations. The compiled flex kernel is replaced by
its uncompiled function with the mode off inside: on a GPU that part is inductor's code."""

from __future__ import annotations

import copy

import pytest
import torch
from test_draft_graphs import GREEDY, MAX_TOKENS, SAMPLED, TARGET, _slot_state, _static_step
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from tltrun.model import attention
from tltrun.model.kvcache import KVCache
from tltrun.model.transformer import fuse_projections
from tltrun.rollout.graphs import CapturePlan, GraphPool
from tltsim.policy import SpecDecision

# reading a device value on the host
READS = ("aten._local_scalar_dense.default", "aten.item.default", "aten.equal.default")
# what may consume a tensor made from a Python scalar: a fill of a slice (``x[:n] = 0``; copy_
# of a 0-dim CPU tensor is a fill on the GPU). Anything else (index_put_ of ``x[idx] = True``,
# arithmetic with ``torch.tensor(...)``) copies host memory to the device, which capture refuses
SCALAR_SINKS = ("aten.copy_.default", "aten.fill_.Tensor", "aten.fill_.Scalar")


class HostTraffic(TorchDispatchMode):
    """Records the operations a CUDA graph capture would refuse while it is active."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self._lifted: set[int] = set()  # ids of tensors made from host data
        self._kept: list[torch.Tensor] = []  # alive while the mode is: no id is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        flat = [*args, *(kwargs or {}).values()]
        flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
        uses_lifted = any(isinstance(a, torch.Tensor) and id(a) in self._lifted for a in flat)
        if name in READS or (uses_lifted and name not in SCALAR_SINKS):
            self.seen.append(name)
        out = func(*args, **(kwargs or {}))
        if name == "aten.lift_fresh.default":
            self._lifted.add(id(out))
            self._kept.append(out)
        return out


def _unguarded(fn):
    def call(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return call


@pytest.fixture
def compiled_flex_path(monkeypatch):
    """The GPU's flex path (padding, folding, the compiled call) on the CPU, uncompiled."""
    monkeypatch.setattr(attention, "compile_on_cpu", True)
    for name in ("symbolic_batch", "static_batch"):
        fn = _unguarded(getattr(attention, f"_flex_{name}"))
        monkeypatch.setattr(attention, f"_compiled_flex_{name}", lambda fn=fn: fn)
    monkeypatch.setattr(attention, "flex_fallbacks", {})


def test_the_guard_sees_what_capture_refuses():
    mask = torch.zeros(2, 8, 8, dtype=torch.bool)
    extra = torch.arange(5, 8)
    with HostTraffic() as guard:
        mask[:, extra, extra] = True
    assert guard.seen == ["aten.index_put_.default"]
    with HostTraffic() as guard:
        bool(mask.any())
    assert guard.seen == ["aten._local_scalar_dense.default"]
    with HostTraffic() as guard:
        mask + torch.tensor([True])  # a host tensor as an operand
    assert guard.seen == ["aten.add.Tensor"]
    with HostTraffic() as guard:
        mask[:, :5, :5] = True  # a slice fill: a kernel with a scalar argument
        torch.eye(8, dtype=torch.bool).expand(2, 8, 8).clone()
    assert guard.seen == []


def test_padded_tree_mask_equals_the_indexed_construction():
    gen = torch.Generator().manual_seed(0)
    for tq, padded in ((1, 1), (3, 4), (5, 8), (7, 8)):
        tree = torch.rand(3, tq, tq, generator=gen) < 0.5
        want = torch.zeros(3, padded, padded, dtype=torch.bool)
        want[:, :tq, :tq] = tree
        for i in range(tq, padded):
            want[:, i, i] = True
        with HostTraffic() as guard:
            got = attention.pad_tree_mask(tree, padded)
        assert torch.equal(got, want) and guard.seen == []


@pytest.mark.parametrize("impl", ["flex", "sdpa"])
@pytest.mark.parametrize("strategy,fused", [("4_1_4", False), ("3_2_6", False), ("3_2_6", True)])
# the compiled flex path runs uncompiled here on purpose (compiled_flex_path): torch's warning
# that flex_attention is then unfused is expected
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_every_graph_body_of_the_pool_is_capturable(impl, strategy, fused, compiled_flex_path):
    """``fused``: with stacked projections (``EngineConfig.fuse_projections``)."""
    plan = CapturePlan(decode_buckets=(1, 4), spec_graphs=((1, strategy), (4, strategy)))
    cache = KVCache.for_model(TARGET.config, 4, MAX_TOKENS)
    cache.lens.copy_(torch.tensor([9, 3, 17, 1]))
    target = fuse_projections(copy.deepcopy(TARGET)) if fused else TARGET
    pool = GraphPool(target, cache, plan, impl, is_capturing=False)
    forwards = [*pool.decode.values(), *pool.verify.values()]
    assert len(forwards) == 4
    for fwd in forwards:
        with torch.no_grad(), HostTraffic() as guard:
            fwd.run()
        assert guard.seen == [], (fwd.batch, fwd.num_tokens, guard.seen)
    assert attention.flex_fallbacks == {}  # the flex path itself ran, not its dense fallback


@pytest.mark.parametrize("impl", ["flex", "sdpa"])
@pytest.mark.parametrize(
    "strategy,sampling", [("4_1_4", SAMPLED), ("4_1_4", GREEDY), ("3_2_6", GREEDY)]
)
def test_every_drafting_body_is_capturable(impl, strategy, sampling, compiled_flex_path):
    state = _slot_state([1, 4, 2], 4, sampling, impl=impl)
    step = _static_step(state, 4, SpecDecision.parse(strategy), 5)
    with HostTraffic() as guard:
        step.run()
    assert guard.seen == []
    assert attention.flex_fallbacks == {}
