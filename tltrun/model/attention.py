"""Attention over (a slot's committed KV cache, the forward's new tokens under a tree mask):
the implementations ``KVCache``'s contexts choose from, by an explicit ``impl`` argument, never
by globals.

* ``"sdpa"``: masked ``torch.nn.functional.scaled_dot_product_attention`` over the batch padded
  to its longest context (``grouped_attention`` with ``in_place_mask``).
* ``"flex"``: ``torch.nn.attention.flex_attention`` with a block mask built from each sequence's
  own length (``flex_attention_by_lens``): blocks past a sequence's context are skipped, so no
  padding work on a GPU (issue #18). Compiled on CUDA (one compile per bucket of new tokens,
  ``new_tokens_bucket``); eager on CPU, where it runs torch's dense reference and is tested
  equal to ``"sdpa"``. A shape the compiled kernel rejects runs the dense masked SDPA instead,
  warned once and listed in ``flex_fallbacks``.
* ``"ref"`` / ``"triton"``: the ``kernels.tree_attention`` reference and kernel.

Run the tests: ``python -m pytest tests/test_kvcache.py -q``.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

ATTN_IMPLS = ("sdpa", "flex", "ref", "triton")
# Attention implementations that attend without padding work (tltsim.cost.profile's
# attention_context "summed"): each sequence reads only its own context's KV blocks.
UNPADDED_ATTN_IMPLS = ("flex",)
# flex_attention's default block (torch.nn.attention.flex_attention _DEFAULT_SPARSE_BLOCK_SIZE):
# the granularity at which a sequence's unused KV width is skipped.
FLEX_BLOCK_TOKENS = 128


def attention_mask(cache_lens: torch.Tensor, length: int, new_mask: torch.Tensor) -> torch.Tensor:
    """(B,1,Tq,L+Tk) bool: cache positions < cache_lens[b] for every query, then ``new_mask``."""
    b, tq, _ = new_mask.shape
    past = torch.arange(length, device=new_mask.device)[None, :] < cache_lens[:, None]  # (B,L)
    return torch.cat((past[:, None, :].expand(b, tq, length), new_mask), dim=-1)[:, None]


def grouped_attention(
    q: torch.Tensor,  # (B,H,Tq,D)
    k: torch.Tensor,  # (B,Hkv,Lk,D), may be a strided view of the cache
    v: torch.Tensor,
    mask: torch.Tensor,  # (B,1,Tq,Lk) bool
    scale: float,
) -> torch.Tensor:
    """SDPA with grouped-query attention done by folding each KV head's G query heads into the
    query axis — (B,Hkv,G*Tq,D) against (B,Hkv,Lk,D) — instead of repeating K/V G times
    (which is what ``enable_gqa`` does on CPU: G copies of the whole context per layer).
    Query head h reads KV head h // G, as Hugging Face's ``repeat_kv``. Returns (B,H,Tq,D)."""
    b, h, tq, d = q.shape
    groups = h // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    qg = q.reshape(b, k.shape[1], groups * tq, d)
    maskg = mask[:, :, None].expand(b, 1, groups, tq, mask.shape[-1]).reshape(b, 1, groups * tq, -1)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=maskg, scale=scale)
    return out.reshape(b, h, tq, d)


def masked_attention(
    q: torch.Tensor,  # (B,H,Tq,D)
    k_cache: torch.Tensor,  # (B,Hkv,L,D)
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,  # (B,) cache positions < cache_lens[b] are visible to every query
    k_new: torch.Tensor,  # (B,Hkv,Tk,D)
    v_new: torch.Tensor,
    new_mask: torch.Tensor,  # (B,Tq,Tk) bool: query i may see new key j
    scale: float,
) -> torch.Tensor:
    """Attention of Tq queries over a cache prefix plus Tk new keys. Returns (B,H,Tq,D)."""
    mask = attention_mask(cache_lens, k_cache.shape[2], new_mask)
    k = torch.cat((k_cache, k_new), dim=2)
    v = torch.cat((v_cache, v_new), dim=2)
    return grouped_attention(q, k, v, mask, scale)


def in_place_mask(cache_lens: torch.Tensor, key_len: int, tree_mask: torch.Tensor) -> torch.Tensor:
    """(B,1,T,key_len) bool for attending over the cache itself after the T new tokens were
    written at ``cache_lens + j``: position p is visible iff p < cache_lens[b] or it holds new
    token j = p - cache_lens[b] with tree_mask[b, i, j]."""
    b, t, _ = tree_mask.shape
    pos = torch.arange(key_len, device=tree_mask.device)[None, :]  # (1,Lk)
    rel = pos - cache_lens[:, None]  # (B,Lk) index among the new tokens
    is_new = (rel >= 0) & (rel < t)
    new_vis = tree_mask.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, key_len))
    return ((pos < cache_lens[:, None])[:, None, :] | (new_vis & is_new[:, None, :]))[:, None]


# flex_attention's compiled kernel needs head dims of at least 16 (torch inductor: "NYI:
# embedding dimension ... must be at least 16"); smaller ones are zero-padded up to it.
FLEX_MIN_HEAD_DIM = 16
# recompiles allowed per compiled function: one per number of new tokens (decode, each
# strategy's tree and drafting widths), dynamo's specializations of sizes 0 and 1, and for the
# static-batch graph path one per (graph bucket up to FLEX_DECODING_MAX_BATCH, new tokens) of
# the capture plan; torch's default limit of 8 sent the ninth back to the dense eager
# reference, which cannot be captured in a CUDA graph (seen on an H200 with torch 2.11)
FLEX_RECOMPILE_LIMIT = 128
# tests set this to run the compiled path on the CPU (inductor compiles flex there too)
compile_on_cpu = False
# more new tokens than this (a long prompt's prefill) run the dense masked SDPA: prefill is
# compute-bound, and every prompt length would be another compile
FLEX_MAX_NEW_TOKENS = FLEX_BLOCK_TOKENS
# graph batches up to this many sequences compile with a static batch (the split-KV decoding
# kernel, see _compiled_flex_static_batch): the long tail's batches, where one sequence's
# context must be spread over the GPU; larger batches fill it with sequences already
FLEX_DECODING_MAX_BATCH = 16
# (dtype, batch, new tokens, key width, head dim, static batch) -> why the compiled kernel failed for that
# shape, which then runs the dense masked SDPA (warned once; reports list these)
flex_fallbacks: dict[tuple, str] = {}


def _raise_recompile_limits() -> None:
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(
        config.accumulated_recompile_limit, 4 * FLEX_RECOMPILE_LIMIT
    )
    # a recompile past the limit raises (and is caught below) instead of running the eager
    # reference, which a CUDA graph cannot capture
    config.fail_on_recompile_limit_hit = True


def _flex_symbolic_batch(q, k_all, v_all, cache_lens, tree_mask, scale: float) -> torch.Tensor:
    """``_flex_by_lens`` with the query heads folded, for the symbolic-batch compile."""
    return _flex_by_lens(q, k_all, v_all, cache_lens, tree_mask, scale, is_folded=True)


def _flex_static_batch(q, k_all, v_all, cache_lens, tree_mask, scale: float) -> torch.Tensor:
    """The same for the static-batch compiles: its own function (its own code object, so
    dynamo keeps them apart from the symbolic-batch one)."""
    return _flex_by_lens(q, k_all, v_all, cache_lens, tree_mask, scale, is_folded=True)


@functools.cache
def _compiled_flex_symbolic_batch():
    """``_flex_symbolic_batch`` compiled once per process, for GPUs: eager flex_attention is
    torch's dense reference (correct everywhere, fast nowhere); compiled, it is a block-sparse
    Triton kernel. The block mask is built inside the compiled function, so the batch and the
    key width become symbolic sizes there once they vary (one compile serves them all) rather
    than Python constants that each new shape would recompile for. The number of new tokens
    stays a constant (``flex_attention_by_lens`` marks it static): a symbolic one broke
    inductor's CPU code generation with torch 2.13, and a run has only a few (decode, each
    strategy's tree)."""
    _raise_recompile_limits()
    return torch.compile(_flex_symbolic_batch)


@functools.cache
def _compiled_flex_static_batch():
    """The small-batch graph path, compiled with a static batch: torch inductor's split-KV
    decoding kernel (``flex_decoding``), which spreads one sequence's context over the GPU,
    is chosen only for a static batch, fewer than 128 query rows and a power-of-two ratio of
    query to KV heads; folding the heads makes that ratio 1 (the Qwen2.5 shapes have 7 and 6).
    One compile per (graph bucket, new tokens) of the capture plan."""
    _raise_recompile_limits()
    return torch.compile(_flex_static_batch)


def query_block_rows(rows: int) -> int:
    """The flex kernel's query tile (``BLOCK_M``) for ``rows`` query rows per program: the next
    power of two, at least 16 (the smallest ``tl.dot`` tile; what inductor's decoding kernel
    picks itself) and at most the block mask's 128. Inductor's main kernel would take 128 on
    an H100/H200 in bf16 at head dim 128 (``h100_default_flex_config``): for a decode's few
    rows it computes and exponentiates a 128-row tile of which 1-7 rows are real."""
    return min(FLEX_BLOCK_TOKENS, max(16, 1 << (rows - 1).bit_length()))


def _flex_by_lens(
    q, k_all, v_all, cache_lens, tree_mask, scale: float, is_folded: bool = False
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    b, num_heads, tq, head_dim = q.shape
    num_kv_heads = k_all.shape[1]
    if is_folded:
        # query head h reads KV head h // G (torch's enable_gqa order): the G heads of a KV
        # head become G x tq query rows of it, row g * tq + t
        q = q.reshape(b, num_kv_heads, num_heads // num_kv_heads * tq, head_dim)
    rows = q.shape[2]
    key_len = k_all.shape[2]
    device = q.device
    block = FLEX_BLOCK_TOKENS
    num_q_blocks = (rows + block - 1) // block
    num_kv_blocks = (key_len + block - 1) // block
    # blocks wholly below a sequence's committed length are visible to every query ("full":
    # the kernel skips mask_mod there); the partial ones hold its end and its new tokens
    full = (cache_lens // block).clamp(max=num_kv_blocks)
    end = ((cache_lens + tq + block - 1) // block).clamp(max=num_kv_blocks)
    blocks = torch.arange(num_kv_blocks, device=device, dtype=torch.int32)

    def per_query_block(x: torch.Tensor) -> torch.Tensor:  # (B,) or (B,K) -> (B,1,QB[,K])
        return x[:, None, None].expand(b, 1, num_q_blocks, *x.shape[1:]).contiguous()

    full_num = per_query_block(full.to(torch.int32))
    full_indices = per_query_block(blocks.expand(b, num_kv_blocks))
    partial_num = per_query_block((end - full).to(torch.int32))
    partial_indices = per_query_block(
        (full.to(torch.int32)[:, None] + blocks[None, :]).clamp(max=num_kv_blocks - 1)
    )

    def mask_mod(bi, hi, qi, kvi):
        t = qi % tq
        rel = kvi - cache_lens[bi]
        is_new = (rel >= 0) & (rel < tq)
        return (rel < 0) | (is_new & tree_mask[bi, t, rel.clamp(0, tq - 1)])

    block_mask = BlockMask.from_kv_blocks(  # forward only: no transposed (q-major) blocks
        partial_num,
        partial_indices,
        full_num,
        full_indices,
        mask_mod=mask_mod,
        seq_lengths=(rows, key_len),
        compute_q_blocks=False,
    )
    out = flex_attention(
        q,
        k_all,
        v_all,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=not is_folded,
        kernel_options={"BLOCK_M": query_block_rows(rows)},
    )
    return out.reshape(b, num_heads, tq, head_dim)


def flex_attention_by_lens(
    q: torch.Tensor,  # (B,H,Tq,D)
    k_all: torch.Tensor,  # (B,Hkv,Lk,D): the cache with the Tq new keys already at lens + j
    v_all: torch.Tensor,
    cache_lens: torch.Tensor,  # (B,) committed positions, visible to every query
    tree_mask: torch.Tensor,  # (B,Tq,Tq) bool: query i may see new key j
    scale: float,
    is_static_batch: bool = False,
) -> torch.Tensor:
    """The attention of ``in_place_mask`` with flex_attention: key p is visible to query i iff
    p < cache_lens[b], or p holds new token j = p - cache_lens[b] and tree_mask[b, i, j]. The
    block mask lists, per sequence, only the KV blocks below cache_lens[b] + Tq, built with
    tensor ops alone (no host sync: capturable in a CUDA graph). Compiled (CUDA), the query heads
    are folded onto their KV head, as FlashAttention's and FlashInfer's decode kernels pack
    them: one program reads a KV head's blocks once for all its G query heads, where one
    program per query head reads them G times and, at a decode's one row, fills a 128-row tile
    with a single real row (H200, session 23: 7B decode at batch 256 and 1k context took 56 ms
    a step, about 13 TFLOP of such tiles). ``is_static_batch``: a graph's fixed batch, which at
    up to ``FLEX_DECODING_MAX_BATCH`` sequences and under 128 query rows compiles per batch for
    the split-KV decoding kernel. Returns (B,H,Tq,D)."""
    is_compiled = q.device.type == "cuda" or compile_on_cpu
    if not is_compiled:
        return _flex_by_lens(q, k_all, v_all, cache_lens, tree_mask, scale)
    b, num_heads, tq, head_dim = q.shape
    is_static = (
        is_static_batch
        and b <= FLEX_DECODING_MAX_BATCH
        and num_heads // k_all.shape[1] * new_tokens_bucket(tq) < FLEX_BLOCK_TOKENS
    )
    key = (q.dtype, b, tq, k_all.shape[2], head_dim, is_static)
    if tq <= FLEX_MAX_NEW_TOKENS and key not in flex_fallbacks:
        try:
            return _compiled_call(q, k_all, v_all, cache_lens, tree_mask, scale, is_static)
        except Exception as e:  # noqa: BLE001 -- a compile failure: this shape runs dense
            if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            flex_fallbacks[key] = reason
            warnings.warn(
                f"compiled flex_attention failed for batch {b}, {tq} new tokens, key width "
                f"{k_all.shape[2]}, head dim {head_dim} ({reason}); that shape runs the dense "
                "masked SDPA instead",
                RuntimeWarning,
                stacklevel=2,
            )
    mask = in_place_mask(cache_lens, k_all.shape[2], tree_mask)
    return grouped_attention(q, k_all, v_all, mask, scale)


def new_tokens_bucket(num_tokens: int) -> int:
    """The number of new tokens the compiled flex kernel is built for: the next power of two.
    An eager SD iteration's drafter catch-up feeds 1 .. draft_steps + 1 pairs, a different
    count as acceptance varies, and each count would be its own compile (seconds, mid-rollout);
    bucketed, a run compiles at most eight."""
    return 1 << (num_tokens - 1).bit_length()


def pad_tree_mask(tree_mask: torch.Tensor, padded: int) -> torch.Tensor:
    """``tree_mask`` (B,T,T) grown to (B,padded,padded): the padding rows see only their own
    position, the real rows none of the padding. Device tensor ops alone, no value from the
    host (an indexed assignment of a Python ``True`` copies a host scalar, which a CUDA graph
    capture refuses)."""
    b, tq = tree_mask.shape[0], tree_mask.shape[1]
    eye = torch.eye(padded, dtype=torch.bool, device=tree_mask.device)
    mask = eye.expand(b, padded, padded).clone()
    mask[:, :tq, :tq] = tree_mask
    return mask


def _compiled_call(
    q, k_all, v_all, cache_lens, tree_mask, scale: float, is_static: bool
) -> torch.Tensor:
    import torch._dynamo

    fn = _compiled_flex_static_batch() if is_static else _compiled_flex_symbolic_batch()
    b, _, tq, head_dim = q.shape
    padded = new_tokens_bucket(tq)
    if padded > tq:
        # padding query rows, discarded after: each sees the committed keys and its own
        # position (never a real row's new keys: the real rows' mask columns stay False)
        q = F.pad(q, (0, 0, 0, padded - tq))
        tree_mask = pad_tree_mask(tree_mask, padded)
    if head_dim < FLEX_MIN_HEAD_DIM:
        # zero-padded dims add nothing to q.k, and the padded output columns are dropped
        pad = (0, FLEX_MIN_HEAD_DIM - head_dim)
        q, k_all, v_all = F.pad(q, pad), F.pad(k_all, pad), F.pad(v_all, pad)
    for t, dim in ((q, 2), (tree_mask, 1), (tree_mask, 2)):
        torch._dynamo.mark_static(t, dim)
    batched = (q, k_all, v_all, cache_lens, tree_mask)
    for t in batched:
        if is_static:  # one compile per graph bucket: the split-KV kernel needs it static
            torch._dynamo.mark_static(t, 0)
        else:  # symbolic from the first compile on (sizes 1 and 0 aside)
            torch._dynamo.maybe_mark_dynamic(t, 0)
    for t in (k_all, v_all):
        torch._dynamo.maybe_mark_dynamic(t, 2)  # the key width: each engine's slot width
    out = fn(q, k_all, v_all, cache_lens, tree_mask, scale)
    return out[:, :, :tq, :head_dim]


def causal_mask(batch: int, num_tokens: int, device: torch.device | str) -> torch.Tensor:
    return (
        torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device)
        .tril()
        .expand(batch, -1, -1)
    )
