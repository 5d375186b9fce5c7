"""Speculative sampling maths for the rollout engine: sampling parameters to probabilities,
draft trees, and lossless verification of a drafted chain or tree against the target.

Notation: p is a target probability, q a draft probability, x a drafted token, u ~ U[0, 1).

* Chain (DESIGN.md "Speculative sampling"; Leviathan et al. 2023, Alg. 1): accept x_j iff all
  earlier drafts were accepted and u_j < p_j(x_j) / q_j(x_j), i.e. with probability
  min(1, p/q); at the first rejection emit a token from norm(max(p - q, 0)); when all k are
  accepted emit a bonus token from p_k. The first emitted token is distributed exactly as p:
      P(y) = min(p(y), q(y)) + (1 - sum_x min(p(x), q(x))) * max(p(y) - q(y), 0) / Z = p(y)
  since Z = sum_x max(p(x) - q(x), 0) = 1 - sum_x min(p(x), q(x)).
* Tree (SpecInfer, Miao et al. 2024, Sec. 4.3 "multi-step speculative sampling"): walk from the
  root; at each node try its children in node-index order. Child c (token x, drafted from q_c)
  is accepted iff u_c < p(x) / q_c(x); on rejection p <- norm(max(p - q_c, 0)) and the next
  sibling is tried against the updated p. The walk stops at the first node none of whose
  children is accepted, and the token emitted there is drawn from the current p. By the
  identity above, applied once per sibling, each emitted token is distributed exactly as the
  target's p, provided q_c is the distribution c was really drawn from given its earlier
  siblings (for sampling without replacement: q with the earlier siblings' tokens removed).
* Deterministic drafting (draft_probs None: top-k or argmax candidates) is the point mass
  q_c = one_hot(x): accept x with probability p(x); on rejection p <- norm(p with x's mass
  removed). This is sequential inversion of p ("is it x1? else is it x2? ..."), so it is
  lossless too, and with a greedy target (p one-hot at the argmax) it reduces to "accept while
  the draft equals the argmax". The history drafter (tltrun.model.history_drafter, issue #20)
  drafts this way: its drafts are a deterministic function of committed tokens. The walk
  tests a node's point-mass siblings all at once (``_walk_point_masses``: after rejecting
  x_1..x_{j-1}, x_j is accepted iff u_j < p(x_j) / (1 - sum_{i<j} p(x_i))); passing the one-hot
  q explicitly walks rank by rank and makes the same decisions but where u lies within float
  rounding of a ratio, which tests/test_history_drafter.py checks on 2,000 trees.

Greedy decoding is temperature 0: p is the one-hot argmax, so the same code path applies.

Usage (what tltrun.rollout.engine does each SD iteration):
    probs = logits_to_probs(target_logits, params)             # (B, N+1, V)
    result = verify(tree, probs, generator, impl="ref")         # impl="triton" on CUDA
    append result.out_tokens[b, : result.num_accepted[b] + 1] to sequence b
Tests: tests/test_speculative.py (exact distributions), tests/test_kernels.py (kernels).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass

import torch

from kernels.spec_verify import IMPLS, sample_from_weights, spec_verify
from tltrun.rollout.interface import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities under temperature, top-k, top-p.

    Order as in Hugging Face and vLLM: temperature, then top-k (keep logits >= the k-th
    largest; ties with the k-th value are all kept), then top-p on the top-k distribution (keep
    the smallest set of most likely tokens whose mass reaches top_p; ties in probability are
    broken by token index, lower first). Temperature 0 is greedy: the one-hot argmax (first
    maximal index on ties)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    if params.is_greedy:
        return point_mass(logits.argmax(dim=-1), vocab)
    scaled = logits / params.temperature  # (..., V)
    if params.top_k is not None and params.top_k < vocab:
        kth_largest = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        cum = torch.cumsum(sorted_probs.to(torch.float64), dim=-1)
        mass_before = cum - sorted_probs.to(torch.float64)  # mass of the more likely tokens
        is_kept_sorted = mass_before < params.top_p  # the most likely token is always kept
        is_kept = torch.zeros_like(is_kept_sorted).scatter(-1, order, is_kept_sorted)
        probs = torch.where(is_kept, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def point_mass(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """(...) token ids -> (..., V) float32 one-hot rows: ``one_hot(tokens).float()`` without
    its range check, which reads the ids back on the host (a stall, and refused by a CUDA
    graph's capture)."""
    out = torch.zeros(*tokens.shape, vocab, device=tokens.device)
    return out.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of (..., V) probabilities by inverse CDF -> int64 (...).

    generator None uses torch's default generator (not reproducible from a seed)."""
    u = torch.rand(probs.shape[:-1], generator=generator, device=probs.device)  # (...)
    return sample_from_weights(probs, u)


@dataclass
class DraftTree:
    """A batch of draft trees with N drafted nodes each (N = 0: no draft).

    tokens (B, N+1) int64: node 0 is the root, the last committed token, not yet fed to the
    target; nodes 1..N are drafted. parents (B, N+1) int64: parents[:, 0] == 0 and
    parents[:, i] < i, so node order is a topological order. draft_probs (B, N+1, V) | None:
    draft_probs[:, i] is the q node i was drawn from (row 0 unused); None means deterministic
    drafting, treated as point masses. Siblings are tried in node-index order; the drafter puts
    them in descending draft probability."""

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    # False: shapes only, no check of the parents' values (a read of device values, which a
    # CUDA graph cannot do and which would stall the host each iteration): for trees the
    # engine's own static steps built, whose construction the tests check
    is_checked: InitVar[bool] = True

    def __post_init__(self, is_checked: bool) -> None:
        if self.tokens.dim() != 2 or self.tokens.shape != self.parents.shape:
            raise ValueError(
                f"tokens and parents must both be (B, N+1), got "
                f"{tuple(self.tokens.shape)} and {tuple(self.parents.shape)}"
            )
        num_seqs, num_nodes = self.tokens.shape
        if num_nodes < 1:
            raise ValueError("a draft tree needs its root (node 0)")
        node_ids = torch.arange(num_nodes, device=self.parents.device)
        is_valid = (
            not is_checked
            or (self.parents[:, 0] == 0).all()
            and ((self.parents[:, 1:] >= 0) & (self.parents[:, 1:] < node_ids[1:])).all()
        )
        if not is_valid:
            raise ValueError("parents must satisfy parents[:, 0] == 0 and 0 <= parents[:, i] < i")
        if self.draft_probs is not None and (
            self.draft_probs.dim() != 3 or self.draft_probs.shape[:2] != (num_seqs, num_nodes)
        ):
            raise ValueError(
                f"draft_probs must be (B, N+1, V) with (B, N+1) = "
                f"{(num_seqs, num_nodes)}, got {tuple(self.draft_probs.shape)}"
            )

    @classmethod
    def chain(
        cls, root: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor | None = None
    ) -> DraftTree:
        """A chain: root (B,), drafted (B, k), q (B, k, V) the draft distributions or None."""
        num_seqs, k = drafted.shape
        tokens = torch.cat([root.reshape(num_seqs, 1), drafted], dim=1).long()  # (B, k+1)
        parents = (torch.arange(k + 1, device=tokens.device) - 1).clamp(min=0)  # 0, 0, 1, ..
        draft_probs = None
        if q is not None:
            draft_probs = torch.cat([q.new_zeros(num_seqs, 1, q.shape[2]), q], dim=1)  # (B, k+1, V)
        return cls(tokens, parents.expand(num_seqs, k + 1).contiguous(), draft_probs)

    @property
    def num_drafted(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def is_chain(self) -> bool:
        """Node i's parent is i - 1 for every i >= 1 in every sequence."""
        expected = torch.arange(self.num_drafted, device=self.parents.device)
        return bool((self.parents[:, 1:] == expected).all())

    @property
    def depth(self) -> torch.Tensor:
        """(B, N+1) int64 depth of each node; the root is 0 (RoPE position = cache_len + depth)."""
        depth = torch.zeros_like(self.parents)
        for i in range(1, self.num_drafted + 1):  # parents[:, i] < i: already computed
            depth[:, i] = depth.gather(1, self.parents[:, i : i + 1]).squeeze(1) + 1
        return depth

    def ancestor_mask(self) -> torch.Tensor:
        """(B, N+1, N+1) bool: [b, i, j] true iff node j is node i or an ancestor of node i."""
        num_seqs, num_nodes = self.tokens.shape
        mask = torch.eye(num_nodes, dtype=torch.bool, device=self.tokens.device)
        mask = mask.expand(num_seqs, num_nodes, num_nodes).clone()
        rows = torch.arange(num_seqs, device=self.tokens.device)
        for i in range(1, num_nodes):
            mask[:, i] |= mask[rows, self.parents[:, i]]  # the parent's row is final already
        return mask

    def children(self, max_children: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N+1, R) child node ids in trial order, and (B, N+1, R) bool validity, where R
        is the largest number of children of any node (at least 1), or ``max_children`` (no
        read of device values): children of a higher rank are then left out."""
        num_seqs, num_nodes = self.tokens.shape
        device = self.tokens.device
        node_ids = torch.arange(num_nodes, device=device)
        is_drafted = node_ids >= 1
        # rank[b, i]: how many earlier drafted siblings node i has
        is_earlier_sibling = (
            (self.parents.unsqueeze(2) == self.parents.unsqueeze(1))
            & (node_ids.unsqueeze(1) > node_ids.unsqueeze(0))
            & is_drafted
        )  # (B, i, j)
        rank = is_earlier_sibling.sum(dim=2)  # (B, N+1)
        if max_children is None:
            max_children = int(rank[:, 1:].max()) + 1 if num_nodes > 1 else 1
        # one spare rank column takes the children left out, then is dropped
        children = torch.zeros(
            (num_seqs, num_nodes, max_children + 1), dtype=torch.long, device=device
        )
        has_child = torch.zeros_like(children, dtype=torch.bool)
        rows = torch.arange(num_seqs, device=device).unsqueeze(1).expand(-1, num_nodes - 1)
        drafted = node_ids[1:].expand(num_seqs, -1)
        rank = rank[:, 1:].clamp(max=max_children)
        children[rows, self.parents[:, 1:], rank] = drafted
        # a device tensor of True, not a Python True: no host-to-device copy (capture refuses it)
        has_child[rows, self.parents[:, 1:], rank] = torch.ones_like(drafted, dtype=torch.bool)
        return children[..., :max_children], has_child[..., :max_children]


@dataclass(frozen=True, kw_only=True)
class TreeShape:
    """Bounds of the draft trees of one strategy, known before they are drafted: depth at most
    ``max_depth`` (its draft steps), siblings tried up to rank ``max_children`` (its top-k: an
    EAGLE tree has at most top-k children per node; the history drafter's has at most top-k
    distinct ones, the rest copies of the root's first child, which the walk rejects with it,
    leaving p unchanged, so leaving them out changes nothing), a chain when top-k is 1."""

    max_depth: int
    max_children: int
    is_chain: bool

    @classmethod
    def of(cls, decision) -> TreeShape:
        """The bounds of ``decision``'s trees (a ``tltsim.policy.SpecDecision``)."""
        return cls(
            max_depth=decision.draft_steps,
            max_children=decision.topk,
            is_chain=decision.topk == 1,
        )


@dataclass
class VerifyResult:
    """Outcome of one verify step for B sequences; D = the tree's depth (k for a chain).

    num_accepted (B,): drafted tokens accepted. accepted_nodes (B, D+1): node ids of the
    accepted path, root 0 first; entries past num_accepted repeat the last accepted node.
    out_tokens (B, D+1): the tokens to append, the accepted drafted tokens then one correction
    (or bonus) token; the valid prefix has length num_accepted + 1 and entries past it repeat
    the correction token."""

    num_accepted: torch.Tensor
    accepted_nodes: torch.Tensor
    out_tokens: torch.Tensor


def verify(
    tree: DraftTree,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    impl: str = "ref",
) -> VerifyResult:
    """Verify a batch of draft trees against target_probs (B, N+1, V), where target_probs[:, i]
    is the target's distribution of the token following node i, already processed by
    logits_to_probs. Draws (B, N) accept uniforms, then (B,) sampling uniforms, from
    ``generator`` (in that order whatever the tree's shape) and calls verify_with_uniforms."""
    num_seqs, num_nodes = tree.tokens.shape
    device = target_probs.device
    u_accept = torch.rand((num_seqs, num_nodes - 1), generator=generator, device=device)
    u_sample = torch.rand((num_seqs,), generator=generator, device=device)
    return verify_with_uniforms(tree, target_probs, u_accept, u_sample, impl)


def verify_with_uniforms(
    tree: DraftTree,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    impl: str = "ref",
    shape: TreeShape | None = None,
) -> VerifyResult:
    """Deterministic core of verify: node i's accept test uses u_accept[:, i - 1] (B, N); the
    emitted correction / bonus token uses u_sample (B,).

    A chain is verified by kernels.spec_verify with ``impl`` ("ref": torch, "triton": the fused
    kernel). A branching tree is walked in torch whatever ``impl`` is (a few gathers per depth
    level and sibling; there is no tree-verify kernel). ``shape``: the tree's bounds known in
    advance, so nothing is read from the device (a CUDA graph's verify); the result is then
    ``shape.max_depth + 1`` wide."""
    num_seqs, num_nodes = tree.tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (num_seqs, num_nodes):
        raise ValueError(
            f"target_probs must be (B, N+1, V) with (B, N+1) = "
            f"{(num_seqs, num_nodes)}, got {tuple(target_probs.shape)}"
        )
    if tree.draft_probs is not None and tree.draft_probs.shape[2] != target_probs.shape[2]:
        raise ValueError(
            f"draft vocabulary {tree.draft_probs.shape[2]} != target vocabulary "
            f"{target_probs.shape[2]}"
        )
    if tuple(u_accept.shape) != (num_seqs, num_nodes - 1) or tuple(u_sample.shape) != (num_seqs,):
        raise ValueError(
            f"u_accept must be (B, N) = {(num_seqs, num_nodes - 1)} and u_sample "
            f"(B,), got {tuple(u_accept.shape)} and {tuple(u_sample.shape)}"
        )
    if tree.is_chain if shape is None else shape.is_chain:
        return _verify_chain(tree, target_probs, u_accept, u_sample, impl)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return _verify_tree(tree, target_probs, u_accept, u_sample, shape)


def _verify_chain(tree, target_probs, u_accept, u_sample, impl) -> VerifyResult:
    k = tree.num_drafted
    drafted = tree.tokens[:, 1:]  # (B, k)
    q = None if tree.draft_probs is None else tree.draft_probs[:, 1:]  # (B, k, V)
    _, num_accepted, next_token = spec_verify(
        target_probs, q, drafted, u_accept, u_sample, impl=impl
    )
    positions = torch.arange(k + 1, device=drafted.device)  # (k+1,)
    accepted_nodes = torch.minimum(positions, num_accepted.unsqueeze(1))  # (B, k+1)
    out_tokens = torch.where(
        positions < num_accepted.unsqueeze(1),
        torch.cat([drafted, next_token.unsqueeze(1)], dim=1),
        next_token.unsqueeze(1),
    )  # (B, k+1)
    return VerifyResult(num_accepted, accepted_nodes, out_tokens)


def _rejection_update(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p <- norm(max(p - q, 0)) per row of (B, V); rows whose residual vanished (possible
    only through rounding, see kernels/spec_verify.py) keep p."""
    residual = torch.clamp_min(p - q, 0.0)
    mass = residual.sum(dim=-1, keepdim=True)  # (B, 1)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def _verify_tree(tree, target_probs, u_accept, u_sample, shape=None) -> VerifyResult:
    """The multi-candidate walk of the module docstring, vectorised over the batch; loops over
    depth levels (and, with explicit draft distributions, sibling ranks)."""
    children, has_child = tree.children(None if shape is None else shape.max_children)
    u_node = torch.cat([torch.zeros_like(u_accept[:, :1]), u_accept], dim=1)  # (B, N+1)
    max_depth = int(tree.depth.max()) if shape is None else shape.max_depth
    walk = _walk_point_masses if tree.draft_probs is None else _walk_siblings
    path, weights = walk(tree, target_probs, children, has_child, u_node, max_depth)
    accepted_nodes = torch.stack(path, dim=1)  # (B, D+1), stopped walks repeat their node
    num_accepted = (accepted_nodes[:, 1:] != accepted_nodes[:, :-1]).sum(dim=1)
    next_token = sample_from_weights(weights, u_sample)
    steps = torch.arange(max_depth + 1, device=target_probs.device)
    out_tokens = torch.where(
        steps < num_accepted.unsqueeze(1),
        tree.tokens.gather(1, _shift_left(accepted_nodes)),
        next_token.unsqueeze(1),
    )
    return VerifyResult(num_accepted, accepted_nodes, out_tokens)


def _walk_siblings(tree, target_probs, children, has_child, u_node, max_depth):
    """The walk trying one sibling rank at a time (explicit draft distributions q): the path
    (D+1 tensors (B,) of node ids) and the weights the emitted token is drawn from (B, V)."""
    num_seqs = tree.tokens.shape[0]
    rows = torch.arange(num_seqs, device=target_probs.device)
    node = torch.zeros_like(rows)  # current node per sequence
    p = target_probs[:, 0].float()  # (B, V) target distribution at node, after rejections
    is_walking = torch.ones(num_seqs, dtype=torch.bool, device=rows.device)
    path = [node]
    for _ in range(max_depth):
        has_moved = torch.zeros_like(is_walking)
        for rank in range(children.shape[2]):
            child = children[rows, node, rank]  # (B,)
            is_tried = is_walking & ~has_moved & has_child[rows, node, rank]
            x = tree.tokens[rows, child]  # (B,)
            q = tree.draft_probs[rows, child].float()  # (B, V)
            p_x = p.gather(1, x.unsqueeze(1)).squeeze(1)
            q_x = q.gather(1, x.unsqueeze(1)).squeeze(1)
            is_ok = is_tried & (u_node[rows, child] < p_x / q_x)  # same test as the chain
            is_rejected = (is_tried & ~is_ok).unsqueeze(1)
            p = torch.where(is_rejected, _rejection_update(p, q), p)
            node = torch.where(is_ok, child, node)
            has_moved |= is_ok
        p = torch.where(has_moved.unsqueeze(1), target_probs[rows, node].float(), p)
        is_walking &= has_moved
        path.append(node)
    return path, p


def _walk_point_masses(tree, target_probs, children, has_child, u_node, max_depth):
    """The walk for deterministic drafts (draft_probs None: every tree the engine verifies),
    all siblings of a node in one step. Rejecting point masses x_1..x_{j-1} leaves the node's
    target row p with their mass removed, renormalised, so x_j is accepted iff

        u_j < p(x_j) / (sum(p) - sum_{i<j} p(x_i))     (0 if x_j repeats an earlier sibling)

    and the first sibling passing its test is the one the rank-by-rank walk accepts; where the
    walk stops the token is drawn from p with every sibling's mass removed (all were tried
    there; ``sample_from_weights`` normalises). The same decisions as ``_walk_siblings`` with
    explicit one-hot q, except where u lies within float32 rounding of the ratio (the two
    round the renormalisation differently). Per depth level a fixed number of ops, not one
    set per rank: a CUDA graph of an 8_4_32 verify launches a quarter as many kernels."""
    num_seqs, device = tree.tokens.shape[0], target_probs.device
    rows = torch.arange(num_seqs, device=device)
    num_ranks = children.shape[2]
    is_earlier = torch.ones(num_ranks, num_ranks, dtype=torch.bool, device=device).tril(-1)
    node = torch.zeros_like(rows)  # current node per sequence
    is_walking = torch.ones(num_seqs, dtype=torch.bool, device=device)
    path = [node]
    for _ in range(max_depth):
        child = children[rows, node]  # (B, R) in trial order
        is_tried = has_child[rows, node] & is_walking[:, None]  # (B, R)
        x = tree.tokens.gather(1, child)  # (B, R)
        p = target_probs[rows, node].float()  # (B, V)
        # [b, j, i]: sibling i < j was tried with the same token: x_j's mass is gone already
        is_repeat = ((x[:, :, None] == x[:, None, :]) & is_earlier & is_tried[:, None, :]).any(2)
        p_x = torch.where(is_tried & ~is_repeat, p.gather(1, x), 0.0)  # (B, R) mass removed
        mass = p.sum(dim=1, keepdim=True) - (p_x.cumsum(dim=1) - p_x)  # (B, R) left before j
        is_ok = is_tried & (u_node.gather(1, child) < p_x / mass)
        is_moved = is_ok.any(dim=1)
        first = is_ok.to(torch.uint8).argmax(dim=1, keepdim=True)  # (B, 1) first passing rank
        node = torch.where(is_moved, child.gather(1, first)[:, 0], node)
        is_walking &= is_moved
        path.append(node)
    # where each walk stopped, all its node's children were tried and rejected
    x = tree.tokens.gather(1, children[rows, node])  # (B, R)
    p = target_probs[rows, node].float()  # (B, V)
    is_left = (~has_child[rows, node]).float()  # 0 at the tokens to remove
    weights = p * torch.ones_like(p).scatter_reduce(1, x, is_left, reduce="amin")
    # as ``_rejection_update``: a residual that vanished (rounding only) keeps p
    return path, torch.where(weights.sum(dim=1, keepdim=True) > 0, weights, p)


def _shift_left(accepted_nodes: torch.Tensor) -> torch.Tensor:
    """(B, D+1) -> (B, D+1): position j holds the node of the (j+1)-th accepted draft token
    (the last column repeats, and is masked out by the caller)."""
    return torch.cat([accepted_nodes[:, 1:], accepted_nodes[:, -1:]], dim=1)
