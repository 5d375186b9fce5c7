"""KV cache: batched prefill of mixed lengths, decode over slots of different lengths, rollback
and tree-path compaction all reproduce the logits of a cache-free forward of the same tokens.

Run: ``python -m pytest tests/test_kvcache.py -q``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import VOCAB, tiny_model

from tltrun.model import attention
from tltrun.model.attention import masked_attention
from tltrun.model.kvcache import KVCache
from tltrun.model.transformer import CausalContext

TOL = 1e-4  # logits are O(10) with std-0.3 weights; fp32 reassociation error ~1e-5
MODEL = tiny_model(seed=0)


def reference_logits(tokens: list[int]) -> torch.Tensor:
    """(T,V) logits of a cache-free causal forward."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits, _ = MODEL(ids, torch.arange(len(tokens))[None], CausalContext())
    return logits[0]


def new_cache(num_slots: int = 4) -> KVCache:
    return KVCache.for_model(MODEL.config, num_slots=num_slots, max_tokens=64)


def forward(cache: KVCache, slots: list[int], rows: list[list[int]], tree_mask=None, depth=None):
    """Feed ``rows`` (right-padded) into ``slots``; positions = lens + (depth or index)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    slot_t = torch.tensor(slots)
    offs = torch.arange(width)[None].expand(len(rows), -1) if depth is None else depth
    pos = cache.lens[slot_t][:, None] + offs
    num_new = torch.tensor([len(r) for r in rows])
    ctx = cache.context(slot_t, width, tree_mask=tree_mask, num_new=num_new)
    with torch.no_grad():
        logits, _ = MODEL(ids, pos, ctx)
    return logits, slot_t, num_new


def test_batched_prefill_mixed_lengths_then_decode_matches_reference():
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 1, 8)]
    cache = new_cache()
    slots = [2, 0, 3, 1]  # slot order differs from row order on purpose
    prompts = [s[:-3] if len(s) > 3 else s[:1] for s in seqs]
    logits, slot_t, num_new = forward(cache, slots, prompts)
    cache.commit(slot_t, num_new)
    for b, p in enumerate(prompts):
        err = (logits[b, : len(p)] - reference_logits(p)).abs().max()
        assert err < TOL, f"prefill row {b}"
    # Decode the remaining tokens one at a time over all slots (lengths differ per slot).
    hist = [list(p) for p in prompts]
    for step in range(3):
        rows = [[s[len(h)] if len(h) < len(s) else 0] for s, h in zip(seqs, hist, strict=True)]
        logits, slot_t, num_new = forward(cache, slots, rows)
        cache.commit(slot_t, 1)
        for b, (h, r) in enumerate(zip(hist, rows, strict=True)):
            h.append(r[0])
            err = (logits[b, 0] - reference_logits(h)[-1]).abs().max()
            assert err < TOL, f"decode step {step} row {b}: {err}"


@settings(max_examples=15, deadline=None)
@given(
    prefix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    rejected=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    nxt=st.integers(0, VOCAB - 1),
)
def test_rollback_equals_never_having_seen_rejected_tokens(prefix, rejected, nxt):
    cache = new_cache(1)
    _, slot_t, num_new = forward(cache, [0], [prefix])
    cache.commit(slot_t, num_new)
    _, slot_t, num_new = forward(cache, [0], [rejected])  # speculative tokens, then rejected
    cache.commit(slot_t, num_new)
    cache.truncate(slot_t, torch.tensor([len(prefix)]))
    logits, _, _ = forward(cache, [0], [[nxt]])
    err = (logits[0, 0] - reference_logits(prefix + [nxt])[-1]).abs().max()
    assert err < TOL


def test_tree_verify_then_compaction_matches_reference():
    # Tree over new tokens: root 0 -> {1, 2}; 1 -> {3}; 2 -> {4}; 3 -> {5}. Path 0-2-4 accepted.
    parents = [0, 0, 0, 1, 2, 3]
    tokens = [7, 11, 13, 17, 19, 23]
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        j = i
        while True:
            mask[i, j] = True
            if j == 0:
                break
            j = parents[j]
        depth[i] = mask[i].sum() - 1
    prefix = [5, 9, 2, 4]
    cache = new_cache(2)
    _, slot_t, num_new = forward(cache, [1], [prefix])
    cache.commit(slot_t, num_new)
    logits, slot_t, _ = forward(cache, [1], [tokens], tree_mask=mask[None], depth=depth[None])
    for i in range(n):  # every node sees exactly its ancestors, at root position + depth
        path = [tokens[j] for j in range(n) if mask[i, j]]
        err = (logits[0, i] - reference_logits(prefix + path)[-1]).abs().max()
        assert err < TOL, f"tree node {i}"
    cache.compact(slot_t, torch.tensor([[0, 2, 4, 0]]), torch.tensor([2]))
    assert cache.lens[1] == len(prefix) + 3
    logits, _, _ = forward(cache, [1], [[29]])
    expect = reference_logits(prefix + [7, 13, 19, 29])[-1]
    assert (logits[0, 0] - expect).abs().max() < TOL


def test_masked_attention_equals_explicit_softmax_with_gqa():
    gen = torch.Generator().manual_seed(3)
    b, h, hkv, tq, length, d = 2, 4, 2, 3, 5, 8
    q = torch.randn(b, h, tq, d, generator=gen)
    kc, vc = torch.randn(2, b, hkv, length, d, generator=gen)
    kn, vn = torch.randn(2, b, hkv, tq, d, generator=gen)
    lens = torch.tensor([2, 5])
    new_mask = torch.rand(b, tq, tq, generator=gen) > 0.5
    new_mask |= torch.eye(tq, dtype=torch.bool)
    out = masked_attention(q, kc, vc, lens, kn, vn, new_mask, d**-0.5)
    k = torch.cat((kc, kn), 2).repeat_interleave(h // hkv, 1)
    v = torch.cat((vc, vn), 2).repeat_interleave(h // hkv, 1)
    scores = q @ k.transpose(-1, -2) * d**-0.5
    past = (torch.arange(length)[None, None] < lens[:, None, None]).expand(b, tq, length)
    allowed = torch.cat((past, new_mask), -1)
    scores = scores.masked_fill(~allowed.expand(b, tq, -1)[:, None], float("-inf"))
    want = scores.softmax(-1) @ v
    assert (out - want).abs().max() < 1e-5


def test_overflow_is_an_error():
    cache = KVCache.for_model(MODEL.config, num_slots=1, max_tokens=4)
    with pytest.raises(ValueError, match="overflow"):
        forward(cache, [0], [[1, 2, 3, 4, 5]])


def test_padded_region_past_the_cache_end_falls_back_and_matches():
    # Slot 0 is nearly full, slot 1 gets a long first chunk: context 6 + 5 new > 8 positions,
    # so the forward takes the separate (cache prefix + new keys) path; results must not change.
    cache = KVCache.for_model(MODEL.config, num_slots=2, max_tokens=8)
    first = [5, 9, 2, 4, 8, 1]
    _, slot_t, num_new = forward(cache, [0], [first])
    cache.commit(slot_t, num_new)
    rows = [[7], [3, 1, 4, 1, 5]]
    ctx = cache.context(torch.tensor([0, 1]), 5, num_new=torch.tensor([1, 5]))
    assert not ctx.is_in_place
    logits, slot_t, num_new = forward(cache, [0, 1], rows)
    cache.commit(slot_t, num_new)
    assert (logits[0, 0] - reference_logits(first + [7])[-1]).abs().max() < TOL
    assert (logits[1, :5] - reference_logits(rows[1])).abs().max() < TOL
    logits, _, _ = forward(cache, [0, 1], [[6], [2]])  # both in place again
    assert (logits[0, 0] - reference_logits(first + [7, 6])[-1]).abs().max() < TOL
    assert (logits[1, 0] - reference_logits(rows[1] + [2])[-1]).abs().max() < TOL


def test_copy_positions_moves_only_the_prefix_of_the_named_slots():
    cache = KVCache(2, 4, 8, 2, 4)
    cache.k.normal_()
    cache.v.normal_()
    cache.lens[:] = torch.tensor([5, 6, 7, 8])
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.copy_positions(torch.tensor([0, 1]), torch.tensor([3, 2]), 5)
    assert torch.equal(cache.k[:, 3, :, :5], before_k[:, 0, :, :5])
    assert torch.equal(cache.v[:, 2, :, :5], before_v[:, 1, :, :5])
    assert torch.equal(cache.k[:, 2:, :, 5:], before_k[:, 2:, :, 5:])  # past the width
    assert torch.equal(cache.k[:, :2], before_k[:, :2])  # sources untouched
    assert cache.lens.tolist() == [5, 6, 7, 8]  # lengths are the caller's
    cache.copy_positions(torch.tensor([0]), torch.tensor([1]), 99)  # clipped to max_tokens
    assert torch.equal(cache.v[:, 1], before_v[:, 0])


def _flex_case(b: int, tq: int, key_len: int, head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 4, tq, head_dim, generator=gen)
    k = torch.randn(b, 2, key_len, head_dim, generator=gen)
    v = torch.randn(b, 2, key_len, head_dim, generator=gen)
    lens = torch.randint(0, key_len - tq + 1, (b,), generator=gen)
    tree = (torch.rand(b, tq, tq, generator=gen) < 0.5) | torch.eye(tq, dtype=torch.bool)
    scale = head_dim**-0.5
    expected = attention.grouped_attention(
        q, k, v, attention.in_place_mask(lens, key_len, tree), scale
    )
    return (q, k, v, lens, tree, scale), expected


@pytest.mark.slow
def test_compiled_flex_matches_the_dense_reference_across_shapes(monkeypatch):
    """The compiled kernel path that CUDA runs (inductor compiles it on the CPU too): batches
    and key widths vary under one compile, new-token counts are constants, and a head dim
    under flex's minimum of 16 is zero-padded (an H200 run failed on head dim 12 before)."""
    monkeypatch.setattr(attention, "compile_on_cpu", True)
    monkeypatch.setattr(attention, "flex_fallbacks", {})
    for b, tq, key_len, head_dim, is_static in [
        (1, 1, 256, 16, False), (4, 1, 300, 16, False), (3, 5, 260, 16, False),
        (2, 1, 256, 12, False), (2, 5, 400, 16, True), (20, 1, 300, 16, True),
    ]:  # fmt: skip
        args, expected = _flex_case(b, tq, key_len, head_dim)
        out = attention.flex_attention_by_lens(*args, is_static_batch=is_static)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert attention.flex_fallbacks == {}
    # new-token counts of one power-of-two bucket share a compile (5 and 6 -> 8), and so do
    # other batches and key widths
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    for b, tq, key_len in [(3, 6, 260), (5, 7, 333), (6, 8, 301)]:
        args, expected = _flex_case(b, tq, key_len, 16)
        torch.testing.assert_close(attention.flex_attention_by_lens(*args), expected,
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize(
    "form",
    [
        "eager",
        "eager folded",
        pytest.param("compiled symbolic batch", marks=pytest.mark.slow),
        pytest.param("compiled static batch", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("lens_kind", ["block_edges", "random"])
def test_flex_block_mask_matches_the_dense_reference(form, lens_kind):
    """The block mask (full blocks below each committed length, partial ones over its end and
    its new tokens) and the folding of query heads onto their KV head: every mistake in which
    keys a query sees changes the output. Eager flex evaluates mask_mod on every block, so only
    the compiled kernel (which skips it on full blocks) checks which blocks are full."""
    args, expected = _flex_case(4, 6, 520, 16, seed=3)
    q, k, v, lens, tree, scale = args
    if lens_kind == "block_edges":  # committed lengths on and around 128-token block edges
        lens = torch.tensor([0, 127, 128, 384])
        expected = attention.grouped_attention(
            q, k, v, attention.in_place_mask(lens, k.shape[2], tree), scale
        )
    if form.startswith("compiled"):
        out = attention._compiled_call(q, k, v, lens, tree, scale, form.endswith("static batch"))
    else:
        out = attention._flex_by_lens(q, k, v, lens, tree, scale, is_folded=form.endswith("folded"))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch,is_static_batch", [(3, False), (40, True), (2, True)])
@pytest.mark.parametrize("num_new", [1, 5])
def test_the_compiled_flex_path_folds_query_heads_at_every_batch(
    monkeypatch, batch, is_static_batch, num_new
):
    """What the GPU's compiled kernel is handed (the compiles replaced by their Python
    functions, flex_attention by a recorder): every batch, static or symbolic, attends with
    the G query heads of a KV head folded into its query rows, in a tile of the next power of
    two of those rows (16 at least), never one program per query head with a 128-row tile."""
    from torch.nn.attention import flex_attention as flex_module

    calls = []
    real = flex_module.flex_attention

    def recorder(q, k, v, **kwargs):
        calls.append((q.shape, k.shape, kwargs["enable_gqa"], kwargs["kernel_options"]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(flex_module, "flex_attention", recorder)
    monkeypatch.setattr(attention, "compile_on_cpu", True)
    monkeypatch.setattr(attention, "flex_fallbacks", {})
    for name in ("symbolic_batch", "static_batch"):
        fn = getattr(attention, f"_flex_{name}")
        monkeypatch.setattr(attention, f"_compiled_flex_{name}", lambda fn=fn: fn)
    args, expected = _flex_case(batch, num_new, 300, 16)
    out = attention.flex_attention_by_lens(*args, is_static_batch=is_static_batch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    rows = 2 * attention.new_tokens_bucket(num_new)  # 4 query heads on 2 KV heads: G = 2
    assert calls == [((batch, 2, rows, 16), (batch, 2, 300, 16), False, {"BLOCK_M": 16})]


def test_query_tile_rows():
    assert [attention.query_block_rows(r) for r in (1, 7, 16, 17, 100, 448)] == [
        16, 16, 16, 32, 128, 128
    ]  # fmt: skip


def test_a_failed_flex_compile_runs_the_dense_attention_and_says_so(monkeypatch):
    def broken(*args):
        raise RuntimeError("LoweringException: no kernel for this shape")

    monkeypatch.setattr(attention, "compile_on_cpu", True)
    monkeypatch.setattr(attention, "flex_fallbacks", {})
    monkeypatch.setattr(attention, "_compiled_flex_symbolic_batch", lambda: broken)
    args, expected = _flex_case(2, 3, 64, 16)
    with pytest.warns(RuntimeWarning, match="batch 2, 3 new tokens, key width 64"):
        out = attention.flex_attention_by_lens(*args)
    torch.testing.assert_close(out, expected)
    assert list(attention.flex_fallbacks) == [(torch.float32, 2, 3, 64, 16, False)]
    assert "no kernel for this shape" in next(iter(attention.flex_fallbacks.values()))
    # the shape is remembered: no second attempt, no second warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(attention.flex_attention_by_lens(*args), expected)
