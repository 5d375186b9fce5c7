"""Preallocated per-slot KV cache for the rollout engine, and the attention that reads it.

One slot per running request (slots = ``max_running_requests``), each with its own length.
Invariant kept by the engine: slot ``s`` holds the keys/values of positions ``0 .. lens[s]-1``;
the newest committed token is NOT in the cache yet (it is the next forward's first input: the
root of the next draft tree, or the single token of a plain decode).

A forward writes its T new tokens at ``lens[s] + j`` but does not move ``lens``: the caller then
either ``commit``s them (prefill, plain decode, drafter catch-up), or ``compact``s the accepted
path of a verified draft tree into consecutive positions, or ``truncate``s (roll back). Entries
at or beyond ``lens[s]`` are garbage by definition, so a rollback is just a length change.

Attention over (committed cache, new tokens with a tree mask) is chosen by an explicit
``impl`` argument (``tltrun.model.attention``: masked SDPA padded to the longest context,
flex_attention over each sequence's own length, the Triton kernel and its reference).

``StaticContext`` is the same attention with static shapes and no host synchronisation (slots
``0..B-1``, keys over the whole slot width, masked by length): the form a CUDA graph captures
(``tltrun.rollout.graphs``).

Run the tests: ``python -m pytest tests/test_kvcache.py -q``.
"""

from __future__ import annotations

import torch

from tltrun.model.attention import (
    ATTN_IMPLS,
    FLEX_MAX_NEW_TOKENS,
    causal_mask,
    flex_attention_by_lens,
    grouped_attention,
    in_place_mask,
    masked_attention,
)
from tltrun.model.config import ModelConfig
from tltrun.model.transformer import KVWrite, write_kv


class KVCache:
    """K and V of shape (num_layers, num_slots, num_kv_heads, max_tokens, head_dim)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_slots, num_kv_heads, max_tokens, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = torch.zeros(num_slots, dtype=torch.long, device=device)
        # (num_layers,1,1): a layer's index as a tensor, for writes inside a compiled layer
        # (``StaticContext.kv_write``; one compile then serves every layer)
        self.layer_ids = torch.arange(num_layers, device=device).view(-1, 1, 1)
        self.max_tokens = max_tokens
        self.head_dim = head_dim

    @classmethod
    def for_model(
        cls,
        cfg: ModelConfig,
        num_slots: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_layers: int | None = None,
    ) -> KVCache:
        layers = cfg.num_hidden_layers if num_layers is None else num_layers
        return cls(
            layers, num_slots, max_tokens, cfg.num_key_value_heads, cfg.head_dim, dtype, device
        )

    @property
    def num_slots(self) -> int:
        return self.lens.shape[0]

    def context(
        self,
        slots: torch.Tensor,  # (B,) long
        num_tokens: int,  # T new tokens per slot this forward (right-padded)
        tree_mask: torch.Tensor | None = None,  # (B,T,T) bool; None = causal
        num_new: torch.Tensor | None = None,  # (B,) valid new tokens (rest is padding); None = T
        impl: str = "sdpa",
    ) -> CacheContext:
        return CacheContext(self, slots, num_tokens, tree_mask, num_new, impl)

    def commit(self, slots: torch.Tensor, num_tokens: torch.Tensor | int) -> None:
        """The new tokens written by the last forward become part of the cache."""
        self.lens[slots] += num_tokens

    def truncate(self, slots: torch.Tensor, new_lens: torch.Tensor) -> None:
        """Roll back: forget everything from ``new_lens`` on (e.g. rejected draft tokens)."""
        if bool((new_lens > self.lens[slots]).any()):
            raise ValueError("truncate can only shorten a slot")
        self.lens[slots] = new_lens

    def reset(self, slots: torch.Tensor) -> None:
        self.lens[slots] = 0

    def copy_positions(self, src: torch.Tensor, dst: torch.Tensor, width: int) -> None:
        """Keys and values of positions < ``width`` from slots ``src`` to slots ``dst``
        (disjoint); lengths are the caller's to set."""
        w = min(width, self.max_tokens)
        self.k[:, dst, :, :w] = self.k[:, src, :, :w]
        self.v[:, dst, :, :w] = self.v[:, src, :, :w]

    def compact(
        self,
        slots: torch.Tensor,
        accepted_nodes: torch.Tensor,
        num_accepted: torch.Tensor,
        is_static: bool = False,
    ) -> None:
        """Keep the accepted path of a verified tree written at ``lens + node`` by the last forward.

        accepted_nodes (B, D+1): node indices of the path, starting with the root 0; entries past
        ``num_accepted`` are ignored. Node ``accepted_nodes[b, j]`` moves to position
        ``lens[b] + j``; afterwards ``lens += num_accepted + 1`` (the root and accepted drafts).
        Path node indices strictly increase (parents precede children), so position j's source
        is at or after j; gathering all sources before scattering makes the move overlap-safe.
        ``is_static`` (a CUDA graph's verify): always move, without reading whether anything
        moves first.
        """
        base = self.lens[slots]  # (B,)
        depth = torch.arange(accepted_nodes.shape[1], device=base.device)  # (D+1,)
        is_on_path = depth[None, :] <= num_accepted[:, None]
        src = base[:, None] + torch.where(is_on_path, accepted_nodes, depth[None, :])  # (B,D+1)
        dst = base[:, None] + depth[None, :]
        if is_static or not torch.equal(src, dst):  # a chain's accepted path is in place
            rows = slots[:, None].expand_as(src)
            self.k[:, rows, :, dst] = self.k[:, rows, :, src]  # (B,D+1,layers,Hkv,D) both sides
            self.v[:, rows, :, dst] = self.v[:, rows, :, src]
        self.lens[slots] = base + num_accepted + 1


class CacheContext:
    """Attention context of one forward over ``slots``: reads the committed cache, writes the
    forward's valid new keys/values at ``lens + j`` (see the module docstring)."""

    def __init__(
        self,
        cache: KVCache,
        slots: torch.Tensor,
        num_tokens: int,
        tree_mask: torch.Tensor | None,
        num_new: torch.Tensor | None,
        impl: str,
    ):
        if impl not in ATTN_IMPLS:
            raise ValueError(f"attention impl {impl!r}: expected one of {ATTN_IMPLS}")
        self.cache, self.slots, self.impl = cache, slots, impl
        self.cache_lens = cache.lens[slots]  # (B,) snapshot: lens do not move during a forward
        batch = slots.shape[0]
        device = cache.lens.device
        self.tree_mask = causal_mask(batch, num_tokens, device) if tree_mask is None else tree_mask
        valid = torch.ones(batch, num_tokens, dtype=torch.bool, device=device)
        if num_new is not None:
            valid = torch.arange(num_tokens, device=device)[None, :] < num_new[:, None]
        rows, cols = valid.nonzero(as_tuple=True)
        self._write_rows = rows
        self._write_slots = slots[rows]
        self._write_pos = self.cache_lens[rows] + cols
        self._write_cols = cols
        if self._write_pos.numel() and int(self._write_pos.max()) >= cache.max_tokens:
            raise ValueError(
                f"KV cache overflow: a slot would exceed max_tokens={cache.max_tokens}"
            )
        self.context_len = int(self.cache_lens.max()) if batch else 0
        # "sdpa" writes the new keys/values first and attends over the cache in place: a view
        # when the slots are one contiguous range (no copy of the context per layer), else one
        # gather. The kernels' API takes the new keys separately (``_attend_kernel``); so does
        # a forward whose padded region would run past the end of the cache.
        self.key_len = self.context_len + num_tokens
        if impl == "flex" and device.type == "cuda" and num_tokens <= FLEX_MAX_NEW_TOKENS:
            # the whole slot width: one compiled kernel shape per (batch, new tokens); blocks
            # past each sequence's length are skipped, so the width costs nothing. A longer
            # prefill runs the dense masked SDPA (flex_attention_by_lens): over the context, not
            # the slot width
            self.key_len = cache.max_tokens
        self.is_in_place = impl in ("sdpa", "flex") and self.key_len <= cache.max_tokens
        if self.is_in_place and impl == "sdpa":
            self.mask = in_place_mask(self.cache_lens, self.key_len, self.tree_mask)
        # slots in one contiguous range (the engine keeps a running batch in 0..n-1) are read
        # as a view of the cache: no copy of the context per layer
        self.slot_range: slice | None = None
        first = int(slots[0]) if batch else 0
        if torch.equal(slots, torch.arange(first, first + batch, device=device)):
            self.slot_range = slice(first, first + batch)

    def kv_write(self, layer: int) -> None:
        return None  # the valid new tokens are a gather (padding rows and columns left out)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.is_in_place:
            out = self._attend_separately(layer, q, k, v)
            self._write(layer, k, v)
            return out
        self._write(layer, k, v)
        rows = self.slot_range if self.slot_range is not None else self.slots
        k_all = self.cache.k[layer, rows, :, : self.key_len]  # (B,Hkv,L+T,D)
        v_all = self.cache.v[layer, rows, :, : self.key_len]
        scale = self.cache.head_dim**-0.5
        if self.impl == "flex":
            return flex_attention_by_lens(q, k_all, v_all, self.cache_lens, self.tree_mask, scale)
        return grouped_attention(q, k_all, v_all, self.mask, scale)

    def _attend_separately(self, layer: int, q, k, v) -> torch.Tensor:
        cache = self.cache
        # (B,Hkv,L,D): a view for a slot range (the kernels read each sequence's own length
        # through the strides), else a gathered copy
        rows = self.slot_range if self.slot_range is not None else self.slots
        k_ctx = cache.k[layer, rows, :, : self.context_len]
        v_ctx = cache.v[layer, rows, :, : self.context_len]
        scale = cache.head_dim**-0.5
        if self.impl in ("sdpa", "flex"):  # a padded region past the cache end: rare
            return masked_attention(q, k_ctx, v_ctx, self.cache_lens, k, v, self.tree_mask, scale)
        from kernels.tree_attention import tree_attention

        return tree_attention(
            q, k_ctx, v_ctx, self.cache_lens, k, v, self.tree_mask, scale, impl=self.impl
        )

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Valid new keys/values (B,Hkv,T,D) to positions ``lens + j`` of their slots."""
        new_k = k.transpose(1, 2)[self._write_rows, self._write_cols]  # (n,Hkv,D)
        new_v = v.transpose(1, 2)[self._write_rows, self._write_cols]
        self.cache.k[layer, self._write_slots, :, self._write_pos] = new_k
        self.cache.v[layer, self._write_slots, :, self._write_pos] = new_v


class StaticContext:
    """The attention of ``CacheContext`` in the form a CUDA graph captures: slots ``0..B-1`` (the
    engine keeps running sequences there), ``T`` new tokens per slot, all valid, keys over the
    whole slot width masked by each slot's length, and no host synchronisation (no ``.item()``,
    no data-dependent shape). Lengths are read from ``cache.lens`` when the forward runs (at
    replay, for a graph). A padding row is a free slot whose length the caller set to 0: it
    attends to its own new tokens only and never touches another row.

    ``impl``: ``"sdpa"`` (dense over the slot width: the CPU reference) or ``"flex"`` (block mask
    by length: each sequence reads its own context only)."""

    def __init__(self, cache: KVCache, batch: int, tree_mask: torch.Tensor, impl: str):
        if impl not in ("sdpa", "flex"):
            raise ValueError(f"static attention impl {impl!r}: expected sdpa or flex")
        if batch > cache.num_slots:
            raise ValueError(f"static batch {batch} exceeds the cache's {cache.num_slots} slots")
        self.cache, self.impl, self.tree_mask = cache, impl, tree_mask  # (B,T,T)
        num_tokens = tree_mask.shape[1]
        self.rows = slice(0, batch)
        self.cache_lens = cache.lens[:batch].clone()  # (B,) lens do not move during a forward
        device = cache.lens.device
        cols = torch.arange(num_tokens, device=device)
        self._write_pos = self.cache_lens[:, None] + cols[None, :]  # (B,T)
        self._write_slots = torch.arange(batch, device=device)[:, None].expand(-1, num_tokens)
        if impl == "sdpa":
            self.mask = in_place_mask(self.cache_lens, cache.max_tokens, tree_mask)

    def kv_write(self, layer: int) -> KVWrite:
        """Every new token is valid: a compiled layer writes them where ``attend`` would."""
        cache = self.cache
        return cache.k, cache.v, cache.layer_ids[layer], self._write_slots, self._write_pos

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        cache = self.cache
        if k is not None:  # else the layer wrote them (kv_write)
            write_kv(self.kv_write(layer), k, v)
        k_all = cache.k[layer, self.rows]  # (B,Hkv,max_tokens,D) a view
        v_all = cache.v[layer, self.rows]
        scale = cache.head_dim**-0.5
        if self.impl == "flex":
            return flex_attention_by_lens(
                q, k_all, v_all, self.cache_lens, self.tree_mask, scale, is_static_batch=True
            )
        return grouped_attention(q, k_all, v_all, self.mask, scale)
