"""Sampling parameters and draft trees of tltrun.rollout.speculative (beside
tests/test_speculative.py's lossless proofs): ``logits_to_probs`` on hand examples and
top-k / top-p / temperature properties; the ``DraftTree`` helpers and their refusals.

Run: .venv/bin/python -m pytest tests/test_sampling_params.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tltrun.rollout.interface import SamplingParams
from tltrun.rollout.speculative import DraftTree, logits_to_probs

torch.set_num_threads(1)  # as tests/test_speculative.py


# ---- sampling parameters ------------------------------------------------------------------------


def test_logits_to_probs_hand_examples():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    np.testing.assert_allclose(
        logits_to_probs(logits, SamplingParams()).numpy(), [[0.1, 0.4, 0.2, 0.3]], rtol=1e-6
    )
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))  # p^2, renormalised
    np.testing.assert_allclose(
        cold.numpy(), [[0.01, 0.16, 0.04, 0.09]] / np.float32(0.30), rtol=1e-5
    )
    top2 = logits_to_probs(logits, SamplingParams(top_k=2))
    np.testing.assert_allclose(top2.numpy(), [[0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7]], rtol=1e-6)
    top_p = logits_to_probs(logits, SamplingParams(top_p=0.65))  # 0.4 + 0.3 = 0.7 >= 0.65
    np.testing.assert_allclose(top_p.numpy(), [[0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7]], rtol=1e-6)
    top_p = logits_to_probs(logits, SamplingParams(top_p=0.75))  # needs the 0.2 as well
    np.testing.assert_allclose(top_p.numpy(), [[0.0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9]], rtol=1e-6)
    # top-p applies to the renormalised top-k: 0.4 / 0.7 >= 0.55 keeps one token (on the full
    # distribution 0.4 < 0.55 would keep two)
    both = logits_to_probs(logits, SamplingParams(top_k=2, top_p=0.55))
    np.testing.assert_allclose(both.numpy(), [[0.0, 1.0, 0.0, 0.0]], rtol=1e-6)
    greedy = logits_to_probs(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), SamplingParams(0.0))
    assert greedy.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # first maximal index on ties
    # a temperature near float32's smallest (1e-39 made the logits infinite, the probabilities
    # NaN and every sampled token 0) is greedy below 1e-5, as in vLLM; 1e-5 itself samples
    for tiny in (1e-39, 1e-45, 9.9e-6):
        cold = logits_to_probs(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), SamplingParams(tiny))
        assert cold.tolist() == [[0.0, 1.0, 0.0, 0.0]], tiny
    warm = logits_to_probs(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), SamplingParams(1e-5))
    assert warm.tolist() == [[0.0, 0.5, 0.5, 0.0]]  # the tie is sampled, not broken


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(1, 40),
    top_k=st.one_of(st.none(), st.integers(1, 50)),
    top_p=st.floats(0.01, 1.0),
    temperature=st.floats(0.05, 4.0),
)
def test_top_k_top_p_properties(seed, vocab, top_k, top_p, temperature):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, vocab, generator=gen) * 3
    probs = logits_to_probs(logits, SamplingParams(temperature, top_p, top_k))
    np.testing.assert_allclose(probs.sum(-1).numpy(), 1.0, rtol=1e-5)
    full = torch.softmax(logits / temperature, dim=-1)
    for row in range(3):
        kept = probs[row] > 0
        if top_k is not None:
            kth = torch.topk(logits[row], min(top_k, vocab)).values[-1]
            assert not kept[logits[row] < kth].any()  # nothing below the k-th largest
        candidates = full[row] * (logits[row] >= kth if top_k is not None else True)
        candidates = candidates / candidates.sum()
        # proportional to the (top-k) distribution on the kept set
        np.testing.assert_allclose(
            probs[row][kept].numpy(), (candidates[kept] / candidates[kept].sum()).numpy(), rtol=1e-4
        )
        # top-p keeps a most-likely set, minimal: mass >= top_p, and without its least likely
        # member the mass falls below top_p
        dropped = torch.cat([candidates[~kept], torch.zeros(1)])
        assert dropped.max() <= candidates[kept].min() + 1e-7
        mass = candidates[kept].sum().item()
        assert mass >= min(top_p, 1.0) - 1e-5
        assert mass - candidates[kept].min().item() < top_p + 1e-5


# ---- DraftTree ------------------------------------------------------------------------------------


def test_draft_tree_helpers():
    #      0
    #    1   2
    #   3 4   5
    #   6
    tree = DraftTree(torch.tensor([[9, 8, 7, 6, 5, 4, 3]]), torch.tensor([[0, 0, 0, 1, 1, 2, 3]]))
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2, 2, 3]]
    expected = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    mask = tree.ancestor_mask()[0]
    for i, ancestors in enumerate(expected):
        assert torch.nonzero(mask[i]).flatten().tolist() == ancestors
    children, has_child = tree.children()
    assert children[0][has_child[0]].tolist() == [1, 2, 3, 4, 5, 6]  # node order, by parent
    assert has_child[0].sum(-1).tolist() == [2, 2, 1, 1, 0, 0, 0]
    assert not tree.is_chain
    chain = DraftTree.chain(torch.tensor([4, 2]), torch.tensor([[1, 2, 3], [3, 2, 1]]))
    assert chain.is_chain and chain.tokens.tolist() == [[4, 1, 2, 3], [2, 3, 2, 1]]
    assert chain.ancestor_mask()[1].int().tolist() == torch.tril(torch.ones(4, 4)).int().tolist()


def test_draft_tree_rejects_bad_parents():
    with pytest.raises(ValueError, match="parents"):
        DraftTree(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 2, 0]]))  # parents[:, 1] >= 1
    with pytest.raises(ValueError, match="parents"):
        DraftTree(torch.tensor([[1, 2]]), torch.tensor([[1, 0]]))  # root's parent is not 0
    with pytest.raises(ValueError, match="draft_probs"):
        DraftTree(torch.tensor([[1, 2]]), torch.tensor([[0, 0]]), torch.ones(1, 3, 4))
