"""Tree attention for the verify step of tree speculative decoding: the T verify tokens of each
sequence (the root and its drafted tree) attend to the sequence's KV-cache prefix and, among
themselves, only to their tree ancestors and themselves. A torch reference and a flash-style
Triton kernel computing the same function (SpecInfer, Miao et al. 2024, "tree attention";
EAGLE, Li et al. 2024, Sec. 4).

Shapes:
    q         (B, H, T, D)      queries of the verify tokens
    k_cache   (B, Hkv, L, D)    cached keys; the first cache_lens[b] entries are valid
    v_cache   (B, Hkv, L, D)
    cache_lens (B,)             valid prefix length per sequence
    k_new     (B, Hkv, T, D)    keys / values of the verify tokens themselves
    v_new     (B, Hkv, T, D)
    tree_mask (B, T, T) bool    [b, i, j] true iff token j is token i or an ancestor of i
                                (tltrun.rollout.speculative.DraftTree.ancestor_mask()); the diagonal
                                must be true so that every row attends to something
    scale     float             softmax scale, usually D ** -0.5
returns (B, H, T, D) in q's dtype. Grouped-query attention: query head h reads KV head
h // (H // Hkv). Computation is in float32 in both implementations.

Usage:
    from kernels.tree_attention import tree_attention
    out = tree_attention(q, k_cache, v_cache, cache_lens, k_new, v_new, mask, D**-0.5,
                         impl="triton")
impl="triton" needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported (see
kernels/spec_verify.py).
"""

from __future__ import annotations

import torch

from kernels.spec_verify import HAS_TRITON, IMPLS, triton_runnable_on

if HAS_TRITON:
    import triton
    import triton.language as tl

BLOCK_L = 64  # prefix keys per step: a (64 x D) tile, the usual flash-attention tile height
# query rows per program at most: a (64 x D) float32 accumulator in registers, as BLOCK_L's tile
MAX_BLOCK_R = 64


def _check_shapes(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_mask) -> None:
    num_seqs, num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be (B, Hkv, L, D), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if (k_cache.shape[0], k_cache.shape[3]) != (num_seqs, head_dim):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"H = {num_heads} must be a multiple of Hkv = {num_kv_heads}")
    expected = (num_seqs, num_kv_heads, num_tokens, head_dim)
    if tuple(k_new.shape) != expected or tuple(v_new.shape) != expected:
        raise ValueError(
            f"k_new and v_new must be (B, Hkv, T, D) = {expected}, got "
            f"{tuple(k_new.shape)} and {tuple(v_new.shape)}"
        )
    if tuple(tree_mask.shape) != (num_seqs, num_tokens, num_tokens):
        raise ValueError(
            f"tree_mask must be (B, T, T) = {(num_seqs, num_tokens, num_tokens)}, "
            f"got {tuple(tree_mask.shape)}"
        )
    if tuple(cache_lens.shape) != (num_seqs,):
        raise ValueError(f"cache_lens must be (B,) = ({num_seqs},), got {tuple(cache_lens.shape)}")


def tree_attention_ref(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_mask, scale):
    """Torch reference: one masked softmax over [prefix keys, verify-token keys]."""
    _check_shapes(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_mask)
    num_seqs, num_heads, num_tokens, _ = q.shape
    max_len = k_cache.shape[2]
    group = num_heads // k_cache.shape[1]
    keys = torch.cat([k_cache, k_new], dim=2).float().repeat_interleave(group, dim=1)
    values = torch.cat([v_cache, v_new], dim=2).float().repeat_interleave(group, dim=1)
    # keys, values: (B, H, L + T, D)
    positions = torch.arange(max_len, device=q.device)
    is_prefix = positions.unsqueeze(0) < cache_lens.to(q.device).unsqueeze(1)  # (B, L)
    allowed = torch.cat(
        [is_prefix.unsqueeze(1).expand(num_seqs, num_tokens, max_len), tree_mask.bool()], dim=2
    )  # (B, T, L + T)
    scores = torch.einsum("bhtd,bhsd->bhts", q.float(), keys) * scale  # (B, H, T, L + T)
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    out = torch.einsum("bhts,bhsd->bhtd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)


def tree_attention(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_mask, scale, impl="ref"):
    """Dispatch on ``impl`` ("ref" | "triton"); same arguments and result as the reference."""
    if impl == "ref":
        return tree_attention_ref(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_mask, scale)
    if impl == "triton":
        return tree_attention_triton(
            q, k_cache, v_cache, cache_lens, k_new, v_new, tree_mask, scale
        )
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def tree_attention_triton(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_mask, scale):
    """Run ``_tree_attention_kernel``: one program per (sequence, KV head, block of query rows).
    The G query heads of a KV head are folded into its rows (G x T of them, head-major), as
    FlashAttention's and FlashInfer's decode kernels pack GQA: each program reads the KV head's
    prefix once for up to ``MAX_BLOCK_R`` rows, where one program per query head read it G
    times and filled a 16-row tile with a decode's single row."""
    _check_shapes(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_mask)
    is_ok, why = triton_runnable_on(q.device, q.dtype)
    if not is_ok:
        raise RuntimeError(why)
    q, k_cache, v_cache, k_new, v_new = map(
        _last_dim_contiguous, (q, k_cache, v_cache, k_new, v_new)
    )
    num_seqs, num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_rows = num_heads // num_kv_heads * num_tokens  # per KV head: G heads x T tokens
    mask = tree_mask.to(torch.int8).contiguous()  # (B, T, T)
    lens = cache_lens.to(device=q.device, dtype=torch.int32).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # tl.dot needs tiles of at least 16 on GPUs; fp32 inputs use IEEE products (not TF32) so the
    # kernel matches the float32 reference.
    block_r = min(MAX_BLOCK_R, max(16, triton.next_power_of_2(num_rows)))
    block_t = max(16, triton.next_power_of_2(num_tokens))
    block_d = max(16, triton.next_power_of_2(head_dim))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (num_seqs, num_kv_heads, triton.cdiv(num_rows, block_r))
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, lens, k_new, v_new, mask, out, float(scale),
        num_tokens, head_dim, num_heads // num_kv_heads, k_cache.shape[2],
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *k_new.stride()[:3], *v_new.stride()[:3], *out.stride()[:3],
        BLOCK_R=block_r, BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_L=BLOCK_L,
        DOT_PRECISION=precision, num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip
    return out


if HAS_TRITON:

    @triton.jit
    def _online_softmax_step(acc, row_max, row_sum, scores, values, DOT_PRECISION: tl.constexpr):
        # Flash-attention update (Dao et al. 2022, Alg. 1) of the running max, sum and output
        # with one tile of scores (BLOCK_T, n) and values (n, BLOCK_D).
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        alpha = tl.exp(row_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(weights, axis=1)
        acc = acc * alpha[:, None] + tl.dot(
            weights.to(values.dtype), values, input_precision=DOT_PRECISION
        )
        return acc, new_max, row_sum

    @triton.jit
    def _tree_attention_kernel(
        q_ptr, kc_ptr, vc_ptr, lens_ptr, kn_ptr, vn_ptr, mask_ptr, out_ptr, scale,
        T, D, GROUP, L,
        sq_b, sq_h, sq_t, skc_b, skc_h, skc_l, svc_b, svc_h, svc_l,
        skn_b, skn_h, skn_t, svn_b, svn_h, svn_t, so_b, so_h, so_t,
        BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_L: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        kv_h = tl.program_id(1).to(tl.int64)
        # this program's query rows: row r of KV head kv_h is query head kv_h * GROUP + r // T
        # (the heads reading kv_h, as Hugging Face's repeat_kv) at verify token r % T
        offs_r = tl.program_id(2).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_r = offs_r < GROUP * T
        h = kv_h * GROUP + offs_r // T  # (BLOCK_R,)
        t = offs_r % T
        offs_t = tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, BLOCK_D)
        in_t = offs_t < T
        in_d = offs_d < D
        q = tl.load(
            q_ptr + b * sq_b + h[:, None] * sq_h + t[:, None] * sq_t + offs_d[None, :],
            mask=in_r[:, None] & in_d[None, :],
            other=0.0,
        )  # (BLOCK_R, BLOCK_D)
        # A finite start for the running max: padded rows (r >= GROUP * T) see only -inf
        # scores and must not produce exp(-inf - -inf) = NaN in the update (never stored).
        row_max = tl.full((BLOCK_R,), -1.0e30, tl.float32)
        row_sum = tl.zeros((BLOCK_R,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)

        cache_len = tl.load(lens_ptr + b)
        for start in range(0, cache_len, BLOCK_L):  # the sequence's valid KV prefix
            offs_l = start + tl.arange(0, BLOCK_L)
            in_l = offs_l < cache_len
            tile_mask = in_l[:, None] & in_d[None, :]
            k = tl.load(
                kc_ptr + b * skc_b + kv_h * skc_h + offs_l[:, None] * skc_l + offs_d[None, :],
                mask=tile_mask,
                other=0.0,
            )  # (BLOCK_L, BLOCK_D)
            v = tl.load(
                vc_ptr + b * svc_b + kv_h * svc_h + offs_l[:, None] * svc_l + offs_d[None, :],
                mask=tile_mask,
                other=0.0,
            )
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            scores = tl.where(in_l[None, :], scores, float("-inf"))  # (BLOCK_R, BLOCK_L)
            acc, row_max, row_sum = _online_softmax_step(
                acc, row_max, row_sum, scores, v, DOT_PRECISION
            )

        # The verify tokens themselves, restricted to ancestors-or-self by the tree mask.
        tile_mask = in_t[:, None] & in_d[None, :]
        k = tl.load(
            kn_ptr + b * skn_b + kv_h * skn_h + offs_t[:, None] * skn_t + offs_d[None, :],
            mask=tile_mask,
            other=0.0,
        )  # (BLOCK_T, BLOCK_D)
        v = tl.load(
            vn_ptr + b * svn_b + kv_h * svn_h + offs_t[:, None] * svn_t + offs_d[None, :],
            mask=tile_mask,
            other=0.0,
        )
        is_visible = tl.load(
            mask_ptr + b * T * T + t[:, None] * T + offs_t[None, :],
            mask=in_r[:, None] & in_t[None, :],
            other=0,
        )  # (BLOCK_R, BLOCK_T): row r's token t sees new token j
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        scores = tl.where(is_visible != 0, scores, float("-inf"))
        acc, row_max, row_sum = _online_softmax_step(
            acc, row_max, row_sum, scores, v, DOT_PRECISION
        )

        out = acc / tl.where(in_r, row_sum, 1.0)[:, None]  # padded rows: avoid 0 / 0
        tl.store(
            out_ptr + b * so_b + h[:, None] * so_h + t[:, None] * so_t + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=in_r[:, None] & in_d[None, :],
        )
