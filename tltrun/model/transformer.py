"""Llama / Qwen2 / Qwen3-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention; Qwen3's
per-head q/k norms) built from a ``tltrun.model.config.ModelConfig``; it matches
``transformers``' logits on the same weights, and ``tltrun.model.hf_checkpoint`` loads and saves
it as a Hugging Face checkpoint (``config.json`` + ``model.safetensors`` or a sharded
``model.safetensors.index.json``).

Parameter names are exactly Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...), so
a state dict moves unchanged between this model, ``transformers`` and vLLM (GRPO weight sync).

Attention is delegated to an *attention context* passed into ``forward``: the context decides
where keys/values come from and go to (no cache for training, the slot KV cache of
``tltrun.model.kvcache`` for rollout, a side buffer for draft trees in ``tltrun.model.drafter``). The model
itself holds no per-call state.

``forward`` returns ``(logits, hidden)``; ``hidden`` is the last layer's output AFTER the final
RMSNorm, i.e. the vector the LM head multiplies. That is the feature EAGLE-1 trains its drafter
on (EAGLE's ``ea_model`` feeds ``base_model.model(...)[0]``, which Hugging Face returns after
``model.norm``; vLLM's EAGLE proposer passes the same post-norm hidden state).

Try it: ``python -m pytest tests/test_model.py -q``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from tltrun.model.config import ModelConfig

# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (D/2,) in float32, with linear / llama3 scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s.kind == "linear":
        return inv / s.factor
    if s.kind == "llama3":
        # Llama 3.1 "frequency-dependent" scaling: long wavelengths divided by factor, short
        # ones kept, a smooth blend in between (Meta's Llama 3.1 release; HF rope utils).
        old_len = s.original_max_position_embeddings
        low_wavelen = old_len / s.low_freq_factor
        high_wavelen = old_len / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, blended, scaled)
    return inv


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` (..., D) in Hugging Face's half-split layout, ``x cos + rotate_half(x) sin``
    with ``rotate_half(x) = cat(-x2, x1)``, computed as ``x cos + cat(x2, x1) cat(-s1, s2)``
    (``Rotary`` returns the sine with rotate_half's sign in it): the same products (negation is
    exact), four kernels instead of five (no negation), and one call rotates q and k together
    where they lie side by side (``Attention.project``). Every decoder layer of a decode step
    runs this: under CUDA graphs without compiled layers each kernel is a replayed launch."""
    swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)  # cat(x2, x1)
    return x * cos + swapped * signed_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Hugging Face's order: normalise in float32, round to x's dtype, then the weight in
        # x's dtype. F.rms_norm upcasts bf16/fp16 input itself and rounds its result once (its
        # CPU decomposition; CUDA's fused kernel), so no x.float() and .to() around it: on CUDA
        # two kernels a norm where four ran (each a launch a captured decode step replays).
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


# Where a layer's compiled projection may write its new keys and values itself: the cache's K
# and V (num_layers, slots, Hkv, max_tokens, D), then the layer (1,1), slot (B,T) and position
# (B,T) indices of ``k_cache[layer, slot, :, position] = k``. Inductor then stores them from
# the kernel that applies RoPE, where the attention context would launch two index_put_ kernels
# a layer (56 of a 7B batch-1 decode step's, 0.20 ms on the H200: benchmarks/RESULTS.md,
# session 21's compiled row); vLLM's reshape_and_cache serves the same end.
KVWrite = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def write_kv(write: KVWrite, k: torch.Tensor, v: torch.Tensor) -> None:
    """New keys and values (B,Hkv,T,D) to the cache positions ``write`` names."""
    k_cache, v_cache, layer_index, slots, positions = write
    # (B,T,Hkv,D) on both sides: advanced indices (layer, slot, position) around the head slice
    k_cache[layer_index, slots, :, positions] = k.transpose(1, 2)
    v_cache[layer_index, slots, :, positions] = v.transpose(1, 2)


class AttentionContext(Protocol):
    """Where keys/values live. ``q`` (B,H,T,D) and ``k``/``v`` (B,Hkv,T,D) are post-RoPE."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of ``q``; ``k`` and ``v`` are None where the layer wrote them to
        ``kv_write(layer)`` itself."""
        ...

    def kv_write(self, layer: int) -> KVWrite | None:
        """Where the layer may write its new keys and values before ``attend``, or None."""
        ...


@dataclass(frozen=True)
class CausalContext:
    """No cache: plain causal attention over the T tokens given (training, reference forward).
    Right padding is harmless: a valid query never attends to a later (padded) key."""

    def kv_write(self, layer: int) -> None:
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )


class StackedProjections(nn.Module):
    """A module whose no-grad forwards may run several ``nn.Linear`` of one input as one GEMM,
    as vLLM's ``QKVParallelLinear`` (q, k, v) and ``MergedColumnParallelLinear`` (gate, up)
    do: at batch 1 on an H200 the three small q/k/v GEMVs read their weights at 1.3 TB/s where
    the MLP's reach 3.8-4.0 (benchmarks/RESULTS.md, session 21), and every GEMM of a captured
    step is a kernel the graph replays.

    ``fuse_projections`` stacks the linears named in ``STACKS`` (output rows in that order);
    the parameters become views of the stacked tensor, so state-dict names stay Hugging Face's
    and every in-place update of them (``load_in_place``, an optimizer step) updates it;
    forwards that record gradients (training) use the linears apart as before. A dtype or
    device conversion re-stacks (``_apply``), as does a deep copy; a parameter replaced by
    assignment breaks the link, so fuse last. Idempotent while the link holds: re-stacking
    would move the weights that graphs captured over this model read."""

    STACKS: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        # (weight, bias or None) of the STACKS linears, once fuse_projections ran
        self.stacked: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse_projections(self) -> None:
        linears = [getattr(self, name) for name in self.STACKS]
        if self.stacked is not None and all(
            t.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
            for stacked, name in zip(self.stacked, ("weight", "bias"), strict=True)
            if stacked is not None
            for t in (getattr(p, name) for p in linears)
        ):
            return
        rows = [p.weight.shape[0] for p in linears]
        weight = torch.cat([p.weight.detach() for p in linears])
        if not linears[0].weight.is_contiguous():  # keep gemm_layout's column-major storage
            weight = weight.t().contiguous().t()
        # .data, not new Parameters: an optimizer (a spot trainer's) keeps the same objects
        for p, view in zip(linears, weight.split(rows), strict=True):
            p.weight.data = view
        bias = None
        if linears[0].bias is not None:
            bias = torch.cat([p.bias.detach() for p in linears])
            for p, view in zip(linears, bias.split(rows), strict=True):
                p.bias.data = view
        self.stacked = (weight, bias)

    def stacked_linear(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` through the stacked linears in one GEMM (their outputs side by side), or None
        where they run apart (not fused, or a forward that records gradients)."""
        if self.stacked is None or torch.is_grad_enabled():
            return None
        return F.linear(x, *self.stacked)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        if self.stacked is not None:  # the conversion gave each parameter its own new tensor
            self.fuse_projections()
        return out

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if self.stacked is not None:  # a deep copy or unpickling clones each parameter alone
            self.fuse_projections()


class Attention(StackedProjections):
    STACKS = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        c, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(c, self.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(c, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(c, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, c, bias=False)
        # Qwen3 normalises each head's query and key before RoPE (elsewhere: identities)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.has_qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.has_qk_norm else nn.Identity()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.output(ctx.attend(self.layer, q, k, v))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B,H,T,D) and keys/values (B,Hkv,T,D) of ``x`` (B,T,C), RoPE applied
        (``cos``, ``signed_sin``: (B,T,D) from ``Rotary``)."""
        b, t, _ = x.shape
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, signed_sin = cos[:, None], signed_sin[:, None]  # (B,1,T,D)
        qkv = self.stacked_linear(x)  # (B,T,(H+2Hkv)D) or None
        if qkv is not None:  # q and k side by side: one rotation of both
            qk = qkv[..., : (h + h_kv) * d].view(b, t, h + h_kv, d)  # (B,T,H+Hkv,D)
            if isinstance(self.q_norm, RMSNorm):  # (no copy of q and k where there is no norm)
                qk = torch.cat([self.q_norm(qk[:, :, :h]), self.k_norm(qk[:, :, h:])], dim=2)
            q, k = apply_rope(qk.transpose(1, 2), cos, signed_sin).split([h, h_kv], dim=1)
            v = qkv[..., (h + h_kv) * d :]
        else:
            q = self.q_norm(self.q_proj(x).view(b, t, h, d)).transpose(1, 2)  # (B,H,T,D)
            k = self.k_norm(self.k_proj(x).view(b, t, h_kv, d)).transpose(1, 2)  # (B,Hkv,T,D)
            q, k, v = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin), self.v_proj(x)
        return q, k, v.view(b, t, h_kv, d).transpose(1, 2)  # v: (B,Hkv,T,D)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output (B,H,T,D) through ``o_proj``: (B,T,C)."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(StackedProjections):
    STACKS = ("gate_proj", "up_proj")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.stacked_linear(x)  # (B,T,2I) or None
        if gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block. ``has_input_norm=False`` is EAGLE's first drafter layer (its input is the
    fc projection, which EAGLE and vLLM's ``llama_eagle.py`` do not normalise)."""

    def __init__(self, cfg: ModelConfig, layer: int, has_input_norm: bool = True):
        super().__init__()
        self.input_layernorm: nn.Module = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if has_input_norm else nn.Identity()
        )
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.is_compiled = False  # set_compiled_layers

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        is_compiled = self.is_compiled and not torch.is_grad_enabled()
        layer = self.self_attn.layer
        write = ctx.kv_write(layer) if is_compiled else None
        q, k, v = _piece(0, is_compiled, self, x, cos, sin, write)
        return _piece(1, is_compiled, self, x, ctx.attend(layer, q, k, v))


# A decoder layer's work in two pieces around the attention context's ``attend`` (which reads
# and writes the KV cache, and may itself be a compiled flex kernel or a Triton kernel): plain
# functions of the layer, so one ``torch.compile`` of each serves every layer of every model
# (dynamo treats the layer's parameters as inputs; tested: one compile per shape regime, not one
# per layer). This is vLLM's "piecewise" compilation (the model compiled with attention as the
# splitting op, docs/design/torch_compile.md), for the same reason: a batch-1 decode step is
# hundreds of small kernels (RMSNorm, RoPE, SiLU, residual adds: ~40 ops per layer eagerly), and a
# CUDA graph replays each at a fixed cost, so fusing them shortens the step (issue #18 item 5).


def _before_attention(
    layer: DecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write: KVWrite | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
    if write is None:
        return q, k, v
    write_kv(write, k, v)
    return q, None, None


def _after_attention(layer: DecoderLayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    h = x + layer.self_attn.output(out)
    return h + layer.mlp(layer.post_attention_layernorm(h))


# A rollout meets a few shape regimes per piece (batch 1 and larger, one token or a verified
# tree, prefills of varying length: dynamo specialises sizes 0 and 1, then marks the rest
# dynamic); more than that is a bug, and past the limit the layer runs eagerly (warned once).
LAYER_RECOMPILE_LIMIT = 16


@functools.cache
def compiled_pieces() -> tuple[Callable, Callable]:
    """``torch.compile`` of the two pieces (one per process, shared by every layer)."""
    from torch._dynamo import config

    config.recompile_limit = max(config.recompile_limit, LAYER_RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(
        config.accumulated_recompile_limit, 4 * LAYER_RECOMPILE_LIMIT
    )
    return torch.compile(_before_attention), torch.compile(_after_attention)


@functools.cache
def _compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compile raises (imported once: ``_piece`` runs twice per layer)."""
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

    return TorchDynamoException, FailOnRecompileLimitHit


# why compiling the pieces failed in this process (they then run eagerly), None while it has not
compile_failure: str | None = None


def _piece(index: int, is_compiled: bool, *args):
    """Piece ``index`` (0: before attention, 1: after), compiled if asked and compiling has not
    failed; a failure is warned once and the piece runs eagerly from then on (the pieces only
    compute, so running one again eagerly is exact)."""
    global compile_failure
    if is_compiled and compile_failure is None:
        try:
            return compiled_pieces()[index](*args)
        except _compile_errors() as e:
            compile_failure = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
            warnings.warn(
                f"compiling the decoder layers failed ({compile_failure}); they run eagerly",
                RuntimeWarning,
                stacklevel=2,
            )
    return (_before_attention, _after_attention)[index](*args)


def fuse_projections(module: nn.Module) -> nn.Module:
    """``StackedProjections.fuse_projections`` for every attention (q, k, v) and MLP (gate, up)
    of ``module`` (a ``Transformer`` or an EAGLE drafter). Returns ``module``."""
    for m in module.modules():
        if isinstance(m, StackedProjections):
            m.fuse_projections()
    return module


def set_compiled_layers(module: nn.Module, is_compiled: bool = True) -> nn.Module:
    """Run every decoder layer of ``module`` (a ``Transformer`` or an EAGLE drafter) through
    ``compiled_pieces`` when no gradient is recorded (inference: the rollout engine's
    forwards, what its CUDA graphs capture); training forwards stay eager. Returns ``module``.
    On any device; on CPU inductor needs a C++ compiler."""
    for m in module.modules():
        if isinstance(m, DecoderLayer):
            m.is_compiled = is_compiled
    return module


class Rotary(nn.Module):
    """RoPE tables for arbitrary (B,T) positions (tree nodes sit at root position + depth):
    ``(cos, signed_sin)``, each (B,T,D), the sine's first half negated (``apply_rope``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # A plain attribute, not a buffer: ``module.to(bfloat16)`` must not round the
        # frequencies (vLLM, too, builds its cos/sin cache in float32).
        self.inv_freq = rope_inv_freq(cfg)  # (D/2,) float32

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            # moved once and kept: a host-to-device copy per forward cannot be captured in a
            # CUDA graph (tltrun.rollout.graphs), and costs a transfer per step besides
            self.inv_freq = self.inv_freq.to(positions.device)  # (D/2,) float32
        freqs = positions[..., None].float() * self.inv_freq  # (B,T,D/2) in float32
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        # (B,T,D) each: cos of both halves, and the sine with rotate_half's sign (apply_rope)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def gemm_layout(module: nn.Module) -> nn.Module:
    """Store every ``nn.Linear`` weight of ``module`` column-major (in place; same shape, names
    and values, strides ``(1, out_features)``) and return ``module``.

    ``F.linear(x, W)`` computes ``x @ W.T``; with ``W`` column-major, ``W.T`` is a row-major
    (in, out) matrix, and MKL's fp32 CPU GEMM is faster on it for the few-row inputs of
    decoding and verification. ``benchmarks/bench_gemm_layout.py`` on this project's CPU (one
    thread, torch 2.13 + MKL 2024.2, 512 -> 1376, weights in cache): 4 rows 267 -> 180 us,
    8 rows 411 -> 234 us, 16 rows 537 -> 339 us, 80 rows 1.21x; 1 row and >= 256 rows about
    unchanged. Whole rollouts gain less where the weights stream from memory (its engine rows:
    0.95-1.11x on the 8-layer hidden-512 model, within this machine's noise).
    Everything that copies into a weight (``load_state_dict``, weight sync) keeps the layout;
    writers that need contiguous tensors (safetensors, vLLM) already call ``.contiguous()``;
    gradients reduced across workers are written back in it (``reduce_grads``).
    GPUs' GEMMs take either layout at the same speed (a transpose flag)."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.weight.is_contiguous():
            m.weight.data = m.weight.data.t().contiguous().t()
    return module


def reduce_grads(params: list[nn.Parameter], reduce: Callable[[torch.Tensor], Any]) -> None:
    """Pass the gradients of ``params`` (zeros where a parameter has none) through ``reduce``
    as ONE flat tensor (one collective, not one per parameter; ``reduce`` works in place, e.g.
    an all-reduce) and write them back, each in its parameter's layout (``gemm_layout``)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduce(flat)
    offset = 0
    for p in params:
        p.grad = torch.empty_like(p).copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rotary = Rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        gemm_layout(self)
        # Activation checkpointing (``tltrun train --gradient-checkpointing``): in training mode
        # each decoder layer keeps only its input and recomputes its activations in the backward
        # pass — layer activations no longer grow with depth, for one more forward of compute.
        self.is_gradient_checkpointing = False

    def forward(
        self,
        input_ids: torch.Tensor,  # (B,T)
        positions: torch.Tensor,  # (B,T) RoPE positions
        ctx: AttentionContext,
        logit_index: torch.Tensor | None = None,  # (B,K): only these positions get logits
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.model.embed_tokens(input_ids)  # (B,T,C)
        cos, sin = self.rotary(positions, x.dtype)
        is_recomputing = (
            self.is_gradient_checkpointing and self.training and torch.is_grad_enabled()
        )
        for layer in self.model.layers:
            if is_recomputing:
                # non-reentrant: works with inputs that need no grad and with autocast
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, ctx, use_reentrant=False)
            else:
                x = layer(x, cos, sin, ctx)
        hidden = self.model.norm(x)  # (B,T,C): post-norm, the EAGLE feature
        picked = (
            hidden
            if logit_index is None
            else hidden.gather(1, logit_index[..., None].expand(-1, -1, hidden.shape[-1]))
        )
        return self.lm_head(picked), hidden  # (B,T|K,V), (B,T,C)
