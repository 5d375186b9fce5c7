"""Generalized suffix automaton over token ids: the index of the history drafter
(``tltrun.model.history_drafter``, issue #20). Pure Python.

The history drafter keeps one generalized suffix automaton (Blumer et al. 1985; the on-line
generalized construction, which handles several strings grown in any interleaving) per prompt
group, over token ids. Every stored string (a sequence: prompt then output) keeps its automaton
state ``last``, whose longest member is the whole string. Each state records ``first_end``, the
(string, position) where its members first ended (a clone inherits its original's, which is also
an end of the clone's members), ``count``, how many positions of the group's strings its members
end at (the occurrences of the contexts it holds), and ``best``, its transition to the highest
count (ties: the token after ``first_end``). Appending a token is the usual amortized O(1)
extension plus a walk up the suffix links from the string's previous suffix of ``count_depth``
tokens, whose ``tok`` transitions are exactly the states holding the suffixes the new position
ends that a draft can read (each gets one more occurrence; each parent's ``best`` is updated
where its child's count grew): at most ``count_depth`` = ngram_max + max_draft_tokens - 1
states, however long the history. Unbounded, that walk follows the whole suffix-link path of the
string's end, which grows with the string when it repeats itself: a response looping on one
token cost 280 us per token at 8,000 tokens (O(length^2) in all) and 6 us bounded
(``benchmarks/bench_history.py``'s ``loop`` rows).

Run the tests: ``python -m pytest tests/test_history_drafter.py -q``.
"""

from __future__ import annotations

from collections.abc import Iterable


class SuffixAutomaton:
    """Generalized suffix automaton over token ids, strings appended to in any interleaving.

    State 0 is the root. Per state: ``length`` (its longest member), ``link`` (suffix link, -1
    at the root), ``trans`` (token -> state, in creation order), ``first_end`` ((string,
    position) of the first end of its members; the root's is (-1, -1)), ``count`` (how many
    positions of all strings its members end at: the occurrences of the context it holds; the
    root's stays 0) and ``best`` (the token whose transition leads to the highest count; on ties
    the token after ``first_end``, else the earliest to reach it; None without transitions).

    ``count_depth`` (None: no bound) bounds the contexts whose statistics are kept: ``best`` is
    exact for every state holding a context of at most ``count_depth`` tokens, ``count`` for
    every state holding one of at most ``count_depth + 1``; the others' may lag. A draft that
    matched at most n tokens and walks d reads only states holding contexts of at most
    n + d - 1 tokens. The bound matters for repetitive strings (a response looping on a few
    tokens, common in RL's long tail): there the suffix-link path of a string's end grows with
    the string, so an unbounded update costs O(length) per token, O(length^2) per string."""

    def __init__(self, count_depth: int | None = None) -> None:
        self.length: list[int] = [0]
        self.link: list[int] = [-1]
        self.trans: list[dict[int, int]] = [{}]
        self.first_end: list[tuple[int, int]] = [(-1, -1)]
        self.count: list[int] = [0]
        self.best: list[int | None] = [None]
        # False while ``from_strings`` builds: counts and best come from one pass at the end
        self.is_counting = True
        self.strings: list[list[int]] = []
        self._num_tokens = 0  # sum of the strings' lengths
        self.last: list[int] = []  # per string: the state whose longest member is the string
        self.count_depth = count_depth
        # per string: (state, m), a state holding a suffix of at least m = min(count_depth,
        # length) tokens whose suffix-link ancestors include the one holding m (window_state)
        self.window: list[tuple[int, int]] = []

    @property
    def num_states(self) -> int:
        return len(self.length)

    @property
    def num_tokens(self) -> int:
        """Tokens of all strings (kept as a count: the shared index asks once per sequence)."""
        return self._num_tokens

    def add_string(self, tokens: Iterable[int] = ()) -> int:
        """A new (empty) string, then ``extend`` it by ``tokens``; returns its index."""
        self.strings.append([])
        self.last.append(0)
        self.window.append((0, 0))
        sid = len(self.strings) - 1
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: Iterable[int]) -> None:
        for tok in tokens:
            self._extend_one(sid, int(tok))

    @classmethod
    def from_strings(
        cls, strings: Iterable[Iterable[int]], count_depth: int | None = None
    ) -> SuffixAutomaton:
        """The automaton of ``strings`` (added in order), its counts and best transitions
        computed in one pass at the end (O(states + transitions)) instead of a suffix-path
        walk per token: a rebuild's way."""
        sam = cls(count_depth)
        sam.is_counting = False
        for tokens in strings:
            sam.add_string(tokens)
        sam._finish_counts()
        for sid, string in enumerate(sam.strings):  # where each string's next update starts
            m = len(string) if count_depth is None else min(count_depth, len(string))
            state = sam.last[sid] if m == len(string) else sam.match(string[-m:])[0]
            sam.window[sid] = (state, m)
        sam.is_counting = True
        return sam

    def _finish_counts(self) -> None:
        """Counts from the end positions (each string position ends at its prefix's state and
        at every suffix-link ancestor's: propagated from the longest states down), then each
        state's best transition by ``_count_end``'s rule (other ties: creation order)."""
        count = [0] * self.num_states
        for string in self.strings:
            state = 0
            for tok in string:  # walking a prefix from the root ends at the prefix's state
                state = self.trans[state][tok]
                count[state] += 1
        by_length: list[list[int]] = [[] for _ in range(max(self.length) + 1)]
        for v in range(1, self.num_states):
            by_length[self.length[v]].append(v)
        for bucket in reversed(by_length):
            for v in bucket:
                count[self.link[v]] += count[v]
        count[0] = 0
        self.count = count
        for u in range(self.num_states):
            first = self._first_next(u)
            trans = self.trans[u]
            self.best[u] = (
                max(trans, key=lambda tok, t=trans, f=first: (count[t[tok]], tok == f))
                if trans
                else None
            )

    def _new_state(
        self,
        length: int,
        link: int,
        trans: dict[int, int],
        end: tuple[int, int],
        count: int = 0,
        best: int | None = None,
    ) -> int:
        self.length.append(length)
        self.link.append(link)
        self.trans.append(trans)
        self.first_end.append(end)
        self.count.append(count)
        self.best.append(best)
        return len(self.length) - 1

    def _clone(self, p: int, q: int, tok: int) -> int:
        """Split q: a clone of length(p) + 1 takes q's shorter members; redirect p's suffix
        path from q to the clone. The clone's ends include q's, so it inherits q's first end,
        count (the new end is counted by ``_count_end``) and best transition (same targets)."""
        clone = self._new_state(
            self.length[p] + 1,
            self.link[q],
            dict(self.trans[q]),
            self.first_end[q],
            self.count[q],
            self.best[q],
        )
        while p != -1 and self.trans[p].get(tok) == q:
            self.trans[p][tok] = clone
            p = self.link[p]
        self.link[q] = clone
        return clone

    def _extend_one(self, sid: int, tok: int) -> None:
        string = self.strings[sid]
        last = self.last[sid]
        string.append(tok)
        self._num_tokens += 1
        q = self.trans[last].get(tok)
        if q is not None:  # the extended string already occurs (another string, or a repeat)
            self.last[sid] = (
                q if self.length[q] == self.length[last] + 1 else self._clone(last, q, tok)
            )
            if self.is_counting:
                self._count_end(sid, tok)
            return
        cur = self._new_state(self.length[last] + 1, 0, {}, (sid, len(string) - 1))
        p = last
        while p != -1 and tok not in self.trans[p]:
            self.trans[p][tok] = cur
            p = self.link[p]
        if p != -1:
            q = self.trans[p][tok]
            self.link[cur] = q if self.length[q] == self.length[p] + 1 else self._clone(p, q, tok)
        self.last[sid] = cur
        if self.is_counting:
            self._count_end(sid, tok)

    def window_state(self, sid: int) -> tuple[int, int]:
        """(state, m): the state holding string ``sid``'s suffix of m = min(count_depth, its
        length) tokens, where its next count update starts. Recorded one state off when the
        window kept its length (the next token's state may hold longer suffixes only), or
        since split by clones (which take a state's shorter members and become its suffix
        link): either way a suffix-link ancestor, found here."""
        state, m = self.window[sid]
        while state != 0 and self.length[self.link[state]] >= m:
            state = self.link[state]
        return state, m

    def _count_end(self, sid: int, tok: int) -> None:
        """String ``sid`` grew by ``tok`` (already extended): the new end position is one more
        occurrence of every suffix of the grown string, whose states are the ``tok``
        transitions of the suffix-link path of the old string's end (every one has one after
        the extension, consecutive ones may share a target: count it once). A state's ``tok``
        parents all lie on that path, so each ``best`` whose child's count grows is updated
        here. The walk starts at the old string's suffix of ``count_depth`` tokens (the
        window), not its end: O(min(count_depth, the path)) per token."""
        window, m = self.window_state(sid)
        counted = -1
        u = window
        while u != -1:
            v = self.trans[u][tok]
            if v != counted:
                self.count[v] += 1
                counted = v
            best = self.best[u]
            if best is None:
                self.best[u] = tok
            elif best != tok and self.count[v] >= self.count[self.trans[u][best]]:
                first = self._first_next(u)  # ties: the first occurrence's next token
                if self.count[v] > self.count[self.trans[u][best]] or tok == first:
                    self.best[u] = tok
            u = self.link[u]
        # the grown string's window: one token longer, or as long, one token on (if the state
        # holds no suffix that short, ``window_state`` moves to its suffix link)
        m = m + 1 if self.count_depth is None else min(m + 1, self.count_depth)
        self.window[sid] = (self.trans[window][tok], m)

    def _first_next(self, state: int) -> int | None:
        """The token after the first end of ``state``'s members (None: that end is a tail)."""
        sid, pos = self.first_end[state]
        return self.strings[sid][pos + 1] if sid >= 0 and pos + 1 < len(self.strings[sid]) else None

    def match(self, context: list[int]) -> tuple[int, int]:
        """(state, length): the longest suffix of ``context`` that occurs in the index, as the
        automaton state holding it and its length (O(len(context)) amortized)."""
        state, matched = 0, 0
        for tok in context:
            while state != 0 and tok not in self.trans[state]:
                state = self.link[state]
                matched = self.length[state]
            nxt = self.trans[state].get(tok)
            if nxt is None:
                state, matched = 0, 0
            else:
                state, matched = nxt, matched + 1
        return state, matched

    def next_token(self, state: int) -> int | None:
        """The token most occurrences of ``state``'s members are followed by (``best``; O(1)),
        None where nothing follows them."""
        return self.best[state]

    def continuation(self, state: int, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens continuing ``state``'s members: a walk along
        transitions choosing ``next_token`` at each state (O(num_tokens)): at each step the
        token most occurrences of the context read so far are followed by."""
        out: list[int] = []
        while len(out) < num_tokens:
            tok = self.next_token(state)
            if tok is None:
                break
            out.append(tok)
            state = self.trans[state][tok]
        return out


__all__ = ["SuffixAutomaton"]
