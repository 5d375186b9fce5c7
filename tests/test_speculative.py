"""Tests of tltrun.rollout.speculative: speculative sampling is lossless.

Three layers on a tiny vocabulary (V = 5), for several p/q pairs including degenerate ones:
1. the rule itself: the exact first-token distribution, enumerated over drafts and branches in
   float64, equals p;
2. the implementation, exactly up to a stated quadrature bound: enumerate the drafts, and for
   each accept / sample branch measure its probability from ``verify_with_uniforms`` on a grid
   of 2^15 uniforms (a branch is an interval of u, so the grid error is <= 1/M per interval);
3. end to end through ``verify`` with a seeded generator: >= 100k SD steps, chi-square p > 0.01.
Plus greedy reduces to argmax matching and hypothesis invariants (top-k / top-p and the
DraftTree helpers: tests/test_sampling_params.py). Run: .venv/bin/python -m pytest
tests/test_speculative.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from tltrun.rollout.interface import SamplingParams
from tltrun.rollout.speculative import (
    DraftTree,
    logits_to_probs,
    sample,
    verify,
    verify_with_uniforms,
)

# As tests/tiny_models.py: small tensor ops gain nothing from intra-op threads, and on a shared
# 2-core machine OpenMP spin-waiting makes them ~10x slower under load.
torch.set_num_threads(1)

VOCAB = 5
U_MAX = 1.0 - 2.0**-24  # largest float32 below 1: a forced rejection unless p/q >= 1
NUM_SAMPLES = 100_000


def _pairs() -> dict[str, tuple[list[float], list[float]]]:
    rng = np.random.default_rng(0)
    near_one_hot = [1 - 4e-4, 1e-4, 1e-4, 1e-4, 1e-4]
    return {
        "random_a": (
            rng.dirichlet(np.ones(VOCAB)).tolist(),
            rng.dirichlet(np.ones(VOCAB)).tolist(),
        ),
        "random_b": (
            rng.dirichlet(np.ones(VOCAB) * 0.3).tolist(),
            rng.dirichlet(np.ones(VOCAB) * 0.3).tolist(),
        ),
        "q_near_one_hot": ([0.1, 0.3, 0.2, 0.15, 0.25], near_one_hot[::-1]),
        "p_near_one_hot": (near_one_hot, [0.1, 0.3, 0.2, 0.15, 0.25]),
        "disjoint": ([0.5, 0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.3, 0.7, 0.0]),
        "equal": ([0.1, 0.3, 0.2, 0.15, 0.25], [0.1, 0.3, 0.2, 0.15, 0.25]),
        "p_one_hot": ([0.0, 0.0, 1.0, 0.0, 0.0], [0.1, 0.3, 0.2, 0.15, 0.25]),
    }


PAIRS = _pairs()


def _f32(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


# ---- 1. the rule, enumerated exactly in float64 ----------------------------------------------


def _rule_first_token(p: np.ndarray, candidates: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """First-token distribution of trying candidates (token x, drafted from q) in order:
    accept with min(1, p(x)/q(x)), else p <- norm(max(p - q, 0)); all rejected: sample p."""
    dist = np.zeros_like(p)
    reach = 1.0  # probability that every earlier candidate was rejected
    for x, q in candidates:
        accept = min(1.0, p[x] / q[x]) if q[x] > 0 else float(p[x] > 0)
        dist[x] += reach * accept
        reach *= 1.0 - accept
        residual = np.maximum(p - q, 0.0)
        p = residual / residual.sum() if residual.sum() > 0 else p
    return dist + reach * p


@pytest.mark.parametrize("name", list(PAIRS))
def test_rule_is_exactly_lossless(name):
    p, q = (np.array(v, dtype=np.float64) for v in PAIRS[name])
    p, q = p / p.sum(), q / q.sum()
    one_hot = np.eye(VOCAB)
    chain = sum(q[x] * _rule_first_token(p, [(x, q)]) for x in range(VOCAB))
    with_replacement = sum(
        q[a] * q[b] * _rule_first_token(p, [(a, q), (b, q)])
        for a in range(VOCAB)
        for b in range(VOCAB)
    )
    without = 0.0
    for a in range(VOCAB):
        q_rest = np.where(np.arange(VOCAB) == a, 0.0, q)
        if q_rest.sum() == 0:
            continue
        q_rest = q_rest / q_rest.sum()  # the second sibling drawn from q without a
        without = without + sum(
            q[a] * q_rest[b] * _rule_first_token(p, [(a, q), (b, q_rest)])
            for b in range(VOCAB)
            if a != b
        )
    deterministic = _rule_first_token(p, [(3, one_hot[3]), (1, one_hot[1]), (0, one_hot[0])])
    for dist in (chain, with_replacement, without, deterministic):
        np.testing.assert_allclose(dist, p, atol=1e-12)


# ---- 2. the implementation, branch by branch ---------------------------------------------------


def _implementation_first_token(p, cases, num_grid, impl="ref") -> np.ndarray:
    """First-token distribution of verify_with_uniforms for a root with m drafted children.

    cases: list of (weight, tokens [m], draft_probs [m rows] | None). For each case, stage j < m
    forces rejections of children < j (u = U_MAX) and sweeps child j's u over the midpoint grid
    to measure its acceptance A_j; stage m forces all rejections and sweeps u_sample to measure
    the residual distribution S. Then P = sum_case w [sum_j prod_{i<j}(1 - A_i) A_j e_{x_j}
    + prod_i (1 - A_i) S]. Each measured probability is off by at most 1/num_grid."""
    grid = (torch.arange(num_grid, dtype=torch.float64) + 0.5) / num_grid
    m = len(cases[0][1])
    tokens, parents, draft_probs, u_accept, u_sample = [], [], [], [], []
    for _, xs, qs in cases:
        for stage in range(m + 1):
            tokens.append(torch.tensor([0, *xs]).expand(num_grid, m + 1))
            parents.append(torch.zeros(num_grid, m + 1, dtype=torch.long))
            if qs is not None:
                rows = torch.stack([torch.zeros(VOCAB), *qs])  # (m+1, V)
                draft_probs.append(rows.expand(num_grid, m + 1, VOCAB))
            u = torch.full((num_grid, m), U_MAX, dtype=torch.float64)
            if stage < m:
                u[:, stage] = grid
            u_accept.append(u)
            u_sample.append(
                grid if stage == m else torch.full((num_grid,), 0.5, dtype=torch.float64)
            )
    tree = DraftTree(
        torch.cat(tokens), torch.cat(parents), torch.cat(draft_probs) if draft_probs else None
    )
    target = p.expand(tree.tokens.shape[0], m + 1, VOCAB)
    result = verify_with_uniforms(
        tree, target, torch.cat(u_accept).float(), torch.cat(u_sample).float(), impl=impl
    )
    first_node = result.accepted_nodes[:, 1].reshape(len(cases), m + 1, num_grid)
    first_token = result.out_tokens[:, 0].reshape(len(cases), m + 1, num_grid)
    dist = np.zeros(VOCAB)
    for c, (weight, xs, _) in enumerate(cases):
        reach = 1.0
        for j in range(m):
            accept = (first_node[c, j] == j + 1).double().mean().item()
            dist[xs[j]] += weight * reach * accept
            reach *= 1.0 - accept
        residual = torch.bincount(first_token[c, m], minlength=VOCAB).double() / num_grid
        dist += weight * reach * residual.numpy()
    return dist


@pytest.mark.parametrize("name", list(PAIRS))
def test_implementation_chain_first_token_is_p(name):
    p, q = (_f32(v) for v in PAIRS[name])
    cases = [(q[x].item(), [x], [q]) for x in range(VOCAB) if q[x] > 0]
    num_grid = 2**15
    dist = _implementation_first_token(p, cases, num_grid)
    np.testing.assert_allclose(dist, p.double().numpy(), atol=3.0 / num_grid)


@pytest.mark.parametrize("name", list(PAIRS))
def test_implementation_tree_first_token_is_p(name):
    p, q = (_f32(v) for v in PAIRS[name])
    one_hot = torch.eye(VOCAB)
    num_grid = 2**12
    # deterministic candidates (point masses), as the top-k drafter produces them
    dist = _implementation_first_token(p, [(1.0, [3, 1, 0], None)], 2**15)
    np.testing.assert_allclose(dist, p.double().numpy(), atol=5.0 / 2**15)
    # the same three candidates passed as explicit one-hot draft distributions
    dist = _implementation_first_token(
        p, [(1.0, [3, 1, 0], [one_hot[3], one_hot[1], one_hot[0]])], 2**15
    )
    np.testing.assert_allclose(dist, p.double().numpy(), atol=5.0 / 2**15)
    # two siblings drawn from q without replacement: q2 = norm(q without the first)
    cases = []
    for a in range(VOCAB):
        q_rest = torch.where(torch.arange(VOCAB) == a, 0.0, q)
        if q[a] == 0 or q_rest.sum() == 0:
            continue
        q_rest = q_rest / q_rest.sum()
        cases += [
            (q[a].item() * q_rest[b].item(), [a, b], [q, q_rest])
            for b in range(VOCAB)
            if q_rest[b] > 0
        ]
    dist = _implementation_first_token(p, cases, num_grid)
    np.testing.assert_allclose(dist, p.double().numpy(), atol=4.0 / num_grid)


# ---- 3. end to end: chi-square over >= 100k SD steps -------------------------------------------


# First-token tests use the level the issue asks for (p > 0.01). The supplementary second-token
# checks add 14 more tests; at 0.01 each, a chance failure somewhere is likely (about 1 in 8 for
# fixed seeds drawn at random), so they use a Bonferroni-corrected 0.01 / 10.
MIN_PVALUE = 0.01
MIN_PVALUE_SECOND_TOKEN = 0.001


def _assert_follows(
    observed_tokens: torch.Tensor, p: torch.Tensor, label: str, min_pvalue: float = MIN_PVALUE
) -> None:
    counts = torch.bincount(observed_tokens, minlength=VOCAB).double()
    is_possible = p > 0
    assert counts[~is_possible].sum() == 0, f"{label}: emitted a token of target probability 0"
    expected = p[is_possible].double() / p[is_possible].double().sum() * counts.sum()
    if is_possible.sum() == 1:
        return  # one possible token, and it was always emitted
    pvalue = chisquare(counts[is_possible].numpy(), expected.numpy()).pvalue
    print(f"{label}: chi-square p = {pvalue:.3f} over {int(counts.sum())} samples")
    assert pvalue > min_pvalue, f"{label}: counts {counts.tolist()} vs p {p.tolist()}"


@pytest.mark.parametrize("name", list(PAIRS))
def test_chain_chi_square(name):
    """k = 2 chain; target after the first token depends on it (table next_p[x1])."""
    gen = torch.Generator().manual_seed(1)
    p, q = (_f32(v) for v in PAIRS[name])
    next_p = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen), dim=-1)  # (V, V)
    drafted = torch.multinomial(q.expand(NUM_SAMPLES, VOCAB), 2, replacement=True, generator=gen)
    q_rows = q.expand(NUM_SAMPLES, 2, VOCAB)
    target = torch.stack(
        [p.expand(NUM_SAMPLES, VOCAB), next_p[drafted[:, 0]], next_p[drafted[:, 1]]], dim=1
    )  # (B, 3, V)
    tree = DraftTree.chain(torch.zeros(NUM_SAMPLES, dtype=torch.long), drafted, q_rows)
    result = verify(tree, target, gen)
    _assert_follows(result.out_tokens[:, 0], p, f"{name} first token")
    # Second emitted token, given the first was an accepted draft y: it must follow next_p[y].
    y = int(torch.argmax(torch.bincount(drafted[result.num_accepted >= 1, 0], minlength=VOCAB)))
    is_y = (result.num_accepted >= 1) & (result.out_tokens[:, 0] == y)
    if is_y.sum() >= 1000:
        _assert_follows(
            result.out_tokens[is_y, 1],
            next_p[y],
            f"{name} second token after {y}",
            MIN_PVALUE_SECOND_TOKEN,
        )


@pytest.mark.parametrize("name", list(PAIRS))
def test_tree_chi_square_deterministic_candidates(name):
    """Root with candidates [3, 1, 0] (point masses); node 1 (token 3) has two children."""
    gen = torch.Generator().manual_seed(2)
    p = _f32(PAIRS[name][0])
    p_after_3 = _f32(PAIRS[name][1])
    tokens = torch.tensor([0, 3, 1, 0, 2, 4]).expand(NUM_SAMPLES, 6)
    parents = torch.tensor([0, 0, 0, 0, 1, 1]).expand(NUM_SAMPLES, 6)
    target = torch.stack([p, p_after_3, p, p, p, p]).expand(NUM_SAMPLES, 6, VOCAB)
    result = verify(DraftTree(tokens, parents), target, gen)
    _assert_follows(result.out_tokens[:, 0], p, f"{name} tree first token")
    is_3 = result.accepted_nodes[:, 1] == 1
    if is_3.sum() >= 1000:
        _assert_follows(
            result.out_tokens[is_3, 1],
            p_after_3,
            f"{name} tree second token",
            MIN_PVALUE_SECOND_TOKEN,
        )


def test_sample_chi_square():
    gen = torch.Generator().manual_seed(3)
    p = _f32(PAIRS["random_b"][0])
    _assert_follows(sample(p.expand(NUM_SAMPLES, VOCAB), gen), p, "sample")


# ---- greedy: temperature 0 reduces to "accept while the draft equals the argmax" ----------------


def test_greedy_chain_accepts_exactly_the_argmax_prefix():
    gen = torch.Generator().manual_seed(4)
    num_seqs, k, vocab = 16, 5, 11
    logits = torch.randn(num_seqs, k + 1, vocab, generator=gen)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    argmax = logits.argmax(dim=-1)  # (B, k+1)
    num_matching = torch.randint(0, k + 1, (num_seqs,), generator=gen)  # drafts right up to here
    drafted = torch.where(
        torch.arange(k) < num_matching.unsqueeze(1), argmax[:, :k], (argmax[:, :k] + 1) % vocab
    )
    q = torch.softmax(torch.randn(num_seqs, k, vocab, generator=gen), dim=-1)
    for draft_probs in (None, q):  # deterministic drafter, then a sampling drafter
        tree = DraftTree.chain(torch.zeros(num_seqs, dtype=torch.long), drafted, draft_probs)
        result = verify(tree, probs, gen)
        assert torch.equal(result.num_accepted, num_matching)
        for b in range(num_seqs):
            n = int(num_matching[b])
            assert result.out_tokens[b, : n + 1].tolist() == argmax[b, : n + 1].tolist()


def test_greedy_tree_follows_the_argmax_path():
    gen = torch.Generator().manual_seed(5)
    vocab = 7
    #        0           root's children 1, 2, 3: node 2 is the first carrying the argmax
    #     1  2  3        (node 3 carries it too, but is never tried)
    #       4 5  6       node 2's children: node 4 is wrong, node 5 right
    parents = torch.tensor([[0, 0, 0, 0, 2, 2, 3]])
    logits = torch.randn(1, 7, vocab, generator=gen)
    argmax = logits.argmax(dim=-1)[0]
    tokens = torch.tensor(
        [[0, (argmax[0] + 1) % vocab, argmax[0], argmax[0], (argmax[2] + 2) % vocab, argmax[2], 1]]
    )
    result = verify(DraftTree(tokens, parents), logits_to_probs(logits, SamplingParams(0.0)), gen)
    # root: node 1 wrong, node 2 right (first match in index order; node 3 is never tried);
    # node 2: node 4 wrong, node 5 right; node 5 has no children: bonus argmax[5].
    assert result.num_accepted.tolist() == [2]
    assert result.accepted_nodes.tolist() == [[0, 2, 5]]
    assert result.out_tokens.tolist() == [[int(argmax[0]), int(argmax[2]), int(argmax[5])]]


# ---- invariants of verify on random trees ---------------------------------------------------------


@st.composite
def _trees(draw):
    num_seqs = draw(st.integers(1, 6))
    num_drafted = draw(st.integers(0, 7))
    vocab = draw(st.integers(2, 9))
    parents = [
        [0] + [draw(st.integers(0, i - 1)) for i in range(1, num_drafted + 1)]
        for _ in range(num_seqs)
    ]
    return num_seqs, num_drafted, vocab, parents, draw(st.booleans()), draw(st.integers(0, 999))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(_trees())
def test_verify_invariants(case):
    num_seqs, num_drafted, vocab, parents, has_draft_probs, seed = case
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (num_seqs, num_drafted + 1), generator=gen)
    # sparse target rows (top-k style zeros) so that "never emits a zero-probability token" bites
    target = torch.softmax(torch.randn(num_seqs, num_drafted + 1, vocab, generator=gen) * 2, -1)
    target = target * (torch.rand(target.shape, generator=gen) < 0.6)
    target[..., 0] += 1e-3  # at least one possible token per row
    target = target / target.sum(-1, keepdim=True)
    q = None
    if has_draft_probs:
        q = torch.softmax(torch.randn(num_seqs, num_drafted + 1, vocab, generator=gen), -1)
    tree = DraftTree(tokens, torch.tensor(parents), q)
    result = verify(tree, target, gen)
    depth = tree.depth
    for b in range(num_seqs):
        n = int(result.num_accepted[b])
        path = result.accepted_nodes[b].tolist()
        assert path[0] == 0 and all(v == path[n] for v in path[n:])
        for j in range(1, n + 1):  # a root-to-leaf path through the tree
            assert parents[b][path[j]] == path[j - 1] and depth[b, path[j]] == j
            assert result.out_tokens[b, j - 1] == tokens[b, path[j]]
            assert target[b, path[j - 1], tokens[b, path[j]]] > 0  # accepted => possible
        emitted = int(result.out_tokens[b, n])
        assert target[b, path[n], emitted] > 0  # never a zero-probability token
        if q is None:  # a rejected point-mass candidate is removed from p: never re-emitted
            rejected = [
                int(tokens[b, c]) for c in range(1, num_drafted + 1) if parents[b][c] == path[n]
            ]
            assert emitted not in rejected or target[b, path[n], emitted] == 1.0
        assert (result.out_tokens[b, n:] == emitted).all()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.integers(0, 6), st.integers(2, 30), st.booleans(), st.integers(0, 999))
def test_tree_walk_on_a_chain_matches_the_chain_kernel_path(num_seqs, k, vocab, has_q, seed):
    """The general tree walk and the spec_verify path agree on a chain with the same uniforms
    (decisions exactly; tokens too, as no uniform here lands within ~1e-7 of a CDF step)."""
    from tltrun.rollout.speculative import TreeShape, _verify_tree

    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(num_seqs, k + 1, vocab, generator=gen), -1)
    q = torch.softmax(torch.randn(num_seqs, k, vocab, generator=gen), -1) if has_q else None
    drafted = torch.randint(0, vocab, (num_seqs, k), generator=gen)
    tree = DraftTree.chain(torch.zeros(num_seqs, dtype=torch.long), drafted, q)
    u_accept = torch.rand(num_seqs, k, generator=gen)
    u_sample = torch.rand(num_seqs, generator=gen)
    by_kernel = verify_with_uniforms(tree, target, u_accept, u_sample, impl="ref")
    by_walk = _verify_tree(tree, target, u_accept, u_sample)
    # the walk with the bounds a graph's verify passes (no reads of device values) too
    bounds = TreeShape(max_depth=k, max_children=1, is_chain=False)
    by_static_walk = _verify_tree(tree, target, u_accept, u_sample, bounds)
    for walk in (by_walk, by_static_walk):
        assert torch.equal(by_kernel.num_accepted, walk.num_accepted)
        assert torch.equal(by_kernel.accepted_nodes, walk.accepted_nodes)
        assert torch.equal(by_kernel.out_tokens, walk.out_tokens)


def test_verify_is_reproducible_from_the_seed():
    target = torch.softmax(torch.randn(8, 4, 13), -1)
    tree = DraftTree.chain(torch.zeros(8, dtype=torch.long), torch.randint(0, 13, (8, 3)))
    first = verify(tree, target, torch.Generator().manual_seed(7))
    second = verify(tree, target, torch.Generator().manual_seed(7))
    assert torch.equal(first.out_tokens, second.out_tokens)
    with pytest.raises(ValueError, match="impl"):
        verify(tree, target, None, impl="cuda")
