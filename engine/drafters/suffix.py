"""The history drafter: drafts from earlier steps' responses to the same prompt and, as one view, from the
group's siblings too; the draft grows with the length of the match.

`History` (engine/history.py) indexes each prompt's earlier responses by n-gram; the group's own documents
(its prompt and the siblings' responses so far) are indexed as the n-gram drafter indexes them, which this
class extends. A proposal finds the longest n (max_n down to min_n) whose last n tokens occur in the
sources, extends each occurrence backwards token by token (up to `max_extend`): the match length is the
longest common suffix of the request's text and the source, what a suffix tree over the sources would give.
Only the occurrences of that longest match vote, the newest `max_matches` of them, through the n-gram
drafter's trie (chains, trees, or in reproducible mode the keyed chain); the draft is `growth` x the match
length long, at least 1 and at most the arm's depth (DAS: a long match is a long stretch of text the policy
already wrote, so more of it is worth verifying). The non-obvious choice: an n-gram entry point with
backward extension, not a suffix automaton: per committed token it costs a few dict appends in Python,
where an automaton's online update with occurrence counts walks suffix links. No forward pass; lossless
like every drafter (verification decides). `propose` drafts from history alone; `with_siblings` is the
view drafting from both (the "cascade" arm puts the EAGLE head behind it: engine/drafters/hybrid.py).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence

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
        device: torch.device | str = "cpu",
    ) -> None:
        """history: the prompts' earlier responses (its n-gram range is this drafter's); max_candidates: the
        newest occurrences of an n-gram extended backwards; max_extend: the longest match measured; growth:
        draft tokens per matched token; head_depth: the cascade arm's EAGLE draft where nothing matches."""
        super().__init__(history.min_n, history.max_n, max_matches, device)
        if max_candidates < 1 or max_extend < history.max_n or growth <= 0:
            raise ValueError(
                f"SuffixDrafter needs max_candidates >= 1, max_extend >= max_n={history.max_n} and growth > 0, "
                f"got {max_candidates}, {max_extend}, {growth}"
            )
        self.history = history
        self.max_candidates, self.max_extend, self.growth = max_candidates, max_extend, growth
        self.head_depth = head_depth
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
        self, states: Sequence[DraftState], depth: int, topk: int, verify: int, *, siblings: bool
    ) -> list[Draft]:
        """One draft per state from the history (and the group's documents where `siblings`)."""
        for name, value in (("depth", depth), ("topk", topk), ("verify", verify)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        return [self._draft_one(state, depth, topk, verify, siblings) for state in states]

    def _draft_one(self, state: DraftState, depth: int, topk: int, verify: int, siblings: bool) -> Draft:
        req = self._sync(state)
        group = self._groups[state.group_id]
        text = group.docs[req.doc]  # the request's prompt and response so far
        seen = self._groups_seen.get(state.group_id)
        if seen is None:
            seen = self._groups_seen[state.group_id] = (prompt_key(text[: state.prompt_len]), NO_LIMIT)
        key, before = seen
        for n in range(min(self.max_n, len(text)), self.min_n - 1, -1):
            gram = tuple(text[len(text) - n :])
            found = self._newest(self.history.occurrences(key, gram, before))
            if siblings:
                found += self._newest((group.docs[d], p) for d, p in reversed(group.index.get(gram, ())))
            if found:
                return self._from_matches(state, text, n, found, depth, topk, verify)
        return Draft.empty(self.device)

    def _newest(self, occurrences: object) -> list[tuple[list[int], int]]:
        out: list[tuple[list[int], int]] = []
        for occurrence in occurrences:  # type: ignore[attr-defined]
            out.append(occurrence)
            if len(out) == self.max_candidates:
                break
        return out

    def _from_matches(
        self, state: DraftState, text: list[int], n: int, found: list[tuple[list[int], int]],
        depth: int, topk: int, verify: int,
    ) -> Draft:  # fmt: skip
        lengths = [n + _extend(text, len(text) - n, doc, pos - n, self.max_extend - n) for doc, pos in found]
        longest = max(lengths)
        best = [occ for occ, length in zip(found, lengths, strict=True) if length == longest]
        best = best[: self.max_matches]  # newest first
        size = max(1, min(depth, round(self.growth * longest)))
        conts = [doc[pos : pos + size] for doc, pos in reversed(best)]  # oldest first, as the trie expects
        if topk == 1 and state.keyed and not state.params.greedy:
            tokens, parents = keyed_chain(conts, min(size, verify), state.params.seed, state.position)
        else:
            tokens, parents = trie_draft(conts, topk, verify)
        return Draft(
            torch.tensor(tokens, dtype=torch.int64, device=self.device),
            torch.tensor(parents, dtype=torch.int64, device=self.device),
        )


def _extend(text: list[int], at: int, doc: list[int], end: int, most: int) -> int:
    """How many tokens before text[at] equal those before doc[end], counting back, at most `most`: the
    backward extension of a match that starts at `at` in the text and at `end` in the document."""
    k = 0
    while k < most and k < at and k < end and text[at - 1 - k] == doc[end - 1 - k]:
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
        return self.drafter.draft(states, depth, topk, verify, siblings=True)
