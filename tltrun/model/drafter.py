"""EAGLE-1 drafter: ``fc(cat(embed(x_{p+1}), f_p))`` then ONE decoder layer of the target's
shape; embedding and LM head are the target's own (shared, never trained here). Chain and
EAGLE-2-style tree drafting over a per-slot drafter KV cache; export to vLLM.

Layout, checked against vLLM 0.32 ``vllm/model_executor/models/llama_eagle.py`` (the loader of
``EagleLlamaForCausalLM``) and EAGLE's ``cnets.py``:

* input pair at RoPE position p: the target's post-norm hidden state f_p (``tltrun.model.transformer``) and
  the NEXT token x_{p+1}; concatenation order is (token embedding, hidden) and ``fc`` has no
  bias (vLLM's ``fc`` is ``bias=False``; EAGLE's original checkpoints carry an fc bias that
  vLLM's loader would reject, so we do not have one);
* the decoder layer is a Llama layer whatever the target (a Qwen3 target's per-head q/k norms
  are not in it: vLLM builds it as one), with no ``input_layernorm`` (vLLM replaces it by
  Identity for layer 0, following EAGLE), and there is no final norm: the layer output g_{p+1} (a prediction of
  f_{p+1}) goes straight into the target's LM head and is the next step's hidden input;
* export: ``config.json`` (the target's sizes, ``architectures: ["EagleLlamaForCausalLM"]``,
  ``model_type: "llama"``, ``num_hidden_layers: 1``) + ``model.safetensors`` with ``fc.weight``
  and ``layers.0.*`` only. ``embed_tokens`` / ``lm_head`` are left out on purpose: vLLM then
  shares the target's (``has_own_embed_tokens`` / ``has_own_lm_head`` stay false). This export
  is also our own save format (plus ``tlt_drafter.json`` metadata), so there is one layout.

Drafter KV-cache scheme (per slot, one layer, a ``tltrun.model.kvcache.KVCache``): the cache holds
only EXACT entries, pairs (f_p, x_{p+1}) built from committed tokens and the target's real
hidden states. Each SD iteration first feeds the pairs the drafter has not seen yet (the
"catch-up": after verifying, the accepted tokens and the correction token; after SD was off or
for a new request, everything since the drafter last ran: that is the re-prefill) and commits
them. Speculative tree entries live in a side buffer (``DraftContext``) that is dropped when the
iteration ends, so nothing in the drafter cache ever needs rolling back.

Tree drafting (EAGLE-2, Li et al. 2024, Sec. 4): expand the top-``topk`` children of each
frontier node for ``draft_steps`` levels, keeping the ``topk`` candidates with the highest
cumulative draft log-probability as the next frontier; then keep the ``verify_tokens`` nodes
with the highest cumulative log-probability (an ancestor-closed set, since log-probabilities
only decrease along a path). Siblings come out in descending draft probability.

Run the tests: ``python -m pytest tests/test_drafter.py -q``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tltrun.model.attention import masked_attention
from tltrun.model.config import CheckpointError, ModelConfig
from tltrun.model.kvcache import KVCache
from tltrun.model.transformer import DecoderLayer, Rotary, Transformer, gemm_layout
from tltrun.rollout.interface import SamplingParams
from tltrun.rollout.speculative import DraftTree, logits_to_probs, sample
from tltsim.policy import SpecDecision

META_FILE = "tlt_drafter.json"
META_FORMAT = "tlt-eagle-drafter"


class EagleDrafter(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        # a Llama layer (EagleLlamaForCausalLM): a Qwen3 target's q/k norms are not in it
        layer_cfg = replace(cfg, model_type="llama") if cfg.model_type == "qwen3" else cfg
        self.layers = nn.ModuleList([DecoderLayer(layer_cfg, 0, has_input_norm=False)])
        self.rotary = Rotary(cfg)
        # The target's embedding and LM head, held outside the module tree (a plain tuple):
        # not in state_dict(), not in parameters(), used detached — "shared and frozen".
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None
        gemm_layout(self)

    @classmethod
    def for_target(cls, target: Transformer, seed: int = 0) -> EagleDrafter:
        """A freshly initialised drafter bound to ``target`` (same dtype and device)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = cls(target.config)
        weight = target.lm_head.weight
        drafter.to(dtype=weight.dtype, device=weight.device)
        drafter.bind(target)
        return drafter

    def bind(self, target: Transformer) -> None:
        self._shared = (target.model.embed_tokens, target.lm_head)

    def _head(self) -> tuple[nn.Embedding, nn.Linear]:
        if self._shared is None:
            raise RuntimeError("EagleDrafter is not bound to a target (call bind(target))")
        return self._shared

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # in the drafter's dtype: a spot-trained drafter (fp32 on a CPU) bound to a bf16 engine
        # target reads the shared head in fp32 (a no-op cast where the dtypes agree)
        return F.linear(hidden, self._head()[1].weight.detach().to(hidden.dtype))

    def forward(
        self,
        tokens: torch.Tensor,  # (B,T) x_{p+1}
        target_hidden: torch.Tensor,  # (B,T,C) f_p (or a drafted g_p inside a tree)
        positions: torch.Tensor,  # (B,T) p
        ctx,  # tltrun.model.transformer.AttentionContext
        logit_index: torch.Tensor | None = None,  # (B,K)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.fc.weight.dtype  # the drafter's own (see lm_logits)
        embed = F.embedding(tokens, self._head()[0].weight.detach()).to(dtype)  # (B,T,C)
        x = self.fc(torch.cat((embed, target_hidden.to(dtype)), dim=-1))  # (B,T,C)
        cos, sin = self.rotary(positions, x.dtype)
        x = self.layers[0](x, cos, sin, ctx)  # g_{p+1}: predicted f_{p+1}, no final norm
        picked = (
            x
            if logit_index is None
            else x.gather(1, logit_index[..., None].expand(-1, -1, x.shape[-1]))
        )
        return self.lm_logits(picked), x


# ---------------------------------------------------------------------------------------------
# Inference: catch-up (re-prefill) and drafting
# ---------------------------------------------------------------------------------------------


class DraftContext:
    """Attention for draft-tree nodes: the slot's committed drafter cache (read only) plus this
    iteration's speculative entries in a side buffer. Set ``mask`` (B,T,S+T) before each
    forward: which side entries (S earlier ones, then the T being added) each query sees."""

    def __init__(self, cache: KVCache, slots: torch.Tensor | slice, width: int | None = None):
        # ``width``: keys over a fixed cache width (masked by length) instead of the longest
        # slot's, and ``slots`` a slice (a view, no gather): the static form a CUDA graph
        # captures (tltrun.rollout.draft_graphs), with no host read of the lengths
        self.cache_lens = cache.lens[slots]
        length = int(self.cache_lens.max()) if width is None else width
        self.k_ctx = cache.k[0, slots, :, :length]  # (B,Hkv,L,D)
        self.v_ctx = cache.v[0, slots, :, :length]
        self.side_k = self.k_ctx[:, :, :0]  # (B,Hkv,S,D)
        self.side_v = self.v_ctx[:, :, :0]
        self.scale = cache.head_dim**-0.5
        self.mask: torch.Tensor | None = None

    @property
    def side_len(self) -> int:
        return self.side_k.shape[2]

    def kv_write(self, layer: int) -> None:
        return None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.side_k = torch.cat((self.side_k, k), dim=2)
        self.side_v = torch.cat((self.side_v, v), dim=2)
        return masked_attention(
            q,
            self.k_ctx,
            self.v_ctx,
            self.cache_lens,
            self.side_k,
            self.side_v,
            self.mask,
            self.scale,
        )


@torch.no_grad()
def drafter_prefill(
    drafter: EagleDrafter,
    cache: KVCache,
    slots: torch.Tensor,  # (B,)
    tokens: torch.Tensor,  # (B,T) right-padded x_{p+1}
    hidden: torch.Tensor,  # (B,T,C) f_p
    num_new: torch.Tensor,  # (B,) >= 1 valid pairs per slot
    attn_impl: str = "sdpa",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed exact pairs at positions ``lens .. lens+num_new-1`` and commit them. Returns the
    last valid pair's (logits (B,V), output g (B,C)): the drafter's view of the next token."""
    width = tokens.shape[1]
    positions = cache.lens[slots][:, None] + torch.arange(width, device=tokens.device)[None]
    ctx = cache.context(slots, width, num_new=num_new, impl=attn_impl)
    last = (num_new - 1)[:, None]  # (B,1)
    logits, out = drafter(tokens, hidden, positions, ctx, logit_index=last)
    cache.commit(slots, num_new)
    g = out.gather(1, last[..., None].expand(-1, -1, out.shape[-1]))[:, 0]
    return logits[:, 0], g


@dataclass
class _Nodes:
    """Growing candidate list of one draft; index 0 is the root."""

    tokens: list[torch.Tensor]  # each (B,n)
    parents: list[torch.Tensor]
    scores: list[torch.Tensor]  # cumulative draft log-prob
    q: list[torch.Tensor | None]  # (B,n,V) distribution each node was drawn from (sampled chains)

    def add(self, tokens, parents, scores, q=None) -> torch.Tensor:
        start = sum(t.shape[1] for t in self.tokens)
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.scores.append(scores)
        self.q.append(q)
        return torch.arange(start, start + tokens.shape[1], device=tokens.device)


@torch.no_grad()
def draft(
    drafter: EagleDrafter,
    cache: KVCache,
    slots: torch.Tensor,
    tokens: torch.Tensor,  # (B,T) catch-up pairs' tokens; the last valid one is the tree root
    hidden: torch.Tensor,  # (B,T,C)
    num_new: torch.Tensor,  # (B,)
    decision: SpecDecision,
    params: SamplingParams,
    generator: torch.Generator | None,
    attn_impl: str = "sdpa",
) -> DraftTree:
    """Catch up on the pending exact pairs, then draft a chain (topk 1) or an EAGLE-2 tree.

    Chains under sampling draw each token from the drafter's processed distribution q and
    return q (the min(1, p/q) test needs it). Greedy chains and all trees draft
    deterministically (argmax / top-k) and return ``draft_probs=None``: point-mass drafts,
    verified losslessly by sequential inversion (tltrun.rollout.speculative)."""
    logits, g = drafter_prefill(drafter, cache, slots, tokens, hidden, num_new, attn_impl)
    root = tokens.gather(1, (num_new - 1)[:, None])  # (B,1)
    return DraftTree(
        *expand_tree(drafter, cache, slots, root, logits, g, decision, params, generator)
    )


def expand_tree(
    drafter: EagleDrafter,
    cache: KVCache,
    slots: torch.Tensor | slice,
    root: torch.Tensor,  # (B,1) the tree roots: each slot's newest exact token
    logits: torch.Tensor,  # (B,V) the drafter's logits after the catch-up's last pair
    g: torch.Tensor,  # (B,C) its output there
    decision: SpecDecision,
    params: SamplingParams,
    generator: torch.Generator | None,
    key_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``draft_steps`` levels of the tree after the catch-up: (tokens, parents, draft_probs)
    of ``DraftTree``. Every shape follows from (B, decision) alone; with ``key_width`` (the drafter
    cache's fixed key width) and ``slots`` a slice, nothing reads a tensor on the host, so a
    CUDA graph can capture it (``tltrun.rollout.draft_graphs``)."""
    batch, device = root.shape[0], root.device
    is_sampled_chain = decision.is_chain and not params.is_greedy
    width = decision.topk
    zeros = torch.zeros(batch, 1, dtype=torch.long, device=device)
    nodes = _Nodes([root], [zeros], [torch.zeros(batch, 1, device=device)], [None])

    def children(logits: torch.Tensor, base: torch.Tensor):
        """logits (B,F,V), base scores (B,F) -> tokens, scores, q of (B,F,width) children."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        if is_sampled_chain:
            q = logits_to_probs(logits, params)  # (B,F,V)
            tok = sample(q, generator)[..., None]  # (B,F,1)
            return tok, base[..., None] + logp.gather(-1, tok), q[:, :, None]
        top = torch.topk(logp, width, dim=-1)  # sorted: siblings in descending probability
        return top.indices, base[..., None] + top.values, None

    tok, score, q = children(logits[:, None], nodes.scores[0])
    frontier = nodes.add(
        tok[:, 0], zeros.expand(-1, width), score[:, 0], None if q is None else q[:, 0, 0][:, None]
    )
    frontier = frontier.expand(batch, -1)  # (B,F) node ids
    front_tok, front_score = tok[:, 0], score[:, 0]  # (B,F)
    front_hidden = g[:, None].expand(-1, width, -1)  # (B,F,C): parent's output g
    ctx = DraftContext(cache, slots, key_width)
    front_anc = torch.zeros(batch, width, 0, dtype=torch.bool, device=device)  # (B,F,S)
    pair_pos = cache.lens[slots]  # a depth-1 node pairs with g at position target_len
    for level in range(1, decision.draft_steps):
        num_front = front_tok.shape[1]
        eye = torch.eye(num_front, dtype=torch.bool, device=device).expand(batch, -1, -1)
        ctx.mask = torch.cat((front_anc, eye), dim=-1)  # ancestors' side entries + itself
        positions = (pair_pos + level - 1)[:, None].expand(-1, num_front)
        out_logits, out = drafter(front_tok, front_hidden, positions, ctx)  # (B,F,V), (B,F,C)
        tok, score, q = children(out_logits, front_score)  # (B,F,W)
        parents = frontier[:, :, None].expand_as(tok).reshape(batch, -1)
        flat_q = None if q is None else q.reshape(batch, -1, q.shape[-1])
        ids = nodes.add(tok.reshape(batch, -1), parents, score.reshape(batch, -1), flat_q)
        # Next frontier: the best ``topk`` of the new candidates (stable: ties keep order).
        order = torch.sort(score.reshape(batch, -1), dim=1, descending=True, stable=True).indices[
            :, :width
        ]
        parent_rank = order // tok.shape[2]  # (B,F') index into the old frontier
        frontier = ids[order]
        front_tok = tok.reshape(batch, -1).gather(1, order)
        front_score = score.reshape(batch, -1).gather(1, order)
        front_hidden = out.gather(1, parent_rank[..., None].expand(-1, -1, out.shape[-1]))
        # the parent's own side entry (a comparison, not one_hot: no host-side range check)
        own = parent_rank[..., None] == torch.arange(num_front, device=device)
        front_anc = torch.cat(
            (front_anc.gather(1, parent_rank[..., None].expand(-1, -1, front_anc.shape[2])), own),
            dim=-1,
        )
    return _select(nodes, decision.verify_tokens)


def tree_layout(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth (B,N+1), ancestor mask (B,N+1,N+1)) of a tree no deeper than ``max_depth``:
    the same as ``DraftTree.depth`` / ``ancestor_mask()`` in ``max_depth`` vectorised steps
    instead of one Python step per node (this runs every SD iteration)."""
    batch, num_nodes = parents.shape
    eye = torch.eye(num_nodes, dtype=torch.bool, device=parents.device)
    mask = eye.expand(batch, -1, -1).clone()  # row i: i and (after step s) ancestors < s up
    ancestor = parents
    rows = torch.arange(batch, device=parents.device)[:, None]
    for _ in range(max_depth):
        mask |= eye[ancestor]  # mark the current ancestor of every node
        ancestor = parents[rows, ancestor]  # one level further up (the root maps to itself)
    return mask.sum(-1) - 1, mask


def _select(
    nodes: _Nodes, verify_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keep the ``verify_tokens`` best candidates (plus the root): a DraftTree's (tokens,
    parents, draft_probs), not yet checked (``DraftTree`` checks on the host).

    Candidate ids grow with depth and, within one parent, with decreasing probability, so
    sorting the kept ids restores a topological, siblings-by-probability order."""
    tokens = torch.cat(nodes.tokens, dim=1)  # (B,M+1)
    parents = torch.cat(nodes.parents, dim=1)
    scores = torch.cat(nodes.scores, dim=1)
    batch, total = tokens.shape
    keep = min(verify_tokens, total - 1)
    # A child's score never exceeds its parent's and its id is larger, so a stable sort keeps
    # parents ahead of children: the kept set is closed under taking ancestors.
    order = torch.sort(scores[:, 1:], dim=1, descending=True, stable=True).indices[:, :keep] + 1
    kept = torch.cat(
        (torch.zeros(batch, 1, dtype=torch.long, device=tokens.device), order.sort(dim=1).values),
        dim=1,
    )
    remap = torch.zeros(batch, total, dtype=torch.long, device=tokens.device)
    remap.scatter_(1, kept, torch.arange(keep + 1, device=tokens.device).expand(batch, -1))
    new_parents = remap.gather(1, parents.gather(1, kept))
    draft_probs = None
    if nodes.q[-1] is not None:
        vocab = nodes.q[-1].shape[-1]
        rows = [torch.zeros(batch, 1, vocab, device=tokens.device)]
        rows += [
            torch.zeros(batch, t.shape[1], vocab, device=tokens.device) if q is None else q.float()
            for t, q in zip(nodes.tokens[1:], nodes.q[1:], strict=True)
        ]
        draft_probs = torch.cat(rows, dim=1).gather(1, kept[..., None].expand(-1, -1, vocab))
    return tokens.gather(1, kept), new_parents, draft_probs


# ---------------------------------------------------------------------------------------------
# Export / save / load
# ---------------------------------------------------------------------------------------------


def vllm_config(cfg: ModelConfig) -> dict:
    """The drafter's ``config.json``: the target's sizes, one layer, vLLM's EAGLE class."""
    d = cfg.to_hf_dict()
    d.update(
        architectures=["EagleLlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        # a Llama layer: attention_bias would give o_proj a bias too, which vLLM then leaves
        # uninitialised (no such tensor here); qkv_bias is the q/k/v-only form it reads
        attention_bias=False,
    )
    d.pop("qkv_bias", None)
    if cfg.attention_bias:
        d["qkv_bias"] = True
    return d


def trainable_copy(drafter: EagleDrafter, target: Transformer) -> EagleDrafter:
    """A copy of ``drafter``'s own weights to train: fp32 master weights, on ``target``'s
    device, bound to ``target`` (whose embedding and LM head stay shared and frozen). AdamW on
    fp16 weights turned the loss NaN on its second step (its eps of 1e-8 is 0 in fp16), and on
    bf16 weights it drops every update under 2^-8 of the weight it changes."""
    copy = EagleDrafter(drafter.config)
    copy.load_state_dict(drafter.state_dict())  # cast to the copy's fp32
    copy.to(device=target.lm_head.weight.device)
    copy.bind(target)
    return copy


def export_vllm(drafter: EagleDrafter, out_dir: str | Path, meta: dict | None = None) -> Path:
    """Write the drafter in the layout vLLM loads as ``EagleLlamaForCausalLM`` (the single
    source of that layout; see the module docstring). ``meta`` goes to ``tlt_drafter.json``."""
    from tltrun.model.hf_checkpoint import save_safetensors

    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(vllm_config(drafter.config), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_safetensors(state, root / "model.safetensors")
    info = {
        "format": META_FORMAT,
        "version": 1,
        "target": drafter.config.to_hf_dict(),
        **(meta or {}),
    }
    (root / META_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return root


def _compared(cfg: ModelConfig, name: str) -> Any:
    """``cfg.name`` as load_drafter compares it: unscaled RoPE is one thing whatever the
    (unused) original context length it carries."""
    value = getattr(cfg, name)
    return "default" if name == "rope_scaling" and value.kind == "default" else value


def _drafter_config(root: Path) -> ModelConfig:
    """The drafter's config. Drafters this project exported before the qkv_bias layout say
    ``attention_bias: true`` for a Qwen2 target's q/k/v biases; their ``tlt_drafter.json``
    marks them, and they are read as q/k/v biases (their tensors have no o_proj bias)."""
    from tltrun.model.config import read_config
    from tltsim.jsonio import read_json

    path = root / "config.json"
    if (root / META_FILE).is_file() and path.is_file():
        raw = read_json(path, "drafter config.json", CheckpointError)
        if isinstance(raw, dict) and raw.get("attention_bias") and "qkv_bias" not in raw:
            raw = {**raw, "attention_bias": False, "qkv_bias": True}
            try:
                return ModelConfig.from_hf_dict(raw, source=str(path))
            except (TypeError, ValueError, OverflowError) as err:
                raise CheckpointError(f"{path}: {err}") from None
    return read_config(root)


def check_drafter_config(root: Path, target_config: ModelConfig) -> None:
    """An exported drafter's config.json against its target's (a ``ModelConfig``): the sizes,
    and what its layer computes with; one CheckpointError naming the field. ``tltrun train``
    checks it before any worker starts."""
    cfg = _drafter_config(root)
    for name in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        # the layer runs with the target's config: a drafter described otherwise would compute
        # another function than the one it was trained as (vLLM builds it from this file)
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
    ):
        if _compared(cfg, name) != _compared(target_config, name):
            raise CheckpointError(
                f"{root / 'config.json'}: {name}={getattr(cfg, name)} but the target has {getattr(target_config, name)}"
            )


def load_drafter(
    in_dir: str | Path, target: Transformer, dtype: torch.dtype | None = None
) -> EagleDrafter:
    """Load an exported drafter (ours, or any EAGLE-1 checkpoint in vLLM's layout without an
    fc bias) and bind it to ``target``; sizes must match the target's. Its weights take the
    target's dtype, or ``dtype`` (a drafter to train keeps fp32 weights fp32)."""
    from tltrun.model.hf_checkpoint import check_dtype_range, load_safetensors

    root = Path(in_dir)
    check_drafter_config(root, target.config)
    if not (root / "model.safetensors").is_file():
        raise CheckpointError(f"{root}: no model.safetensors")
    tensors = load_safetensors(root / "model.safetensors")
    for shared in ("embed_tokens.weight", "lm_head.weight"):
        tensors.pop(shared, None)  # we always use the target's own
    drafter = EagleDrafter(target.config)
    expected = set(drafter.state_dict())
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise CheckpointError(
            f"{root / 'model.safetensors'}: unexpected tensors {extra[:3]}, missing {missing[:3]}"
        )
    for name, tensor in drafter.state_dict().items():
        if tuple(tensors[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{root / 'model.safetensors'}: tensor {name!r} has shape "
                f"{tuple(tensors[name].shape)}, the target implies {tuple(tensor.shape)}"
            )
    weight = target.lm_head.weight
    check_dtype_range(root / "model.safetensors", tensors, dtype or weight.dtype)
    drafter.load_state_dict(tensors)
    drafter.to(dtype=dtype or weight.dtype, device=weight.device).eval()
    drafter.bind(target)
    return drafter
