"""Model-free history drafter (issue #20): draft chains and trees by matching a sequence's last
n tokens against the rollout history of its prompt — its own prompt and output, its running and
finished siblings (the same prompt id in this rollout), and earlier rollouts of the same prompt
id, kept across steps up to ``max_history_tokens`` (oldest finished sequences evicted first);
and, with ``is_cross_prompt`` (the default), the engine's sequences of every other prompt: a
shared index (SuffixDecoding's global tree, arXiv 2411.04975) drafts where the context it
matches is strictly longer than in the prompt's own group, whose statistics win ties.
The index is ``tltrun.model.suffix_automaton``'s (one automaton per prompt group; the shared
one in two generations of at most ``max_shared_tokens / 2`` tokens each, the older dropped
whole when the newer fills, its running sequences indexed anew).
Pure Python, no torch: ``tltrun.rollout.rollout_history`` turns proposals into a ``DraftTree``.

Proposal (``propose`` / ``propose_tree``): walk the automaton with the sequence's last
``ngram_max`` tokens from the root (matching statistics: on a missing transition follow suffix
links), giving the longest suffix of the context that occurs in the index (the context always
occurs: the sequence itself is indexed, so this is the length-ngram_max suffix unless the
sequence is shorter). A match that nothing follows anywhere (its only occurrences are tails:
the sequence's own, running siblings') falls back along suffix links to a shorter context, down
to ``ngram_min`` tokens, else nothing is proposed. The draft then walks d transitions, taking at
each state its ``best`` token: the continuation most occurrences of the context read so far
agree on (like SuffixDecoding's frequency-scored drafts, arXiv 2411.04975; following the first
occurrence instead drafted 7% fewer accepted tokens per verify on hanoi's GRPO rollouts with
chains of 4 and 8, and the same on the built-in task: benchmarks/RESULTS.md). The cost is a
walk of at most ngram_max + d tokens per index searched (the group's, two shared
generations): independent of the history's length. A tree's branches
are the matched state's outgoing transitions (distinct next tokens: the chain's first, then
the others in creation order), each continued by the same walk.

Eviction rebuilds the automaton of the group that lost a sequence (suffix automata do not
delete; ``SuffixAutomaton.from_strings`` counts in one pass at the end, not per token); it runs
when a sequence is finished, never in a proposal.

A history draft is deterministic given the committed tokens, so its draft distribution is a
point mass and ``tltrun.rollout.speculative.verify`` with ``draft_probs=None`` keeps decoding
lossless (accept x with probability p(x), else resample from p with x removed).

Run the tests: ``python -m pytest tests/test_history_drafter.py tests/test_history_engine.py -q``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from tltrun.model.suffix_automaton import SuffixAutomaton


@dataclass(frozen=True, kw_only=True)
class HistoryConfig:
    """History drafter settings (``EngineConfig.history_config``: ngram_min, ngram_max and
    max_history_tokens are its fields, max_draft_tokens is its max_verify_tokens;
    evict_to_fraction keeps its default there)."""

    ngram_min: int = field(
        default=2, metadata={"help": "shortest context (tokens) a history draft may match"}
    )
    ngram_max: int = field(
        default=8, metadata={"help": "longest context (tokens) a history draft matches"}
    )
    # CPython holds about 0.5 KB per indexed token (1.35 automaton states per token on
    # bench_history's synthetic responses): the default bounds the index at about 0.5 GB.
    max_history_tokens: int = field(
        default=1_000_000,
        metadata={"help": "tokens the history index keeps (oldest finished sequences evicted)"},
    )

    # Eviction runs down to this fraction of max_history_tokens, not just under it: a group
    # that loses some of its sequences is rebuilt, so evicting one sequence per new one (the
    # steady state of a long run at the cap) rebuilt a group per added sequence, 5x the
    # indexing's own time (bench_history.py's steady-state table); a round freeing 10% of
    # the cap drops old groups whole, which needs no rebuild.
    evict_to_fraction: float = field(
        default=0.9,
        metadata={"help": "evict the oldest finished sequences down to this share of the cap"},
    )
    # The deepest draft a proposal returns: counts and best transitions are kept exact only
    # for contexts a draft can read (ngram_max + max_draft_tokens - 1 tokens), which bounds
    # the work of indexing one token (SuffixAutomaton.count_depth).
    max_draft_tokens: int = field(
        default=64, metadata={"help": "the longest draft chain a proposal returns (tokens)"}
    )
    # The cross-prompt tier (SuffixDecoding's global tree, arXiv 2411.04975, Sec. 4): every
    # sequence of every group also goes into one shared index, and a proposal drafts from it
    # where the context it matches there is longer than in the prompt's own group. RL responses
    # to different prompts share their template text: replaying the history drafter on step-0
    # GRPO rollouts with chains of 4 gave +0.15 to +0.35 accepted tokens per verify on hanoi
    # and +0.17 to +0.23 on the built-in task (benchmarks/RESULTS.md, bench_history.py).
    is_cross_prompt: bool = field(
        default=True,
        metadata={"help": "also draft from other prompts' sequences (a shared index)"},
    )
    # The shared index lives in two generations of at most half this many tokens each (plus
    # what running sequences add): once the newer one is full, the older one is dropped whole,
    # as suffix automata do not delete. About 0.5 KB per token (above): 0.25 GB at the default.
    max_shared_tokens: int = field(
        default=500_000,
        metadata={"help": "tokens the cross-prompt index keeps (two generations of half each)"},
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.evict_to_fraction <= 1.0:
            raise ValueError(
                f"HistoryConfig: evict_to_fraction must be in (0, 1], got {self.evict_to_fraction}"
            )
        if self.max_draft_tokens < 1:
            raise ValueError(
                f"HistoryConfig: max_draft_tokens must be >= 1, got {self.max_draft_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"HistoryConfig: need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        if self.max_history_tokens < 1 or self.max_shared_tokens < 1:
            raise ValueError(
                "HistoryConfig: max_history_tokens and max_shared_tokens must be >= 1, got "
                f"{self.max_history_tokens} and {self.max_shared_tokens}"
            )


@dataclass
class _Stored:
    """A sequence in the index: its group, its string in the group's automaton, and whether it
    may be evicted (finished)."""

    group: Hashable
    sid: int
    is_finished: bool = False
    shared: tuple[int, int] | None = None  # (generation, string) in the cross-prompt index


class HistoryDrafter:
    """The history index of one engine, kept across rollouts.

    Sequences are registered with ``add(key, group, tokens)`` (the prompt), grown with
    ``extend`` as tokens are committed, and ``finish``-ed when done (they stay as history of
    their group until evicted, or until ``drop_group``). ``group`` is the prompt id: every
    sequence of a group, running or finished, this rollout or an earlier one, is history for
    every other."""

    def __init__(self, config: HistoryConfig | None = None):
        self.config = config or HistoryConfig()
        # the longest context a proposal reads (SuffixAutomaton.count_depth)
        self.count_depth = self.config.ngram_max + self.config.max_draft_tokens - 1
        self.automata: dict[Hashable, SuffixAutomaton] = {}
        self.sequences: dict[Hashable, _Stored] = {}  # insertion order = age (eviction order)
        self.num_tokens = 0
        # the cross-prompt index: generation number -> automaton, at most two, newest last
        self.shared: dict[int, SuffixAutomaton] = {}
        self._num_generations = 0

    @property
    def num_shared_tokens(self) -> int:
        """Tokens the cross-prompt index holds (``max_shared_tokens`` plus running growth)."""
        return sum(sam.num_tokens for sam in self.shared.values())

    def __contains__(self, key: Hashable) -> bool:
        return key in self.sequences

    def add(
        self, key: Hashable, group: Hashable, tokens: Iterable[int], *, is_shared: bool = True
    ) -> None:
        """Index ``key`` (``tokens``, extended later) in ``group``'s automaton and, with
        ``is_shared`` (and the cross-prompt tier on), in the shared one. A sequence of a group
        that ``drop_group`` will forget must not be shared: an automaton cannot forget a
        string, and the shared one outlives the group (its tokens drafted for later prompts)."""
        if key in self.sequences:
            raise ValueError(f"history drafter: sequence {key!r} is already indexed")
        sam = self.automata.get(group)
        if sam is None:
            sam = self.automata[group] = SuffixAutomaton(self.count_depth)
        tokens = list(tokens)
        stored = self.sequences[key] = _Stored(group=group, sid=sam.add_string(tokens))
        if self.config.is_cross_prompt and is_shared:
            stored.shared = self._add_shared(tokens)
        self.num_tokens += len(tokens)
        self._evict()

    def extend(self, key: Hashable, tokens: list[int]) -> None:
        stored = self.sequences[key]
        self.automata[stored.group].extend(stored.sid, tokens)
        if stored.shared is not None:
            generation, sid = stored.shared
            self.shared[generation].extend(sid, tokens)
        self.num_tokens += len(tokens)

    def _add_shared(self, tokens: list[int]) -> tuple[int, int]:
        """Index ``tokens`` as a new string of the newest shared generation, after starting a
        new generation if it holds half of ``max_shared_tokens``: then the oldest of three is
        dropped whole, and its running sequences are indexed anew in the new one."""
        newest = self.shared.get(self._num_generations - 1)
        if newest is None or newest.num_tokens >= self.config.max_shared_tokens // 2:
            generation = self._num_generations
            newest = self.shared[generation] = SuffixAutomaton(self.count_depth)
            self._num_generations += 1
            if len(self.shared) > 2:
                dropped = min(self.shared)
                del self.shared[dropped]
                for key, stored in self.sequences.items():
                    if stored.shared is not None and stored.shared[0] == dropped:
                        stored.shared = (
                            None
                            if stored.is_finished
                            else (generation, newest.add_string(self.tokens(key)))
                        )
        return self._num_generations - 1, newest.add_string(tokens)

    def finish(self, key: Hashable) -> None:
        """``key`` is done: it stays as history and may now be evicted (a no-op if it was
        finished or evicted already)."""
        stored = self.sequences.get(key)
        if stored is not None and not stored.is_finished:
            stored.is_finished = True
            self._evict()

    def drop_group(self, group: Hashable) -> None:
        """Forget a group (a rollout-local one whose rollout ended)."""
        sam = self.automata.pop(group, None)
        if sam is None:
            return
        self.num_tokens -= sam.num_tokens
        self.sequences = {k: s for k, s in self.sequences.items() if s.group != group}

    def tokens(self, key: Hashable) -> list[int]:
        stored = self.sequences[key]
        return self.automata[stored.group].strings[stored.sid]

    def _match(self, key: Hashable) -> tuple[SuffixAutomaton, int, int]:
        """(automaton, state, context length) of ``key``'s longest usable match, or state -1:
        in its group's automaton, or in a shared generation where that match is strictly
        longer (ties keep the group's own statistics, then the newer generation's)."""
        cfg = self.config
        context = self.tokens(key)[-cfg.ngram_max :]
        best = usable_match(self.automata[self.sequences[key].group], context, cfg.ngram_min)
        for generation in sorted(self.shared, reverse=True):
            if best[2] == len(context):  # the whole context matched: nothing can be longer
                break
            found = usable_match(self.shared[generation], context, cfg.ngram_min)
            if found[2] > best[2]:
                best = found
        return best

    def propose(self, key: Hashable, num_tokens: int) -> list[int]:
        """A draft chain of at most ``num_tokens`` tokens (and ``max_draft_tokens``) for
        sequence ``key`` (may be empty)."""
        num_tokens = min(num_tokens, self.config.max_draft_tokens)
        sam, state, _ = self._match(key)
        return sam.continuation(state, num_tokens) if state >= 0 else []

    def propose_tree(self, key: Hashable, num_tokens: int, max_branches: int) -> list[list[int]]:
        """At most ``max_branches`` continuations of at most ``num_tokens`` tokens each, with
        distinct first tokens; the first is ``propose``'s chain."""
        num_tokens = min(num_tokens, self.config.max_draft_tokens)
        sam, state, _ = self._match(key)
        if state < 0 or num_tokens < 1:
            return []
        first = sam.continuation(state, num_tokens)
        branches = [first]
        for tok, child in sam.trans[state].items():  # the others in creation order: O(branches)
            if len(branches) >= max_branches:
                break
            if tok != first[0]:
                branches.append([tok] + sam.continuation(child, num_tokens - 1))
        return branches

    def _evict(self) -> None:
        """Once the index holds more than max_history_tokens, drop the oldest finished
        sequences until it holds at most ``evict_to_fraction`` of that, then rebuild the
        automata that lost some (not all) of their sequences."""
        cap = self.config.max_history_tokens
        if self.num_tokens <= cap:
            return
        excess = self.num_tokens - int(self.config.evict_to_fraction * cap)
        dropped: set[Hashable] = set()
        for key, stored in list(self.sequences.items()):
            if excess <= 0:
                break
            if stored.is_finished:
                n = len(self.automata[stored.group].strings[stored.sid])
                del self.sequences[key]
                excess -= n
                self.num_tokens -= n
                dropped.add(stored.group)
        for group in dropped:
            self._rebuild(group)

    def _rebuild(self, group: Hashable) -> None:
        old = self.automata[group]
        members = [(k, s) for k, s in self.sequences.items() if s.group == group]
        if not members:
            del self.automata[group]
            return
        sam = SuffixAutomaton.from_strings(
            (old.strings[stored.sid] for _, stored in members), self.count_depth
        )
        for sid, (_, stored) in enumerate(members):
            stored.sid = sid
        self.automata[group] = sam


def usable_match(
    sam: SuffixAutomaton, context: list[int], ngram_min: int
) -> tuple[SuffixAutomaton, int, int]:
    """(sam, state, length) of the longest suffix of ``context`` occurring in ``sam`` that
    something follows, of at least ``ngram_min`` tokens; (sam, -1, 0) if there is none. A
    match that nothing follows (its only occurrences are tails: the sequence's own, running
    siblings') falls back along suffix links to a shorter context."""
    state, matched = sam.match(context)
    while matched >= ngram_min and not sam.trans[state]:
        state = sam.link[state]
        matched = sam.length[state]
    return (sam, state, matched) if matched >= ngram_min else (sam, -1, 0)


def tree_nodes(branches: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Draft-tree nodes of ``branches`` (distinct first tokens, so siblings are distinct): node
    tokens and parent indices, nodes 1.. in (depth, branch) order — ancestor-closed, parents
    before children — at most ``max_nodes`` drafted nodes. Node 0 (the root) is the caller's;
    returned lists cover nodes 1.. only, parents index the full node list."""
    tokens: list[int] = []
    parents: list[int] = []
    last_node = [0] * len(branches)  # per branch: its deepest node so far
    depth = 0
    while len(tokens) < max_nodes:
        grew = False
        for b, branch in enumerate(branches):
            if depth < len(branch) and len(tokens) < max_nodes:
                tokens.append(branch[depth])
                parents.append(last_node[b])
                last_node[b] = len(tokens)  # node index (the root is 0)
                grew = True
        if not grew:
            break
        depth += 1
    return tokens, parents


__all__ = ["HistoryConfig", "HistoryDrafter", "tree_nodes"]
