"""The history drafter: drafts from earlier steps' responses to the same prompt and, as one view, from the
group's siblings too; the draft grows with the length of the match.

`History` (engine/history.py) chains each prompt's earlier responses by the hash of every n-gram; the
group's own documents (its prompt and the siblings' responses so far) are indexed as the n-gram drafter
indexes them, which this class extends. A proposal takes the newest `max_candidates` occurrences of the
request's last n tokens in each source and extends each backwards token by token (up to `max_extend`):
the match length is the longest common suffix of the request's text and the source, what a suffix tree over
the sources would give. Only the occurrences of that longest match vote, the newest `max_matches` of them,
through the n-gram drafter's trie (chains, trees, or in reproducible mode the keyed chain); the draft is
`growth` x the match length long, at least 1 and at most the arm's depth (DAS: a long match is a long stretch
of text the policy already wrote, so more of it is worth verifying). The non-obvious choice: a hash-chain
entry point with backward extension, not a suffix automaton: per stored token it costs one dict write and
12 bytes of arrays in Python, where an automaton's nodes and occurrence counts cost hundreds. No forward
pass; lossless like every drafter (verification decides). `propose` drafts from history alone; `with_siblings` is the
view drafting from both (the "cascade" arm puts the EAGLE head behind it: engine/drafters/hybrid.py).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from itertools import islice

import torch

from slipstream.engine.drafters.base import Draft, Drafter, DraftState
from slipstream.engine.drafters.ngram import NGramDrafter, keyed_chain, trie_draft
from slipstream.engine.history import History, prompt_key

__all__ = ["SuffixDrafter"]

NO_LIMIT = sys.maxsize


class SuffixDrafter(NGramDrafter):
    """Drafts from the prompt's history (and, viewed `with_siblings`, its group); see the module docstring."""

    name = "history"
    uses_hidden = False

    def __init__(
        self,
        history: History,
        *,
        max_matches: int = 16,
        max_candidates: int = 64,
        max_extend: int = 64,
        growth: float = 1.0,
        head_depth: int = 3,
        head_below: int = 5,
        device: torch.device | str = "cpu",
    ) -> None:
        """history: the prompts' earlier responses; max_candidates: the newest occurrences of a match's first
        n-gram measured backwards (per source); max_extend: the longest match measured; growth: draft tokens
        per matched token; head_depth: the cascade arm's EAGLE draft where nothing matches; head_below: the
        cascade's view drafts from no match shorter, leaving the head to draft there. The group's own
        documents are indexed as the n-gram drafter's (2- to 4-grams)."""
        super().__init__(2, 4, max_matches, device)
        if max_candidates < 1 or max_extend < max(history.n, self.max_n) or growth <= 0:
            raise ValueError(
                f"SuffixDrafter needs max_candidates >= 1, max_extend >= {max(history.n, self.max_n)} and "
                f"growth > 0, got {max_candidates}, {max_extend}, {growth}"
            )
        self.history = history
        self.max_candidates, self.max_extend, self.growth = max_candidates, max_extend, growth
        self.head_depth, self.head_below = head_depth, head_below
        self._groups_seen: dict[
            Hashable, tuple[str, int]
        ] = {}  # group -> (prompt key, versions visible below)
        self.with_siblings = _Siblings(self)

    def attach(self, group_id: Hashable, key: str, before: int) -> None:
        """Group `group_id` is prompt `key` sampled at version `before`: it drafts from what earlier versions
        sampled (unattached, a group drafts from all the history of its prompt)."""
        self._groups_seen[group_id] = (key, before)

    def reset_group(self, group_id: Hashable) -> None:
        super().reset_group(group_id)
        self._groups_seen.pop(group_id, None)

    def propose(self, states: Sequence[DraftState], depth: int, topk: int, verify: int) -> list[Draft]:
        return self.draft(states, depth, topk, verify, siblings=False)

    def draft(
        self, states: Sequence[DraftState], depth: int, topk: int, verify: int, *, siblings: bool,
        shortest: int = 1,
    ) -> list[Draft]:  # fmt: skip
        """One draft per state from the history (and the group's documents where `siblings`); none where
        the longest match is shorter than `shortest` tokens."""
        for name, value in (("depth", depth), ("topk", topk), ("verify", verify)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        return [self._draft_one(state, depth, topk, verify, siblings, shortest) for state in states]

    def _draft_one(
        self, state: DraftState, depth: int, topk: int, verify: int, siblings: bool, shortest: int
    ) -> Draft:
        req = self._sync(state)
        group = self._groups[state.group_id]
        text = group.docs[req.doc]  # the request's prompt and response so far
        seen = self._groups_seen.get(state.group_id)
        if seen is None:
            seen = self._groups_seen[state.group_id] = (prompt_key(text[: state.prompt_len]), NO_LIMIT)
        key, before = seen
        found: list[_Match] = []
        n = self.history.n
        if len(text) >= n:
            earlier = self.history.occurrences(key, text[len(text) - n :], before)
            found += [(seq, pos, lo, hi, n) for seq, pos, lo, hi in islice(earlier, self.max_candidates)]
        if siblings:
            for m in range(min(self.max_n, len(text)), self.min_n - 1, -1):
                if occ := group.index.get(tuple(text[len(text) - m :])):
                    newest = islice(reversed(occ), self.max_candidates)
                    found += [(group.docs[d], pos, 0, len(group.docs[d]), m) for d, pos in newest]
                    break
        if not found:
            return Draft.empty(self.device)
        return self._from_matches(state, text, found, depth, topk, verify, shortest)

    def _from_matches(
        self, state: DraftState, text: list[int], found: list[_Match], depth: int, topk: int, verify: int,
        shortest: int,
    ) -> Draft:  # fmt: skip
        lengths = [
            n + _extend(text, len(text) - n, seq, pos - n, lo, self.max_extend - n)
            for seq, pos, lo, _, n in found
        ]
        longest = max(lengths)
        if longest < shortest:
            return Draft.empty(self.device)
        best = [match for match, length in zip(found, lengths, strict=True) if length == longest]
        best = best[: self.max_matches]  # newest first
        size = max(1, min(depth, round(self.growth * longest)))
        # Oldest first, as the trie expects; a continuation stops where its response ends.
        conts = [list(seq[pos : min(pos + size, hi)]) for seq, pos, _, hi, _ in reversed(best)]
        conts = [c for c in conts if c]
        if not conts:
            return Draft.empty(self.device)
        if topk == 1 and state.keyed and not state.params.greedy:
            tokens, parents = keyed_chain(conts, min(size, verify), state.params.seed, state.position)
        else:
            tokens, parents = trie_draft(conts, topk, verify)
        return Draft(
            torch.tensor(tokens, dtype=torch.int64, device=self.device),
            torch.tensor(parents, dtype=torch.int64, device=self.device),
        )


_Match = tuple[Sequence[int], int, int, int, int]
"""An occurrence: (the tokens it is in, the position right after the matched n-gram, where its document
starts and ends there, n)."""


def _extend(text: list[int], at: int, doc: Sequence[int], end: int, lo: int, most: int) -> int:
    """How many tokens before text[at] equal those before doc[end], counting back but not before doc[lo], at
    most `most`: the backward extension of a match that starts at `at` in the text and at `end` in the doc."""
    k = 0
    while k < most and k < at and end - 1 - k >= lo and text[at - 1 - k] == doc[end - 1 - k]:
        k += 1
    return k


class _Siblings(Drafter):
    """The view of a `SuffixDrafter` that drafts from the group's siblings as well as from the history.
    It owns nothing: the drafter it views is held and kept informed by the speculator."""

    name = "history+siblings"
    uses_hidden = False

    def __init__(self, drafter: SuffixDrafter) -> None:
        self.drafter = drafter

    def propose(self, states: Sequence[DraftState], depth: int, topk: int, verify: int) -> list[Draft]:
        return self.drafter.draft(
            states, depth, topk, verify, siblings=True, shortest=self.drafter.head_below
        )
