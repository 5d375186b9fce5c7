"""Verification step of speculative sampling for a batch of draft chains: a torch reference and
one fused Triton kernel computing the same function.

Given, for B sequences and k drafted positions,
    target_probs (B, k+1, V)  p_j: target distribution of the token after position j
    draft_probs  (B, k, V)    q_j: distribution draft token j was sampled from (None: point mass)
    draft_tokens (B, k)       x_j
    u_accept     (B, k)       uniforms in [0, 1) for the accept tests
    u_sample     (B,)         uniform in [0, 1) for the correction / bonus token
it returns (accepted (B, k) bool, num_accepted (B,), next_token (B,)).

The rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Alg. 1; Chen et al. 2023): position j is accepted iff every earlier position was accepted and

    u_accept[j] < p_j(x_j) / q_j(x_j)          (float32, IEEE round-to-nearest division)

which is "accept with probability min(1, p/q)" because u < 1. The division form is chosen over
``u * q < p`` because it gets the edge cases right exactly: p == q gives p/q == 1 > u (always
accept), p == 0 gives 0 (never accept), q == 0 < p gives inf (accept), p == q == 0 gives NaN
(reject). The kernel uses ``tl.math.div_rn`` (plain ``/`` in Triton is not correctly rounded on
NVIDIA GPUs), so accept decisions and num_accepted are bit-identical between kernel and reference.

With n = num_accepted, the next token is drawn from the weights
    w = max(p_n - q_n, 0)   if n < k (rejection: the residual distribution, unnormalised)
    w = p_k                 if n == k (all accepted: the bonus token)
by inverse CDF: the smallest t with cdf(t) > u_sample * cdf(V-1), cdf accumulated in float64.
If the residual vanishes (p_n <= q_n everywhere, possible only through float rounding since a
rejection has positive probability only when some p > q) w falls back to p_n. The point-mass
draft (draft_probs None, deterministic drafting) is q_n = one_hot(x_n): the test is u < p(x) and
the residual is p with x's mass removed.

Residual kernel/reference difference: the float64 cumulative sums are added in different orders
(sequential vs. per-block tree scans), so they differ by ~1e-16 relative; the sampled token can
differ only when u_sample * total lies within that distance of a CDF step, a set of measure
~V * 1e-16 of the uniforms. ``spec_verify_from_logits`` computes the softmax inside the kernel
(exp and sums in a different order from torch), so there decisions match the reference except
when u lies within a few float32 ulps of p/q; tests draw uniforms away from those boundaries.

Usage:
    from kernels.spec_verify import spec_verify
    accepted, num_accepted, next_token = spec_verify(p, q, x, u_acc, u_smp, impl="triton")

impl="triton" runs the kernel: compiled on CUDA tensors, or through the Triton interpreter on
CPU tensors when TRITON_INTERPRET=1 was set before triton was imported (Triton's own standard
library is decorated at import time, so setting it later does not work).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the [kernels] extra is not installed: only the references are available
    HAS_TRITON = False

IMPLS = ("ref", "triton")
MAX_BLOCK_V = 4096  # vocabulary tile: 16 KiB of fp32 per operand, enough to keep loads wide


def sample_from_weights(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the smallest t with cdf(t) > u * cdf(V-1), cdf in float64.

    weights (..., V) non-negative, not necessarily normalised, with a positive entry per row;
    u (...) uniforms in [0, 1). Returns int64 tokens (...). A zero-weight token is never chosen
    (the CDF does not rise there). Same rule as the kernels (see the module docstring)."""
    cdf = torch.cumsum(weights.to(torch.float64), dim=-1)  # (..., V)
    threshold = u.to(torch.float64) * cdf[..., -1]  # (...)
    token = (cdf <= threshold.unsqueeze(-1)).sum(dim=-1)  # first index with cdf > threshold
    return token.clamp(max=weights.shape[-1] - 1)  # only reached when a row is all zero


def _check_shapes(target_probs, draft_probs, draft_tokens, u_accept, u_sample) -> None:
    num_seqs, k = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (num_seqs, k + 1):
        raise ValueError(
            f"target_probs must be (B, k+1, V) = ({num_seqs}, {k + 1}, V), got "
            f"{tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (num_seqs, k, vocab):
        raise ValueError(
            f"draft_probs must be (B, k, V) = {(num_seqs, k, vocab)}, got "
            f"{tuple(draft_probs.shape)}"
        )
    if tuple(u_accept.shape) != (num_seqs, k) or tuple(u_sample.shape) != (num_seqs,):
        raise ValueError(
            f"u_accept must be (B, k) and u_sample (B,), got "
            f"{tuple(u_accept.shape)} and {tuple(u_sample.shape)}"
        )


def next_token_weights(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
) -> torch.Tensor:
    """The (B, V) float32 weights the correction / bonus token is drawn from, given n =
    num_accepted: max(p_n - q_n, 0) if n < k (p_n if that is all zero), p_k if n == k."""
    num_seqs, k = draft_tokens.shape
    rows = torch.arange(num_seqs, device=target_probs.device)
    p_row = target_probs[rows, num_accepted].float()  # (B, V) p_n
    has_draft = (num_accepted < k).unsqueeze(-1)  # (B, 1) False: bonus token from p_k
    q_pos = num_accepted.clamp(max=max(k - 1, 0))
    if k == 0:
        q_row = torch.zeros_like(p_row)
    elif draft_probs is None:  # point mass on the drafted token
        # one-hot by scatter: one_hot's range check reads the ids back (a host stall)
        q_row = torch.zeros_like(p_row).scatter_(1, draft_tokens[rows, q_pos].long()[:, None], 1.0)
    else:
        q_row = draft_probs[rows, q_pos]  # (B, V) q_n
    residual = torch.clamp_min(p_row - torch.where(has_draft, q_row.float(), 0.0), 0.0)
    is_empty = residual.to(torch.float64).sum(-1, keepdim=True) == 0  # rounding-only case
    return torch.where(is_empty, p_row, residual)


def spec_verify_ref(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the verification rule in the module docstring, vectorised over B."""
    _check_shapes(target_probs, draft_probs, draft_tokens, u_accept, u_sample)
    num_seqs, k = draft_tokens.shape
    p = target_probs.float()  # (B, k+1, V)
    tokens = draft_tokens.long()  # (B, k)
    p_tok = p[:, :k].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, k) p_j(x_j)
    if draft_probs is None:
        q_tok = torch.ones_like(p_tok)  # point mass on the drafted token
    else:
        q_tok = draft_probs.float().gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, k)
    is_ok = u_accept.float() < p_tok / q_tok  # (B, k), NaN (0/0) compares False
    accepted = torch.cumprod(is_ok.to(torch.int32), dim=-1).bool()  # all earlier accepted too
    num_accepted = accepted.sum(dim=-1)  # (B,)

    weights = next_token_weights(p, draft_probs, tokens, num_accepted)
    next_token = sample_from_weights(weights, u_sample)
    return accepted, num_accepted, next_token


def spec_verify_from_logits_ref(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of the logits entry: softmax(logits / temperature) then ``spec_verify_ref``."""
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0 (greedy uses the probs entry), got {temperature}"
        )
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    return spec_verify_ref(p, q, draft_tokens, u_accept, u_sample)


def spec_verify(target_probs, draft_probs, draft_tokens, u_accept, u_sample, impl: str = "ref"):
    """Dispatch on ``impl`` ("ref" | "triton"); same arguments and results as spec_verify_ref."""
    if impl == "ref":
        return spec_verify_ref(target_probs, draft_probs, draft_tokens, u_accept, u_sample)
    if impl == "triton":
        return spec_verify_triton(target_probs, draft_probs, draft_tokens, u_accept, u_sample)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def spec_verify_from_logits(
    target_logits, draft_logits, draft_tokens, u_accept, u_sample, temperature, impl="ref"
):
    """Dispatch on ``impl``; same results as spec_verify_from_logits_ref (see module docstring)."""
    if impl == "ref":
        return spec_verify_from_logits_ref(
            target_logits, draft_logits, draft_tokens, u_accept, u_sample, temperature
        )
    if impl == "triton":
        return spec_verify_from_logits_triton(
            target_logits, draft_logits, draft_tokens, u_accept, u_sample, temperature
        )
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def triton_runnable_on(
    device: torch.device, dot_dtype: torch.dtype | None = None
) -> tuple[bool, str]:
    """Whether the Triton kernels can run on tensors of ``device``, and why not;
    ``dot_dtype``: the dtype a kernel feeds ``tl.dot`` (tree attention's inputs)."""
    if not HAS_TRITON:
        return False, "triton is not installed (pip install -e .[kernels])"
    if device.type == "cuda":
        return True, ""
    if triton.knobs.runtime.interpret and dot_dtype == torch.bfloat16:
        # the interpreter's tl.dot of a cast to bf16 is garbage (max error ~1e9 where fp32 and
        # fp16 match the reference; triton 3.x, 2026-11-28): refused, not a silent wrong result
        return False, (
            "Triton's interpreter (TRITON_INTERPRET=1) computes bfloat16 tl.dot wrongly; use "
            "--dtype float32 or float16 on a CPU, or CUDA tensors"
        )
    if triton.knobs.runtime.interpret:
        return True, ""
    return False, (
        f"impl='triton' on {device.type} tensors needs TRITON_INTERPRET=1 set before "
        "triton is imported (Triton has no CPU backend), or CUDA tensors"
    )


def _prepare(target, draft, draft_tokens, u_accept, u_sample):
    """Checks, contiguous copies where needed, outputs; tensors of width k are given width
    max(k, 1) so that no pointer handed to the kernel belongs to an empty tensor (the
    interpreter crashes on those); with k == 0 the kernel reads none of the padding."""
    _check_shapes(target, draft, draft_tokens, u_accept, u_sample)
    is_ok, why = triton_runnable_on(target.device)
    if not is_ok:
        raise RuntimeError(why)
    num_seqs, k = draft_tokens.shape
    device = target.device
    width = max(k, 1)
    tokens = torch.zeros((num_seqs, width), dtype=torch.int64, device=device)
    tokens[:, :k] = draft_tokens
    u_acc = torch.zeros((num_seqs, width), dtype=torch.float32, device=device)
    u_acc[:, :k] = u_accept
    target = target if target.stride(-1) == 1 else target.contiguous()
    if draft is None or k == 0:
        draft = None
    elif draft.stride(-1) != 1:
        draft = draft.contiguous()
    inputs = (target, draft, tokens, u_acc, u_sample.float().contiguous())
    outputs = (
        torch.zeros((num_seqs, width), dtype=torch.int8, device=device),  # accepted
        torch.zeros((num_seqs,), dtype=torch.int32, device=device),  # num_accepted
        torch.zeros((num_seqs,), dtype=torch.int64, device=device),  # next_token
    )
    block_v = min(MAX_BLOCK_V, triton.next_power_of_2(target.shape[-1]))
    return inputs, outputs, block_v


def _finish(outputs, k):
    accepted, num_accepted, next_token = outputs
    return accepted[:, :k].bool(), num_accepted.long(), next_token


def spec_verify_triton(target_probs, draft_probs, draft_tokens, u_accept, u_sample):
    """Run ``_spec_verify_kernel``: one program per sequence."""
    inputs, outputs, block_v = _prepare(target_probs, draft_probs, draft_tokens, u_accept, u_sample)
    target, draft, tokens, u_acc, u_smp = inputs
    num_seqs, k = draft_tokens.shape
    # With no draft row to read, the target stands in for the draft pointer; never dereferenced.
    # enable_fp_fusion=False: no a*b+c contracted into an FMA, so each float operation rounds
    # exactly as torch's does (the accept test has none anyway; this keeps it so).
    draft_arg = target if draft is None else draft
    _spec_verify_kernel[(num_seqs,)](
        target, draft_arg, tokens, u_acc, u_smp, *outputs,
        k, target.shape[-1], tokens.stride(0), target.stride(0), target.stride(1),
        draft_arg.stride(0), draft_arg.stride(1),
        HAS_DRAFT_PROBS=draft is not None, BLOCK_V=block_v, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    return _finish(outputs, k)


def spec_verify_from_logits_triton(
    target_logits, draft_logits, draft_tokens, u_accept, u_sample, temperature
):
    """Run ``_spec_verify_logits_kernel``: softmax fused, rows after a rejection never read."""
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0 (greedy uses the probs entry), got {temperature}"
        )
    inputs, outputs, block_v = _prepare(
        target_logits, draft_logits, draft_tokens, u_accept, u_sample
    )
    target, draft, tokens, u_acc, u_smp = inputs
    num_seqs, k = draft_tokens.shape
    draft_arg = target if draft is None else draft  # k == 0: never dereferenced
    _spec_verify_logits_kernel[(num_seqs,)](
        target, draft_arg, tokens, u_acc, u_smp, *outputs,
        k, target.shape[-1], float(temperature), tokens.stride(0), target.stride(0),
        target.stride(1), draft_arg.stride(0), draft_arg.stride(1),
        BLOCK_V=block_v, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    return _finish(outputs, k)


if HAS_TRITON:

    @triton.jit
    def _spec_verify_kernel(
        target_ptr, draft_ptr, tokens_ptr, u_accept_ptr, u_sample_ptr,
        accepted_ptr, num_accepted_ptr, next_token_ptr,
        K, V, stride_xb, stride_tb, stride_tk, stride_db, stride_dk,
        HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # One program per sequence b. Phase 1: k scalar accept tests; phase 2: two passes over
        # the one vocabulary row the next token is drawn from (total, then inverse CDF).
        b = tl.program_id(0).to(tl.int64)
        num_acc = tl.zeros((), dtype=tl.int32)
        for j in range(K):
            tok = tl.load(tokens_ptr + b * stride_xb + j)
            p = tl.load(target_ptr + b * stride_tb + j * stride_tk + tok).to(tl.float32)
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_ptr + b * stride_db + j * stride_dk + tok).to(tl.float32)
            else:
                q = tl.full((), 1.0, tl.float32)  # point mass on the drafted token
            u = tl.load(u_accept_ptr + b * stride_xb + j)
            is_ok = (u < tl.math.div_rn(p, q)) & (num_acc == j)  # the reference's exact test
            tl.store(accepted_ptr + b * stride_xb + j, is_ok.to(tl.int8))
            num_acc += is_ok.to(tl.int32)
        tl.store(num_accepted_ptr + b, num_acc)

        has_draft = num_acc < K  # False: all accepted, bonus token from p_k
        q_pos = tl.maximum(tl.minimum(num_acc, K - 1), 0)  # clamped so the loads stay in bounds
        t_row = target_ptr + b * stride_tb + num_acc * stride_tk
        d_row = draft_ptr + b * stride_db + q_pos * stride_dk
        rejected_tok = tl.load(tokens_ptr + b * stride_xb + q_pos)  # only used if has_draft
        # q_n's row length: V, or 0 when there is no q_n. A bound rather than `mask & has_draft`
        # because the interpreter turns (block bool) & (scalar bool) into int32 (triton 3.9).
        q_len = tl.where(has_draft, V, 0)
        total_r = tl.zeros((), dtype=tl.float64)  # residual mass
        total_p = tl.zeros((), dtype=tl.float64)  # p_n mass (fallback)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            in_v = offs < V
            p = tl.load(t_row + offs, mask=in_v, other=0.0).to(tl.float32)
            if HAS_DRAFT_PROBS:
                q = tl.load(d_row + offs, mask=offs < q_len, other=0.0).to(tl.float32)
            else:
                q = tl.where((offs == rejected_tok) & (offs < q_len), 1.0, 0.0)
            total_r += tl.sum(tl.maximum(p - q, 0.0).to(tl.float64), axis=0)
            total_p += tl.sum(p.to(tl.float64), axis=0)
        is_residual = total_r > 0
        threshold = tl.load(u_sample_ptr + b).to(tl.float64) * tl.where(
            is_residual, total_r, total_p
        )
        prefix = tl.zeros((), dtype=tl.float64)
        found = tl.full((), V, dtype=tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            in_v = offs < V
            p = tl.load(t_row + offs, mask=in_v, other=0.0).to(tl.float32)
            if HAS_DRAFT_PROBS:
                q = tl.load(d_row + offs, mask=offs < q_len, other=0.0).to(tl.float32)
            else:
                q = tl.where((offs == rejected_tok) & (offs < q_len), 1.0, 0.0)
            w = tl.where(is_residual, tl.maximum(p - q, 0.0), p).to(tl.float64)
            cdf = prefix + tl.cumsum(w, axis=0)
            found = tl.minimum(found, tl.min(tl.where((cdf > threshold) & in_v, offs, V), axis=0))
            prefix += tl.sum(w, axis=0)
        tl.store(next_token_ptr + b, tl.minimum(found, V - 1).to(tl.int64))

    @triton.jit
    def _row_softmax_stats(row_ptr, V, temperature, BLOCK_V: tl.constexpr):
        # Online max and sum of exp over one logits row (Milakov & Gimelshein 2018).
        row_max = tl.full((), float("-inf"), tl.float32)
        row_sum = tl.zeros((), dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            z = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            z = tl.math.div_rn(z, temperature)
            new_max = tl.maximum(row_max, tl.max(z, axis=0))
            row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
            row_max = new_max
        return row_max, row_sum

    @triton.jit
    def _row_probs(row_ptr, offs, temperature, row_max, row_sum):
        z = tl.load(row_ptr + offs).to(tl.float32)
        return tl.exp(tl.math.div_rn(z, temperature) - row_max) / row_sum

    @triton.jit
    def _masked_row_probs(row_ptr, offs, mask, temperature, row_max, row_sum):
        z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        return tl.where(mask, tl.exp(tl.math.div_rn(z, temperature) - row_max) / row_sum, 0.0)

    @triton.jit
    def _spec_verify_logits_kernel(
        target_ptr, draft_ptr, tokens_ptr, u_accept_ptr, u_sample_ptr,
        accepted_ptr, num_accepted_ptr, next_token_ptr,
        K, V, temperature, stride_xb, stride_tb, stride_tk, stride_db, stride_dk,
        BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # As _spec_verify_kernel with p = softmax(target / T), q = softmax(draft / T) formed on
        # the fly; positions after the first rejection are skipped, so their rows are never read.
        b = tl.program_id(0).to(tl.int64)
        num_acc = tl.zeros((), dtype=tl.int32)
        t_max = tl.zeros((), dtype=tl.float32)
        t_sum = tl.full((), 1.0, tl.float32)
        d_max = tl.zeros((), dtype=tl.float32)
        d_sum = tl.full((), 1.0, tl.float32)
        for j in range(K):
            if num_acc == j:
                t_row = target_ptr + b * stride_tb + j * stride_tk
                d_row = draft_ptr + b * stride_db + j * stride_dk
                t_max, t_sum = _row_softmax_stats(t_row, V, temperature, BLOCK_V)
                d_max, d_sum = _row_softmax_stats(d_row, V, temperature, BLOCK_V)
                tok = tl.load(tokens_ptr + b * stride_xb + j)
                p = _row_probs(t_row, tok, temperature, t_max, t_sum)
                q = _row_probs(d_row, tok, temperature, d_max, d_sum)
                is_ok = tl.load(u_accept_ptr + b * stride_xb + j) < tl.math.div_rn(p, q)
                tl.store(accepted_ptr + b * stride_xb + j, is_ok.to(tl.int8))
                num_acc += is_ok.to(tl.int32)
        tl.store(num_accepted_ptr + b, num_acc)

        has_draft = num_acc < K
        t_row = target_ptr + b * stride_tb + num_acc * stride_tk
        d_row = draft_ptr + b * stride_db + tl.minimum(num_acc, K - 1) * stride_dk
        q_len = tl.where(has_draft, V, 0)  # see _spec_verify_kernel
        if num_acc == K:  # all accepted: the bonus row p_k has not been normalised yet
            t_max, t_sum = _row_softmax_stats(t_row, V, temperature, BLOCK_V)
        total_r = tl.zeros((), dtype=tl.float64)
        total_p = tl.zeros((), dtype=tl.float64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            in_v = offs < V
            p = _masked_row_probs(t_row, offs, in_v, temperature, t_max, t_sum)
            q = _masked_row_probs(d_row, offs, offs < q_len, temperature, d_max, d_sum)
            total_r += tl.sum(tl.maximum(p - q, 0.0).to(tl.float64), axis=0)
            total_p += tl.sum(p.to(tl.float64), axis=0)
        is_residual = total_r > 0
        threshold = tl.load(u_sample_ptr + b).to(tl.float64) * tl.where(
            is_residual, total_r, total_p
        )
        prefix = tl.zeros((), dtype=tl.float64)
        found = tl.full((), V, dtype=tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            in_v = offs < V
            p = _masked_row_probs(t_row, offs, in_v, temperature, t_max, t_sum)
            q = _masked_row_probs(d_row, offs, offs < q_len, temperature, d_max, d_sum)
            w = tl.where(is_residual, tl.maximum(p - q, 0.0), p).to(tl.float64)
            cdf = prefix + tl.cumsum(w, axis=0)
            found = tl.minimum(found, tl.min(tl.where((cdf > threshold) & in_v, offs, V), axis=0))
            prefix += tl.sum(w, axis=0)
        tl.store(next_token_ptr + b, tl.minimum(found, V - 1).to(tl.int64))
